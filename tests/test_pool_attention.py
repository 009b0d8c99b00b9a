"""Tests of pallas_kernels.pool_attention: the Pallas kernel in interpret mode vs the plain-jnp
reference (every head of a layer over one row pool, each at its own offset and length), and its CUDA
(Triton) lowering without a GPU.

Pools are built so the kernel can only pass by reading exactly each head's visible rows: regions are
placed in a shuffled order at non-contiguous offsets, and every row outside a head's visible range
(gaps, the end of the pool, the rows past lengths + T - 1) holds NaN. Shapes are small: the Pallas
interpreter compiles each distinct shape (~1 s).
"""

from __future__ import annotations

import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import lower_cuda
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels._util import MASK_VALUE
from pool_utils import make_paged_pool
from pallas_kernels.pool_attention import (default_pool_num_splits, pool_attention,
                                           pool_attention_reference)

TRITON_CALL = "__gpu$xla.gpu.triton"   # custom-call target, jax/jaxlib 0.10.2

# Kernel vs reference (float32 math on the same inputs; the bf16 kernel feeds p to the p@v dot in bf16).
TOL = {
    jnp.float32: dict(out=2e-5, lse=2e-5, logits=2e-5),
    jnp.bfloat16: dict(out=3e-2, lse=1e-3, logits=1e-3),
}


def make_pool(rng, lengths, T, D, dtype, *, gap_max=9, q_scale=2.0):
  """A row pool [B, P, D] holding each head's visible rows, NaN elsewhere.

  Head (b, h) owns rows [offsets, offsets + lengths + T - 1) (what its last query position sees); the
  regions of a sequence are laid out in a random order with random NaN gaps between them and NaN after
  the last one. Returns (k_nan, v_nan, k_clean, v_clean, offsets): the clean pools equal the NaN ones on
  visible rows and are 0 elsewhere (the reference gathers up to max_len rows, which may include gaps).
  """
  lengths = np.asarray(lengths, np.int32)
  B, H = lengths.shape
  need = np.maximum(lengths + T - 1, 0)
  offsets = np.zeros((B, H), np.int32)
  visible = []
  P = int(max(need.sum(axis=1) + gap_max * (H + 1)))
  for b in range(B):
    pos = int(rng.integers(0, gap_max + 1))
    vis = np.zeros(P, bool)
    for h in rng.permutation(H):            # unsorted offsets
      offsets[b, h] = pos
      vis[pos:pos + need[b, h]] = True
      pos += int(need[b, h]) + int(rng.integers(1, gap_max + 1))
    visible.append(vis)
  visible = np.stack(visible)[..., None]                            # [B, P, 1]
  k = (rng.standard_normal((B, P, D))).astype(np.float32)
  v = (rng.standard_normal((B, P, D))).astype(np.float32)
  k_clean, v_clean = np.where(visible, k, 0.0), np.where(visible, v, 0.0)
  k_nan, v_nan = np.where(visible, k, np.nan), np.where(visible, v, np.nan)
  cast = lambda x: jnp.asarray(x, jnp.float32).astype(dtype)       # noqa: E731
  return cast(k_nan), cast(v_nan), cast(k_clean), cast(v_clean), jnp.asarray(offsets)


