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
from hetero_jax.cache import kv_bytes, prompt_kv_bytes, tail_kv_bytes, used_kv_bytes
from hetero_jax.config import ModelConfig
from hetero_jax.errors import PromptError
from hetero_jax.layout import params_for

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
    kv_bytes_prompt: int  # of which the prompt's head groups
    kv_bytes_tail: int  # of which the tail (tokens added after prefill)
    stop_reason: str  # "eos", "stop", "max_new_tokens" or "context"
    compile_seconds: float = 0.0  # XLA compilation in this call (excluded from the timings above)
    policy: str = "FullKV(budget=1.0)"
    achieved_rho: float = 1.0  # prompt KV kept on the device / full prompt KV (tokens x KV heads x layers)

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def decode_ms_per_token(self) -> float:
        return 1e3 * float(np.mean(self.decode_seconds)) if self.decode_seconds else float("nan")

    def summary(self) -> str:
        return (
            f"prompt {self.prompt_tokens} tok, prefill {self.prefill_seconds:.2f} s "
            f"({self.prefill_tokens_per_second:.0f} tok/s) | generated {self.generated_tokens} tok, "
            f"decode {self.decode_ms_per_token:.1f} ms/tok | KV device {self.kv_bytes_device / 2**20:.1f} MiB "
            f"(used {self.kv_bytes_used / 2**20:.1f} MiB), host {self.kv_bytes_host / 2**20:.1f} MiB | "
            f"rho {self.achieved_rho:.3f} | compile {self.compile_seconds:.1f} s | stop: {self.stop_reason}"
        )


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


def compiled(jitted, *args, **static):
    """AOT-compile ``jitted`` for these argument shapes once and reuse it.

    Keeps compile time out of the timed prefill and decode steps; it is
    reported separately as ``compile_seconds``.
    """
    leaves, treedef = jax.tree.flatten(args)
    key = (jitted, treedef, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves), tuple(sorted(static.items())))
    fn = _COMPILED.get(key)
    if fn is None:
        t0 = time.perf_counter()
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
    jax.jit, static_argnames=("cfg", "temperature", "top_p"), donate_argnames=("cache",)
)
def _decode_jit(params, cache, tokens, key, cfg, temperature, top_p):
    logits, cache = M.decode_step(params, cache, tokens, cfg)
    return sample(logits, key, temperature, top_p), logits, cache


