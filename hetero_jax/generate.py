"""``generate``: chunked prefill, then a jitted decode loop with the cache donated."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax import model as M
from hetero_jax.cache import grow_tail, kv_bytes, prompt_arrays, prompt_kv_bytes, tail_kv_bytes, used_kv_bytes
from hetero_jax.config import ModelConfig
from hetero_jax.errors import PromptError
from hetero_jax.layout import params_for
from hetero_jax.sharding import MeshError, batch_sharding, imbalance, per_device_bytes, shard_cache, to_host

# Prefill chunk sizes: a prompt is padded to a multiple of its bucket, so a new
# prompt length recompiles only when it crosses into a new bucket.
MAX_CHUNK = 512
MIN_CHUNK = 16
# The tail (tokens added after prefill) is allocated in multiples of this many
# tokens, so decode recompiles only when a request crosses into a new bucket.
TAIL_QUANTUM = 128


@dataclasses.dataclass
class GenerationStats:
    prompt_tokens: int
    generated_tokens: int
    prefill_seconds: float
    decode_seconds: list[float]  # one entry per decode step (wall time, token read back)
    kv_bytes_device: int  # bytes of K/V arrays allocated on the device (whole batch)
    kv_bytes_used: int  # bytes of K/V holding valid tokens at the end (whole batch)
    kv_bytes_host: int  # bytes of K/V kept in host memory (0 without offload)
    kv_bytes_host_by_role: dict  # HeteroCache: host bytes per head role ({} without offload)
    kv_bytes_index: int  # device bytes of policy state beside the K/V groups (page summaries, K_base, ...)
    kv_bytes_read_per_step: int  # K/V + index bytes one decode step reads (device reads + host fetches)
    kv_bytes_prompt: int  # of which the prompt's head groups
    kv_bytes_tail: int  # of which the tail (tokens added after prefill)
    stop_reason: str  # "eos", "stop", "max_new_tokens" or "context"
    compile_seconds: float = 0.0  # XLA compilation in this call (excluded from the timings above)
    extend_seconds: float = 0.0  # session turns: appending the question before decoding (compile excluded)
    # the policy's decode counters (HeteroCache: checks, triggers, recalls, bytes); in a Session, totals
    # since the context's prefill
    policy_stats: dict = dataclasses.field(default_factory=dict)
    policy_summary: str = ""  # those counters as text
    policy: str = "FullKV(budget=1.0)"
    # prompt KV kept on the device / full prompt KV (tokens x KV heads x layers); in bytes for a policy that keeps
    # no token rows (HCAttention: keys or codes + codebook / full K+V bytes)
    achieved_rho: float = 1.0
    # on a mesh: K/V bytes each device holds (str(device) -> bytes, measured from the shards; replicated
    # groups count on every device) and the host bytes held for each device; {} on one device
    kv_bytes_per_device: dict = dataclasses.field(default_factory=dict)
    host_bytes_per_device: dict = dataclasses.field(default_factory=dict)

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    def _host_roles_text(self) -> str:
        roles = {k: v for k, v in self.kv_bytes_host_by_role.items() if v}
        if not roles:
            return ""
        return " (" + ", ".join(f"{k}s {v / 2**20:.1f}" for k, v in roles.items()) + ")"

    def decode_ms_percentile(self, q: float) -> float:
        return 1e3 * float(np.percentile(self.decode_seconds, q)) if self.decode_seconds else float("nan")

    @property
    def decode_ms_per_token(self) -> float:
        return 1e3 * float(np.mean(self.decode_seconds)) if self.decode_seconds else float("nan")

    def summary(self) -> str:
        return (
            f"prompt {self.prompt_tokens} tok, prefill {self.prefill_seconds:.2f} s "
            f"({self.prefill_tokens_per_second:.0f} tok/s) | generated {self.generated_tokens} tok, "
            f"decode {self.decode_ms_per_token:.1f} ms/tok | KV device {self.kv_bytes_device / 2**20:.1f} MiB "
            f"(used {self.kv_bytes_used / 2**20:.1f} MiB), host {self.kv_bytes_host / 2**20:.1f} MiB{self._host_roles_text()} | "
            f"rho {self.achieved_rho:.3f}{' | ' + self.policy_summary if self.policy_summary else ''}"
            f"{self._devices_text()} | compile {self.compile_seconds:.1f} s | stop: {self.stop_reason}"
        )

    def _devices_text(self) -> str:
        if not self.kv_bytes_per_device:
            return ""
        dev = np.asarray(list(self.kv_bytes_per_device.values()), np.float64)
        return (f" | {dev.size} devices: KV max {dev.max() / 2**20:.1f} MiB/device "
                f"(max/mean {imbalance(self.kv_bytes_per_device):.2f})")


@dataclasses.dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens only (EOS excluded)
    stats: GenerationStats


def chunk_bucket(prompt_len: int) -> int:
    """Chunk size for a prompt: the next power of two, between MIN_CHUNK and MAX_CHUNK."""
    c = MIN_CHUNK
    while c < prompt_len and c < MAX_CHUNK:
        c *= 2
    return c


def _round_up(x: int, q: int) -> int:
    return -(-x // q) * q


_COMPILED: dict = {}

# Share of the kernel's per-process limit on memory mappings (vm.max_map_count, usually 65530) above
# which compiled executables are let go before the next compile. XLA's CPU runtime maps three regions
# (code, read-only data, data) for every kernel of an executable and keeps them while any cache holds
# the executable; jax's caches hold up to 2048 executables, ours holds all. At 60 to 300 kernels per
# prefill or decode executable, a process that meets many prompt lengths (a server, a benchmark grid)
# would otherwise die in LLVM ("Unable to allocate section memory") after a few dozen of them.
MAP_BUDGET_FRACTION = 0.5


def mapping_count() -> int | None:
    """Memory mappings this process holds now (Linux), else None."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def mapping_budget() -> int | None:
    """Mappings above which :func:`compiled` releases executables (None where the limit is unknown)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(int(f.read()) * MAP_BUDGET_FRACTION)
    except (OSError, ValueError):
        return None


def release_executables() -> None:
    """Drop every cached executable (ours and jax's); those still referenced (live engines) stay valid."""
    _COMPILED.clear()
    jax.clear_caches()


def compiled(jitted, *args, **static):
    """AOT-compile ``jitted`` for these argument shapes once and reuse it.

    Keeps compile time out of the timed prefill and decode steps; it is
    reported separately as ``compile_seconds``. Before a compile, if the
    process holds more memory mappings than :func:`mapping_budget`, cached
    executables are released (:func:`release_executables`) and recompiled
    when next needed.
    """
    leaves, treedef = jax.tree.flatten(args)
    # Shardings are part of the key: an executable compiled for one placement rejects another.
    key = (jitted, treedef, tuple((jnp.shape(x), jnp.result_type(x), getattr(x, "sharding", None)) for x in leaves),
           tuple(sorted(static.items())))
    fn = _COMPILED.get(key)
    if fn is None:
        t0 = time.perf_counter()  # the mapping check is part of the compile's cost, kept out of timings too
        budget, held = mapping_budget(), mapping_count()
        if budget is not None and held is not None and held > budget:
            release_executables()
        fn = jitted.lower(*args, **static).compile()
        _COMPILE_TIME[0] += time.perf_counter() - t0
        _COMPILED[key] = fn
    return fn


_COMPILE_TIME = [0.0]


def sample(logits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """logits [B, V] float32 -> tokens [B]. Greedy at temperature 0; nucleus sampling otherwise."""
    if temperature <= 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        cum = jnp.cumsum(probs, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        n_keep = jnp.sum(cum - probs < top_p, axis=-1)
        cutoff = jnp.take_along_axis(sorted_logits, (n_keep - 1)[:, None], axis=-1)
        logits = jnp.where(logits < cutoff, M.MASK_VALUE, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(
    jax.jit, static_argnames=("cfg", "policy", "temperature", "top_p"), donate_argnames=("cache",)
)
def _decode_jit(params, cache, tokens, key, cfg, policy, temperature, top_p):
    """One decode step with the policy's ``attend`` in every layer: (tokens, logits, cache, extras)."""
    logits, cache, extras = M.decode_step(params, cache, tokens, cfg, policy=policy)
    return sample(logits, key, temperature, top_p), logits, cache, extras


def prefill(params: dict, cfg: ModelConfig, prompts: Sequence[Sequence[int]], *, tail_capacity: int,
            build_layer=None, all_logits: bool = False, mesh=None):
    """Chunked prefill of a right-padded batch of token-id lists (split over ``mesh``'s "data" axis).

    Returns (logits of each prompt's last token [B, V] float32, cache).
    """
    lens = np.array([len(p) for p in prompts], np.int32)
    T = int(lens.max())
    C = chunk_bucket(T)
    tokens = np.zeros((len(prompts), _round_up(T, C)), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    if mesh is not None:
        tokens = jax.device_put(tokens, batch_sharding(mesh, tokens.shape))
    return M.prefill(
        params, cfg, tokens, lens, chunk=C, tail_capacity=tail_capacity,
        build_layer=build_layer, compile_fn=compiled, all_logits=all_logits,
    )


def _as_token_batches(model, prompt, chat: bool) -> tuple[list[list[int]], bool]:
    """Normalise the prompt forms to a list of token-id lists; returns (batch, is_batch)."""
    tok = model.tokenizer
    if isinstance(prompt, str):
        return [_encode(tok, prompt, chat)], False
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if isinstance(prompt, (list, tuple)):
        if len(prompt) == 0:
            raise PromptError("empty prompt: pass a non-empty string, list of strings or token ids")
        if all(isinstance(p, str) for p in prompt):
            return [_encode(tok, p, chat) for p in prompt], True
        if all(isinstance(p, (int, np.integer)) for p in prompt):
            return [_token_list(prompt, "the prompt")], False
        if all(isinstance(p, (list, tuple, np.ndarray)) for p in prompt):
            return [_token_list(p, f"prompt {i}") for i, p in enumerate(prompt)], True
        if not any(isinstance(p, (str, list, tuple, np.ndarray)) for p in prompt):
            _token_list(prompt, "the prompt")  # numbers, not all integers: name the first that is not
    raise PromptError(
        f"unsupported prompt type {type(prompt).__name__}: pass a string, a list of strings, "
        "a list of token ids or a list of token-id lists"
    )


def _encode(tok, text: str, chat: bool) -> list[int]:
    if not text.strip():
        raise PromptError("empty prompt: the prompt text has no content")
    return tok.encode_prompt(text, chat=chat)


def _validate_ids(batch: list[list[int]], cfg: ModelConfig, is_batch: bool, what: str = "prompt") -> None:
    for i, ids in enumerate(batch):
        if len(ids) == 0:
            raise PromptError(f"empty {what} (batch item {i}): it encodes to zero tokens")
        if len(ids) >= cfg.max_position_embeddings:
            raise PromptError(
                f"{what}{'' if not is_batch else f' {i}'} has {len(ids)} tokens but the model's context "
                f"is {cfg.max_position_embeddings} tokens (room is needed for at least one new token); "
                f"shorten the {what}"
            )
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise PromptError(f"token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _check_request(max_new_tokens, temperature, top_p, *, seed=0, stop=None, on_token=None) -> list[str]:
    """Types and ranges of the decoding arguments, before any compute; returns the stop strings as a list.

    The types are checked first, so the range comparisons at the end only ever see numbers.
    """
    if not _is_int(max_new_tokens):
        raise PromptError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not _is_real(temperature) or not np.isfinite(temperature) or temperature < 0:
        raise PromptError(f"temperature must be a finite number >= 0 (0 = greedy, > 0 samples), got {temperature!r}")
    if not _is_real(top_p) or not np.isfinite(top_p):
        raise PromptError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if not _is_int(seed) or not -(2**63) <= seed < 2**63:
        raise PromptError(f"seed must be an integer in [-2**63, 2**63), got {seed!r}")
    if on_token is not None and not callable(on_token):
        raise PromptError(f"on_token must be a function taking the new text, or None; got {on_token!r}")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(x, str) for x in stops):
        raise PromptError(f"stop must be a string, a list of strings or None, got {stop!r}")
    if any(x == "" for x in stops):
        raise PromptError("stop strings must be non-empty: an empty stop string matches at once and ends "
                          "generation after one token; drop it or pass stop=None")
    if max_new_tokens < 0:
        raise PromptError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not (0.0 < top_p <= 1.0):
        raise PromptError(f"top_p must be in (0, 1], got {top_p}")
    return list(stops)


def _check_model(model) -> None:
    """A loaded model bundle (``hetero_jax.load``), not a name or a path."""
    if not all(hasattr(model, a) for a in ("config", "params", "tokenizer")) or not isinstance(
            getattr(model, "config", None), ModelConfig):
        got = repr(model) if model is None or isinstance(model, str) else f"a {type(model).__name__}"
        raise PromptError(f"model must be a loaded model from hetero_jax.load(NAME_OR_DIR), got {got}"
                          + ("; load it first: model = hetero_jax.load(name)" if isinstance(model, str) else ""))


def _token_list(seq, what: str) -> list[int]:
    """``seq`` as a list of Python ints; PromptError naming the first element that is not an integer."""
    if isinstance(seq, np.ndarray):
        if seq.ndim != 1:
            raise PromptError(f"{what} must be a flat list of token ids, got an array of shape {seq.shape}")
        seq = seq.tolist()
    if not isinstance(seq, (list, tuple)):
        raise PromptError(f"{what} must be a list of token ids, got {type(seq).__name__}")
    for j, t in enumerate(seq):
        if not _is_int(t):
            raise PromptError(f"token ids must be integers: {what} has {t!r} ({type(t).__name__}) at position {j}")
    return [int(t) for t in seq]


def bind_policy(model, policy):
    """``policy`` (None = full KV) checked and bound to ``model`` (HeteroCache picks its profile)."""
    from hetero_jax.policies import FullKV, Policy

    policy = FullKV() if policy is None else policy
    if not isinstance(policy, Policy):
        raise PromptError(
            f"policy must be a hetero_jax.policies.Policy (e.g. SnapKV(budget=0.3)) or None, got {policy!r}"
        )
    return policy.bind(model)


@functools.partial(jax.jit, static_argnames=("cfg", "policy"), donate_argnames=("cache",))
def _extend_jit(params, cache, tokens, n_new, cfg, policy):
    return M.extend(params, cache, tokens, n_new, cfg, policy=policy)


class Engine:
    """A prefilled batch and its decode machinery: the shared core of ``generate`` and ``Session``.

    Validates the prompts and the policy's budget before any compute, permutes
    the heads for the policy's layout (once per model and layout), prefills
    layer by layer with the policy's selection, and then steps the decoder,
    running the policy's ``attend`` inside each step and its decode state's hooks
    (``policies.base.DecodeState``) around it, the same way for every policy.
    """

    def __init__(self, model, batch: list[list[int]], policy, *, tail_capacity: int, seed: int = 0,
                 is_batch: bool = False):
        _check_model(model)
        _validate_ids(batch, model.config, is_batch)
        policy = bind_policy(model, policy)
        lens = [len(b) for b in batch]
        plan = policy.make_prefill(model.config, lens, compile_fn=compiled)  # checks budgets
        compile_start = before = _COMPILE_TIME[0]
        t0 = time.perf_counter()
        params = params_for(model, policy.layout(model.config))  # permuted once per (model, layout)
        mesh = getattr(model, "mesh", None)
        logits, cache = prefill(params, model.config, batch, tail_capacity=tail_capacity,
                                build_layer=plan.build_layer, mesh=mesh)
        cache, state = plan.finish(cache)  # the decode sees only the state the prefill hands on
        if mesh is not None:  # KV heads on "model", batch on "data", wherever the partitioner put them
            cache = shard_cache(cache, mesh)
            if jax.process_count() > 1 and state.host_arrays():
                raise MeshError(f"{policy!r} keeps host copies, which its decode reads in one process; across "
                                f"{jax.process_count()} processes run a policy without host copies (full, snapkv, "
                                "pyramidkv, h2o, cake, streamingllm, quest, contextkeeper) or one process with "
                                "several devices")
        # the compressed caches and host reservoirs are off the logits' critical path: wait for them too,
        # so prefill_seconds (TTFT) is the time until decode can start, not until the logits exist
        jax.block_until_ready((logits, cache, state.host_arrays()))
        seconds = time.perf_counter() - t0 - (_COMPILE_TIME[0] - before)
        self._start(model, policy, lens, params, logits, cache, state, seconds, seed, compile_start)

    @classmethod
    def from_prefilled(cls, model, policy, lens: list[int], params, logits, cache, state, *,
                       prefill_seconds: float, seed: int = 0) -> "Engine":
        """An engine around a prefill done elsewhere: ``policy`` bound (``bind_policy``), ``params`` in its
        layout, and ``(cache, state)`` from its plan's ``finish``. Benchmarks share one forward pass
        between several policies this way; ``generate`` never needs it."""
        e = cls.__new__(cls)
        e._start(model, policy, list(lens), params, logits, cache, state, prefill_seconds, seed, _COMPILE_TIME[0])
        return e

    def _start(self, model, policy, lens, params, logits, cache, state, prefill_seconds, seed, compile_start):
        self.model, self.cfg, self.policy, self.lens = model, model.config, policy, lens
        self.params, self.logits, self.cache, self.state = params, logits, cache, state
        self.achieved_rho = state.achieved_rho(cache, self.cfg)
        self.prefill_seconds = prefill_seconds
        self.compile_start = compile_start
        self.key = jax.random.PRNGKey(seed)
        self.steps = 0
        self._fns: dict = {}

    @property
    def positions_left(self) -> int:
        return self.cfg.max_position_embeddings - int(np.max(to_host(self.cache.seq_lens)))

    def reserve(self, n: int) -> None:
        """Make room for ``n`` more tail tokens (grows the tail in TAIL_QUANTUM steps; recompiles decode)."""
        need = int(np.max(to_host(self.cache.tail_lens))) + n
        if need > self.cache.tail_capacity:
            self.cache = grow_tail(self.cache, _round_up(need, TAIL_QUANTUM))

    def first_tokens(self, temperature: float, top_p: float) -> np.ndarray:
        """Sample the tokens that follow the prefilled prompt."""
        self.key, sub = jax.random.split(self.key)
        return to_host(sample(self.logits, sub, temperature, top_p))

    def step(self, tokens, temperature: float, top_p: float) -> tuple[np.ndarray, float]:
        """Append ``tokens`` [B] and sample the next ones. Returns (next tokens [B], seconds)."""
        t1 = time.perf_counter()
        before = _COMPILE_TIME[0]
        out = self._advance(tokens, temperature, top_p)
        nxt = to_host(out[0])  # the read-back is part of the step's cost
        return nxt, time.perf_counter() - t1 - (_COMPILE_TIME[0] - before)

    def step_with_logits(self, tokens, temperature: float = 0.0, top_p: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """``step`` that also returns the logits it sampled from: (next tokens [B], logits [B, V] float32)."""
        out = self._advance(tokens, temperature, top_p)
        return to_host(out[0]), to_host(out[1]).astype(np.float32)

    def _advance(self, tokens, temperature: float, top_p: float):
        """One decode step with the policy's hooks; the jitted outputs (tokens, logits, cache, extras)."""
        self.cache = self.state.before_step(self.steps, self.cache)
        self.key, sub = jax.random.split(self.key)
        args = (self.params, self.cache, jnp.asarray(tokens, jnp.int32), sub)
        fn_key = (self.cache.tail_capacity, float(temperature), float(top_p))
        fn = self._fns.get(fn_key)
        if fn is None:  # shapes are fixed until the tail grows: look the executable up once
            fn = self._fns[fn_key] = compiled(_decode_jit, *args, cfg=self.cfg, policy=self.policy,
                                              temperature=float(temperature), top_p=float(top_p))
        out = fn(*args)
        self.cache = out[2]
        self.state.after_step(self.steps, out[3], self.cache)
        self.steps += 1
        return out

    def extend(self, ids: Sequence[int], *, max_chunk: int = MAX_CHUNK) -> np.ndarray:
        """Append ``ids`` (a session's turn) through chunked passes over the cache as it is; returns the
        logits of the last token [B, V] float32.

        Chunks are ``chunk_bucket`` sized (at most ``max_chunk``; the last one padded), so a turn of
        thousands of tokens costs a few prefill-like passes instead of one decode step per token, and
        equals those steps (tests/test_extend.py). No decode hook runs per token; the policy's decode
        state gets the turn's queries once, at the end (``after_extend``: HeteroCache re-selects).
        """
        ids = [int(t) for t in ids]
        if not ids:
            raise PromptError("nothing to extend: the turn has no tokens")
        self.reserve(len(ids))
        C = min(chunk_bucket(len(ids)), max_chunk)
        keep_q = self.state.wants_turn_queries
        per_chunk, logits = [], None
        for start in range(0, len(ids), C):
            part = ids[start : start + C]
            tokens = np.zeros((len(self.lens), C), np.int32)
            tokens[:] = part + [0] * (C - len(part))
            n_new = np.full(len(self.lens), len(part), np.int32)
            args = (self.params, self.cache, jnp.asarray(tokens), jnp.asarray(n_new))
            logits, self.cache, queries = compiled(_extend_jit, *args, cfg=self.cfg, policy=self.policy)(*args)
            if keep_q:
                per_chunk.append(tuple(q[:, :, : len(part)] for q in queries))
        if keep_q:
            turn_queries = tuple(jnp.concatenate(qs, axis=2) for qs in zip(*per_chunk))  # [B, Nkv, n, G, D]
            self.cache = self.state.after_extend(turn_queries, self.cache)
        return to_host(logits).astype(np.float32)

    def drain(self) -> float:
        """Wait until the policy's asynchronous decode work (HeteroCache's dispatched drift checks and
        recall copies) has finished; returns the seconds waited. Decoding never needs this; a benchmark
        that times several engines in turn does, so one engine's background work is not timed as
        another's step."""
        t0 = time.perf_counter()
        jax.block_until_ready((self.cache, self.state.in_flight()))
        return time.perf_counter() - t0

    def stats_fields(self) -> dict:
        return dict(
            kv_bytes_device=kv_bytes(self.cache),
            kv_bytes_used=used_kv_bytes(self.cache),
            kv_bytes_host=self.state.host_bytes(),
            kv_bytes_host_by_role=self.state.host_bytes_by_role(),
            kv_bytes_index=self.state.index_bytes(self.cache),
            kv_bytes_read_per_step=self.state.kv_bytes_read(self.cache),
            kv_bytes_prompt=prompt_kv_bytes(self.cache),
            kv_bytes_tail=tail_kv_bytes(self.cache),
            policy=repr(self.policy),
            compile_seconds=_COMPILE_TIME[0] - self.compile_start,
            policy_stats=self.state.stats(),
            policy_summary=self.state.summary(),
            kv_bytes_per_device=self.kv_bytes_per_device(),
            host_bytes_per_device=(per_device_bytes(self.state.host_arrays())
                                   if getattr(self.model, "mesh", None) is not None else {}),
        )

    def kv_bytes_per_device(self) -> dict:
        """On a mesh: K/V bytes (prompt groups + tail) each device holds; {} on one device."""
        if getattr(self.model, "mesh", None) is None:
            return {}
        return per_device_bytes(prompt_arrays(self.cache)
                                + [(l.tail_k, l.tail_v) for l in self.cache.layers])


def _decode_loop(engine: Engine, next_tok: np.ndarray, budget: int, *, temperature, top_p, stops, on_token):
    """Accept sampled tokens and step until EOS / stop string / budget. Returns per-sequence outputs."""
    tok = engine.model.tokenizer
    eos = set(tok.eos_token_ids) | set(engine.cfg.eos_token_ids)
    B = len(next_tok)
    out_ids: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    reasons = ["max_new_tokens"] * B
    texts = [""] * B
    decode_s: list[float] = []

    def accept(i: int, t: int) -> None:
        if done[i]:
            return
        if t in eos:
            done[i], reasons[i] = True, "eos"
            return
        out_ids[i].append(t)
        text = tok.decode(out_ids[i])
        if on_token is not None:
            on_token(text[len(texts[i]) :])
        texts[i] = text
        for s in stops:
            cut = text.find(s)
            if cut >= 0:
                texts[i] = text[:cut]
                done[i], reasons[i] = True, "stop"
                return

    for step in range(budget):
        for i in range(B):
            accept(i, int(next_tok[i]))
        if all(done) or step == budget - 1:
            break
        next_tok, seconds = engine.step(next_tok, temperature, top_p)
        decode_s.append(seconds)
    return out_ids, texts, reasons, decode_s


def _results(engine, out_ids, texts, reasons, decode_s, prompt_lens, extend_s=0.0):
    fields = engine.stats_fields()
    results = []
    for i in range(len(out_ids)):
        stats = GenerationStats(
            prompt_tokens=prompt_lens[i], generated_tokens=len(out_ids[i]),
            prefill_seconds=engine.prefill_seconds, decode_seconds=decode_s, stop_reason=reasons[i],
            achieved_rho=float(engine.achieved_rho[i]), extend_seconds=extend_s, **fields,
        )
        results.append(GenerationResult(text=texts[i], token_ids=out_ids[i], stats=stats))
    return results


def generate(
    model,
    prompt,
    policy=None,
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop: Sequence[str] | str | None = None,
    chat: bool = True,
    on_token: Callable[[str], None] | None = None,
):
    """Generate a continuation for one prompt or a batch.

    ``prompt``: a string, a list of strings (a batch), token ids, or a list of
    token-id lists. ``policy=None`` means full KV. Greedy at temperature 0.
    Stops at EOS, at any ``stop`` string, or after ``max_new_tokens``.
    ``on_token(text_delta)`` streams a single prompt's new text.
    Returns a :class:`GenerationResult` (a list of them for a batch).
    """
    stops = _check_request(max_new_tokens, temperature, top_p, seed=seed, stop=stop, on_token=on_token)
    _check_model(model)
    batch, is_batch = _as_token_batches(model, prompt, chat)
    if on_token is not None and is_batch:
        raise PromptError("on_token streams a single prompt; pass one prompt or on_token=None")
    T = max(len(b) for b in batch)
    budget = min(max_new_tokens, model.config.max_position_embeddings - T)  # never past the context
    engine = Engine(model, batch, policy, tail_capacity=_round_up(max(budget, 1), TAIL_QUANTUM), seed=seed,
                    is_batch=is_batch)
    first = engine.first_tokens(temperature, top_p)
    out_ids, texts, reasons, decode_s = _decode_loop(engine, first, budget, temperature=temperature, top_p=top_p,
                                                     stops=stops, on_token=on_token)
    if budget < max_new_tokens:
        reasons = ["context" if r == "max_new_tokens" else r for r in reasons]
    results = _results(engine, out_ids, texts, reasons, decode_s, [len(b) for b in batch])
    return results if is_batch else results[0]


def _check_session_args(model, context, chat, seed, reserve_tokens) -> None:
    """Session's arguments, before any compute. The model needs only its tokenizer here (Engine checks the
    rest): benchmarks/bench_multiturn.py probes a Session's context ids with a tokenizer-only stand-in."""
    if not hasattr(model, "tokenizer"):
        _check_model(model)
    if context is None or not isinstance(context, (str, list, tuple, np.ndarray)):
        raise PromptError(f"context must be a string or a list of token ids, got {type(context).__name__}; "
                          "a Session answers questions about a context given up front")
    if not isinstance(chat, (bool, np.bool_)):
        raise PromptError(f"chat must be True or False, got {chat!r}")
    _check_request(0, 0.0, 1.0, seed=seed)
    if not _is_int(reserve_tokens) or reserve_tokens < 1:
        raise PromptError(f"reserve_tokens must be an integer >= 1, got {reserve_tokens!r}")


def _question_ids(question, cfg: ModelConfig) -> list[int]:
    """A question given as token ids: integers inside the vocabulary, at least one."""
    if not isinstance(question, (list, tuple, np.ndarray)):
        raise PromptError(f"question must be a string or a list of token ids, got {type(question).__name__}")
    ids = _token_list(question, "the question")
    if not ids:
        raise PromptError("empty question: pass a non-empty string or list of token ids")
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise PromptError(f"token id {bad[0]} of the question is outside the vocabulary [0, {cfg.vocab_size})")
    return ids


class Session:
    """A long context prefilled once, then several questions answered in turn.

    Each turn is appended to the cache as an extension (on the tail of every
    head, like generated tokens) in chunked passes (``Engine.extend``), then
    answered. The policy's prefill selection sees only the context; HeteroCache
    re-selects its compressed heads from each turn's queries before the answer.
    ``generate`` is one turn of this with the question inside the prompt.
    """

    def __init__(self, model, context: str | Sequence[int], policy=None, *, chat: bool = True, seed: int = 0,
                 reserve_tokens: int = 512):
        _check_session_args(model, context, chat, seed, reserve_tokens)
        self.model, self.chat = model, chat
        tok = model.tokenizer
        self.messages: list[dict] = []
        if isinstance(context, str):
            if not context.strip():
                raise PromptError("empty context: the session's context text has no content")
            if chat:
                marker = "\x00HETERO_JAX_TURN\x00"
                rendered = tok.apply_chat_template([{"role": "user", "content": context + marker}])
                self._prefix_text = rendered[: rendered.index(marker)]
                ids = tok.encode(self._prefix_text, add_special_tokens=False)
            else:
                self._prefix_text = context
                ids = tok.encode_prompt(context, chat=False)
            self._context_text = context
        else:
            ids = _token_list(context, "the context")
            self._prefix_text = None
            self._context_text = None
        self.engine = Engine(model, [ids], policy, tail_capacity=reserve_tokens, seed=seed)
        self.context_tokens = len(ids)
        self._rendered = self._prefix_text
        self._unfed: list[int] = []
        self.turns: list[GenerationResult] = []

    def _turn_ids(self, question: str | Sequence[int]) -> tuple[list[int], list[dict], str | None]:
        """Tokens that close the previous turn (if any) and open this one, with the chat history and
        rendered text after it; ``ask`` commits them only once the turn is accepted."""
        tok = self.model.tokenizer
        unfed = self._unfed
        if not isinstance(question, str):
            return unfed + _question_ids(question, self.engine.cfg), self.messages, self._rendered
        if not question.strip():
            raise PromptError("empty question: the question text has no content")
        if self._context_text is None or not self.chat:
            sep = "\n\n" if (self.turns or self._context_text) else ""
            return unfed + tok.encode(sep + question, add_special_tokens=False), self.messages, self._rendered
        if not self.turns:
            msgs = [{"role": "user", "content": self._context_text + "\n\n" + question}]
        else:
            msgs = self.messages + [{"role": "user", "content": question}]
        rendered = tok.apply_chat_template(msgs, add_generation_prompt=True)
        if not rendered.startswith(self._rendered):
            raise PromptError("the chat template does not render turns incrementally; use chat=False")
        new_text = rendered[len(self._rendered):]
        return unfed + tok.encode(new_text, add_special_tokens=False), msgs, rendered

    def ask(self, question, *, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
            stop=None, on_token=None) -> GenerationResult:
        """Append ``question`` (text or token ids) and generate the answer."""
        stops = _check_request(max_new_tokens, temperature, top_p, stop=stop, on_token=on_token)
        eng = self.engine
        ids, messages, rendered = self._turn_ids(question)
        room = eng.positions_left - len(ids)
        if room < 1:
            raise PromptError(
                f"the question ({len(ids)} tokens) does not fit: {eng.positions_left} positions are left in the "
                f"model's {eng.cfg.max_position_embeddings}-token context; ask a shorter question or start a new "
                "session (this one is unchanged)"
            )
        # every check passed: the turn is accepted (a refused one leaves the session as it was)
        self._unfed, self.messages, self._rendered = [], messages, rendered
        budget = min(max_new_tokens, room)
        eng.reserve(len(ids) + budget + 1)
        # All but the turn's last token go in chunked passes (the policy re-selects from their queries,
        # HeteroCache's after_extend); the last one is a decode step, so the answer's first token is
        # sampled with the new selection in place.
        before = _COMPILE_TIME[0]
        t0 = time.perf_counter()
        if len(ids) > 1:
            eng.extend(ids[:-1])
        nxt, _ = eng.step(np.asarray(ids[-1:], np.int32), temperature, top_p)
        extend_s = time.perf_counter() - t0 - (_COMPILE_TIME[0] - before)  # compile excluded, as in decode
        out_ids, texts, reasons, decode_s = _decode_loop(eng, nxt, budget, temperature=temperature, top_p=top_p,
                                                         stops=stops, on_token=on_token)
        if budget < max_new_tokens:
            reasons = ["context" if r == "max_new_tokens" else r for r in reasons]
        # the answer is in the cache except its last token when it did not end at EOS:
        # that one opens the next turn
        if out_ids[0] and reasons[0] != "eos":
            self._unfed = [out_ids[0][-1]]
        if self.chat and self._context_text is not None:
            answer = self.model.tokenizer.decode(out_ids[0])
            self.messages = self.messages + [{"role": "assistant", "content": answer}]
            self._rendered = self._rendered + answer
        res = _results(eng, out_ids, texts, reasons, decode_s, [self.context_tokens], extend_s)[0]
        self.turns.append(res)
        return res