def check_against_reference(rng, lengths, T, G, D, dtype, *, block_k, num_splits=None, score_len=0,
                            score_heads=None, max_len=None):
  lengths = np.asarray(lengths, np.int32)
  B, H = lengths.shape
  k_nan, v_nan, k, v, offsets = make_pool(rng, lengths, T, D, dtype)
  q = jnp.asarray(2.0 * rng.standard_normal((B, H, T, G, D)), jnp.float32).astype(dtype)
  if max_len is None:
    max_len = int(max(1, lengths.max() + T - 1))
  lens = jnp.asarray(lengths)
  flags = None if score_heads is None else jnp.asarray(score_heads, jnp.int32)
  out, lse, logits = pool_attention(q, k_nan, v_nan, offsets, lens, flags, max_len=max_len,
                                    score_len=score_len, block_k=block_k, num_splits=num_splits,
                                    interpret=True)
  r_out, r_lse, r_logits = pool_attention_reference(q, k, v, offsets, lens, flags, max_len=max_len,
                                                    score_len=score_len)
  assert out.shape == (B, H, T, G, D) and out.dtype == dtype
  assert lse.shape == (B, H, T, G) and lse.dtype == jnp.float32
  out, lse = np.asarray(out, np.float32), np.asarray(lse)
  assert np.isfinite(out).all() and np.isfinite(lse).all()
  tol = TOL[dtype]
  np.testing.assert_allclose(out, np.asarray(r_out, np.float32), atol=tol["out"], rtol=tol["out"])
  np.testing.assert_allclose(lse, np.asarray(r_lse), atol=tol["lse"], rtol=tol["lse"])
  # Empty query positions (n <= 0): out exactly 0, lse exactly MASK_VALUE.
  n = np.clip(lengths[:, :, None] + np.arange(T), 0, max_len)                 # [B, H, T]
  empty = np.broadcast_to((n == 0)[..., None], lse.shape)
  assert (lse[empty] == np.float32(MASK_VALUE)).all() and (out[empty] == 0).all()
  if not score_len:
    assert logits is None and r_logits is None
    return
  assert logits.shape == (B, H, G, score_len) and logits.dtype == jnp.float32
  scored = np.ones(H, bool) if score_heads is None else np.asarray(score_heads) != 0
  seen = np.arange(score_len)[None, None, :] < np.minimum(lengths, max_len)[..., None]    # [B, H, L]
  want = np.broadcast_to((seen & scored[None, :, None])[:, :, None, :], logits.shape)
  got, ref = np.asarray(logits)[want], np.asarray(r_logits)[want]
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, ref, atol=tol["logits"], rtol=tol["logits"])


# ---------------------------------------------------------------------------
# Interpret mode vs the reference

# Every G in {1, 4, 7}, D in {64, 128}, T in {1, 5} (and a chunk over several row tiles), both dtypes,
# lengths 0, 1, block_k - 1, block_k + 1 and a long head, B = 3 with different lengths per sequence,
# score_len shorter and longer than a head's rows, flags mixing 0 and 1.
BK = 16
LONG = 150
CASES = [
    # id, lengths [B, H], T, G, D, dtype, num_splits, score_len, score_heads
    ("decode-g4-logits-flags", [[0, 1, BK - 1], [BK + 1, LONG, 5], [LONG - 3, 2, BK]], 1, 4, 64,
     jnp.float32, 3, 20, [1, 0, 1]),
    ("decode-g7-bf16-logits-all", [[BK + 1, 0], [LONG, 1], [3, BK - 1]], 1, 7, 128, jnp.bfloat16, 4, 64,
     None),
    ("decode-g1-default-splits", [[LONG, 0, BK - 1]], 1, 1, 64, jnp.float32, None, 0, None),
    ("chunk-g4", [[0, 1, BK - 1], [BK + 1, LONG, 2], [7, 0, BK]], 5, 4, 64, jnp.float32, 2, 0, None),
    ("chunk-g7-bf16", [[LONG, BK + 1], [0, BK - 1]], 5, 7, 128, jnp.bfloat16, 3, 0, None),
    ("chunk-tiles-g1", [[1, LONG - 90], [0, BK + 1]], 40, 1, 64, jnp.float32, 2, 0, None),  # 40 rows, 1 tile
    ("chunk-3tiles-g4", [[0, BK + 1]], 40, 4, 64, jnp.float32, 2, 0, None),                 # 160 rows, 3 tiles
]


@pytest.mark.parametrize("name,lengths,T,G,D,dtype,num_splits,score_len,score_heads", CASES,
                         ids=[c[0] for c in CASES])
def test_interpret_matches_reference(name, lengths, T, G, D, dtype, num_splits, score_len, score_heads):
  rng = np.random.default_rng(zlib.crc32(name.encode()))
  check_against_reference(rng, lengths, T, G, D, dtype, block_k=BK, num_splits=num_splits,
                          score_len=score_len, score_heads=score_heads)


