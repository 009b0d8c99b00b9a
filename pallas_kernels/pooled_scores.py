"""Pooled attention scores for token selection and drift checks (Pallas, Triton).

Shared scoring primitive of the design notes (shared/design/METHODS.md, outside the package), as
defined here. For query row (b, h, w, g) and prompt token t < L = lengths[b, h]:

    p[g, t]      = softmax_t( <q[b,h,w,g], k[b,h,t]> / sqrt(D) )       float32
    pool[g, t]   = (p[g,t-2] + p[g,t-1] + p[g,t] + p[g,t+1] + p[g,t+2]) / 5
                   (zero padding: p = 0 outside [0, L); count_include_pad)
    out[b,h,w,t] = max_g pool[g, t]        (gqa="max": runtime / drift)
                 | mean_g pool[g, t]       (gqa="mean": calibration)

and out[b, h, w, t] = MASK_VALUE (= -1e30, finite) for t >= L, so that a
caller's `jax.lax.top_k` never prefers an invalid token and sums over rows
stay finite. Top-k is left to the caller (no sort in kernels).

Kernel: grid = (B * Hkv, W); program (r, w) holds the G query rows of one
buffered step (padded to >= 16 rows for the Triton dot) and makes two passes
over the keys of its head, both bounded by L:
  1. aligned blocks of `block_t` keys: online row max m and row sum l;
  2. windows of `block_t` keys starting at i * (block_t - 4): normalised
     probabilities p (zeroed outside [0, L)), pooled inside the window by a
     [block_t, block_t] band matrix (1/5 on |t' - t| <= 2) on the matrix unit,
     then reduced over the G rows (max or mean). Window i writes its interior
     columns [2, block_t - 2) (window 0 also columns 0, 1: the zero padding is
     real there), so each token is written exactly once with its full 5-tap
     halo. Windows overlap by 4 tokens: 4 / block_t extra key reads.
So pooling and GQA aggregation are both in the kernel (max_g does not commute
with pooling). Only the MASK_VALUE fill of t >= L is an XLA `where`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._util import (MASK_VALUE, MIN_DOT_ROWS, dot_precision,
                                  is_pow2, next_pow2, resolve_backend)
from pallas_kernels.sparse_decode_attention import masked_decode_attention

__all__ = [
    "MASK_VALUE",
    "POOL_KERNEL_SIZE",
    "pooled_scores",
    "pooled_scores_reference",
    "masked_softmax",
    "avg_pool",
    "gqa_reduce",
    "overlap_bitmap",
    "topk_threshold",
    "topk_membership",
    "normalised_overlap",
    "drift_check",
    "drift_check_reference",
]

POOL_KERNEL_SIZE: int = 5
_HALO = POOL_KERNEL_SIZE // 2


def _pooled_kernel(
    q_ref,    # [block_g, D]  G query rows of one (b, h, w); rows >= G zero pad
    k_ref,    # [T, D]        prompt keys of (b, h)
    len_ref,  # []            int32 valid prompt tokens L of (b, h)
    o_ref,    # [T]           float32 pooled, GQA-aggregated scores
    *,
    sm_scale: float,
    block_t: int,
    num_groups: int,
    gqa: str,
):
  block_g, _ = q_ref.shape
  length = len_ref[()]
  q = q_ref[...]
  precision = dot_precision(q.dtype)
  lane = jnp.arange(block_t, dtype=jnp.int32)

  def scores(off):
    valid = (off + lane) < length                               # [block_t]
    k = plgpu.load(k_ref.at[pl.ds(off, block_t), :],
                   mask=valid[:, None], other=0.0)              # [block_t, D]
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * sm_scale
    return jnp.where(valid[None, :], s, MASK_VALUE), valid      # [bg, bt]

  # Pass 1: softmax statistics over aligned blocks.
  def stats_body(i, carry):
    m, l = carry
    s, _ = scores(i * block_t)
    m_new = jnp.maximum(m, s.max(axis=-1))
    l_new = l * jnp.exp(m - m_new) + jnp.exp(s - m_new[:, None]).sum(axis=-1)
    return m_new, l_new

  m0 = jnp.full((block_g,), MASK_VALUE, jnp.float32)
  l0 = jnp.zeros((block_g,), jnp.float32)
  m, l = lax.fori_loop(0, (length + block_t - 1) // block_t, stats_body,
                       (m0, l0))
  inv_l = 1.0 / jnp.where(l > 0, l, 1.0)

  # Pass 2: normalise, pool (band matmul), aggregate over G, store.
  stride = block_t - 2 * _HALO
  diff = lane[:, None] - lane[None, :]
  band = jnp.where((diff <= _HALO) & (diff >= -_HALO),
                   1.0 / POOL_KERNEL_SIZE, 0.0).astype(jnp.float32)
  row_ok = (jnp.arange(block_g, dtype=jnp.int32) < num_groups)[:, None]

  def pool_body(i, carry):
    off = i * stride
    s, valid = scores(off)
    p = jnp.where(valid[None, :], jnp.exp(s - m[:, None]) * inv_l[:, None],
                  0.0)                                          # [bg, bt]
    pooled = plgpu.dot(p, band, precision=lax.Precision.HIGHEST)   # [bg, bt]
    if gqa == "max":
      agg = jnp.where(row_ok, pooled, 0.0).max(axis=0)          # pooled >= 0
    else:
      agg = jnp.where(row_ok, pooled, 0.0).sum(axis=0) * (1.0 / num_groups)
    col_ok = (((lane >= _HALO) | (i == 0)) & (lane < block_t - _HALO)
              & valid)
    plgpu.store(o_ref.at[pl.ds(off, block_t)], agg, mask=col_ok)
    return carry

  n_win = jnp.where(length > 0,
                    jnp.maximum(1, (length - _HALO + stride - 1) // stride), 0)
  lax.fori_loop(0, n_win, pool_body, 0)


def _check_pooled_args(q_rows, keys, lengths, gqa):
  """ValueError naming the first argument that does not fit (kernel and reference, before any compute)."""
  if gqa not in ("max", "mean"):
    raise ValueError(f"gqa must be 'max' or 'mean', got {gqa!r}")
  if jnp.ndim(q_rows) != 5:
    raise ValueError(f"q_rows must be [B, Hkv, W, G, D], got shape {jnp.shape(q_rows)}")
  B, H, W, G, D = q_rows.shape
  if jnp.ndim(keys) != 4 or keys.shape != (B, H, keys.shape[2], D):
    raise ValueError(f"shape mismatch: q_rows {q_rows.shape} keys {jnp.shape(keys)}; keys must be [B, Hkv, T, D] "
                     f"with q_rows' B, Hkv, D = {B}, {H}, {D}")
  if G < 1 or D < 1:
    raise ValueError(f"q_rows needs G >= 1 query heads per KV head (the GQA {gqa} of none is undefined) and "
                     f"head_dim D >= 1, got {q_rows.shape}")
  if lengths is not None and jnp.shape(lengths) != (B, H):
    raise ValueError(f"lengths must be [B, Hkv] = {(B, H)} or None, got {jnp.shape(lengths)}")


def _prepare_lengths(lengths, B, H, T):
  if lengths is None:
    return jnp.full((B, H), T, jnp.int32)
  return jnp.clip(lengths.astype(jnp.int32), 0, T)


@functools.partial(
    jax.jit,
    static_argnames=("kernel_size", "gqa", "block_t", "num_warps",
                     "num_stages", "interpret"))
def pooled_scores(
    q_rows,         # [B, Hkv, W, G, D]  W query steps, G query heads each
    keys,           # [B, Hkv, T, D]     prompt keys of each KV head
    lengths=None,   # [B, Hkv] int32     valid prompt tokens (default T)
    *,
    kernel_size: int = POOL_KERNEL_SIZE,
    gqa: str = "max",
    block_t: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
):
  """Pooled, GQA-aggregated softmax scores (see module docstring).

  Args:
    q_rows: [B, Hkv, W, G, D] queries (unscaled), bf16/f16/f32.
    keys: [B, Hkv, T, D] keys (RoPE applied), same dtype as q_rows.
    lengths: optional [B, Hkv] int32, tokens >= L are ignored (never read).
    kernel_size: must be 5 (the pooling defined above).
    gqa: "max" (runtime selection / drift) or "mean" (calibration).
    block_t: keys per block, power of two >= 16.
    num_warps, num_stages: Triton compiler parameters.
    interpret: run the kernel in the Pallas interpreter.

  Returns:
    [B, Hkv, W, T] float32; MASK_VALUE at t >= L (an empty array when W or T is 0, as in the reference).
  """
  if kernel_size != POOL_KERNEL_SIZE:
    raise NotImplementedError("only kernel_size=5 (padding 2) is implemented")
  _check_pooled_args(q_rows, keys, lengths, gqa)
  B, H, W, G, D = q_rows.shape
  T = keys.shape[2]
  if not is_pow2(D) or D < 16:
    raise ValueError(f"head_dim must be a power of two >= 16, got {D}")
  if not is_pow2(block_t) or block_t < 16:
    raise ValueError(f"block_t must be a power of two >= 16, got {block_t}")
  if B * H * W * T == 0:
    return jnp.full((B, H, W, T), MASK_VALUE, jnp.float32)
  lengths = _prepare_lengths(lengths, B, H, T)
  block_g = max(MIN_DOT_ROWS, next_pow2(G))
  BH = B * H
  q_p = jnp.pad(q_rows, ((0, 0),) * 3 + ((0, block_g - G), (0, 0)))
  q_p = q_p.reshape(BH, W, block_g, D)
  k_r = keys.reshape(BH, T, D)

  kernel = functools.partial(_pooled_kernel, sm_scale=1.0 / math.sqrt(D),
                             block_t=block_t, num_groups=G, gqa=gqa)
  out = pl.pallas_call(
      kernel,
      grid=(BH, W),
      in_specs=[
          pl.BlockSpec((None, None, block_g, D), lambda r, w: (r, w, 0, 0)),
          pl.BlockSpec((None, T, D), lambda r, w: (r, 0, 0)),
          pl.BlockSpec((None,), lambda r, w: (r,)),
      ],
      out_specs=pl.BlockSpec((None, None, T), lambda r, w: (r, w, 0)),
      out_shape=jax.ShapeDtypeStruct((BH, W, T), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                           num_stages=num_stages),
      interpret=interpret,
      name="pooled_scores",
  )(q_p, k_r, lengths.reshape(BH))
  out = out.reshape(B, H, W, T)
  valid = jnp.arange(T)[None, None, None, :] < lengths[:, :, None, None]
  return jnp.where(valid, out, MASK_VALUE)


def masked_softmax(s, visible):
  """float32 softmax over the last axis of ``s`` where ``visible`` (broadcast to s); masked entries get 0,
  a row with nothing visible gets zeros (never NaN). The softmax of every pooled score in this project."""
  s = jnp.where(visible, s.astype(jnp.float32), MASK_VALUE)
  m = s.max(axis=-1, keepdims=True)
  e = jnp.where(visible, jnp.exp(s - m), 0.0)
  return e / jnp.maximum(e.sum(axis=-1, keepdims=True), 1e-30)


def avg_pool(x, kernel: int = POOL_KERNEL_SIZE):
  """1-D average pooling along the last axis: stride 1, zero padding kernel // 2, divided by kernel
  (count_include_pad), the pooling of the module docstring."""
  half = kernel // 2
  xp = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(half, half)])
  n = x.shape[-1]
  return sum(xp[..., i:i + n] for i in range(kernel)) / kernel


def gqa_reduce(x, how: str, axis: int):
  """Aggregate the G query heads of each KV head along ``axis``: ``how`` in {"max", "mean"}."""
  if how == "max":
    return x.max(axis=axis)
  if how == "mean":
    return x.mean(axis=axis)
  raise ValueError(f"GQA aggregation must be 'max' or 'mean', got {how!r}")


@functools.partial(jax.jit, static_argnames=("kernel_size", "gqa"))
def pooled_scores_reference(
    q_rows,         # [B, Hkv, W, G, D]
    keys,           # [B, Hkv, T, D]
    lengths=None,   # [B, Hkv] int32
    *,
    kernel_size: int = POOL_KERNEL_SIZE,
    gqa: str = "max",
):
  """Plain-jnp reference of :func:`pooled_scores`; [B, Hkv, W, T] float32."""
  _check_pooled_args(q_rows, keys, lengths, gqa)
  if kernel_size % 2 != 1:
    raise ValueError("kernel_size must be odd")
  B, H, W, G, D = q_rows.shape
  T = keys.shape[2]
  if B * H * W * T == 0:
    return jnp.full((B, H, W, T), MASK_VALUE, jnp.float32)
  lengths = _prepare_lengths(lengths, B, H, T)
  valid = jnp.arange(T)[None, None, :] < lengths[..., None]        # [B, H, T]
  # Keys are not masked: key t only reaches score t, which the `where` below
  # replaces for t >= L (garbage or NaN included). Masking them was fused into
  # the dot and cost 4x on XLA:CPU (23 vs 6 ms for W=5, G=3 at T=32K).
  s = jnp.einsum("bhwgd,bhtd->bhwgt", q_rows.astype(jnp.float32),
                 keys.astype(jnp.float32),
                 precision=lax.Precision.HIGHEST) / math.sqrt(D)
  p = masked_softmax(s, valid[:, :, None, None, :])
  agg = gqa_reduce(avg_pool(p, kernel_size), gqa, axis=3)
  return jnp.where(valid[:, :, None, :], agg, MASK_VALUE)


def overlap_bitmap(
    topk_idx_a,  # [..., Ka] int  index set A (entries outside [0, T) ignored)
    topk_idx_b,  # [..., Kb] int  index set B, same leading dims
    T: int,      # static number of positions
):
  """Overlap coefficient |A ∩ B| / min(|A|, |B|) per leading index, no sort.

  A is scattered into a [N, T] boolean bitmap, B's entries are looked up in
  it. Indices outside [0, T) (e.g. -1 padding) are not members. Entries of
  one set are assumed distinct (true for `lax.top_k` indices). Returns
  [...] float32; 0 where a set is empty.
  """
  lead = topk_idx_a.shape[:-1]
  if topk_idx_b.shape[:-1] != lead:
    topk_idx_b = jnp.broadcast_to(topk_idx_b, lead + topk_idx_b.shape[-1:])
  a = topk_idx_a.reshape(-1, topk_idx_a.shape[-1]).astype(jnp.int32)
  b = topk_idx_b.reshape(-1, topk_idx_b.shape[-1]).astype(jnp.int32)
  n = a.shape[0]
  a_ok = (a >= 0) & (a < T)
  b_ok = (b >= 0) & (b < T)
  rows = jnp.arange(n, dtype=jnp.int32)[:, None]
  bitmap = jnp.zeros((n, T), jnp.bool_).at[rows, jnp.where(a_ok, a, T)].set(
      True, mode="drop")
  hit = bitmap[rows, jnp.clip(b, 0, T - 1)] & b_ok
  inter = hit.sum(axis=-1).astype(jnp.float32)
  size = jnp.minimum(a_ok.sum(axis=-1), b_ok.sum(axis=-1)).astype(jnp.float32)
  ov = jnp.where(size > 0, inter / jnp.maximum(size, 1.0), 0.0)
  return ov.reshape(lead)


def _sortable_bits(x):
  """float32 [...] -> uint32 [...] whose unsigned order is the order of
  `lax.top_k`: non-negative floats get the sign bit set, negative ones all
  bits flipped. It is IEEE total order: -0.0 ranks just below +0.0, as in
  XLA's top-k (scores never hold -0.0 or NaN)."""
  b = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  return jnp.where((b >> 31) == 1, ~b, b | jnp.uint32(0x80000000))


