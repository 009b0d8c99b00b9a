"""Token-scoring building blocks shared by the KV-cache policies and the offline profiling, written once
(below both, so that profile/ and policies/ import them downwards).

Scores are float32; masks use finite values (never -inf); a head never keeps
zero tokens (budget rules guarantee at least one).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from hetero_jax.model.cache import RowBlock
from hetero_jax.model.config import ModelConfig
from hetero_jax.model.transformer import prompt_queries
from pallas_kernels import MASK_VALUE, gqa_reduce, masked_softmax

# Score of a token a policy must keep (sinks, observation window): above any real score.
FORCE = 1e30


def window_rows(prompt_lens: jax.Array, window: int) -> tuple[jax.Array, jax.Array]:
    """Slots of each sequence's last ``window`` prompt tokens.

    prompt_lens: [B]. Returns rows [B, W] int32 (clipped at 0) and valid [B, W]
    (False where the prompt is shorter than the window).
    """
    rows = prompt_lens[:, None] - window + jnp.arange(window, dtype=jnp.int32)[None, :]
    return jnp.maximum(rows, 0), rows >= 0


def attention_probs(
    q_rows: jax.Array, keys: jax.Array, q_pos: jax.Array, prompt_lens: jax.Array
) -> jax.Array:
    """Causal float32 softmax of prompt queries over the prompt keys.

    q_rows: [B, Hkv, W, G, D]; keys: [B, Hkv, Tp, D]; q_pos: [B, W] position of
    each query row; prompt_lens: [B]. Key t is visible to row w iff
    t <= q_pos[w] and t < prompt_len. Returns [B, Hkv, W, G, Tp].
    """
    D = q_rows.shape[-1]
    s = jnp.einsum("bhwgd,bhtd->bhwgt", q_rows, keys, preferred_element_type=jnp.float32)
    s = s * (1.0 / math.sqrt(D))
    t = jnp.arange(keys.shape[2], dtype=jnp.int32)
    visible = (t[None, None, :] <= q_pos[:, :, None]) & (t[None, None, :] < prompt_lens[:, None, None])
    return masked_softmax(s, visible[:, None, :, None, :])


def query_probs_max(q: jax.Array, keys: jax.Array, lengths: jax.Array) -> jax.Array:
    """One query per KV head over its keys: float32 softmax(q k^T / sqrt(D)), max over the G query heads,
    no pooling (SyncKV's scoring, paper §4.1-4.2).

    q: [B, H, G, D]; keys: [B, H, T, D]; lengths: [B, H] valid keys (the rest are masked in the softmax
    and scored MASK_VALUE). Returns [B, H, T] float32.
    """
    s = jnp.einsum("bhgd,bhtd->bhgt", q, keys, preferred_element_type=jnp.float32) * (1.0 / math.sqrt(q.shape[-1]))
    valid = jnp.arange(keys.shape[2], dtype=jnp.int32)[None, None, :] < lengths[..., None]  # [B, H, T]
    return jnp.where(valid, gqa_reduce(masked_softmax(s, valid[:, :, None, :]), "max", axis=2), MASK_VALUE)


def observation_window_probs(
    layer: dict, x_in: jax.Array, keys: jax.Array, prompt_lens: jax.Array, window: int, cfg: ModelConfig
) -> tuple[jax.Array, jax.Array]:
    """Attention of each sequence's last ``window`` prompt queries over its prompt keys.

    Returns probs [B, Hkv, W, G, Tp] (rows beyond a short prompt are zero) and
    the valid-row mask [B, W].
    """
    rows, valid = window_rows(prompt_lens, window)
    q = prompt_queries(layer, x_in, rows, cfg)
    p = attention_probs(q, keys, rows, prompt_lens)
    return jnp.where(valid[:, None, :, None, None], p, 0.0), valid


def keep_mask(prompt_lens: jax.Array, tp: int) -> jax.Array:
    """[B, Tp] True on real prompt slots."""
    return jnp.arange(tp, dtype=jnp.int32)[None, :] < prompt_lens[:, None]


def finalize_scores(scores: jax.Array, prompt_lens: jax.Array, forced: jax.Array | None = None) -> jax.Array:
    """scores [B, Hkv, Tp] -> FORCE on forced slots ([B, Tp] or [B, Hkv, Tp]), MASK_VALUE beyond the prompt."""
    scores = scores.astype(jnp.float32)
    if forced is not None:
        if forced.ndim == 2:
            forced = forced[:, None, :]
        scores = jnp.where(forced, FORCE, scores)
    return jnp.where(keep_mask(prompt_lens, scores.shape[-1])[:, None, :], scores, MASK_VALUE)


def select_topk(scores: jax.Array, counts: jax.Array, cap: int) -> jax.Array:
    """Indices of each head's top-``counts`` tokens, stored in position order.

    scores: [B, H, T] float32; counts: [B, H] int32 (<= cap); cap: static.
    Ties go to the lower position (``lax.top_k`` is stable). Returns
    [B, H, cap] int32; entries at or beyond ``counts`` repeat the last kept
    index (finite padding; they are masked by the group's lengths).
    """
    _, idx = jax.lax.top_k(scores, cap)  # best first
    rank = jnp.arange(cap, dtype=jnp.int32)
    big = jnp.iinfo(jnp.int32).max
    kept = jnp.where(rank[None, None, :] < counts[..., None], idx, big)
    kept = jnp.sort(kept, axis=-1)  # position order, padding last
    last = jnp.take_along_axis(kept, jnp.maximum(counts - 1, 0)[..., None], axis=-1)
    return jnp.where(kept == big, last, kept).astype(jnp.int32)


def gather_group(k: jax.Array, v: jax.Array, positions: jax.Array, idx: jax.Array, counts: jax.Array) -> RowBlock:
    """Gather kept slots into a row block (what a prefill plan hands the pool; its ``heads`` are set by the
    caller). k, v: [B, H, T, D]; positions: [B, H, T] int32; idx: [B, H, cap]; counts: [B, H]."""
    take = lambda a: jnp.take_along_axis(a, idx[..., None], axis=2)  # noqa: E731
    pos = jnp.take_along_axis(positions, idx, axis=2)
    valid = jnp.arange(idx.shape[-1])[None, None, :] < counts[..., None]
    return RowBlock(k=take(k), v=take(v), positions=jnp.where(valid, pos, -1), lengths=counts.astype(jnp.int32))