def test_max_len_clips_and_larger_max_len_is_the_same():
  """n = clip(lengths + t, 0, max_len): a max_len above the longest head changes nothing (other splits),
  one below it truncates exactly as the reference does."""
  rng = np.random.default_rng(3)
  lengths = [[BK + 1, 40], [0, 33]]
  check_against_reference(rng, lengths, 1, 3, 64, jnp.float32, block_k=BK, num_splits=2, max_len=100,
                          score_len=50, score_heads=[1, 1])
  check_against_reference(rng, lengths, 1, 3, 64, jnp.float32, block_k=BK, num_splits=2, max_len=36,
                          score_len=50, score_heads=[1, 1])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_matches_reference(data):
  """Random lengths, layouts, flags and values at a few small shapes (few compiles: fixed max_len)."""
  T = data.draw(st.sampled_from([1, 3]), label="T")
  G = data.draw(st.sampled_from([1, 3]), label="G")
  B, H, D, max_len = 2, 3, 16, 48
  lengths = data.draw(st.lists(st.integers(0, max_len - T + 1), min_size=B * H, max_size=B * H),
                      label="lengths")
  lengths = np.asarray(lengths, np.int32).reshape(B, H)
  flags = data.draw(st.lists(st.integers(0, 1), min_size=H, max_size=H), label="flags")
  seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
  check_against_reference(np.random.default_rng(seed), lengths, T, G, D, jnp.float32, block_k=BK,
                          num_splits=2, max_len=max_len, score_len=24 if T == 1 else 0,
                          score_heads=flags if T == 1 else None)


# ---------------------------------------------------------------------------
# Paged heads: each head attends chosen blocks of its region (Quest's pages), read in place


PAGED_CASES = [
    # id, lengths [B, H], G, D, dtype, blocks in the table, blocks in a region, num_splits
    ("g1-d64", [[0, 1, BK - 1], [BK + 1, 5 * BK, 3], [2 * BK, 0, 4 * BK - 2]], 1, 64, jnp.float32, 5, 9, 2),
    ("g4-d128-bf16", [[BK, 3 * BK + 1], [1, 5 * BK]], 4, 128, jnp.bfloat16, 5, 7, None),
    ("g7-d64", [[BK + 1, BK - 1, 0]], 7, 64, jnp.float32, 3, 4, 3),
]


@pytest.mark.parametrize("name,lengths,G,D,dtype,n_blocks,region_blocks,num_splits", PAGED_CASES,
                         ids=[c[0] for c in PAGED_CASES])
def test_paged_heads_match_reference_and_numpy(name, lengths, G, D, dtype, n_blocks, region_blocks, num_splits):
  """A paged call reads exactly the blocks its table names, in logical order: the kernel (interpret) equals
  the reference, and the reference equals numpy softmax attention over the rows the table names (every
  other row of the pool is NaN, so a stray read would show)."""
  rng = np.random.default_rng(zlib.crc32(name.encode()))
  lengths = np.asarray(lengths, np.int32)
  B, H = lengths.shape
  k, v, offsets, table, rows = make_paged_pool(rng, lengths, n_blocks, region_blocks, BK, D, dtype)
  q = jnp.asarray(2.0 * rng.standard_normal((B, H, 1, G, D)), jnp.float32).astype(dtype)
  max_len = n_blocks * BK
  lens = jnp.asarray(lengths)
  out, lse, _ = pool_attention(q, k, v, offsets, lens, None, table, max_len=max_len, block_size=BK,
                               num_splits=num_splits, interpret=True)
  k0, v0 = jnp.nan_to_num(k), jnp.nan_to_num(v)   # the reference gathers whole blocks, then masks
  r_out, r_lse, _ = pool_attention_reference(q, k0, v0, offsets, lens, None, table, max_len=max_len,
                                             block_size=BK)
  tol = TOL[dtype]
  out32, r32 = np.asarray(out, np.float32), np.asarray(r_out, np.float32)
  assert np.isfinite(out32).all() and np.isfinite(np.asarray(lse)).all()
  np.testing.assert_allclose(out32, r32, atol=tol["out"], rtol=tol["out"])
  np.testing.assert_allclose(np.asarray(lse), np.asarray(r_lse), atol=tol["lse"], rtol=tol["lse"])
  kf, vf, qf = (np.asarray(x, np.float64) for x in (k, v, q))
  for (b, h), r in rows.items():
    if not len(r):
      assert (out32[b, h] == 0).all() and (np.asarray(lse)[b, h] == np.float32(MASK_VALUE)).all()
      continue
    s = qf[b, h, 0] @ kf[b, r].T / np.sqrt(D)                              # [G, n]
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ vf[b, r]
    np.testing.assert_allclose(r32[b, h, 0], want, atol=max(tol["out"], 1e-5), rtol=max(tol["out"], 1e-5))