def _sorted_kth(key, k):
  """:func:`_bisect_kth` by one sort per row: the GPU's way (a sort is a few kernels; the bisection's 32
  passes are 32 launches per row set, each a loop trip)."""
  T = key.shape[-1]
  k = jnp.broadcast_to(jnp.asarray(k, jnp.int32), key.shape[:-1])
  kth = jnp.take_along_axis(jnp.sort(key, axis=-1), jnp.clip(T - k, 0, T - 1)[..., None], axis=-1)[..., 0]
  v = jnp.where(k > 0, kth, jnp.uint32(0xFFFFFFFF))
  return v, (key >= v[..., None]).sum(axis=-1, dtype=jnp.int32)


def _kth_key(key, k):
  """The k-th largest sortable key of each row of key [..., T] and the count of keys at or above it
  (k: int or int [...]): a sort on a GPU (``resolve_backend()`` is 'pallas'), the bisection elsewhere
  (XLA:CPU sorts slowly)."""
  return _sorted_kth(key, k) if resolve_backend() == "pallas" else _bisect_kth(key, k)


def _bisect_kth(key, k: int):
  """Largest uint32 v with count(key >= v) >= k per row of key [..., T] (the k-th largest key), and that
  count. 32 passes of a compare and a sum; the sum in float32 (exact below 2^24 entries) runs 1.3-1.5x
  faster than an int32 one on XLA:CPU (14 rows of 32K: 2.5 against 3.2-3.8 ms)."""
  T = key.shape[-1]
  count_dtype = jnp.float32 if T < (1 << 24) else jnp.int32

  def body(i, carry):
    v, n_v = carry
    cand = v | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
    n_ge = jnp.where(key >= cand[..., None], 1, 0).astype(count_dtype).sum(axis=-1)
    take = n_ge >= k
    return jnp.where(take, cand, v), jnp.where(take, n_ge, n_v)

  init = (jnp.zeros(key.shape[:-1], jnp.uint32), jnp.full(key.shape[:-1], T, count_dtype))
  v, n_v = lax.fori_loop(0, 32, body, init)
  return v, n_v.astype(jnp.int32)


