"""Decode attention of every KV head of a layer over one row pool, each head at its own offset and length.

The cache keeps a layer's kept rows of all its KV heads in one pool per device (``hetero_jax.model.cache``):
head h of sequence b owns the rows [offsets[b, h], offsets[b, h] + capacity) of ``k_pool[b]`` / ``v_pool[b]``,
its kept prompt rows first and the tokens added after prefill right behind them. One call attends every head
of a layer, reading the pool in place.

Equation, for query position t and query head g of KV head h in batch b, with n = lengths[b, h] + t rows
visible (a chunk of T new tokens whose own K/V sit right after the first n_0 rows sees them causally; a
decode step is T = 1) and o = offsets[b, h]:

    s_j   = sm_scale * <q[b, h, t, g], k_pool[b, o + j]>          j in [0, n)
    lse   = log sum_j exp(s_j)                                    (float32)
    out   = sum_j exp(s_j - lse) * v_pool[b, o + j]

n <= 0 gives out = 0 and lse = MASK_VALUE (an empty head, which merges as nothing).

With ``score_len`` > 0 (T = 1 only) the call also returns each scored head's logits s_j over its first
``score_len`` rows ([B, H, G, score_len] float32): HeteroCache's pivots keep their whole prompt first in their
region, and the drift check pools those logits (``pivot_pooled_scores``) instead of reading the keys again.
Entries past a head's visible rows, and every entry of a head whose ``score_heads`` flag is 0, are
unspecified in the kernels (callers mask by the prompt length); the reference fills them with MASK_VALUE.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._util import MASK_VALUE
from pallas_kernels.pooled_scores import POOL_KERNEL_SIZE, avg_pool, gqa_reduce, masked_softmax

__all__ = ["pool_attention_reference", "pivot_pooled_scores"]


@functools.partial(jax.jit, static_argnames=("max_len", "score_len", "sm_scale"))
def pool_attention_reference(
    q,                 # [B, H, T, G, D]  T query positions per KV head, G query heads each (after RoPE, unscaled)
    k_pool,            # [B, P, D]        the pool's keys (after RoPE); head h's rows start at offsets[b, h]
    v_pool,            # [B, P, D]        the pool's values
    offsets,           # [B, H] int32     first pool row of each head's region
    lengths,           # [B, H] int32     rows query position 0 sees; position t sees lengths + t
    score_heads=None,  # [H] int32        1: the kernels also write this head's logits (ignored here)
    *,
    max_len: int,      # static: the most rows any query position sees (>= max(lengths) + T - 1)
    score_len: int = 0,
    sm_scale: float | None = None,
):
  """Plain-jnp reference of the pool attention (module docstring): a gather of every head's rows, then masked
  float32 attention. Returns (out [B, H, T, G, D] in q.dtype, lse [B, H, T, G] float32, logits
  [B, H, G, score_len] float32 or None)."""
  del score_heads
  B, H, T, G, D = q.shape
  P = k_pool.shape[1]
  if k_pool.shape != (B, P, D) or v_pool.shape != (B, P, D):
    raise ValueError(f"shape mismatch: q {q.shape} k_pool {k_pool.shape} v_pool {v_pool.shape}")
  if offsets.shape != (B, H) or lengths.shape != (B, H):
    raise ValueError(f"offsets and lengths must be [B, H] = {(B, H)}, got {offsets.shape} and {lengths.shape}")
  if score_len and T != 1:
    raise ValueError(f"logits are returned for one query position only, got T={T}")
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(D)
  S = max(1, int(max_len))
  slot = jnp.arange(S, dtype=jnp.int32)
  rows = jnp.clip(offsets.astype(jnp.int32)[..., None] + slot, 0, P - 1)          # [B, H, S]
  k = jnp.take_along_axis(k_pool[:, None], rows[..., None], axis=2)                # [B, H, S, D]
  v = jnp.take_along_axis(v_pool[:, None], rows[..., None], axis=2)
  seen = lengths.astype(jnp.int32)[:, :, None] + jnp.arange(T, dtype=jnp.int32)    # [B, H, T]
  visible = slot[None, None, None, :] < seen[..., None]                            # [B, H, T, S]
  s = jnp.einsum("bhtgd,bhsd->bhtgs", q.astype(jnp.float32), k.astype(jnp.float32),
                 precision=lax.Precision.HIGHEST) * sm_scale
  s = jnp.where(visible[:, :, :, None, :], s, MASK_VALUE)
  m = s.max(axis=-1)
  p = jnp.where(visible[:, :, :, None, :], jnp.exp(s - m[..., None]), 0.0)
  l = p.sum(axis=-1)
  nonempty = l > 0
  l_safe = jnp.where(nonempty, l, 1.0)
  out = jnp.einsum("bhtgs,bhsd->bhtgd", p, v.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST) / l_safe[..., None]
  lse = jnp.where(nonempty, m + jnp.log(l_safe), MASK_VALUE)
  logits = None
  if score_len:
    n = min(S, int(score_len))
    logits = s[:, :, 0, :, :n]                                                     # [B, H, G, n]
    if n < score_len:
      logits = jnp.pad(logits, ((0, 0), (0, 0), (0, 0), (0, score_len - n)), constant_values=MASK_VALUE)
  return out.astype(q.dtype), lse, logits


def pivot_pooled_scores(
    logits,   # [B, Hp, G, T] float32  scaled logits of the scored heads over their prompt rows
    lengths,  # [B, Hp] int32          prompt rows of each (entries past them are ignored)
    gqa: str = "max",
):
  """The pooled scores of METHODS.md from one decode query's logits: softmax over the prompt rows (float32),
  5-tap average pooling, GQA aggregation; [B, Hp, T] float32, MASK_VALUE at t >= lengths. Equal to
  ``pooled_scores_reference(q[:, :, None], keys, lengths, gqa=gqa)[:, :, 0]`` for the same query and keys."""
  T = logits.shape[-1]
  valid = jnp.arange(T)[None, None, :] < lengths[..., None]                        # [B, Hp, T]
  p = masked_softmax(logits, valid[:, :, None, :])
  agg = gqa_reduce(avg_pool(p, POOL_KERNEL_SIZE), gqa, axis=2)
  return jnp.where(valid, agg, MASK_VALUE)