def test_paged_argument_errors():
  q = jnp.zeros((1, 2, 1, 1, 16), jnp.float32)
  pool = jnp.zeros((1, 64, 16), jnp.float32)
  idx = jnp.zeros((1, 2), jnp.int32)
  with pytest.raises(ValueError, match="block_rows must be"):
    pool_attention(q, pool, pool, idx, idx, None, jnp.zeros((1, 3, 2), jnp.int32), max_len=32, block_size=16,
                   interpret=True)
  with pytest.raises(ValueError, match="must cover"):
    pool_attention(q, pool, pool, idx, idx, None, jnp.zeros((1, 2, 1), jnp.int32), max_len=32, block_size=16,
                   interpret=True)
  with pytest.raises(ValueError, match="power of two >= 16"):
    pool_attention(q, pool, pool, idx, idx, None, jnp.zeros((1, 2, 4), jnp.int32), max_len=32, block_size=8,
                   interpret=True)


def test_default_num_splits():
  assert default_pool_num_splits(1) == 1
  assert default_pool_num_splits(512) == 1
  assert default_pool_num_splits(32 * 1024) == 64          # 512 rows per split
  assert default_pool_num_splits(64 * 1024) == 128         # 512 rows per split
  assert default_pool_num_splits(128 * 1024) == 128        # capped: 1024 rows per split
  assert default_pool_num_splits(128 * 1024, row_tiles=8) == 16
  assert default_pool_num_splits(100, block_k=16) == 1


def test_argument_errors():
  q = jnp.zeros((1, 2, 3, 1, 16), jnp.float32)
  pool = jnp.zeros((1, 32, 16), jnp.float32)
  idx = jnp.zeros((1, 2), jnp.int32)
  with pytest.raises(ValueError, match="one query position"):
    pool_attention(q, pool, pool, idx, idx, max_len=8, score_len=4, interpret=True)
  with pytest.raises(ValueError, match="offsets and lengths"):
    pool_attention(q, pool, pool, idx[:, :1], idx, max_len=8, interpret=True)
  with pytest.raises(ValueError, match="block_k"):
    pool_attention(q, pool, pool, idx, idx, max_len=8, block_k=24, interpret=True)
  with pytest.raises(ValueError, match="head_dim"):
    pool_attention(q[..., :12], pool[..., :12], pool[..., :12], idx, idx, max_len=8, interpret=True)


def test_degenerate_arguments_are_refused_alike_on_every_backend():
  """A q of the wrong rank, a negative score_len, max_len < 1, num_splits < 1: a ValueError naming the
  argument from every backend, before any compute (the reference once returned logits of a nonsense shape
  for score_len=-3 and clipped max_len=0 to 1)."""
  import pallas_kernels as pk
  q = jnp.zeros((1, 2, 1, 1, 16), jnp.float32)
  pool = jnp.zeros((1, 32, 16), jnp.float32)
  idx = jnp.zeros((1, 2), jnp.int32)
  for be in ("reference", "native", "interpret"):
    with pytest.raises(ValueError, match=r"q must be \[B, H, T, G, D\], got shape \(1, 2, 1, 16\)"):
      pk.pool_attention(q[:, :, 0], pool, pool, idx, idx, max_len=8, backend=be)
    with pytest.raises(ValueError, match="score_len must be >= 0"):
      pk.pool_attention(q, pool, pool, idx, idx + 4, max_len=8, score_len=-3, backend=be)
    with pytest.raises(ValueError, match="max_len must be >= 1"):
      pk.pool_attention(q, pool, pool, idx, idx, max_len=0, backend=be)
  for n in (0, -2):
    with pytest.raises(ValueError, match="num_splits must be None"):
      pool_attention(q, pool, pool, idx, idx + 4, max_len=8, num_splits=n, interpret=True)


@pytest.mark.parametrize("shape,P", [((1, 2, 0, 3, 16), 32), ((1, 2, 1, 0, 16), 32), ((0, 2, 1, 3, 16), 32),
                                     ((1, 2, 1, 3, 16), 0), ((1, 2, 2, 3, 16), 0)],
                         ids=["T0", "G0", "B0", "P0-decode", "P0-chunk"])