def _threshold_counts(scores, k: int):
  """(sortable keys [..., T], k-th largest key [...], n_greater [...], n_at_least [...]: entries above it
  and at or above it)."""
  T = scores.shape[-1]
  if not 1 <= k <= T:
    raise ValueError(f"k must lie in [1, {T}], got {k}")
  key = _sortable_bits(scores)
  v, n_ge = _kth_key(key, k)
  n_greater = (key > v[..., None]).sum(axis=-1, dtype=jnp.int32)
  return key, v, n_greater, n_ge


def _key_to_float(v):
  b = jnp.where((v >> 31) == 1, v & jnp.uint32(0x7FFFFFFF), ~v)
  return lax.bitcast_convert_type(b, jnp.float32)


@functools.partial(jax.jit, static_argnames=("k",))
def topk_threshold(
    scores,   # [..., T] float32
    k: int,   # static, 1 <= k <= T
):
  """The k-th largest entry of each row and the number of entries above it.

  A bisection on the float32 bit pattern: 32 passes of count(key >= x) per
  row, each a compare and a sum over T (no sort). Returns (kth [...] float32,
  n_greater [...] int32). The top-k set of `lax.top_k` is then exactly
  {t: s_t > kth} plus the first k - n_greater indices t with s_t == kth
  (ties go to the lower index).
  """
  _, v, n_greater, _ = _threshold_counts(scores, k)
  return _key_to_float(v), n_greater


