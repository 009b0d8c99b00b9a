"""Offline calibration of a HeteroCache head profile on a model (issue 4).

For each calibration sample (a token sequence, no chat template):

1. Layer-major prefill with full KV. While a layer's prompt KV exists, the
   last prompt token's query is recomputed from the layer input and scored
   against the prompt keys (``pallas_kernels.scores``: softmax, 5-tap average
   pooling, GQA aggregated by MEAN as the design notes, shared/design/METHODS.md,
   ask for calibration). Its top-k per KV head is K_prefill, kept as a bool mask [L, H, Tp]. The
   pairwise overlaps of a layer's K_prefill sets are its similarity matrix
   [H, H] (the graph of the star clustering).
2. ``decode_steps`` greedy decode steps. One jitted function per step runs
   the model step and, for every layer, scores that step's query against the
   layer's prompt keys, takes the top-k mask K_t and records
   O(K_t, K_prefill) per head. The cache is donated; only [L, H] overlaps
   leave the device, never attention matrices.
3. Per sample: stability = median over steps of the overlap (Eq. 2).
4. Copy phase (ours, ``copy_steps`` > 0): from a second full-KV prefill of
   the sample, ``copy_steps`` of its tokens (``COPY_SPANS`` runs spread over
   it, see :func:`copy_positions`) are fed again, teacher forced, right after
   the prompt, as if the model quoted the text. At each step a KV head scores a hit
   when the argmax over the prompt keys of any of its query heads (raw q.k)
   is the earlier occurrence of the token just fed. copy_score = hits / steps,
   averaged over samples. Heads that copy this way (duplicate-token heads)
   look stable by top-k overlap, yet a long answer that repeats the prompt
   (a number, a name) needs exactly the tokens they point at; ``build_profile``
   keeps heads with copy_score >= tau_copy whole.

Both follow the authors' release rather than the design notes' first reading:
top-k = 20% of the calibration length (the paper's App. D "one-fifth of the
length"; the paper's figures used 1024 of 10K) and the similarity graph at
the prefill step (the release builds it from the K_prefill sets; the notes
had the last decode step). Stability and similarity stay raw overlaps (Eq. 1):
their chance level k/L is the same for every head of a calibration, so
normalising them against it would be a monotone map that changes no role,
only the scale of the thresholds (see ``HeteroCache.drift_threshold``, which
converts tau_stable to the chance-normalised scale of the drift check).

Across samples the statistics are averaged (arithmetic mean of each head's
stability and of each layer's similarity matrix), then thresholded once by
``build_profile``. The paper only says its profile is "based on the
statistical average" over the calibration set; we average the scores rather
than voting on per-sample roles because a mean of scores is stable under
small perturbations of a single sample and keeps the tau sweep meaningful.

``scoring="synckv"`` calibrates SyncKV's grouping instead: no prefill scoring; at every decode
step each KV head's top-k (10% of the length) of its raw softmax over the prompt (GQA max, no
pooling), the pairwise overlaps of those sets averaged over steps and samples, then k-means of the
rows of max(S) - S (``clustering.synckv_roles``).

Everything is deterministic: greedy decoding, fixed top-k tie rule of
``jax.lax.top_k`` (lower index first), fixed reduction order. ``seed`` only
chooses the windows in :func:`calibration_windows` and is recorded.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from hetero_jax.model import transformer as M
from hetero_jax.model.cache import gather_rows
from hetero_jax.model.config import ModelConfig
from hetero_jax.runtime.compile_cache import chunk_bucket, compiled
from hetero_jax.model.scoring import query_probs_max
from hetero_jax.profile.clustering import default_n_r
from hetero_jax.profile.head_profile import build_profile, build_synckv_profile
from hetero_jax.profile.schema import ProfileError, ProfileSettings
from hetero_jax.profile.shipped import weights_fingerprint
from hetero_jax.profile.metrics import max_similarity

__all__ = [
    "TOP_K_FRACTION",
    "CalibrationStats",
    "default_top_k",
    "calibrate",
    "calibrate_tokens",
    "calibration_windows",
    "chance_length",
    "pydoc_text",
]

# The authors' release (and the paper's App. D at 128K): top-k = one fifth of the length.
TOP_K_FRACTION = 0.2
# SyncKV's calibration top-k (its paper leaves k "predefined"): a tenth of the length (ours).
SYNCKV_TOP_K_FRACTION = 0.1
SCORINGS = ("heterocache", "synckv")
# Copy phase (ours): teacher-forced steps that re-feed a span of each sample, and the duplicate-token
# score from which a compressed head is kept whole. tau_copy was chosen on held-out needle prompts
# (README, "Where the misses came from"), not on the reported grid.
DEFAULT_COPY_STEPS = 48
COPY_SPANS = 4
DEFAULT_TAU_COPY = 0.3


def default_top_k(n_tokens: int, scoring: str = "heterocache") -> int:
    """top_k used when none is given: 20% of the (shortest) calibration length (10% for SyncKV), at least 1."""
    frac = SYNCKV_TOP_K_FRACTION if scoring == "synckv" else TOP_K_FRACTION
    return max(1, int(round(frac * int(n_tokens))))


@dataclasses.dataclass(frozen=True)
class CalibrationStats:
    """Raw per-sample statistics behind a profile (for analysis and tests).

    ``overlaps`` [N, S, L, H]: O(K_t, K_prefill) per sample, step, layer, head.
    ``stability`` [N, L, H]: per-sample median over steps.
    ``similarity_matrix`` [N, L, H, H]: per-sample pairwise overlaps of the
    K_prefill sets within each layer.
    ``generated`` [N, S]: the greedy tokens fed at each step.
    ``copy_hits`` [N, C, L, H] bool: copy-phase hits per step (None without a copy phase);
    ``copy_positions`` [N, C]: the prompt position re-fed at each copy step.
    SyncKV scoring (``scoring="synckv"``): ``overlaps`` and ``stability`` are None,
    ``similarity_steps`` [N, S, L, H, H] holds the pairwise overlaps of the heads'
    top-k sets at every decode step and ``similarity_matrix`` their mean over steps.
    """

    overlaps: np.ndarray | None
    stability: np.ndarray | None
    similarity_matrix: np.ndarray
    generated: np.ndarray
    prompt_lens: np.ndarray
    top_k: int
    similarity_steps: np.ndarray | None = None
    copy_hits: np.ndarray | None = None
    copy_positions: np.ndarray | None = None


# --------------------------------------------------------------------- jitted pieces
def _topk_mask(scores: jax.Array, k: int) -> jax.Array:
    """scores [..., T] -> bool [..., T] with k True per row (lax.top_k: ties to the lower index)."""
    _, idx = jax.lax.top_k(scores, k)
    one = jnp.zeros(scores.shape, jnp.int32)
    lead = scores.shape[:-1]
    flat = one.reshape(-1, scores.shape[-1])
    rows = jnp.arange(flat.shape[0])[:, None]
    flat = flat.at[rows, idx.reshape(-1, k)].set(1)
    return flat.reshape(lead + (scores.shape[-1],)).astype(bool)


# The jitted steps return overlaps as integer counts (|A & B|, min(|A|, |B|)), stacked on a last axis of 2, and
# the host divides them in float64 (``_ratio``): a float32 7/10 is 0.699999988 < 0.7, which would turn an exact
# tie at a threshold (S >= tau_stable, O >= tau_sim) into a miss.
def _overlap_counts(a: jax.Array, b: jax.Array) -> jax.Array:
    """Bool masks [..., T] -> int32 [..., 2]: |A & B| and min(|A|, |B|) along the last axis."""
    inter = jnp.sum(a & b, axis=-1, dtype=jnp.int32)
    denom = jnp.minimum(jnp.sum(a, axis=-1, dtype=jnp.int32), jnp.sum(b, axis=-1, dtype=jnp.int32))
    return jnp.stack([inter, denom], axis=-1)


def _pairwise_counts(m: jax.Array) -> jax.Array:
    """m bool [B, H, T] -> int32 [B, H, H, 2]: the overlap counts of every pair of heads."""
    mi = m.astype(jnp.int32)
    inter = jnp.einsum("bht,bgt->bhg", mi, mi)
    size = mi.sum(-1)
    return jnp.stack([inter, jnp.minimum(size[:, :, None], size[:, None, :])], axis=-1)


def _ratio(counts) -> np.ndarray:
    """Overlap counts [..., 2] (device or host) -> the overlaps [...], float64 (exact n / k)."""
    c = np.asarray(counts, np.int64)
    return c[..., 0] / np.maximum(c[..., 1], 1)


@functools.partial(jax.jit, static_argnames=("cfg", "top_k"))
def _prefill_topk_jit(layer, x_in, k_buf, lens, cfg, top_k):
    """K_prefill of one layer: bool [B, H, Tp] top-k of the last prompt token's pooled scores,
    and their pairwise overlap counts [B, H, H, 2] (the similarity matrix, ``_ratio``)."""
    B, H = k_buf.shape[:2]
    q = M.prompt_queries(layer, x_in, (lens - 1)[:, None], cfg)  # [B, H, 1, G, D]
    lengths = jnp.broadcast_to(lens[:, None], (B, H)).astype(jnp.int32)
    s = pallas_kernels.scores(q, k_buf, lengths, gqa="mean")[:, :, 0]  # [B, H, Tp]
    mask = _topk_mask(s, top_k)
    return mask, _pairwise_counts(mask)


def _prompt_keys(cache, li: int, width: int | None = None):
    """Traced: layer ``li``'s prompt keys [B, H, T, D] (full KV: every head holds its prompt) and lengths
    [B, H], gathered out of the pool; T = ``width`` (default the layer's static bound ``capacity``, which may
    exceed the longest prompt: rows past a head's length are masked by it)."""
    lc = cache.layers[li]
    keys, _, _ = gather_rows(cache.pool, lc.offsets, lc.lengths, lc.capacity if width is None else width)
    return keys, lc.lengths


@functools.partial(jax.jit, static_argnames=("cfg", "top_k"), donate_argnames=("cache",))
def _calib_step_jit(params, cache, tokens, prefill_masks, cfg, top_k):
    """One greedy decode step + every layer's scoring: a single dispatch.

    prefill_masks: bool [L, B, H, T] (T: the rows of the longest prompt). Returns (next tokens [B], cache,
    overlap counts [L, B, H, 2]).
    """
    logits, cache, queries = M.decode_step(params, cache, tokens, cfg, return_queries=True)
    overlaps = []
    for li, q in enumerate(queries):
        keys, lengths = _prompt_keys(cache, li, prefill_masks.shape[-1])
        s = pallas_kernels.scores(q[:, :, None], keys, lengths, gqa="mean")[:, :, 0]  # [B, H, Tp]
        overlaps.append(_overlap_counts(_topk_mask(s, top_k), prefill_masks[li]))
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache, jnp.stack(overlaps)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _copy_step_jit(params, cache, tokens, src, cfg):
    """One teacher-forced copy step: feed ``tokens`` [B], whose earlier occurrence is at prompt position
    ``src`` [B]. Returns (cache, hits bool [L, B, H]): some query head of the KV head has its largest
    raw q.k over the prompt keys (positions < the sample's length) at ``src``."""
    _, cache, queries = M.decode_step(params, cache, tokens, cfg, return_queries=True)
    hits = []
    for li, q in enumerate(queries):
        keys, lengths = _prompt_keys(cache, li)
        s = jnp.einsum("bhgd,bhtd->bhgt", q.astype(jnp.float32), keys.astype(jnp.float32))
        valid = jnp.arange(keys.shape[2])[None, None, None, :] < lengths[:, :, None, None]
        top = jnp.argmax(jnp.where(valid, s, jnp.finfo(jnp.float32).min), axis=-1)  # [B, H, G]
        hits.append(jnp.any(top == src[:, None, None], axis=-1))
    return cache, jnp.stack(hits)


def copy_positions(lens: np.ndarray, copy_steps: int, spans: int | None = None) -> np.ndarray:
    """Prompt positions re-fed by the copy phase, int64 [N, copy_steps].

    ``spans`` (default ``COPY_SPANS``, at most ``copy_steps``) consecutive runs of near-equal length,
    run i centred at (i + 1) / (spans + 1) of the sample, so the copied text sits at several distances
    from the prompt's end; positions are clipped to the sample.
    """
    spans = min(COPY_SPANS if spans is None else int(spans), int(copy_steps))
    sizes = np.full(spans, copy_steps // spans) + (np.arange(spans) < copy_steps % spans)
    out = []
    for T in np.asarray(lens, np.int64):
        pos = [int(round((i + 1) * T / (spans + 1))) - n // 2 + np.arange(n) for i, n in enumerate(sizes)]
        out.append(np.clip(np.concatenate(pos), 0, T - 1))
    return np.stack(out).astype(np.int64)


@functools.partial(jax.jit, static_argnames=("cfg", "top_k"), donate_argnames=("cache",))
def _synckv_step_jit(params, cache, tokens, cfg, top_k):
    """SyncKV's calibration step: one greedy decode step, then per layer every KV head's top-k of the
    step's query over the prompt keys (raw softmax, GQA max, no pooling: ``query_probs_max``) and the
    pairwise overlap counts of those sets. Returns (next tokens [B], cache, counts [L, B, H, H, 2])."""
    logits, cache, queries = M.decode_step(params, cache, tokens, cfg, return_queries=True)
    sims = []
    for li, q in enumerate(queries):
        keys, lengths = _prompt_keys(cache, li)
        sims.append(_pairwise_counts(_topk_mask(query_probs_max(q, keys, lengths), top_k)))
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache, jnp.stack(sims)


def chance_length(lengths: Sequence[int]) -> int:
    """The ``tokens_per_sample`` recorded for samples of ``lengths`` tokens: their harmonic mean, rounded.

    A top-k set of k of L_i tokens overlaps another by chance k / L_i; the chance level of the calibration
    is the mean of those over the samples, and k / L equals it for L = n / sum(1 / L_i), the harmonic mean.
    ``HeteroCache.drift_threshold`` reads c = top_k / tokens_per_sample, so samples of one length L record L,
    and unequal lengths keep the chance correction (rounding L moves c by at most k / (2 L^2)). It is never
    below the shortest sample, hence above top_k.
    """
    lens = np.asarray(lengths, np.float64)
    return int(round(lens.size / np.sum(1.0 / lens)))


# --------------------------------------------------------------------- one batch of samples
def _phase(bar, phase: str) -> None:
    """The bar's postfix: the batch of samples and the phase it is in (prefill, decode, copy prefill, copy)."""
    if bar is not None:
        bar.set_postfix_str(f"{bar.batch_label}: {phase}")


def _calibrate_batch(cfg, params, batch: list[np.ndarray], top_k: int, decode_steps: int, bar,
                     scoring: str = "heterocache", copy_steps: int = 0):
    """Prefill + decode a right-padded batch of samples; per-row results are independent.

    Returns overlaps [B, S, L, H], the K_prefill similarities [B, L, H, H]
    (float64), the greedy tokens fed at each step [B, S] and the copy phase's hits [B, C, L, H]
    (None when ``copy_steps`` is 0). With ``scoring="synckv"``: (None, the per-step pairwise overlaps
    [B, S, L, H, H], tokens, None).
    """
    B = len(batch)
    lens = np.array([s.size for s in batch], np.int32)
    T = int(lens.max())
    C = chunk_bucket(T)
    Tp = -(-T // C) * C
    tokens = np.zeros((B, Tp), np.int32)
    for i, s in enumerate(batch):
        tokens[i, : s.size] = s
    masks: list = [None] * cfg.num_layers
    sims: list = [None] * cfg.num_layers

    def observe(li, layer, x_in, k_buf, v_buf, lens_dev):
        if scoring != "synckv":  # SyncKV is scored at the decode steps only
            masks[li], sims[li] = compiled(_prefill_topk_jit, layer, x_in, k_buf, lens_dev, cfg=cfg, top_k=top_k)(
                layer, x_in, k_buf, lens_dev)

    logits, cache = M.prefill(params, cfg, tokens, lens, chunk=C, tail_capacity=decode_steps + 1,
                              observe=observe, compile_fn=compiled)
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    _phase(bar, "decode")
    if scoring == "synckv":
        steps, gen = [], []
        for _ in range(decode_steps):
            fn = compiled(_synckv_step_jit, params, cache, tok, cfg=cfg, top_k=top_k)
            gen.append(np.asarray(tok))
            tok, cache, sim = fn(params, cache, tok)
            steps.append(_ratio(sim))  # [L, B, H, H]
            if bar is not None:
                bar.update(B)
        del cache
        return None, np.stack(steps).transpose(2, 0, 1, 3, 4), np.stack(gen, axis=1).astype(np.int64), None
    # [L, B, H, T]: the decode steps score the prompt rows the pool keeps (the longest prompt T, not the
    # chunk-padded Tp); the top-k of a prompt never reaches past T
    prefill_masks = jnp.stack(masks)[..., :T]
    sims = _ratio(jnp.stack(sims)).transpose(1, 0, 2, 3)  # [B, L, H, H]
    ovs, gen = [], []
    for _ in range(decode_steps):
        args = (params, cache, tok, prefill_masks)
        fn = compiled(_calib_step_jit, *args, cfg=cfg, top_k=top_k)
        gen.append(np.asarray(tok))
        tok, cache, ov = fn(*args)
        ovs.append(_ratio(ov))  # [L, B, H]; reading it back paces the bar
        if bar is not None:
            bar.update(B)
    del cache
    ovs = np.stack(ovs).transpose(2, 0, 1, 3)  # [B, S, L, H]
    return ovs, sims, np.stack(gen, axis=1).astype(np.int64), _copy_phase(cfg, params, tokens, lens, C, copy_steps, bar)


def _copy_phase(cfg, params, tokens: np.ndarray, lens: np.ndarray, chunk: int, copy_steps: int, bar):
    """Copy-phase hits [B, C, L, H] bool (None when ``copy_steps`` is 0), from a fresh full-KV prefill:
    the copy starts right after the prompt, as an answer that quotes it does."""
    if not copy_steps:
        return None
    B = tokens.shape[0]
    _phase(bar, "copy prefill")
    _, cache = M.prefill(params, cfg, tokens, lens, chunk=chunk, tail_capacity=copy_steps + 1, compile_fn=compiled)
    _phase(bar, "copy")
    src_all = copy_positions(lens, copy_steps)  # [B, C]
    rows = np.arange(B)
    hits = []
    for j in range(copy_steps):
        src = src_all[:, j].astype(np.int32)
        args = (params, cache, jnp.asarray(tokens[rows, src]), jnp.asarray(src))
        cache, hit = compiled(_copy_step_jit, *args, cfg=cfg)(*args)
        hits.append(np.asarray(hit))  # [L, B, H]
        if bar is not None:
            bar.update(B)
    return np.stack(hits).transpose(2, 0, 1, 3)


# --------------------------------------------------------------------- public API
def calibrate_tokens(
    cfg: ModelConfig,
    params,
    token_samples: Sequence[Sequence[int]],
    *,
    top_k: int | None = None,
    decode_steps: int = 100,
    tau_stable: float = 0.5,
    tau_sim: float = 0.5,
    seed: int = 0,
    tokens: int | None = None,
    progress: bool = True,
    model_name: str | None = None,
    data_description: str | None = None,
    fingerprint: str | None = None,
    batch_size: int = 4,
    return_stats: bool = False,
    scoring: str = "heterocache",
    n_r: int | None = None,
    copy_steps: int | None = None,
    tau_copy: float | None = DEFAULT_TAU_COPY,
):
    """Calibrate a HeadProfile from token-id samples (no tokenizer needed).

    ``copy_steps`` (default ``DEFAULT_COPY_STEPS``, at most half the shortest sample): length of the
    copy phase after the greedy steps (module docstring, step 4); 0 skips it. Compressed heads whose
    copy score is >= ``tau_copy`` become volatile (None: scores recorded, no head changed).

    ``scoring="synckv"`` builds SyncKV's grouping instead (paper §4.1): at every decode step each KV
    head's top-k (default 10% of the length) of the raw softmax (GQA max, no pooling) over the prompt,
    the heads' pairwise overlaps averaged over steps and samples into S [L, H, H], then k-means of the
    rows of max(S) - S into ``n_r`` clusters per layer (default a quarter of the KV heads, at least 1);
    ``tau_stable`` and ``tau_sim`` do not apply.
    ``token_samples``: one token-id sequence per sample; with ``tokens`` each
    is cut to its first ``tokens`` ids (and must have that many). The profile's
    ``settings.tokens_per_sample`` is :func:`chance_length` of the samples' lengths
    (their common length when equal), the chance level the drift threshold corrects for.
    Returns the profile, or ``(profile, CalibrationStats)`` with ``return_stats``.
    ``batch_size`` samples run together (right-padded; decode is bound by
    reading the weights, so a batch costs about one sample per step); the
    batching is fixed by the sample order, so results stay deterministic.
    """
    if scoring not in SCORINGS:
        raise ProfileError(f"scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}")
    if n_r is not None and (isinstance(n_r, bool) or int(n_r) != n_r or n_r < 1):
        raise ProfileError(f"n_r must be a positive integer (R-heads per layer), got {n_r!r}")
    if scoring == "synckv" and n_r is not None and n_r > cfg.num_kv_heads:
        raise ProfileError(f"n_r={n_r} R-heads per layer exceeds the model's {cfg.num_kv_heads} KV heads per "
                           f"layer; use at most {cfg.num_kv_heads}")
    samples = [np.asarray(s, dtype=np.int64).reshape(-1) for s in token_samples]
    if not samples:
        raise ProfileError("no calibration data: pass at least one non-empty sample")
    if tokens is not None:
        if isinstance(tokens, bool) or not isinstance(tokens, numbers.Integral) or tokens < 2:
            raise ProfileError(f"tokens must be an integer >= 2 (the prompt tokens kept of each sample), got "
                               f"{tokens!r}")
        short = [i for i, s in enumerate(samples) if s.size < tokens]
        if short:
            raise ProfileError(f"calibration sample(s) {short} have fewer than tokens={tokens} tokens "
                               f"(shortest: {min(samples[i].size for i in short)}); use longer texts or "
                               "a smaller --tokens")
        samples = [s[:tokens] for s in samples]
    if int(decode_steps) != decode_steps or decode_steps < 1:
        raise ProfileError(f"decode_steps must be a positive integer, got {decode_steps!r}")
    shortest = min(s.size for s in samples)
    if shortest == 0:
        raise ProfileError("empty calibration sample: every sample needs tokens")
    if top_k is None:
        top_k = default_top_k(shortest, scoring)
    if int(top_k) != top_k or top_k < 1:
        raise ProfileError(f"top_k must be a positive integer, got {top_k!r}")
    top_k = int(top_k)
    if shortest <= top_k:
        raise ProfileError(f"calibration sample of {shortest} tokens is too short for top_k={top_k}: "
                           "each sample needs more tokens than top_k (else every set is the whole "
                           "prompt and every overlap is 1)")
    longest = max(s.size for s in samples)
    if longest + decode_steps > cfg.max_position_embeddings:
        raise ProfileError(f"a {longest}-token sample plus {decode_steps} decode steps exceeds the "
                           f"model's context of {cfg.max_position_embeddings} tokens")
    bad = [i for i, s in enumerate(samples) if s.min() < 0 or s.max() >= cfg.vocab_size]
    if bad:
        raise ProfileError(f"sample(s) {bad} hold token ids outside the vocabulary [0, {cfg.vocab_size})")
    if not (0.0 <= tau_stable <= 1.0 and 0.0 <= tau_sim <= 1.0):
        raise ProfileError(f"tau_stable and tau_sim must lie in [0, 1], got {tau_stable}, {tau_sim}")
    if scoring == "synckv":
        copy_steps = 0  # SyncKV's grouping has no copy rule
    elif copy_steps is None:
        copy_steps = min(DEFAULT_COPY_STEPS, shortest // 2)
    if isinstance(copy_steps, bool) or int(copy_steps) != copy_steps or copy_steps < 0:
        raise ProfileError(f"copy_steps must be a non-negative integer, got {copy_steps!r}")
    copy_steps = int(copy_steps)
    if copy_steps >= shortest:
        raise ProfileError(f"copy_steps={copy_steps} needs samples longer than the copied span; the shortest "
                           f"has {shortest} tokens (use fewer copy steps than that; the default is half of it)")
    if longest + copy_steps > cfg.max_position_embeddings:
        raise ProfileError(f"a {longest}-token sample plus {copy_steps} copy steps exceeds the model's "
                           f"context of {cfg.max_position_embeddings} tokens")
    if tau_copy is not None and not (math.isfinite(tau_copy) and 0.0 <= tau_copy <= 1.0):
        raise ProfileError(f"tau_copy must lie in [0, 1] (or None for no copy rule), got {tau_copy}")

    if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
        raise ProfileError(f"batch_size must be a positive integer, got {batch_size!r}")
    batch_size = int(batch_size)

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(samples) * (decode_steps + copy_steps), desc="calibrate", unit="step")
    try:
        per = []
        for b0 in range(0, len(samples), batch_size):
            batch = samples[b0:b0 + batch_size]
            if bar is not None:
                bar.batch_label = f"samples {b0 + 1}-{b0 + len(batch)}/{len(samples)}"
            _phase(bar, "prefill")
            ov, sim, gen, hits = _calibrate_batch(cfg, params, batch, top_k, int(decode_steps), bar, scoring,
                                                  copy_steps)
            per.extend(zip(ov if ov is not None else [None] * len(batch), sim, gen,
                           hits if hits is not None else [None] * len(batch)))
            _phase(bar, "done")
    finally:
        if bar is not None:
            bar.close()

    settings = ProfileSettings(
        top_k=top_k, decode_steps=int(decode_steps), seed=int(seed), calibration_data=data_description,
        samples=len(samples), copy_steps=copy_steps if scoring != "synckv" else None,
        tokens_per_sample=chance_length([s.size for s in samples]))
    identity = dict(architecture=cfg.architecture, head_dim=cfg.head_dim, model_name=model_name,
                    weights_fingerprint=fingerprint if fingerprint is not None else weights_fingerprint(params))
    if scoring == "synckv":
        steps = np.stack([p[1] for p in per])  # [N, S, L, H, H]
        per_sample = steps.mean(axis=1)  # [N, L, H, H]
        n_r = default_n_r(cfg.num_kv_heads) if n_r is None else int(n_r)
        profile = build_synckv_profile(per_sample.mean(axis=0), n_r, settings=settings, **identity)
        if return_stats:
            return profile, CalibrationStats(
                overlaps=None, stability=None, similarity_matrix=per_sample,
                generated=np.stack([p[2] for p in per]), prompt_lens=np.array([s.size for s in samples]),
                top_k=top_k, similarity_steps=steps)
        return profile
    overlaps = np.stack([p[0] for p in per])  # [N, S, L, H]
    simm_per = np.stack([p[1] for p in per])  # [N, L, H, H]
    stab_per = np.median(overlaps, axis=1)  # [N, L, H]
    stability = stab_per.mean(axis=0)
    simm = simm_per.mean(axis=0)
    copy_hits = np.stack([p[3] for p in per]) if copy_steps else None  # [N, C, L, H]
    copy_score = copy_hits.mean(axis=(0, 1)) if copy_steps else None
    profile = build_profile(stability, simm, tau_stable=float(tau_stable), tau_sim=float(tau_sim),
                            similarity=max_similarity(simm), copy_score=copy_score,
                            tau_copy=None if tau_copy is None else float(tau_copy), settings=settings, **identity)
    if return_stats:
        lens_all = np.array([s.size for s in samples])
        stats = CalibrationStats(overlaps=overlaps, stability=stab_per,
                                 similarity_matrix=simm_per, generated=np.stack([p[2] for p in per]),
                                 prompt_lens=lens_all, top_k=top_k, copy_hits=copy_hits,
                                 copy_positions=copy_positions(lens_all, copy_steps) if copy_steps else None)
        return profile, stats
    return profile


def _encode_plain(tokenizer, text: str) -> list[int]:
    # Plain text, no chat template; the tokenizer's own specials (e.g. BOS) when it adds any.
    return list(tokenizer.encode(text, add_special_tokens=True))


def calibrate(model, texts: Sequence[str] | str, *, data_description: str | None = None, **options):
    """Calibrate a HeadProfile for ``model`` (a ``hetero_jax.io.hub.Model``) on ``texts``; ``options`` are
    :func:`calibrate_tokens`' keywords.

    Each text is one sample, tokenized as plain text (no chat template) so
    the model continues it; ``tokens`` keeps the first ``tokens`` tokens of
    each (use :func:`calibration_windows` to cut a long text into windows).
    ``top_k`` defaults to 20% of the shortest sample (the authors'
    release). Greedy decoding for ``decode_steps`` steps; thresholds as in
    the design notes (shared/design/METHODS.md). Deterministic for the same data, settings and seed.
    """
    if isinstance(texts, str):
        texts = [texts]
    texts = list(texts)
    if not texts:
        raise ProfileError("no calibration data: pass at least one text")
    empty = [i for i, t in enumerate(texts) if not str(t).strip()]
    if empty:
        raise ProfileError(f"calibration text(s) {empty} are empty")
    samples = [_encode_plain(model.tokenizer, t) for t in texts]
    desc = data_description or f"{len(texts)} text(s) passed to calibrate()"
    return calibrate_tokens(model.config, model.params, samples, model_name=getattr(model, "name", None),
                            data_description=desc, **options)


def calibration_windows(tokenizer, text: str, tokens: int, samples: int, seed: int = 0) -> list[list[int]]:
    """Cut ``text`` into ``samples`` windows of ``tokens`` token ids, chosen by ``seed``.

    The text is tokenized once (plain, no specials) and split into
    consecutive non-overlapping windows; ``samples`` of them are drawn
    without replacement with ``numpy.random.default_rng(seed)`` and returned
    in text order. The tokenizer's leading special tokens (e.g. BOS), if it
    adds any, start every window and count toward ``tokens``.
    """
    if samples < 1:
        raise ProfileError(f"samples must be >= 1, got {samples}")
    prefix = list(tokenizer.encode("", add_special_tokens=True))
    body = int(tokens) - len(prefix)
    if body < 1:
        raise ProfileError(f"tokens={tokens} leaves no room for text after {len(prefix)} special token(s)")
    if not text.strip():
        raise ProfileError("no calibration data: the text is empty")
    ids = tokenizer.encode(text, add_special_tokens=False)
    n_win = len(ids) // body
    if n_win < samples:
        raise ProfileError(f"the calibration text has {len(ids)} tokens: room for {n_win} window(s) of "
                           f"{body} tokens, but {samples} sample(s) were asked for; give more text or "
                           "fewer/shorter samples")
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.choice(n_win, size=samples, replace=False))
    return [prefix + ids[int(w) * body:(int(w) + 1) * body] for w in chosen]


def pydoc_text() -> str:
    """Python's own ``pydoc_data.topics.topics`` texts joined in sorted key order (real English prose)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def read_texts(paths: Iterable[str]) -> tuple[str, str]:
    """``--data`` values -> (joined text, description). ``pydoc`` = :func:`pydoc_text`."""
    parts, names = [], []
    for p in paths:
        if p == "pydoc":
            parts.append(pydoc_text())
            import sys

            # The topic texts change between Python releases: record which one.
            names.append(f"pydoc_data.topics of Python {sys.version_info[0]}.{sys.version_info[1]} "
                         "(topic help, sorted keys)")
            continue
        try:
            with open(p, encoding="utf-8") as f:
                parts.append(f.read())
        except FileNotFoundError:
            raise ProfileError(f"calibration data file not found: {p}") from None
        except UnicodeDecodeError as e:
            raise ProfileError(f"calibration data file {p} is not UTF-8 text: {e}") from None
        except OSError as e:  # a directory, no permission, ...
            raise ProfileError(f"cannot read calibration data file {p}: {e.strerror or e}; pass a UTF-8 text "
                               "file (or --data pydoc)") from None
        names.append(p)
    if not parts:
        raise ProfileError("no calibration data: pass --data FILE (or --data pydoc)")
    return "\n\n".join(parts), " + ".join(names)