def prefill(params: dict, cfg: ModelConfig, prompts: Sequence[Sequence[int]], *, tail_capacity: int,
            build_layer=None, all_logits: bool = False):
    """Chunked prefill of a right-padded batch of token-id lists.

    Returns (logits of each prompt's last token [B, V] float32, cache).
    """
    lens = np.array([len(p) for p in prompts], np.int32)
    T = int(lens.max())
    C = chunk_bucket(T)
    tokens = np.zeros((len(prompts), _round_up(T, C)), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
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
            return [[int(t) for t in prompt]], False
        if all(isinstance(p, (list, tuple, np.ndarray)) for p in prompt):
            return [[int(t) for t in p] for p in prompt], True
    raise PromptError(
        f"unsupported prompt type {type(prompt).__name__}: pass a string, a list of strings, "
        "a list of token ids or a list of token-id lists"
    )


def _encode(tok, text: str, chat: bool) -> list[int]:
    if not text.strip():
        raise PromptError("empty prompt: the prompt text has no content")
    return tok.encode_prompt(text, chat=chat)


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
    from hetero_jax.policies import FullKV, Policy, PolicyPrefill, achieved_rho

    policy = FullKV() if policy is None else policy
    if not isinstance(policy, Policy):
        raise PromptError(
            f"policy must be a hetero_jax.policies.Policy (e.g. SnapKV(budget=0.3)) or None, got {policy!r}"
        )
    if max_new_tokens < 0:
        raise PromptError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not (0.0 < top_p <= 1.0):
        raise PromptError(f"top_p must be in (0, 1], got {top_p}")
    cfg: ModelConfig = model.config
    batch, is_batch = _as_token_batches(model, prompt, chat)
    if on_token is not None and is_batch:
        raise PromptError("on_token streams a single prompt; pass one prompt or on_token=None")
    for i, ids in enumerate(batch):
        if len(ids) == 0:
            raise PromptError(f"empty prompt (batch item {i}): it encodes to zero tokens")
        if len(ids) >= cfg.max_position_embeddings:
            raise PromptError(
                f"prompt{'' if not is_batch else f' {i}'} has {len(ids)} tokens but the model's context "
                f"is {cfg.max_position_embeddings} tokens (room is needed for at least one new token); "
                "shorten the prompt"
            )
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise PromptError(f"token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    stops = [stop] if isinstance(stop, str) else list(stop or [])

    lens = [len(b) for b in batch]
    plan = PolicyPrefill(policy, cfg, lens, compile_fn=compiled)  # checks budgets before any compute
    T = max(lens)
    # tokens beyond the context are not generated; say so in stop_reason
    budget = min(max_new_tokens, cfg.max_position_embeddings - T)
    tail_capacity = _round_up(max(budget, 1), TAIL_QUANTUM)
    eos = set(model.tokenizer.eos_token_ids) | set(cfg.eos_token_ids)

    compile_start = compile_before = _COMPILE_TIME[0]
    t0 = time.perf_counter()
    params = params_for(model, policy.layout(cfg))  # heads permuted once per (model, layout)
    build = None if isinstance(policy, FullKV) else plan.build_layer
    logits, cache = prefill(params, cfg, batch, tail_capacity=tail_capacity, build_layer=build)
    cache = plan.finish(cache)
    rho = achieved_rho(cache, cfg)
    key = jax.random.PRNGKey(seed)
    key, sub = jax.random.split(key)
    next_tok = np.asarray(sample(logits, sub, temperature, top_p))
    prefill_s = time.perf_counter() - t0 - (_COMPILE_TIME[0] - compile_before)
    compile_before = _COMPILE_TIME[0]

    B = len(batch)
    out_ids: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    reasons = ["max_new_tokens" if budget == max_new_tokens else "context"] * B
    texts = [""] * B
    decode_s: list[float] = []

    def accept(i: int, t: int) -> None:
        if done[i]:
            return
        if t in eos:
            done[i], reasons[i] = True, "eos"
            return
        out_ids[i].append(t)
        text = model.tokenizer.decode(out_ids[i])
        if on_token is not None:
            on_token(text[len(texts[i]) :])
        texts[i] = text
        for s in stops:
            cut = text.find(s)
            if cut >= 0:
                texts[i] = text[:cut]
                done[i], reasons[i] = True, "stop"
                return

    step_fn = None
    for step in range(budget):
        for i in range(B):
            accept(i, int(next_tok[i]))
        if all(done) or step == budget - 1:
            break
        t1 = time.perf_counter()
        key, sub = jax.random.split(key)
        args = (params, cache, jnp.asarray(next_tok, jnp.int32), sub)
        if step_fn is None:  # shapes are fixed for the whole loop: look the executable up once
            step_fn = compiled(_decode_jit, *args, cfg=cfg, temperature=float(temperature), top_p=float(top_p))
            t1 += _COMPILE_TIME[0] - compile_before  # compile time is reported apart
            compile_before = _COMPILE_TIME[0]
        tok_dev, _, cache = step_fn(*args)
        next_tok = np.asarray(tok_dev)  # the read-back is part of the step's cost
        decode_s.append(time.perf_counter() - t1)

    results = []
    for i in range(B):
        stats = GenerationStats(
            prompt_tokens=lens[i],
            generated_tokens=len(out_ids[i]),
            prefill_seconds=prefill_s,
            decode_seconds=decode_s,
            kv_bytes_device=kv_bytes(cache),
            kv_bytes_used=used_kv_bytes(cache),
            kv_bytes_host=0,
            kv_bytes_prompt=prompt_kv_bytes(cache),
            kv_bytes_tail=tail_kv_bytes(cache),
            stop_reason=reasons[i],
            policy=repr(policy),
            achieved_rho=float(rho[i]),
            compile_seconds=_COMPILE_TIME[0] - compile_start,
        )
        results.append(GenerationResult(text=texts[i], token_ids=out_ids[i], stats=stats))
    return results if is_batch else results[0]