@functools.partial(jax.jit, static_argnames=("k",))
def topk_membership(
    scores,   # [..., T] float32
    k: int,   # static top-k size
    idx,      # [..., K] int  indices to test (outside [0, T): not members)
):
  """Whether each idx[..., j] is in the top-k of its row, exactly as `lax.top_k` ranks.

  With kth, n_greater = topk_threshold(scores, k): t is a member iff
  s_t > kth, or s_t == kth and fewer than k - n_greater indices t' < t have
  s_t' == kth (lax.top_k keeps the lower indices of a tie; "==" and ">" in
  its total order, where -0.0 < +0.0). Returns bool [..., K]; no sort. When
  every entry equal to kth is a member (no tie crosses the cut, the usual
  case) membership is s_t >= kth and the running count of ties is skipped.
  """
  return _membership(scores, k, idx)


def _membership(scores, k, idx):
  """:func:`topk_membership`'s body; k: an int, or int [...] (one size per row, each in [1, T]), traced."""
  if isinstance(k, int):
    key, kkey, _, n_ge = _threshold_counts(scores, k)
  else:  # a size per row: the same bisection (it reads k per row)
    k = jnp.asarray(k, jnp.int32)
    key = _sortable_bits(scores)
    kkey, n_ge = _kth_key(key, k)
  kkey = kkey[..., None]
  T = scores.shape[-1]
  ok = (idx >= 0) & (idx < T)
  j = jnp.clip(idx, 0, T - 1).astype(jnp.int32)
  kj = jnp.take_along_axis(key, j, axis=-1)
  tied = lambda: ok & jnp.take_along_axis(_tie_cut(key, kkey, k), j, axis=-1)  # noqa: E731
  if resolve_backend() == "pallas":  # a GPU conditional waits for its predicate on the host: the cut always
    return tied()
  # n_ge - n_greater entries equal kth, k - n_greater of them are members: all of them iff the counts agree
  return lax.cond(jnp.all(n_ge == k), lambda: ok & (kj >= kkey), tied)


