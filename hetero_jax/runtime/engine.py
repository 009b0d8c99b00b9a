"""The engine: a prefilled batch and its jitted decode loop, the same for every policy.

Data flows one way: prompts -> ``prefill`` (the policy's plan selects per layer) -> ``plan.finish`` hands
(cache, DecodeState) on -> ``Engine.step`` runs the policy's ``attend`` inside the jitted step and the
state's hooks around it (drift checks, recalls) -> ``decode_loop`` accepts tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from hetero_jax.errors import ConfigError, PromptError
from hetero_jax.model import transformer as M
from hetero_jax.model.cache import kv_bytes, resize_tail, prompt_arrays, prompt_kv_bytes, tail_kv_bytes, used_kv_bytes
from hetero_jax.model.config import ModelConfig
from hetero_jax.model.layout import params_for
from hetero_jax.model.sharding import (DATA, batch_sharding, committed, keep_placed, per_device_bytes, shard_cache,
                                       to_host)
from hetero_jax.runtime import heap
from hetero_jax.runtime.compile_cache import MAX_CHUNK, TAIL_QUANTUM, chunk_bucket, compile_seconds, compiled, round_up
from hetero_jax.runtime.prompts import check_model, stop_token_ids, validate_ids
from hetero_jax.runtime.results import GenerationResult, GenerationStats
from hetero_jax.runtime.sampling import draw_key, sample, sampling_mode
from hetero_jax.runtime.streaming import AnswerStream, AnswerText


@functools.partial(jax.jit, static_argnames=("cfg", "policy", "mode"), donate_argnames=("cache",))
def decode_step_jit(params, cache, tokens, key, host, sampling=None, *, cfg, policy, mode="greedy"):
    """One decode step with the policy's ``attend`` in every layer: (cache, tokens, logits, extras, the next
    key). ``host``: the decode state's host operands (``DecodeState.host_operands``), read and never donated.
    ``mode`` (static, ``sampling.sampling_mode``) and ``sampling`` ([2] float32: temperature, top_p; None when
    greedy): the values are operands, so every temperature and top_p of one mode runs one executable.
    A sampled step (temperature > 0) splits the key here (``draw_key``), as ``jax.random.split(key)`` on the
    host would (an eager split was a dispatch of its own before every step); a greedy step draws nothing and
    returns None for the key, which the caller keeps (a split in the graph is a loop on a CPU, a quarter second
    more of every greedy step's compile; returning the key unchanged would copy it, one kernel per step on a GPU).

    The cache comes first because jax pairs each donated input buffer with the first unclaimed output of the same
    shape and dtype, in output order: a [B] int32 output ahead of the cache (the sampled tokens) would claim the
    cache's first [B] int32 leaf, shift every later pairing by one, and XLA would then copy each unchanged small
    leaf (lengths, counters) into the buffer of its neighbour, one kernel each per step."""
    logits, cache, extras = M.decode_step(params, cache, tokens, cfg, policy=policy, host=host)
    next_key, sub = draw_key(key, mode)
    temperature, top_p = (None, None) if sampling is None else (sampling[0], sampling[1])
    return (keep_placed(cache), sample(logits, sub, temperature, top_p, mode), logits, extras,
            None if mode == "greedy" else next_key)


def warn_unsplit_batch(batch: int, mesh) -> None:
    """A RuntimeWarning when the mesh's "data" axis does not divide ``batch``: the batch then stays whole on
    it, so each data-parallel device repeats the whole batch's work and memory."""
    import warnings

    dp = mesh.shape[DATA]
    if dp > 1 and batch % dp:
        warnings.warn(f"a batch of {batch} prompt(s) does not split over the mesh's dp={dp} data-parallel devices, "
                      f"so each of them holds and computes the whole batch; give a batch that {dp} divides, or a "
                      "mesh with dp=1 (make_mesh(tp=..., dp=1))",
                      RuntimeWarning, stacklevel=3)


def prefill(params: dict, cfg: ModelConfig, prompts: Sequence[Sequence[int]], *, tail_capacity: int,
            plan=None, observe=None, all_logits: bool = False, mesh=None):
    """Chunked prefill of a right-padded batch of token-id lists (split over ``mesh``'s "data" axis) with a
    policy's ``plan`` (None: full KV) and an ``observe`` hook (``model.transformer.prefill``).

    Returns (logits of each prompt's last token [B, V] float32, cache).
    """
    lens = np.array([len(p) for p in prompts], np.int32)
    T = int(lens.max())
    C = chunk_bucket(T)
    tokens = np.zeros((len(prompts), round_up(T, C)), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    if mesh is not None:
        warn_unsplit_batch(len(prompts), mesh)
        tokens = jax.device_put(tokens, batch_sharding(mesh, tokens.shape))
    return M.prefill(
        params, cfg, tokens, lens, chunk=C, tail_capacity=tail_capacity, plan=plan, observe=observe,
        compile_fn=compiled, all_logits=all_logits, mesh=mesh,
    )



def check_kernel_backend() -> None:
    """ConfigError for a kernel backend setting (``HETERO_JAX_KERNELS`` or ``use_kernels``) that this process
    cannot run, before any compute: an unknown name, or the Triton kernels without a GPU."""
    try:
        mode = pallas_kernels.resolve_backend(native=True)
    except pallas_kernels.KernelBackendError as e:
        raise ConfigError(str(e)) from None
    if mode == "pallas" and not pallas_kernels.gpu_available():
        raise ConfigError(f"the kernel backend is 'pallas' ({pallas_kernels.ENV_VAR} or use_kernels), whose Triton "
                          "kernels need a GPU, and jax sees none; unset it (auto picks the native CPU kernel here) "
                          "or choose native, reference or interpret")


# what the engine calls on a policy instance (policies/base.py's ``Policy`` has them all); the runtime sits below
# policies/ (docs/architecture.md, "Layering"), so it checks the shape rather than importing the class (a class
# itself has the methods too, unbound: refused like any other non-policy)
POLICY_METHODS = ("bind", "make_prefill", "layout", "attend", "attend_chunk")


def bind_policy(model, policy):
    """``policy`` checked and bound to ``model`` (HeteroCache picks its profile). The runtime runs the policy
    it is given: None (full KV) is filled in by the package's front doors (``hetero_jax.generate``,
    ``hetero_jax.Session``, the server), which sit above policies/."""
    if policy is None:
        raise PromptError("policy is None: the runtime needs a policy object; pass hetero_jax.policies.FullKV() for "
                          "full KV, or call hetero_jax.generate / hetero_jax.Session, which take None for it")
    if isinstance(policy, type) or not all(callable(getattr(policy, m, None)) for m in POLICY_METHODS):
        raise PromptError(
            f"policy must be a hetero_jax.policies.Policy (e.g. SnapKV(budget=0.3)) or None, got {policy!r}"
        )
    return policy.bind(model)


@functools.partial(jax.jit, static_argnames=("cfg", "policy"), donate_argnames=("cache",))
def _extend_jit(params, cache, tokens, n_new, host, cfg, policy):
    logits, cache, queries = M.extend(params, cache, tokens, n_new, cfg, policy=policy, host=host)
    return logits, keep_placed(cache), queries


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
        check_model(model)
        check_kernel_backend()
        heap.flags()  # a malformed HETERO_JAX_GC_FREEZE / _MALLOC_TRIM is refused before any compute
        validate_ids(batch, model.config, is_batch)
        policy = bind_policy(model, policy)
        lens = [len(b) for b in batch]
        plan = policy.make_prefill(model.config, lens, compile_fn=compiled)  # checks budgets
        compile_start = before = compile_seconds()
        t0 = time.perf_counter()
        params = params_for(model, policy.layout(model.config))  # permuted once per (model, layout)
        mesh = getattr(model, "mesh", None)
        logits, cache = prefill(params, model.config, batch, tail_capacity=tail_capacity, plan=plan, mesh=mesh)
        cache, state = plan.finish(cache)  # the decode sees only the state the prefill hands on
        if mesh is not None:  # KV heads on "model", batch on "data", wherever the partitioner put them
            cache = shard_cache(cache, mesh)
        # the compressed caches and host reservoirs are off the logits' critical path: wait for them too,
        # so prefill_seconds (TTFT) is the time until decode can start, not until the logits exist
        jax.block_until_ready((logits, cache, state.host_arrays()))
        seconds = time.perf_counter() - t0 - (compile_seconds() - before)
        self._start(model, policy, lens, params, logits, cache, state, seconds, seed, compile_start)

    @classmethod
    def from_prefilled(cls, model, policy, lens: list[int], params, logits, cache, state, *,
                       prefill_seconds: float, seed: int = 0) -> "Engine":
        """An engine around a prefill done elsewhere: ``policy`` bound (``bind_policy``), ``params`` in its
        layout, and ``(cache, state)`` from its plan's ``finish``. Benchmarks share one forward pass
        between several policies this way; ``generate`` never needs it."""
        e = cls.__new__(cls)
        e._start(model, policy, list(lens), params, logits, cache, state, prefill_seconds, seed, compile_seconds())
        return e

    def _start(self, model, policy, lens, params, logits, cache, state, prefill_seconds, seed, compile_start):
        heap.engine_started(self)  # its compiles freeze the heap (``runtime.heap``)
        self.model, self.cfg, self.policy, self.lens = model, model.config, policy, lens
        # one fast-path signature for every step (``committed``); on a mesh params and cache are placed, and
        # the key must stay free to follow them onto the mesh's devices
        single = getattr(model, "mesh", None) is None
        if single:
            params, cache = committed((params, cache))
        self.params, self.logits, self.cache, self.state = params, logits, cache, state
        self.achieved_rho = state.achieved_rho(cache, self.cfg)
        self.prefill_seconds = prefill_seconds
        # compile seconds of building the engine (its prefill), counted by its first result only; each call
        # counts from its own mark (``begin_call``), as the process-wide counter also runs for other engines
        self.compile_owed = compile_seconds() - compile_start
        self.compile_mark = compile_seconds()
        self.key = committed(seed_key(seed)) if single else seed_key(seed)
        self.steps = 0
        self._fns: dict = {}
        self._single = single
        self._sampling = None  # ((temperature, top_p), its device operand): _sampling_operand

    def begin_call(self) -> None:
        """Start a call's compile count (a session's turn): its result counts only the compiles from here on,
        and the engine's build while no result has counted it (``compile_counted``)."""
        self.compile_mark = compile_seconds()

    def compile_counted(self) -> None:
        """A result has counted the engine's build: later calls count only their own compiles."""
        self.compile_owed = 0.0

    @property
    def positions_left(self) -> int:
        return self.cfg.max_position_embeddings - int(np.max(to_host(self.cache.seq_lens)))

    def reserve(self, n: int, *, doubling: bool = False) -> None:
        """Make room for ``n`` more tail tokens (TAIL_QUANTUM multiples). ``doubling``: grow to at least twice
        the capacity, never past the rows the context can still use; each new capacity compiles decode and
        extend again, so a session's turns compile O(log(context)) times, not once per turn."""
        used = int(np.max(to_host(self.cache.tail_lens)))
        need, cap = used + n, self.cache.tail_capacity
        if need > cap:
            usable = used + self.positions_left  # rows past this can never be written
            target = max(need, min(2 * cap, usable)) if doubling else need
            self.cache = resize_tail(self.cache, round_up(target, TAIL_QUANTUM))
            self.state.pool_moved(self.cache)

    def trim(self, n: int) -> None:
        """Give back tail rows past the tokens held and ``n`` more (in TAIL_QUANTUM steps): a held conversation
        keeps what it uses, not the room its longest answer reserved (the next ``reserve`` grows it again)."""
        self.shrink_tail(round_up(int(np.max(to_host(self.cache.tail_lens))) + max(n, 1), TAIL_QUANTUM))

    def shrink_tail(self, capacity: int) -> None:
        """Give back tail rows past ``capacity`` (at least the rows held); a larger ``capacity`` changes nothing."""
        if capacity < self.cache.tail_capacity:
            self.cache = resize_tail(self.cache, capacity)
            self.state.pool_moved(self.cache)

    def first_tokens(self, temperature: float, top_p: float) -> np.ndarray:
        """Sample the tokens that follow the prefilled prompt (the key advances only when sampling, as in
        ``decode_step_jit``)."""
        mode = sampling_mode(temperature, top_p)
        self.key, sub = draw_key(self.key, mode)
        return to_host(sample(self.logits, sub, temperature, top_p, mode))

    def step(self, tokens, temperature: float, top_p: float) -> tuple[np.ndarray, float]:
        """Append ``tokens`` [B] and sample the next ones. Returns (next tokens [B], seconds)."""
        t1 = time.perf_counter()
        before = compile_seconds()
        nxt = to_host(self._advance(tokens, temperature, top_p)[0])  # the read-back is part of the step's cost
        return nxt, time.perf_counter() - t1 - (compile_seconds() - before)

    def dispatch(self, tokens, temperature: float, top_p: float) -> jax.Array:
        """Dispatch one decode step on ``tokens`` [B] (host ints, or the device tokens an earlier ``dispatch``
        returned) without waiting for it: the next tokens [B] on the device. The policy's hooks run as in
        ``step``."""
        return self._advance(tokens, temperature, top_p)[0]

    def step_with_logits(self, tokens, temperature: float = 0.0, top_p: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """``step`` that also returns the logits it sampled from: (next tokens [B], logits [B, V] float32)."""
        nxt, logits = self._advance(tokens, temperature, top_p)
        return to_host(nxt), to_host(logits).astype(np.float32)

    def _sampling_operand(self, mode: str, temperature: float, top_p: float):
        """The step's [2] float32 (temperature, top_p) on the device, None when greedy; the last one is kept, so
        an answer's steps transfer it once."""
        if mode == "greedy":
            return None
        want = (float(temperature), float(top_p))
        if self._sampling is None or self._sampling[0] != want:
            value = jnp.asarray(want, jnp.float32)  # as the key: committed on one device, free on a mesh
            self._sampling = (want, committed(value) if self._single else value)
        return self._sampling[1]

    def _advance(self, tokens, temperature: float, top_p: float):
        """One decode step with the policy's hooks: (next tokens [B], logits [B, V]) on the device."""
        mode = sampling_mode(temperature, top_p)
        self.cache = self.state.before_step(self.steps, self.cache)
        # host ints go in as an int32 numpy array (jit's own transfer); an eager jnp conversion was an XLA
        # dispatch per step. Device tokens (``dispatch``'s) stay where they are.
        tokens = tokens if isinstance(tokens, jax.Array) else np.asarray(tokens, np.int32)
        args = (self.params, self.cache, tokens, self.key, self.state.host_operands(),
                self._sampling_operand(mode, temperature, top_p))
        fn_key = (self.cache.tail_capacity, mode)
        fn = self._fns.get(fn_key)
        if fn is None:  # shapes are fixed until the tail grows: look the executable up once
            fn = self._fns[fn_key] = compiled(decode_step_jit, *args, cfg=self.cfg, policy=self.policy, mode=mode)
        self.cache, nxt, logits, extras, next_key = fn(*args)
        if next_key is not None:  # a greedy step leaves the key as it was
            self.key = next_key
        self.state.after_step(self.steps, extras, self.cache)
        self.steps += 1
        return nxt, logits

    def extend(self, ids: Sequence[int], *, max_chunk: int = MAX_CHUNK) -> np.ndarray:
        """Append ``ids`` (a session's turn) through chunked passes over the cache as it is; returns the
        logits of the last token [B, V] float32.

        Chunks are ``chunk_bucket`` sized (at most ``max_chunk``; the last one padded), so a turn of
        thousands of tokens costs a few prefill-like passes instead of one decode step per token, and
        equals those steps (tests/test_extend.py). No decode hook runs per token; the policy's decode
        state gets the turn's queries once, at the end (``after_extend``: HeteroCache re-selects); a state
        that ``reencodes_turn`` has the turn appended a second time, over the rows it re-selected.
        """
        ids = [int(t) for t in ids]
        if not ids:
            raise PromptError("nothing to extend: the turn has no tokens")
        self.reserve(len(ids))
        keep_q = self.state.wants_turn_queries
        logits, turn_queries = self._extend_pass(ids, max_chunk, keep_q)
        if keep_q:
            before = self.cache
            self.cache = self.state.after_extend(turn_queries, before)
            if self.state.reencodes_turn and self.cache is not before:
                # The turn's own K/V were computed over the rows the heads held before the turn; once
                # the policy re-selected from its queries, take the turn back and append it again, so
                # the turn and the answer both attend the new rows (HeteroCache: README, departures).
                n = len(ids)
                self.cache = self.cache.replace(seq_lens=self.cache.seq_lens - n, tail_lens=self.cache.tail_lens - n)
                logits, _ = self._extend_pass(ids, max_chunk, False)
        return to_host(logits).astype(np.float32)

    def _extend_pass(self, ids: list[int], max_chunk: int, keep_q: bool):
        """Append ``ids`` in chunked passes: (logits of the last token [B, V] on the device, the turn's queries
        per layer [B, Nkv, n, G, D] when ``keep_q``, else None)."""
        C = min(chunk_bucket(len(ids)), max_chunk)
        per_chunk, logits = [], None
        for start in range(0, len(ids), C):
            part = ids[start : start + C]
            tokens = np.zeros((len(self.lens), C), np.int32)
            tokens[:] = part + [0] * (C - len(part))
            n_new = np.full(len(self.lens), len(part), np.int32)
            args = (self.params, self.cache, jnp.asarray(tokens), jnp.asarray(n_new), self.state.host_operands())
            logits, self.cache, queries = compiled(_extend_jit, *args, cfg=self.cfg, policy=self.policy)(*args)
            if keep_q:
                per_chunk.append(tuple(q[:, :, : len(part)] for q in queries))
        turn_queries = tuple(jnp.concatenate(qs, axis=2) for qs in zip(*per_chunk)) if keep_q else None
        return logits, turn_queries

    def checkpoint(self) -> "EngineCheckpoint":
        """What a session's turn may change, saved so that ``restore`` can undo the turn if it fails.

        The cache's arrays are copied (every jitted call donates them); the pool only when the decode state
        may rewrite prompt rows (``DecodeState.writes_prompt_rows``): otherwise a turn only writes tail rows
        past the saved lengths, and the live pool serves again. Call it after ``reserve``, so the tail does
        not grow inside the turn."""
        copy = functools.partial(jax.tree.map, lambda a: a.copy())
        whole = bool(self.state.writes_prompt_rows)
        cache = copy(self.cache) if whole else copy(self.cache.replace(pool=None))
        return EngineCheckpoint(cache=cache, pool_copied=whole, pool_shape=tuple(self.cache.pool.k.shape),
                                state=_copy_state(vars(self.state)), key=self.key, steps=self.steps)

    def restore(self, ck: "EngineCheckpoint") -> bool:
        """Put the engine back as ``ck`` saw it; False if it cannot be (its pool was not copied and the live one
        is gone: a device call was interrupted after it took the donated pool, or the tail grew)."""
        if ck.pool_copied:
            cache = ck.cache
        else:
            pool = self.cache.pool
            if tuple(pool.k.shape) != ck.pool_shape or any(a.is_deleted() for a in jax.tree.leaves(pool)):
                return False
            cache = ck.cache.replace(pool=pool)
        self.cache, self.key, self.steps = cache, ck.key, ck.steps
        attrs = vars(self.state)
        attrs.clear()
        attrs.update(ck.state)  # in place: whoever holds the state object sees the restored one
        return True

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
            kv_bytes_read_per_step=self.state.kv_bytes_read(self.cache, self.steps),
            kv_bytes_prompt=prompt_kv_bytes(self.cache),
            kv_bytes_tail=tail_kv_bytes(self.cache),
            policy=repr(self.policy),
            compile_seconds=self.compile_owed + compile_seconds() - self.compile_mark,
            policy_stats=self.state.stats(),
            policy_summary=self.state.summary(),
            kv_bytes_per_device=self.kv_bytes_per_device(),
            host_bytes_per_device=(per_device_bytes(self.state.host_arrays())
                                   if getattr(self.model, "mesh", None) is not None else {}),
        )

    def kv_bytes_per_device(self) -> dict:
        """On a mesh: K/V bytes (each device's shard of the pool) each device holds; {} on one device."""
        if getattr(self.model, "mesh", None) is None:
            return {}
        return per_device_bytes(prompt_arrays(self.cache))


@dataclasses.dataclass(frozen=True)
class EngineCheckpoint:
    """An engine's state before a session turn (``Engine.checkpoint``); used once, by ``Engine.restore``."""

    cache: object  # copies of the cache's arrays (the pool's only when ``pool_copied``; else pool=None)
    pool_copied: bool
    pool_shape: tuple  # the live pool's shape when the pool was not copied: it must still be that one
    state: dict  # the decode state's attributes, containers and host arrays copied
    key: object
    steps: int


def _copy_state(value):
    """``value`` with its containers and numpy arrays copied (the decode state's held positions, buffers, step
    lists). Device arrays (immutable), host stores (written once, at prefill), plans and policies are shared;
    so are a host store's call counters, which a failed turn leaves counted."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if type(value) in (list, tuple, set):
        return type(value)(_copy_state(v) for v in value)
    if type(value) is collections.deque:  # HeteroCache's steps awaiting the drift check
        return collections.deque((_copy_state(v) for v in value), maxlen=value.maxlen)
    if type(value) is dict:
        return {k: _copy_state(v) for k, v in value.items()}
    return value


def seed_key(seed: int) -> jax.Array:
    """The raw threefry key [2] uint32 of a 64-bit ``seed`` (two's complement): its high and low words, as
    ``jax.random.PRNGKey`` makes it with x64 on (off, it keeps the low 32 bits only, so seed 2**32 sampled as
    seed 0). Seeds in [0, 2**32) get PRNGKey's own key."""
    s = int(seed) % 2**64
    return jnp.asarray(np.array([s >> 32, s & 0xFFFFFFFF], np.uint32))


def decode_loop(engine: Engine, next_tok: np.ndarray, budget: int | Sequence[int], *, temperature, top_p, stops,
                on_token, pipelined: bool = False, max_new_tokens: int | None = None):
    """Accept sampled tokens and step until every sequence has ended (EOS, a stop string or its budget).
    Returns per-sequence outputs.

    A stop string is matched in the answer's text; one that is a special token's whole text (which decoding
    leaves out of the text) also by that token, which ends the answer as EOS does, with the stop reason "stop".

    ``budget``: the most tokens each sequence takes, per sequence or one for all. A sequence that reaches it
    stops with "max_new_tokens", or "context" when its budget is below ``max_new_tokens`` (the context's room
    set it); the others go on. ``on_token(delta)`` (a single sequence) gets, once per accepted token (and once
    more at EOS or a stop token if text was held back), the new text no later token can change
    (``AnswerStream``): joined, the answer's text, which is its tokens' whole decode (but for invalid bytes of a
    byte-fallback tokenizer, whose decode can turn an earlier streamed character into U+FFFD).

    ``pipelined``: each step is dispatched before the previous step's tokens are read back (it takes them on
    the device), so the host's work for a step (hooks, dispatch, a GPU's launch) overlaps the device's work
    for the one before. The step dispatched after the answer's last token is then computed and discarded:
    only for an engine used once (``generate``), since it appends a token the answer does not hold.
    ``decode_s``: per step, the wall seconds until its tokens were on the host (compiles excluded)."""
    tok = engine.model.tokenizer
    eos = set(tok.eos_token_ids) | set(engine.cfg.eos_token_ids)
    stop_ids = stop_token_ids(tok, stops)
    B = len(next_tok)
    budgets = [int(budget)] * B if np.ndim(budget) == 0 else [int(b) for b in budget]
    limits = ["context" if max_new_tokens is not None and b < max_new_tokens else "max_new_tokens" for b in budgets]
    out_ids: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    reasons = list(limits)
    streams = [AnswerStream(stops) for _ in range(B)]
    answers = [AnswerText(tok) for _ in range(B)]
    decode_s: list[float] = []

    def finish(i: int) -> str:
        """The answer's text as the whole decode of its tokens, and what is still held back of it."""
        return streams[i].update(answers[i].whole()) + streams[i].flush()

    def accept(i: int, t: int) -> None:
        if done[i]:
            return
        if t in eos or t in stop_ids:  # EOS first: a stop string naming the EOS token ends at EOS, as before
            done[i], reasons[i] = True, "eos" if t in eos else "stop"
            delta = finish(i)
            if on_token is not None and delta:
                on_token(delta)
            return
        out_ids[i].append(t)
        delta = streams[i].update(answers[i].add(t))
        if streams[i].stopped:
            done[i], reasons[i] = True, "stop"
        elif len(out_ids[i]) >= budgets[i]:
            done[i], reasons[i] = True, limits[i]
            delta += finish(i)
        if on_token is not None:
            on_token(delta)

    steps = max(budgets, default=0)  # the longest budget; a sequence done earlier is stepped and ignored
    # the tail grows as the answer does (doubling, ``TAIL_QUANTUM`` multiples), never to the whole budget up
    # front: a large max_new_tokens answered in a few tokens held the rows (and read-cost stats) of all of them
    used = int(np.max(to_host(engine.cache.tail_lens))) if steps > 1 else 0
    left = steps - 1  # the steps this loop may dispatch, each appending one tail row

    def room_for_one() -> None:
        nonlocal used, left
        if used + 1 > engine.cache.tail_capacity:
            engine.reserve(min(max(engine.cache.tail_capacity, TAIL_QUANTUM), left))
        used, left = used + 1, left - 1

    ahead = None  # pipelined: the device tokens of the step dispatched ahead
    for step in range(steps):
        for i in range(B):
            accept(i, int(next_tok[i]))
        if all(done) or step == steps - 1:
            break
        t1, before = time.perf_counter(), compile_seconds()
        if not pipelined:
            room_for_one()
            next_tok, seconds = engine.step(next_tok, temperature, top_p)
        else:
            if ahead is None:
                room_for_one()
            this = engine.dispatch(next_tok, temperature, top_p) if ahead is None else ahead
            # the step after this one, while this one computes (never past the budget)
            if step + 2 < steps:
                room_for_one()
            ahead = engine.dispatch(this, temperature, top_p) if step + 2 < steps else None
            next_tok = to_host(this)
            seconds = time.perf_counter() - t1 - (compile_seconds() - before)
        decode_s.append(seconds)
    return out_ids, [s.text for s in streams], reasons, decode_s


def make_results(engine, out_ids, texts, reasons, decode_s, prompt_lens, extend_s=0.0):
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
