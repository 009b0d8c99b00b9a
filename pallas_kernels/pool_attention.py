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

n <= 0 gives out = 0 and lse = MASK_VALUE (an empty head, which merges as nothing). n is clipped to the static
``max_len``: n = clip(lengths + t, 0, max_len) on every backend.

Every row a head sees must lie in the pool, [0, P). Every entry point (reference, Pallas, native) refuses
concrete offsets, lengths or block_rows that break this with a ValueError; under jit they are traced, and the
caller is at fault. What the backends then do, never reading outside the pool: a contiguous head whose offset is
outside [0, P) is empty and a range past P is cut at P (all backends alike); a paged head's rows outside the
pool are clamped into it one by one by the reference and the native kernel and skipped by the Pallas kernel.

Paged heads (``block_rows`` [B, H, NB], ``block_size`` rows a block): logical key j of head h is region row
block_rows[b, h, j // block_size] + j % block_size instead of row j, so a head attends chosen blocks of its
region (Quest's selected pages, then its partial page and tail as consecutive blocks) in place, with no
gather copy; the visible count n and the causal rule apply to the logical keys.

With ``score_len`` > 0 (T = 1 only) the call also returns each scored head's logits s_j over its first
``score_len`` rows ([B, H, G, score_len] float32): HeteroCache's pivots keep their whole prompt first in their
region, and the drift check pools those logits (``pivot_pooled_scores``) instead of reading the keys again.
Entries past a head's visible rows, and every entry of a head whose ``score_heads`` flag is 0, are
unspecified in the kernels (callers mask by the prompt length); the reference fills them with MASK_VALUE.

Kernel (:func:`pool_attention`, Pallas lowered through Triton): ONE launch per layer over all heads.
grid = (B * H, row tiles, key splits). The T * G query rows of a KV head (row = t * G + g) form the rows of
its query tiles (padded to >= 16 rows, a Triton ``dot`` needs them); program (r, i, j) owns the key range
[j * split_len, (j + 1) * split_len) of head r and reads only its part below the tile's largest visible
count n_max = lengths + t_last, in blocks of ``block_k`` rows at ``pl.ds(offset + key, block_k)`` of the
batch element's whole [P, D] pool block (read in place, no gather). The loop bound comes from n_max, so a
split past it does no load and a short head reads ceil(n / block_k) * block_k rows at most; the last
block's loads are masked (``plgpu.load(mask=..., other=0)``), so no row outside [offset, offset + n_max)
is ever read (it may hold another head's rows, or NaN). Each row masks its own causal bound lengths + t.
Online softmax in float32; the per-split partials (o, m, l) of the real rows are combined by log-sum-exp
in XLA. Tiles hold at most 64 rows (a decode step is one tile); split_len = max_len / num_splits rounded
up to block_k is a fixed unit of work, so a full head runs many busy programs and a short one a few
(:func:`default_pool_num_splits`). With score_len > 0 the programs of a scored head store each key
block's logits (masked to the block's visible rows below score_len) into that head's [G, score_len] rows.

Triton in jax 0.10.2 has no scalar prefetch ("scalar prefetch not implemented"): each program loads its
head's offset and length (and score flag) as scalars from [B * H] refs at its start, the equivalent here.
"""

from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import numpy as np

from pallas_kernels._util import MASK_VALUE, MIN_DOT_ROWS, cdiv, dot_precision, is_pow2, next_pow2
from pallas_kernels.pooled_scores import POOL_KERNEL_SIZE, avg_pool, base_overlap, gqa_reduce, masked_softmax
from pallas_kernels.pool_checks import check_pool_args
from pallas_kernels.sparse_decode_attention import combine_splits

__all__ = ["pool_attention", "pool_attention_reference", "check_pool_args", "pivot_pooled_scores",
           "default_pool_num_splits", "gather_blocks"]


_POOL_ARGS = ("q", "k_pool", "v_pool", "offsets", "lengths", "score_heads", "block_rows", "block_size", "max_len",
              "score_len")


def _checked(fn):
  """``fn`` (jitted, with the pool attention's arguments) that first runs :func:`check_pool_args` outside
  the jit, where offsets and lengths may still be concrete."""
  sig = inspect.signature(fn)

  @functools.wraps(fn)
  def call(*args, **kwargs):
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    check_pool_args(**{k: bound.arguments[k] for k in _POOL_ARGS})
    return fn(*args, **kwargs)
  return call


@_checked
@functools.partial(jax.jit, static_argnames=("max_len", "score_len", "sm_scale", "block_size"))
def pool_attention_reference(
    q,                 # [B, H, T, G, D]  T query positions per KV head, G query heads each (after RoPE, unscaled)
    k_pool,            # [B, P, D]        the pool's keys (after RoPE); head h's rows start at offsets[b, h]
    v_pool,            # [B, P, D]        the pool's values
    offsets,           # [B, H] int32     first pool row of each head's region
    lengths,           # [B, H] int32     rows query position 0 sees; position t sees lengths + t
    score_heads=None,  # [H] int32        1: the kernels also write this head's logits (ignored here)
    block_rows=None,   # [B, H, NB] int32 first region row of each logical key block (None: contiguous)
    *,
    max_len: int,      # static: the most rows any query position sees (>= max(lengths) + T - 1)
    score_len: int = 0,
    sm_scale: float | None = None,
    block_size: int = 0,  # static: rows of one logical key block of ``block_rows``
):
  """Plain-jnp reference of the pool attention (module docstring): a gather of every head's rows, then masked
  float32 attention. Returns (out [B, H, T, G, D] in q.dtype, lse [B, H, T, G] float32, logits
  [B, H, G, score_len] float32 or None). Arguments are checked first (:func:`check_pool_args`)."""
  del score_heads
  B, H, T, G, D = q.shape
  P = k_pool.shape[1]
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(D)
  S = int(max_len)
  slot = jnp.arange(S, dtype=jnp.int32)
  rows = _pool_rows(offsets, block_rows, block_size, S, P)                         # [B, H, S]
  seen = lengths.astype(jnp.int32)[:, :, None] + jnp.arange(T, dtype=jnp.int32)    # [B, H, T]
  visible = slot[None, None, None, :] < seen[..., None]                            # [B, H, T, S]
  if block_rows is None:  # a contiguous head's rows outside the pool are not keys (as in the kernels)
    first = offsets.astype(jnp.int32)[:, :, None]
    visible &= ((first >= 0) & (first + slot < P))[:, :, None, :]
  # rows no query of the head sees are zeroed: they belong to other heads or are free (any value, NaN too)
  mine = visible.any(axis=2)[..., None]                                            # [B, H, S, 1]
  k = jnp.where(mine, jnp.take_along_axis(k_pool[:, None], rows[..., None], axis=2), 0)  # [B, H, S, D]
  v = jnp.where(mine, jnp.take_along_axis(v_pool[:, None], rows[..., None], axis=2), 0)
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
    n = min(S, score_len)
    logits = s[:, :, 0, :, :n]                                                     # [B, H, G, n]
    if n < score_len:
      logits = jnp.pad(logits, ((0, 0), (0, 0), (0, 0), (0, score_len - n)), constant_values=MASK_VALUE)
  return out.astype(q.dtype), lse, logits


def _pool_rows(offsets, block_rows, block_size: int, S: int, P: int):
  """[B, H, S] int32 pool row of each head's logical keys 0..S-1, clipped into [0, P): region row j (contiguous
  heads, ``block_rows`` None), or the first row of key j's block plus its place in the block (paged heads)."""
  slot = jnp.arange(S, dtype=jnp.int32)
  if block_rows is None:
    rel = slot[None, None, :]
  else:
    blk = jnp.minimum(slot // block_size, block_rows.shape[-1] - 1)
    rel = jnp.take(block_rows.astype(jnp.int32), blk, axis=-1) + slot % block_size
  return jnp.clip(offsets.astype(jnp.int32)[..., None] + rel, 0, P - 1)


def gather_blocks(
    k_pool,       # [B, P, D]        the pool's keys
    v_pool,       # [B, P, D]        the pool's values
    offsets,      # [B, H] int32     first pool row of each head's region
    block_rows,   # [B, H, NB] int32 first region row of each logical key block
    *,
    block_size: int,  # rows of one block
    max_len: int,     # logical rows gathered per head (<= NB * block_size)
):
  """Paged heads as contiguous regions, for a kernel that cannot read their blocks (the native CPU one where a
  block is not a power of two rows):
  ([B, H * S, D] keys and values of each head's S = max_len logical rows, head h's at h * S; those offsets
  [B, H]). Rows are clipped into the pool: a row past a head's visible length is gathered but never read."""
  B, H, _ = block_rows.shape
  P = k_pool.shape[1]
  S = max(1, int(max_len))
  rows = _pool_rows(offsets, block_rows, block_size, S, P).reshape(B, H * S, 1)
  take = lambda pool: jnp.take_along_axis(pool, rows, axis=1)  # noqa: E731
  return take(k_pool), take(v_pool), jnp.broadcast_to(jnp.arange(H, dtype=jnp.int32) * S, (B, H))


def pivot_pooled_scores(
    logits,   # [B, Hp, G, T] float32  scaled logits of the scored heads over their prompt rows
    lengths,  # [B, Hp] int32          prompt rows of each (entries past them are ignored)
    gqa: str = "max",
):
  """The pooled scores (``pooled_scores`` module docstring) from one decode query's logits: softmax over the
  prompt rows (float32), 5-tap average pooling, GQA aggregation; [B, Hp, T] float32, MASK_VALUE at t >= lengths.
  Equal to
  ``pooled_scores_reference(q[:, :, None], keys, lengths, gqa=gqa)[:, :, 0]`` for the same query and keys."""
  T = logits.shape[-1]
  valid = jnp.arange(T)[None, None, :] < lengths[..., None]                        # [B, Hp, T]
  p = masked_softmax(logits, valid[:, :, None, :])
  agg = gqa_reduce(avg_pool(p, POOL_KERNEL_SIZE), gqa, axis=2)
  return jnp.where(valid, agg, MASK_VALUE)


def pivot_statistics_reference(
    logits,   # [B, Hp, G, T] float32  scaled logits of the pivots over their prompt rows
    lengths,  # [B, Hp] int32          prompt rows of each
    k_base,   # [B, Hp, K] int32       each pivot's K_base positions, -1 past its own L_base
):
  """A pivot layer's drift statistics of one decode step: (scores [B, Hp, T] float32, ``pivot_pooled_scores``
  with GQA max; o'_t [B, Hp] float32, the normalised overlap of the top-L_base of the scores with K_base,
  Eq. 9, each row with its own L_base = the count of its K_base entries >= 0, ``base_overlap``). The native
  CPU kernel ``pallas_kernels.native.pivot_statistics_native`` computes the same."""
  if jnp.shape(lengths) != jnp.shape(logits)[:2] or jnp.shape(k_base)[:2] != jnp.shape(logits)[:2]:
    raise ValueError(f"lengths must be [B, Hp] = {jnp.shape(logits)[:2]} and k_base [B, Hp, K], got "
                     f"{jnp.shape(lengths)} and {jnp.shape(k_base)}")
  scores = pivot_pooled_scores(logits, lengths)
  l_base = (k_base >= 0).sum(axis=-1, dtype=jnp.int32)
  return scores, base_overlap(scores[:, :, None], k_base, l_base, lengths)[:, :, 0]


def pool_attention_statistics_reference(
    q,             # [B, H, 1, G, D]
    k_pool,        # [B, P, D]
    v_pool,        # [B, P, D]
    offsets,       # [B, H] int32
    lengths,       # [B, H] int32     rows the query sees
    score_slots,   # static tuple of Hs distinct heads whose statistics are returned, in this order
    stat_lengths,  # [B, Hs] int32    the rows each statistic is over (a pivot's prompt rows)
    k_base,        # [B, Hs, K] int32 each scored head's K_base, -1 past its own L_base
    *,
    max_len: int,
    score_len: int,
    sm_scale: float | None = None,
):
  """A decode step's attention over the pool with the drift statistics of the heads ``score_slots``: the
  attention of ``pool_attention_reference`` (their logits over the first ``score_len`` rows) followed by
  ``pivot_statistics_reference`` on those logits. Returns (out [B, H, 1, G, D], lse [B, H, 1, G] float32,
  scores [B, Hs, score_len] float32, o'_t [B, Hs] float32). The native CPU kernel
  ``pallas_kernels.native.pool_attention_statistics_native`` computes the same in one call."""
  out, lse, logits = pool_attention_reference(q, k_pool, v_pool, offsets, lengths,
                                              score_flags(q.shape[1], score_slots), max_len=max_len,
                                              score_len=score_len, sm_scale=sm_scale)
  scores, overlap = pivot_statistics_reference(logits[:, list(score_slots)], stat_lengths, k_base)
  return out, lse, scores, overlap


def score_flags(H: int, score_slots) -> jax.Array:
  """The [H] int32 ``score_heads`` flags of the heads ``score_slots`` (a static tuple of distinct heads)."""
  slots = tuple(int(h) for h in score_slots)
  if not slots or len(set(slots)) != len(slots) or not all(0 <= h < H for h in slots):
    raise ValueError(f"score_slots must be distinct heads in [0, {H}), at least one, got {score_slots!r}")
  flags = np.zeros((H,), np.int32)
  flags[list(slots)] = 1
  return jnp.asarray(flags)


# ---------------------------------------------------------------------------
# The Pallas (Triton) kernel

# Most query rows (T * G) in one tile: a chunk of many tokens is cut into tiles of this many rows
# (the float32 accumulator is [rows, D] per program).
MAX_TILE_ROWS = 64
# Fewest pool rows a key split covers by default (a work unit of a program).
MIN_SPLIT_ROWS = 512
# Most key splits per (head, row tile) by default. 128: on an H200 a 128K pool of two full heads and six at
# 0.1x took 61 us with 128 splits against 85 with 64 (RESULTS `kernels-gpu-pool`); at 32K both give 64.
MAX_SPLITS = 128


def default_pool_num_splits(max_len: int, block_k: int = 64, row_tiles: int = 1) -> int:
  """Number of key splits used when ``num_splits`` is None.

  One split per ``MIN_SPLIT_ROWS`` (512) rows of ``max_len``, at most ``MAX_SPLITS`` (128) / ``row_tiles``
  and never more splits than key blocks. Heads of a pool differ in length, so a split is a fixed-size unit
  of work (split_len = max_len / num_splits): a full head runs many busy programs, a 0.1x head a few, and
  the rest exit before any load. More splits than :func:`default_num_splits`'s 16 because with 8 KV heads
  and a few full ones, 16 busy programs per full head would leave most SMs of an H100/H200 idle; a chunk
  (several row tiles) already has parallelism along its rows, so it gets fewer.
  """
  n = min(MAX_SPLITS, cdiv(max(1, max_len), MIN_SPLIT_ROWS), cdiv(max(1, max_len), block_k))
  return int(max(1, n // max(1, row_tiles)))


def _pool_kernel(
    q_ref,      # [block_r, D]       query rows i * block_r + [0, block_r) of head r (row = t * G + g); pad rows 0
    k_ref,      # [P, D]             the whole key pool of batch element r // H (read in place)
    v_ref,      # [P, D]             the whole value pool of batch element r // H
    off_ref,    # []                 int32 first pool row of head r
    len_ref,    # []                 int32 rows query position t = 0 of head r sees
    *rest,      # [flag_ref [] int32 (score_len > 0 only)], [table_ref [NB] int32 (paged only)],
                # o_ref [block_r, D] f32, m_ref [block_r] f32, l_ref [block_r] f32,
                # [logits_ref [G, score_len] f32 (score_len > 0 only)]
    sm_scale: float,
    block_k: int,
    split_len: int,
    num_rows: int,   # T * G real query rows per head
    group: int,      # G
    max_len: int,    # clip of every visible count (static, >= 1)
    pool_rows: int,  # P
    score_len: int,
    paged: bool,     # key block b of head r starts at region row table_ref[b] (else at b * block_k)
):
  """One (head r, row tile i, key split j): online-softmax attention of the tile's rows over the split's
  keys, s = sm_scale * q k^T (float32), masked per row at lengths + t; writes the split's unnormalised
  o = sum_j exp(s_j - m) v_j, m = max_j s_j and l = sum_j exp(s_j - m) for the real rows, and (score_len > 0,
  scored heads) the logits s_j, j < min(score_len, n), of the split's keys."""
  rest = list(rest)
  flag_ref = rest.pop(0) if score_len else None
  table_ref = rest.pop(0) if paged else None
  o_ref, m_ref, l_ref = rest[:3]
  logits_ref = rest[3] if score_len else None
  block_r, head_dim = q_ref.shape
  tile = pl.program_id(1)
  split = pl.program_id(2)
  base = off_ref[()]
  length = len_ref[()]

  # Per-row visible count n = clip(lengths + t, 0, max_len); pad rows see nothing, nor does a head whose
  # offset is outside the pool (the reference's and the native kernel's rule: no load at all).
  inside = (base >= 0) & (base < pool_rows)
  row = tile * block_r + jnp.arange(block_r, dtype=jnp.int32)              # [block_r]
  real = row < num_rows
  t_row = lax.div(row, jnp.int32(group))
  n_row = jnp.where(real & inside, jnp.clip(length + t_row, 0, max_len), 0)  # [block_r]
  # The tile's largest count bounds the key loop (rows are ordered by t).
  t_last = lax.div(jnp.minimum((tile + 1) * block_r - 1, num_rows - 1), jnp.int32(group))
  n_tile = jnp.where(inside, jnp.clip(length + t_last, 0, max_len), 0)
  start = split * split_len
  end = jnp.minimum(n_tile, start + split_len)
  n_blocks = (jnp.maximum(end - start, 0) + block_k - 1) // block_k

  q = q_ref[...]
  precision = dot_precision(q.dtype)
  lane = jnp.arange(block_k, dtype=jnp.int32)
  scored = (flag_ref[()] != 0) if score_len else None

  def body(it, carry):
    o, m, l = carry
    off = start + it * block_k
    key = off + lane                                                      # [block_k] logical keys of the head
    # off is a multiple of block_k (split_len is): key block off // block_k starts at region row `first`
    first = table_ref[off // block_k] if paged else off
    prow = base + first + lane                                            # [block_k] rows of the pool
    # Rows read: below the tile's bound, and inside the pool whatever the offsets.
    read = (key < end) & (prow >= 0) & (prow < pool_rows)                 # [block_k]
    k = plgpu.load(k_ref.at[pl.ds(base + first, block_k), :],
                   mask=read[:, None], other=0.0)                         # [block_k, D]
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * sm_scale     # [block_r, block_k] f32
    vis = read[None, :] & (key[None, :] < n_row[:, None])                 # [block_r, block_k]
    s = jnp.where(vis, s, MASK_VALUE)
    if score_len:
      # vis is False on pad rows: rows past G of this [G, score_len] block are the next head's logits.
      @pl.when((off < score_len) & scored)
      def _():
        plgpu.store(logits_ref.at[pl.ds(tile * block_r, block_r), pl.ds(off, block_k)], s,
                    mask=vis & (key[None, :] < score_len))
    # A row may see none of this block (its causal bound, or a pad row): its m stays MASK_VALUE and
    # its p is forced to 0, so it adds nothing.
    m_new = jnp.maximum(m, s.max(axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(vis, jnp.exp(s - m_new[:, None]), 0.0)
    l_new = alpha * l + p.sum(axis=-1)
    v = plgpu.load(v_ref.at[pl.ds(base + first, block_k), :],
                   mask=read[:, None], other=0.0)                         # [block_k, D]
    pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)            # [block_r, D] f32
    return alpha[:, None] * o + pv, m_new, l_new

  o = jnp.zeros((block_r, head_dim), jnp.float32)
  m = jnp.full((block_r,), MASK_VALUE, jnp.float32)
  l = jnp.zeros((block_r,), jnp.float32)
  o, m, l = lax.fori_loop(0, n_blocks, body, (o, m, l))
  # Pad rows are not written (the combine slices them off).
  plgpu.store(o_ref, o, mask=real[:, None])
  plgpu.store(m_ref, m, mask=real)
  plgpu.store(l_ref, l, mask=real)


@_checked
@functools.partial(
    jax.jit,
    static_argnames=("max_len", "score_len", "sm_scale", "block_k", "num_splits", "num_warps",
                     "num_stages", "interpret", "block_size"))
def pool_attention(
    q,                 # [B, H, T, G, D]  T query positions per KV head, G query heads each (after RoPE, unscaled)
    k_pool,            # [B, P, D]        the pool's keys (after RoPE); head h's rows start at offsets[b, h]
    v_pool,            # [B, P, D]        the pool's values
    offsets,           # [B, H] int32     first pool row of each head's region
    lengths,           # [B, H] int32     rows query position 0 sees; position t sees lengths + t
    score_heads=None,  # [H] int32        1: also write this head's logits (None: every head)
    block_rows=None,   # [B, H, NB] int32 first region row of each logical key block (None: contiguous)
    *,
    max_len: int,      # static: the most rows any query position sees (>= max(lengths) + T - 1)
    score_len: int = 0,
    sm_scale: float | None = None,
    block_size: int = 0,  # static: rows of one block of ``block_rows`` (the kernel's block_k then)
    block_k: int = 64,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
):
  """Attention of every KV head of a layer over one row pool, one kernel launch (module docstring):

      s_j = sm_scale * <q[b, h, t, g], k_pool[b, o + j]>,  j < n = lengths[b, h] + t,  o = offsets[b, h]
      out = softmax(s) @ v_pool[b, o:o + n],   lse = log sum_j exp(s_j)   (float32)

  Args:
    q: [B, H, T, G, D] queries, bf16/f16/f32 (T = 1: decode; T > 1: a chunk, causal over its own rows).
    k_pool, v_pool: [B, P, D] the pool, same dtype as q; only rows [o, o + n) of each head are read.
    offsets, lengths: [B, H] int32. n = clip(lengths + t, 0, max_len); n = 0 gives out = 0 and
      lse = MASK_VALUE. Every row a head sees must lie in [0, P) (refused when concrete; under jit the kernel
      reads nothing outside the pool: module docstring).
    score_heads: [H] int32 flags of the heads whose logits are written (score_len > 0); None: all.
    block_rows: [B, H, NB] int32, paged heads: logical key j of head h is region row
      block_rows[b, h, j // block_size] + j % block_size (Quest's selected pages, then its contiguous rest),
      read in place block by block; None: key j is region row j.
    max_len: static bound of n, >= 1 (sets the key splits); score_len: logits per scored head (T = 1 only).
    block_size: rows of a block of ``block_rows`` (power of two >= 16); the kernel reads blocks of that
      many rows (it replaces block_k).
    sm_scale: logit scale, default 1 / sqrt(D).
    block_k: pool rows per inner block (power of two >= 16).
    num_splits: key splits per (head, row tile), >= 1; default :func:`default_pool_num_splits`.
    num_warps, num_stages: Triton compiler parameters.
    interpret: run in the Pallas interpreter (CPU tests).

  Returns:
    out [B, H, T, G, D] in q.dtype, lse [B, H, T, G] float32, and logits [B, H, G, score_len] float32 (s_j
    of scored heads for j < min(score_len, n); other entries unspecified) or None when score_len = 0.
    Zero-size axes (and a pool of P = 0 rows: every head empty) give what the reference gives.
  """
  B, H, T, G, D = q.shape
  P = k_pool.shape[1]
  paged = block_rows is not None
  if paged:
    if not is_pow2(block_size) or block_size < 16:
      raise ValueError(f"the kernel reads a paged head block by block: block_size must be a power of two >= 16, "
                       f"got {block_size} (a page size such as 16, 32 or 64)")
    block_k = block_size
  if not is_pow2(D) or D < 16:
    raise ValueError(f"head_dim must be a power of two >= 16, got {D}")
  if not is_pow2(block_k) or block_k < 16:
    raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
  if num_splits is not None and num_splits < 1:
    raise ValueError(f"num_splits must be None (the default) or >= 1, got {num_splits}")
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(D)
  S = int(max_len)
  score_len = int(score_len)
  if q.size == 0 or P == 0:  # nothing to attend: out 0, lse and logits MASK_VALUE (empty heads)
    logits = jnp.full((B, H, G, score_len), MASK_VALUE, jnp.float32) if score_len else None
    return jnp.zeros(q.shape, q.dtype), jnp.full((B, H, T, G), MASK_VALUE, jnp.float32), logits

  # Query rows of a head: row = t * G + g, cut into tiles of block_r rows (>= 16 for the dot).
  R = T * G
  block_r = max(MIN_DOT_ROWS, min(MAX_TILE_ROWS, next_pow2(R)))
  row_tiles = cdiv(R, block_r)
  Rp = row_tiles * block_r
  if num_splits is None:
    num_splits = default_pool_num_splits(S, block_k, row_tiles)
  split_len = cdiv(cdiv(S, num_splits), block_k) * block_k
  num_splits = cdiv(S, split_len)          # drop splits that would be empty
  BH = B * H

  q_p = jnp.pad(q.reshape(BH, R, D), ((0, 0), (0, Rp - R), (0, 0)))       # [BH, Rp, D]
  off_r = offsets.astype(jnp.int32).reshape(BH)
  len_r = lengths.astype(jnp.int32).reshape(BH)

  scalar = pl.BlockSpec((None,), lambda r, i, j: (r,))
  in_specs = [
      pl.BlockSpec((None, block_r, D), lambda r, i, j: (r, i, 0)),
      pl.BlockSpec((None, P, D), lambda r, i, j: (r // H, 0, 0)),
      pl.BlockSpec((None, P, D), lambda r, i, j: (r // H, 0, 0)),
      scalar,
      scalar,
  ]
  args = [q_p, k_pool, v_pool, off_r, len_r]
  out_specs = [
      pl.BlockSpec((None, None, block_r, D), lambda r, i, j: (r, j, i, 0)),
      pl.BlockSpec((None, None, block_r), lambda r, i, j: (r, j, i)),
      pl.BlockSpec((None, None, block_r), lambda r, i, j: (r, j, i)),
  ]
  out_shape = [
      jax.ShapeDtypeStruct((BH, num_splits, Rp, D), jnp.float32),
      jax.ShapeDtypeStruct((BH, num_splits, Rp), jnp.float32),
      jax.ShapeDtypeStruct((BH, num_splits, Rp), jnp.float32),
  ]
  if score_len:
    flags = (jnp.ones((H,), jnp.int32) if score_heads is None else score_heads.astype(jnp.int32))
    in_specs.append(scalar)
    args.append(jnp.broadcast_to(flags[None, :], (B, H)).reshape(BH))
    # Every program of head r writes its own keys' columns of the one [G, score_len] block.
    out_specs.append(pl.BlockSpec((None, G, score_len), lambda r, i, j: (r, 0, 0)))
    out_shape.append(jax.ShapeDtypeStruct((BH, G, score_len), jnp.float32))
  if paged:
    NB = block_rows.shape[2]
    in_specs.append(pl.BlockSpec((None, NB), lambda r, i, j: (r, 0)))
    args.append(block_rows.astype(jnp.int32).reshape(BH, NB))

  kernel = functools.partial(
      _pool_kernel, sm_scale=float(sm_scale), block_k=block_k, split_len=split_len, num_rows=R,
      group=G, max_len=S, pool_rows=P, score_len=score_len, paged=paged)
  res = pl.pallas_call(
      kernel,
      grid=(BH, row_tiles, num_splits),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="pool_attention",
  )(*args)
  o, m, l = (x[:, :, :R] for x in res[:3])                 # pad rows were never written

  out, lse = combine_splits(o, m, l)                       # [BH, R, D], [BH, R]
  out = out.reshape(B, H, T, G, D).astype(q.dtype)
  lse = lse.reshape(B, H, T, G)
  logits = res[3].reshape(B, H, G, score_len) if score_len else None
  return out, lse, logits