def _tie_cut(key, kv, k):
  """bool [..., T]: the top-k of sortable keys [..., T] whose k-th key is kv [..., 1] when a tie crosses
  the cut: every key above kv, and of those equal to it the first k - n_greater (lax.top_k keeps the lower
  indices of a tie)."""
  gt = key > kv
  eq = key == kv
  n_greater = gt.sum(axis=-1, dtype=jnp.int32)
  return gt | (eq & (jnp.cumsum(eq, axis=-1, dtype=jnp.int32) <= (k - n_greater)[..., None]))


def _top_members(key, k):
  """bool [..., T]: the top-k of each row of sortable keys [..., T] as `lax.top_k` picks them (ties to the
  lower index); k: int [...] in [0, T]."""
  v, n_ge = _kth_key(key, k)
  kv = v[..., None]
  if resolve_backend() == "pallas":
    return _tie_cut(key, kv, k)
  return lax.cond(jnp.all(n_ge == k), lambda: key >= kv, lambda: _tie_cut(key, kv, k))


def _compact(member, values, cap: int, fill):
  """values [..., T] where member [..., T], in order, into [..., cap]; ``fill`` past the members."""
  lead, T = member.shape[:-1], member.shape[-1]
  R = math.prod(lead)
  slot = jnp.where(member, jnp.cumsum(member, axis=-1, dtype=jnp.int32) - 1, cap)
  out = jnp.full((R, cap), fill, values.dtype).at[jnp.arange(R)[:, None], slot.reshape(R, T)].set(
      jnp.broadcast_to(values, member.shape).reshape(R, T), mode="drop")
  return out.reshape(lead + (cap,))