def test_zero_size_axes_give_the_same_result_on_every_backend(shape, P):
  """Zero-size axes: empty arrays of the documented shapes, and a pool of no rows makes every head empty
  (out 0, lse and logits MASK_VALUE) on every backend (the Pallas wrapper raised ZeroDivisionError). With
  P = 0, heads that see no row are fine eagerly; lengths 4 are rows outside the pool: refused eagerly, empty
  heads traced."""
  import pallas_kernels as pk
  B, H, T, G, D = shape
  q = jnp.ones(shape, jnp.float32)
  pool = jnp.ones((B, P, D), jnp.float32)
  idx = jnp.zeros((B, H), jnp.int32)
  score_len = 4 if T == 1 else 0
  calls = [(lambda f: f, idx - T)] + ([(jax.jit, idx + 4)] if P == 0 else [])
  for (wrap, lens), be in itertools.product(calls, ("reference", "native", "interpret")):
    out, lse, logits = wrap(lambda *a: pk.pool_attention(*a, max_len=8, score_len=score_len, backend=be))(
        q, pool, pool, idx, lens)
    assert out.shape == shape and out.dtype == q.dtype and lse.shape == shape[:4], be
    np.testing.assert_array_equal(np.asarray(out), 0)
    np.testing.assert_array_equal(np.asarray(lse), np.float32(MASK_VALUE))
    if score_len:
      assert logits.shape == (B, H, G, score_len)
      np.testing.assert_array_equal(np.asarray(logits), np.float32(MASK_VALUE))


# ---------------------------------------------------------------------------
# CUDA lowering without a GPU


# name, B, H, G, D, per-head capacity, max_len, T, score_len
LOWER_CASES = [
    ("smollm2-135m-decode-logits", 1, 3, 3, 64, 8192, 8192, 1, 8000),
    ("llama-3.1-8b-decode-logits", 1, 8, 4, 128, 131072, 131072, 1, 32768),
    ("llama-3.1-8b-chunk", 2, 8, 4, 128, 32768, 32768, 64, 0),
]


@pytest.mark.parametrize("name,B,H,G,D,cap,max_len,T,score_len", LOWER_CASES, ids=[c[0] for c in LOWER_CASES])
def test_lowers_to_triton_for_cuda(verified_triton_modules, name, B, H, G, D, cap, max_len, T, score_len):
  sds = jax.ShapeDtypeStruct
  P = H * cap // 3 + 1000                     # a pool of a compressed layer (odd size)
  for dtype in (jnp.bfloat16, jnp.float32):
    args = (sds((B, H, T, G, D), dtype), sds((B, P, D), dtype), sds((B, P, D), dtype),
            sds((B, H), jnp.int32), sds((B, H), jnp.int32), sds((H,), jnp.int32))
    txt = lower_cuda(lambda *a: pool_attention(*a, max_len=max_len, score_len=score_len), *args)
    assert txt.count(TRITON_CALL) == 1, name      # one launch for all the heads of the layer
  assert verified_triton_modules and all(verified_triton_modules)


def test_paged_lowers_to_triton_for_cuda(verified_triton_modules):
  """Quest's in-device step at Llama-3.1-8B shapes, 32K: 614 selected 16-row pages plus the partial page and
  a 128-row tail as 9 more blocks, one launch for the layer."""
  sds = jax.ShapeDtypeStruct
  B, H, G, D, bs, nb = 1, 8, 4, 128, 16, 614 + 9
  P = H * (32768 + 128)
  args = (sds((B, H, 1, G, D), jnp.bfloat16), sds((B, P, D), jnp.bfloat16), sds((B, P, D), jnp.bfloat16),
          sds((B, H), jnp.int32), sds((B, H), jnp.int32), None, sds((B, H, nb), jnp.int32))
  txt = lower_cuda(lambda q, k, v, o, n, t: pool_attention(q, k, v, o, n, None, t, max_len=nb * bs, block_size=bs),
                   *(a for a in args if a is not None))
  assert txt.count(TRITON_CALL) == 1
  assert verified_triton_modules and all(verified_triton_modules)
