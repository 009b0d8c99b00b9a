"""Split-K decode attention over ragged per-head KV caches (Pallas, Triton).

One new query token per sequence attends, for each (batch b, KV head h), to
the first ``lengths[b, h]`` slots of that head's cache. Heads of one layer may
keep very different numbers of tokens (HeteroCache budgets), so the length is
per (b, h), not per sequence.

Equation, for query head g of KV head h in batch b, with L = lengths[b, h]:

    s_j   = sm_scale * <q[b,h,g], k[b,h,j]>                 j in [0, L)
    lse   = log sum_j exp(s_j)                              (float32)
    out   = sum_j exp(s_j - lse) * v[b,h,j]

Kernel layout: grid = (B * Hkv, num_splits). Program (r, j) owns the key range
[j * split_len, (j + 1) * split_len) of row r and processes only its part
below L, in blocks of ``block_k`` keys (online softmax, float32 accumulators).
The loop bound is computed from L, so a split that lies entirely beyond L does
no loads at all and a partly valid split stops at the first block past L:
the bytes read per head are ceil(L / block_k) * block_k rows of K and V, which
is what makes decode time fall with the per-head budget. The last block's
loads are masked (`plgpu.load(mask=..., other=0)`), so slots >= L are never
read even inside that block (padding may hold garbage, even NaN). The partial
results (unnormalised o, running max m, running sum l per split) are combined
by a log-sum-exp reduction in XLA afterwards.

The G query heads of a KV head form the rows of the query tile; they are
padded to max(16, next_pow2(G)) rows because a Triton `dot` needs >= 16 rows.

The (out, lse) pair lets a caller attend separately to other tiers of the
cache (e.g. the append-only tail of generated tokens) and combine exactly with
:func:`merge_attention`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._util import (MASK_VALUE, MIN_DOT_ROWS, cdiv, dot_precision,
                                  is_pow2, next_pow2)
from pallas_kernels.pool_checks import check_int_dtype, check_same_dtype

__all__ = [
    "sparse_decode_attention",
    "sparse_decode_attention_reference",
    "merge_attention",
    "default_num_splits",
]


def default_num_splits(capacity: int, block_k: int = 64) -> int:
  """Number of key splits used when ``num_splits`` is None.

  About one split per 1024 cache slots, at most 16 (enough programs to fill an
  A100/H100 at batch 1 with a handful of KV heads), never more splits than
  blocks.
  """
  return int(max(1, min(16, cdiv(capacity, 1024), cdiv(capacity, block_k))))


def _check_decode_args(q, k, v, lengths):
  """ValueError naming the first argument that does not fit (kernel and reference, before any compute)."""
  if jnp.ndim(q) != 4:
    raise ValueError(f"q must be [B, Hkv, G, D] (one query token), got shape {jnp.shape(q)}")
  B, H, G, D = q.shape
  if jnp.ndim(k) != 4 or k.shape != (B, H, k.shape[2], D) or v.shape != k.shape:
    raise ValueError(f"shape mismatch: q {q.shape} k {jnp.shape(k)} v {jnp.shape(v)}; k and v must both be "
                     f"[B, Hkv, S, D] with q's B, Hkv, D = {B}, {H}, {D}")
  if D < 1:
    raise ValueError(f"q's head_dim must be >= 1, got q {q.shape}")
  if jnp.shape(lengths) != (B, H):
    raise ValueError(f"lengths must be [B, Hkv] = {(B, H)}, got {jnp.shape(lengths)}")
  check_same_dtype(q=q, k=k, v=v)
  check_int_dtype(lengths=lengths)


def _empty_attention(q):
  """(out 0, lse MASK_VALUE): the result of every head when there is no slot to attend (S = 0)."""
  return jnp.zeros(q.shape, q.dtype), jnp.full(q.shape[:-1], MASK_VALUE, jnp.float32)


def _decode_kernel(
    q_ref,    # [block_h, D]  query rows of one (b, h); rows >= G are zero pad
    k_ref,    # [S, D]        keys of one (b, h)
    v_ref,    # [S, D]        values of one (b, h)
    len_ref,  # []            int32 valid length L of this (b, h)
    o_ref,    # [block_h, D]  float32 unnormalised output of this split
    m_ref,    # [block_h]     float32 running max of this split
    l_ref,    # [block_h]     float32 running sum of this split
    *,
    sm_scale: float,
    block_k: int,
    split_len: int,
):
  block_h, head_dim = q_ref.shape
  split = pl.program_id(1)
  length = len_ref[()]
  start = split * split_len
  end = jnp.minimum(length, start + split_len)
  # Number of key blocks of this split that hold at least one valid slot.
  n_blocks = (jnp.maximum(end - start, 0) + block_k - 1) // block_k

  q = q_ref[...]
  precision = dot_precision(q.dtype)
  lane = jnp.arange(block_k, dtype=jnp.int32)

  def body(it, carry):
    o, m, l = carry
    off = start + it * block_k
    valid = (off + lane) < end                                  # [block_k]
    k = plgpu.load(k_ref.at[pl.ds(off, block_k), :],
                   mask=valid[:, None], other=0.0)              # [block_k, D]
    s = plgpu.dot(q, k, trans_b=True, precision=precision)         # [bh, bk] f32
    s = s * sm_scale
    s = jnp.where(valid[None, :], s, MASK_VALUE)
    # Every block in the loop holds >= 1 valid slot, so m_new is a real logit.
    m_new = jnp.maximum(m, s.max(axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])                             # masked -> 0
    l_new = alpha * l + p.sum(axis=-1)
    v = plgpu.load(v_ref.at[pl.ds(off, block_k), :],
                   mask=valid[:, None], other=0.0)              # [block_k, D]
    pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)      # [bh, D] f32
    return alpha[:, None] * o + pv, m_new, l_new

  o = jnp.zeros((block_h, head_dim), jnp.float32)
  m = jnp.full((block_h,), MASK_VALUE, jnp.float32)
  l = jnp.zeros((block_h,), jnp.float32)
  o, m, l = jax.lax.fori_loop(0, n_blocks, body, (o, m, l))
  o_ref[...] = o
  m_ref[...] = m
  l_ref[...] = l


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "block_k", "num_splits", "num_warps",
                     "num_stages", "interpret"))
def sparse_decode_attention(
    q,        # [B, Hkv, G, D]  one query token, G query heads per KV head
    k,        # [B, Hkv, S, D]  per-head key cache (RoPE applied), capacity S
    v,        # [B, Hkv, S, D]  per-head value cache
    lengths,  # [B, Hkv] int32  valid slots per (b, h), 0 <= L <= S
    *,
    sm_scale: float | None = None,
    block_k: int = 64,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
):
  """Decode attention of one token over ragged per-head caches.

  Args:
    q: [B, Hkv, G, D] queries (unscaled), bf16/f16/f32.
    k: [B, Hkv, S, D] keys, same dtype as q; slots >= lengths are never read.
    v: [B, Hkv, S, D] values, same dtype as q; slots >= lengths never read.
    lengths: [B, Hkv] int32 number of valid leading slots per (b, h). Values
      are clamped to [0, S]; L = 0 gives out = 0 and lse = MASK_VALUE (an
      empty tier that merges as nothing), and so does every head when S = 0.
    sm_scale: logit scale, default 1 / sqrt(D).
    block_k: keys per inner block (power of two, >= 16).
    num_splits: programs along the key axis per (b, h), >= 1; default
      :func:`default_num_splits`.
    num_warps, num_stages: Triton compiler parameters.
    interpret: run the kernel in the Pallas interpreter (CPU tests).

  Returns:
    out: [B, Hkv, G, D] in q.dtype, softmax(s) @ v over the valid slots.
    lse: [B, Hkv, G] float32, log sum_j exp(s_j) over the valid slots.
  """
  _check_decode_args(q, k, v, lengths)
  B, H, G, D = q.shape
  S = k.shape[2]
  if not is_pow2(D) or D < 16:
    raise ValueError(f"head_dim must be a power of two >= 16, got {D}")
  if not is_pow2(block_k) or block_k < 16:
    raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
  if num_splits is not None and num_splits < 1:
    raise ValueError(f"num_splits must be None (the default) or >= 1, got {num_splits}")
  if S == 0 or q.size == 0:
    return _empty_attention(q)
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(D)
  if num_splits is None:
    num_splits = default_num_splits(S, block_k)
  split_len = cdiv(cdiv(S, num_splits), block_k) * block_k
  num_splits = cdiv(S, split_len)          # drop splits that would be empty
  block_h = max(MIN_DOT_ROWS, next_pow2(G))
  BH = B * H

  q_p = jnp.pad(q, ((0, 0), (0, 0), (0, block_h - G), (0, 0)))
  q_p = q_p.reshape(BH, block_h, D)
  k_r = k.reshape(BH, S, D)
  v_r = v.reshape(BH, S, D)
  len_r = jnp.clip(lengths.astype(jnp.int32), 0, S).reshape(BH)

  kernel = functools.partial(_decode_kernel, sm_scale=float(sm_scale),
                             block_k=block_k, split_len=split_len)
  o, m, l = pl.pallas_call(
      kernel,
      grid=(BH, num_splits),
      in_specs=[
          pl.BlockSpec((None, block_h, D), lambda r, j: (r, 0, 0)),
          pl.BlockSpec((None, S, D), lambda r, j: (r, 0, 0)),
          pl.BlockSpec((None, S, D), lambda r, j: (r, 0, 0)),
          pl.BlockSpec((None,), lambda r, j: (r,)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, block_h, D), lambda r, j: (r, j, 0, 0)),
          pl.BlockSpec((None, None, block_h), lambda r, j: (r, j, 0)),
          pl.BlockSpec((None, None, block_h), lambda r, j: (r, j, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((BH, num_splits, block_h, D), jnp.float32),
          jax.ShapeDtypeStruct((BH, num_splits, block_h), jnp.float32),
          jax.ShapeDtypeStruct((BH, num_splits, block_h), jnp.float32),
      ],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                           num_stages=num_stages),
      interpret=interpret,
      name="sparse_decode_attention",
  )(q_p, k_r, v_r, len_r)

  out, lse = combine_splits(o, m, l)
  out = out[:, :G].reshape(B, H, G, D).astype(q.dtype)
  lse = lse[:, :G].reshape(B, H, G)
  return out, lse


def combine_splits(
    o,  # [BH, ns, R, D]  float32 unnormalised output of each key split
    m,  # [BH, ns, R]     float32 running max of each split
    l,  # [BH, ns, R]     float32 running sum of each split
):
  """Log-sum-exp combine of a split-K kernel's partial results (XLA): out [BH, R, D] float32 and lse
  [BH, R] float32. An empty split has m = MASK_VALUE and l = 0: its weight exp(MASK_VALUE - m_max) is
  exactly 0 (or 1 with l = 0 and o = 0 when the whole row is empty: out 0, lse MASK_VALUE)."""
  m_max = m.max(axis=1)                                   # [BH, R]
  # Same workaround as the stock decode kernel (b/389925439).
  m_max = jax.lax.optimization_barrier(m_max)
  w = jnp.exp(m - m_max[:, None, :])                      # [BH, ns, R]
  l_tot = (w * l).sum(axis=1)                             # [BH, R]
  o_tot = (w[..., None] * o).sum(axis=1)                  # [BH, R, D]
  nonempty = l_tot > 0
  l_safe = jnp.where(nonempty, l_tot, 1.0)
  return o_tot / l_safe[..., None], jnp.where(nonempty, m_max + jnp.log(l_safe), MASK_VALUE)


@functools.partial(jax.jit, static_argnames=("sm_scale", "finite_padding"))
def sparse_decode_attention_reference(
    q,        # [B, Hkv, G, D]
    k,        # [B, Hkv, S, D]
    v,        # [B, Hkv, S, D]
    lengths,  # [B, Hkv] int32
    *,
    sm_scale: float | None = None,
    finite_padding: bool = False,
):
  """Plain-jnp reference of :func:`sparse_decode_attention` (float32 math).

  Returns (out [B, Hkv, G, D] in q.dtype, lse [B, Hkv, G] float32). Slots at
  or beyond lengths are masked with a finite value in the scores (S = 0: every
  head is empty). Unless
  ``finite_padding`` is set, K and V are also zeroed there so that NaN/inf
  garbage in padding cannot leak in; the model's caches promise finite
  padding (zeros or copies of real tokens) and pass ``finite_padding=True``,
  which skips two full-cache masked copies per step on CPU.
  """
  _check_decode_args(q, k, v, lengths)
  D = q.shape[-1]
  S = k.shape[2]
  if S == 0 or q.size == 0:
    return _empty_attention(q)
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(D)
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, S)
  valid = jnp.arange(S)[None, None, :] < lengths[..., None]       # [B, H, S]
  if not finite_padding:
    k = jnp.where(valid[..., None], k, jnp.zeros((), k.dtype))
    v = jnp.where(valid[..., None], v, jnp.zeros((), v.dtype))
  out, lse, _, _ = masked_decode_attention(q, k, v, valid, sm_scale)
  return out.astype(q.dtype), lse


def masked_decode_attention(q, k, v, valid, sm_scale: float):
  """The float32 math of :func:`sparse_decode_attention_reference`: q [B, H, G, D]; k, v [B, H, S, D];
  valid [B, H, S] bool. Returns (out [B, H, G, D] float32, lse [B, H, G], the unnormalised
  probabilities exp(s - max) [B, H, G, S] (0 where not valid) and their sums l [B, H, G])."""
  s = jnp.einsum("bhgd,bhsd->bhgs", q, k, preferred_element_type=jnp.float32,
                 precision=jax.lax.Precision.HIGHEST) * sm_scale
  s = jnp.where(valid[:, :, None, :], s, MASK_VALUE)
  m = s.max(axis=-1)
  p = jnp.where(valid[:, :, None, :], jnp.exp(s - m[..., None]), 0.0)
  l = p.sum(axis=-1)
  nonempty = l > 0
  l_safe = jnp.where(nonempty, l, 1.0)
  out = jnp.einsum("bhgs,bhsd->bhgd", p, v,
                   preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST) / l_safe[..., None]
  lse = jnp.where(nonempty, m + jnp.log(l_safe), MASK_VALUE)
  return out, lse, p, l


def merge_attention(
    out_a,  # [..., D]  attention output over key set A
    lse_a,  # [...]     float32 log-sum-exp of the logits over A
    out_b,  # [..., D]  attention output over key set B (disjoint from A)
    lse_b,  # [...]     float32 log-sum-exp over B
):
  """Exact softmax attention over A ∪ B from the two partial results.

      lse = logaddexp(lse_a, lse_b)
      out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

  computed in float32; out is returned in out_a.dtype. An empty part is
  given by lse = MASK_VALUE (finite): its weight is exactly 0. Do not pass
  -inf for both parts.

  Returns (out [..., D], lse [...] float32).
  """
  la = lse_a.astype(jnp.float32)
  lb = lse_b.astype(jnp.float32)
  m = jnp.maximum(la, lb)
  wa = jnp.exp(la - m)
  wb = jnp.exp(lb - m)
  tot = wa + wb                       # >= 1 since one of the weights is 1
  out = (wa[..., None] * out_a.astype(jnp.float32)
         + wb[..., None] * out_b.astype(jnp.float32)) / tot[..., None]
  lse = m + jnp.log(tot)
  return out.astype(out_a.dtype), lse