@functools.partial(jax.jit, static_argnames=("cap",))
def topk_sets(
    scores,    # [..., T] float32
    sizes,     # [..., K] int  set sizes, each in [0, min(cap, T)]
    cap: int,  # static, >= every size
):
  """For each size k of `sizes`, the positions of the top-k entries of the
  row, the set `lax.top_k(scores, k)` picks (ties to the lower index, its
  total order), in ascending position order and -1 past k: int32 [..., K, cap].

  No ranking: a bisection finds the k-th key of the row's largest size and a
  prefix sum compacts those members (at most cap); each size is then cut from
  them the same way. XLA:CPU's top-k sorts the row, which with k in the
  thousands cost 3-4x this at 16K-32K entries.
  """
  T = scores.shape[-1]
  # a size above cap (out of contract) is cut to cap, so it cannot push the row's other sets off their
  # candidates (the cut was by position)
  k = jnp.minimum(jnp.asarray(sizes, jnp.int32), cap)
  key = _sortable_bits(scores)
  pos = jnp.arange(T, dtype=jnp.int32)
  top = _top_members(key, k.max(axis=-1))                   # [..., T]
  cand_pos = _compact(top, pos, cap, -1)                    # [..., cap] ascending
  # padding sorts below every real key (0 is a NaN's key), and no size reaches it
  cand_key = _compact(top, key, cap, jnp.uint32(0))
  member = _top_members(jnp.broadcast_to(cand_key[..., None, :], k.shape + (cap,)), k)
  return _compact(member, cand_pos[..., None, :], cap, -1)


def normalised_overlap(
    inter,     # [...] number of common members of two L_base-sets
    L_base,    # int or [...] set size
    lengths,   # [...] int  valid prompt tokens L
):
  """(o - c) / (1 - c) with o = inter / L_base and chance c = L_base / L.

  Two random L_base-subsets of L tokens share c * L_base members on
  average, so this is 0 at chance and 1 for equal sets (negative below
  chance). 1 where L <= L_base: the top-L_base set is then the whole prompt
  and cannot move. float32 [...].
  """
  L = jnp.asarray(lengths, jnp.float32)
  Lb = jnp.asarray(L_base, jnp.float32)
  c = Lb / jnp.maximum(L, 1.0)
  o = jnp.asarray(inter, jnp.float32) / jnp.maximum(Lb, 1.0)
  return jnp.where(c < 1.0, (o - c) / jnp.maximum(1.0 - c, 1e-12), 1.0)


def drift_check(
    q_buffer,      # [B, Hp, W, G, D]  buffered query rows of the pivot heads
    prompt_keys,   # [B, Hp, T, D]     each pivot's full prompt keys
    k_base_idx,    # [B, Hp, L_base] int  current base index set K_base
    L_base: int,   # static top-k size
    tau_drift,     # scalar float      drift threshold (on the normalised scale)
    lengths=None,  # [B, Hp] int32     valid prompt tokens (default T)
    *,
    backend: str | None = None,
):
  """HeteroCache drift check for pivot heads (paper Eq. 9-10, normalised).

      scores_t = pooled_scores(q_t, K_prompt, gqa="max")      t = 1..W
      K_t      = top-L_base(scores_t)                         (lax.top_k ties)
      o_t      = |K_t ∩ K_base| / L_base,  c = L_base / L
      o'_t     = (o_t - c) / (1 - c)                          (1 if L <= L_base)
      drift    = median_t(o'_t) < tau_drift

  Departure from the paper: it compares o_t itself with tau_drift. But o_t
  is c on average for unrelated sets (0.14-0.38 with SmolLM2's profile at
  rho 0.3-0.5), so a fixed raw threshold mostly measures rho (README, "Drift
  check"). K_t is never materialised:
  membership of K_base's entries comes from :func:`topk_membership`.
  `backend` is "pallas" | "interpret" | "reference" | "auto" (None: the
  process setting, see `pallas_kernels.use_kernels`); it is static.

  Returns:
    drift:   [B, Hp] bool
    overlap: [B, Hp] float32 median_t(o'_t)
    scores:  [B, Hp, T] float32 pooled scores of the latest step (w = W-1);
             callers rank them (new K_base, recall rows) only after a drift
  """
  return _drift_check(q_buffer, prompt_keys, k_base_idx, tau_drift, lengths,
                      L_base=int(L_base), mode=resolve_backend(backend, head_dim=prompt_keys.shape[-1]))


@functools.partial(jax.jit, static_argnames=("L_base", "mode"))
def _drift_check(q_buffer, prompt_keys, k_base_idx, tau_drift, lengths, *,
                 L_base, mode):
  B, H, W = q_buffer.shape[:3]
  T = prompt_keys.shape[2]
  lengths = _prepare_lengths(lengths, B, H, T)
  if mode == "reference":
    scores = pooled_scores_reference(q_buffer, prompt_keys, lengths, gqa="max")
  else:
    scores = pooled_scores(q_buffer, prompt_keys, lengths, gqa="max",
                           interpret=(mode == "interpret"))
  ov = jnp.median(base_overlap(scores, k_base_idx, L_base, lengths), axis=-1)
  return ov < tau_drift, ov, scores[:, :, -1, :]


def base_overlap(
    scores,        # [B, Hp, W, T] float32 pooled scores of W queries (MASK_VALUE beyond lengths)
    k_base_idx,    # [B, Hp, K] int  K_base (-1: none)
    L_base,        # static top-k size, or int [B, Hp]: each row's own (a batch of prompts of other lengths)
    lengths,       # [B, Hp] int32  valid prompt tokens
):
  """o'_t = (|top-L_base(scores_t) ∩ K_base| / L_base - c) / (1 - c) per query: [B, Hp, W] float32.

  The per-query part of :func:`drift_check` (Eq. 9, normalised), without sorting: membership of
  K_base's entries by :func:`topk_membership`; entries at -1 or beyond L are not members. With L_base per
  row (each in [1, T]) every row is what it would be alone with its own static L_base.
  """
  B, H, W, T = scores.shape
  base = jnp.where(k_base_idx < lengths[..., None], k_base_idx, -1)
  idx = jnp.broadcast_to(base[:, :, None, :], (B, H, W, base.shape[-1]))
  if isinstance(L_base, (int, np.integer)):
    member = topk_membership(scores, min(int(L_base), T), idx)
    size = L_base
  else:
    size = jnp.asarray(L_base, jnp.int32)[..., None]  # [B, Hp, 1]
    member = _membership(scores, jnp.broadcast_to(jnp.minimum(size, T), (B, H, W)), idx)
  return normalised_overlap(member.sum(axis=-1), size, lengths[..., None])


def attention_and_pooled_scores(
    q,        # [B, H, G, D]  one decode query per head
    k,        # [B, H, T, D]  its prompt keys (slots beyond lengths finite)
    v,        # [B, H, T, D]
    lengths,  # [B, H] int32  valid prompt tokens
    scored_heads: int | None = None,  # static: pooled scores of heads [0, scored_heads) only (None: all H)
):
  """Decode attention over the prompt and the same query's pooled scores from one q·K.

  Returns (out [B, H, G, D], lse [B, H, G] float32: what
  ``sparse_decode_attention_reference(..., finite_padding=True)`` returns, to be merged with the
  tail's; scores [B, n, T] float32 for the first n = ``scored_heads`` heads:
  ``pooled_scores_reference(q[:, :n, None], k[:, :n], lengths[:, :n], gqa="max")[:, :, 0]``). A drift
  check at every step needs the pivots' scores, and on CPU reading their keys a second time cost more
  than the rest of the check. With the reference kernels HeteroCache passes a pivot layer's whole
  full-head group (its pivots first), because XLA:CPU copies a K/V slice. Plain jnp on every backend.
  """
  T = k.shape[2]
  n = k.shape[1] if scored_heads is None else int(scored_heads)
  lengths = _prepare_lengths(lengths, k.shape[0], k.shape[1], T)
  valid = jnp.arange(T)[None, None, :] < lengths[..., None]        # [B, H, T]
  out, lse, e, l = masked_decode_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                           v.astype(jnp.float32), valid, 1.0 / math.sqrt(q.shape[-1]))
  p = e[:, :n] / jnp.maximum(l[:, :n], 1e-30)[..., None]
  scores = jnp.where(valid[:, :n], gqa_reduce(avg_pool(p), "max", axis=2), MASK_VALUE)
  return out.astype(q.dtype), lse, scores


def drift_check_reference(
    q_buffer,      # [B, Hp, W, G, D]
    prompt_keys,   # [B, Hp, T, D]
    k_base_idx,    # [B, Hp, L_base] int
    L_base: int,
    tau_drift,
    lengths=None,  # [B, Hp] int32
):
  """:func:`drift_check` by the definition: `lax.top_k` of every step, then
  :func:`overlap_bitmap` (plain jnp scores). Same outputs."""
  return _drift_check_reference(q_buffer, prompt_keys, k_base_idx, tau_drift,
                                lengths, L_base=int(L_base))


@functools.partial(jax.jit, static_argnames=("L_base",))
def _drift_check_reference(q_buffer, prompt_keys, k_base_idx, tau_drift,
                           lengths, *, L_base):
  B, H = q_buffer.shape[:2]
  T = prompt_keys.shape[2]
  lengths = _prepare_lengths(lengths, B, H, T)
  scores = pooled_scores_reference(q_buffer, prompt_keys, lengths, gqa="max")
  vals, idx = lax.top_k(scores, min(L_base, T))             # [B, Hp, W, L]
  idx = jnp.where(vals > MASK_VALUE * 0.5, idx, -1).astype(jnp.int32)
  base = jnp.where(k_base_idx < lengths[..., None], k_base_idx, -1)
  bitmap_ov = overlap_bitmap(idx, base[:, :, None, :], T)   # |∩| / min sizes
  size = jnp.minimum((idx >= 0).sum(-1), (base >= 0).sum(-1)[..., None])
  inter = jnp.round(bitmap_ov * size)                       # back to |∩|
  ov = jnp.median(normalised_overlap(inter, L_base, lengths[..., None]),
                  axis=-1)
  return ov < tau_drift, ov, scores[:, :, -1, :]
