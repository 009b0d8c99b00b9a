"""Tests of pallas_kernels: interpret-mode numerics vs the references, the
references vs independent numpy, and a CUDA (Triton) lowering check that
needs no GPU.

Shapes are kept small: the Pallas interpreter compiles each shape (~1-2 s).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import lower_cuda
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pallas_kernels as pk
from pallas_kernels import (MASK_VALUE, drift_check,
                            drift_check_reference, merge_attention,
                            normalised_overlap, overlap_bitmap, pooled_scores,
                            pooled_scores_reference, sparse_decode_attention,
                            sparse_decode_attention_reference,
                            topk_membership, topk_sets, topk_threshold)

TRITON_CALL = "__gpu$xla.gpu.triton"   # custom-call target, jax/jaxlib 0.10.2

# Per-dtype tolerances for kernel vs reference (reference: float32 math on the
# same low-precision inputs; the kernel feeds p to the p@v dot in bf16).
TOL = {
    jnp.float32: dict(out=2e-5, lse=2e-5),
    jnp.bfloat16: dict(out=3e-2, lse=1e-3),
}


def _keys(seed, n):
  """n independent numpy generators (numpy inputs: no per-shape compiles)."""
  return [np.random.default_rng([seed, i]) for i in range(n)]


def _rand(rng, shape, dtype, scale=1.0):
  """Fresh N(0, scale^2) array (never zeros) as a jax array of `dtype`."""
  x = (scale * rng.standard_normal(shape)).astype(np.float32)
  return jnp.asarray(x).astype(dtype)


def _decode_qkv(seed, q_scale=1.0):
  """float32 q [B, H, G, D] and k, v [B, H, S, D] at the SHARED sizes."""
  B, H, G, D, S = (SHARED[x] for x in "BHGDS")
  ks = _keys(seed, 3)
  return (_rand(ks[0], (B, H, G, D), jnp.float32, q_scale), _rand(ks[1], (B, H, S, D), jnp.float32),
          _rand(ks[2], (B, H, S, D), jnp.float32))


def _ragged_lengths(rng, B, H, S):
  """[B, H] lengths that include 1 and S, the rest random in [1, S]."""
  lens = rng.integers(1, S + 1, size=(B, H))
  flat = lens.reshape(-1)
  flat[0] = 1
  flat[-1] = S
  if flat.size > 2:
    flat[1] = min(S, 17)     # just past a 16-key block boundary
  return jnp.asarray(lens, jnp.int32)


# ---------------------------------------------------------------------------
# sparse_decode_attention

# Each value of G {1,3,4,7,8}, D {64,128}, B {1,2} and both dtypes appears at
# least once (not the full product). SHARED is reused by the other decode
# tests with identical shapes and static arguments, so the interpreter
# compiles it once (jit cache).
SHARED = dict(B=2, H=2, G=3, D=64, S=64, block_k=16, num_splits=2)
DECODE_CASES = [
    # B, Hkv, G, D,   S,   dtype,        block_k, num_splits
    (2, 2, 3, 64, 64, jnp.float32, 16, 2),      # == SHARED
    (2, 2, 3, 64, 64, jnp.bfloat16, 16, 2),     # == SHARED, bf16
    (1, 3, 4, 128, 128, jnp.float32, 32, 4),
    (1, 2, 7, 128, 100, jnp.bfloat16, 16, 3),   # S not a multiple of splits
    (2, 1, 8, 64, 128, jnp.bfloat16, 64, None),
    (1, 1, 1, 64, 32, jnp.float32, 16, 2),
]


@pytest.mark.parametrize("B,H,G,D,S,dtype,block_k,num_splits", DECODE_CASES)
def test_decode_interpret_matches_reference(B, H, G, D, S, dtype, block_k,
                                            num_splits):
  keys = _keys(B * 1000 + G * 10 + D + S, 3)
  q = _rand(keys[0], (B, H, G, D), dtype, 2.0)
  k = _rand(keys[1], (B, H, S, D), dtype)
  v = _rand(keys[2], (B, H, S, D), dtype)
  lengths = _ragged_lengths(np.random.default_rng(S + G), B, H, S)
  out, lse = sparse_decode_attention(q, k, v, lengths, block_k=block_k,
                                     num_splits=num_splits, interpret=True)
  ref_out, ref_lse = sparse_decode_attention_reference(q, k, v, lengths)
  assert out.shape == (B, H, G, D) and out.dtype == dtype
  assert lse.shape == (B, H, G) and lse.dtype == jnp.float32
  tol = TOL[dtype]
  np.testing.assert_allclose(np.asarray(out, np.float32),
                             np.asarray(ref_out, np.float32),
                             atol=tol["out"], rtol=tol["out"])
  np.testing.assert_allclose(lse, ref_lse, atol=tol["lse"], rtol=tol["lse"])


def _np_attention(q, k, v, mask, scale):
  """float64 numpy attention: q [..., G, D], k/v [..., S, D], mask [..., S]."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  s = np.einsum("...gd,...sd->...gs", q, k) * scale
  s = np.where(mask[..., None, :], s, -np.inf)
  m = s.max(-1, keepdims=True)
  e = np.exp(s - m)
  l = e.sum(-1, keepdims=True)
  v = np.where(mask[..., None], v, 0.0)
  return np.einsum("...gs,...sd->...gd", e / l, v), (m + np.log(l))[..., 0]


def test_decode_reference_matches_numpy_and_ignores_garbage_padding():
  q, k, v = _decode_qkv(7, 2.0)
  S, D = k.shape[2:]
  lengths = jnp.array([[1, 64], [20, 33]], jnp.int32)
  mask = np.arange(S)[None, None, :] < np.asarray(lengths)[..., None]
  want_out, want_lse = _np_attention(q, k, v, mask, 1 / math.sqrt(D))
  # Slots >= length hold NaN: neither the reference nor the kernel may read
  # them into the result.
  kn = jnp.where(jnp.asarray(mask)[..., None], k, jnp.nan)
  vn = jnp.where(jnp.asarray(mask)[..., None], v, jnp.nan)
  for out, lse in (sparse_decode_attention_reference(q, kn, vn, lengths),
                   sparse_decode_attention(q, kn, vn, lengths, block_k=16,
                                           num_splits=2, interpret=True)):
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=2e-5)


def test_decode_empty_head_is_finite_and_merges_as_nothing():
  q, k, v = _decode_qkv(3)
  lengths = jnp.array([[0, 5], [64, 0]], jnp.int32)
  for out, lse in (sparse_decode_attention(q, k, v, lengths, block_k=16,
                                           num_splits=2, interpret=True),
                   sparse_decode_attention_reference(q, k, v, lengths)):
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(lse).all()
    np.testing.assert_array_equal(out[0, 0], 0.0)
    np.testing.assert_array_equal(lse[0, 0], np.float32(MASK_VALUE))
    # Merging an empty part with a non-empty one returns the non-empty one.
    np.testing.assert_array_equal(out[1, 1], 0.0)
    np.testing.assert_array_equal(lse[1, 1], np.float32(MASK_VALUE))
    m_out, m_lse = merge_attention(out[:1, :1], lse[:1, :1], out[:1, 1:],
                                   lse[:1, 1:])
    np.testing.assert_allclose(m_out, out[:1, 1:], atol=1e-6)
    np.testing.assert_allclose(m_lse, lse[:1, 1:], atol=1e-6)


def test_decode_degenerate_arguments():
  """An empty cache tier (S = 0) gives out 0 and lse MASK_VALUE, as L = 0 does, and merges as nothing, from the
  kernel and the reference alike (both used to raise); G = 0 gives empty arrays; num_splits < 1 and a q of the
  wrong rank get a ValueError naming them (not ZeroDivisionError / an unpacking error)."""
  q, k, v = _decode_qkv(3)
  B, H, G, D = q.shape
  empty = jnp.zeros((B, H, 0, D), jnp.float32)
  lens = jnp.array([[0, 5], [64, 0]], jnp.int32)
  for fn in (lambda *a: sparse_decode_attention(*a, interpret=True), sparse_decode_attention_reference,
             lambda *a: pk.decode_attention(*a, backend="interpret")):
    out, lse = fn(q, empty, empty, lens)
    assert out.shape == q.shape and lse.shape == (B, H, G)
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(lse, np.float32(MASK_VALUE))
    full_out, full_lse = sparse_decode_attention_reference(q, k, v, lens + 3)
    m_out, m_lse = merge_attention(out, lse, full_out, full_lse)
    np.testing.assert_array_equal(m_out, full_out)
    np.testing.assert_array_equal(m_lse, full_lse)
    out, lse = fn(q[:, :, :0], k, v, lens)
    assert out.shape == (B, H, 0, D) and lse.shape == (B, H, 0)
  for n in (0, -2):
    with pytest.raises(ValueError, match="num_splits must be None"):
      sparse_decode_attention(q, k, v, lens, num_splits=n, interpret=True)
  for fn in (lambda *a: sparse_decode_attention(*a, interpret=True), sparse_decode_attention_reference):
    with pytest.raises(ValueError, match=r"q must be \[B, Hkv, G, D\]"):
      fn(q[:, :, 0], k, v, lens)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_merge_cache_and_tail_equals_attention_over_concat(dtype):
  """attention([cache[:L] ; tail[:n]]) == merge(attn(cache), attn(tail))."""
  B, H, G, D, S = (SHARED[x] for x in "BHGDS")
  Tt = 16
  ks = _keys(11, 5)
  q = _rand(ks[0], (B, H, G, D), dtype, 2.0)
  kc = _rand(ks[1], (B, H, S, D), dtype)
  vc = _rand(ks[2], (B, H, S, D), dtype)
  kt = _rand(ks[3], (B, H, Tt, D), dtype)
  vt = _rand(ks[4], (B, H, Tt, D), dtype)
  len_c = jnp.array([[1, 64], [30, 47]], jnp.int32)
  len_t = jnp.array([[3, 16], [1, 9]], jnp.int32)   # append-only tail
  out_c, lse_c = sparse_decode_attention(q, kc, vc, len_c, block_k=16,
                                         num_splits=2, interpret=True)
  out_t, lse_t = sparse_decode_attention_reference(q, kt, vt, len_t)
  out, lse = merge_attention(out_c, lse_c, out_t, lse_t)
  assert out.dtype == dtype and lse.dtype == jnp.float32

  k_all = jnp.concatenate([kc, kt], axis=2)
  v_all = jnp.concatenate([vc, vt], axis=2)
  pos = np.arange(S + Tt)[None, None, :]
  mask = np.where(pos < S, pos < np.asarray(len_c)[..., None],
                  (pos - S) < np.asarray(len_t)[..., None])
  want_out, want_lse = _np_attention(np.asarray(q, np.float32),
                                     np.asarray(k_all, np.float32),
                                     np.asarray(v_all, np.float32), mask,
                                     1 / math.sqrt(D))
  tol = TOL[dtype]
  np.testing.assert_allclose(np.asarray(out, np.float32), want_out,
                             atol=tol["out"], rtol=tol["out"])
  np.testing.assert_allclose(lse, want_lse, atol=tol["lse"], rtol=tol["lse"])
  if dtype == jnp.float32:
    # Exactness of the merge itself (reference parts, float32).
    ro_c, rl_c = sparse_decode_attention_reference(q, kc, vc, len_c)
    mo, ml = merge_attention(ro_c, rl_c, out_t, lse_t)
    np.testing.assert_allclose(mo, want_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ml, want_lse, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------
# pooled_scores

POOLED_CASES = [
    # B, Hkv, W, G, D,  T,  dtype,        block_t, gqa
    (2, 2, 2, 3, 64, 200, jnp.float32, 32, "max"),
    (1, 1, 3, 4, 128, 100, jnp.float32, 16, "mean"),
    (1, 2, 2, 8, 64, 130, jnp.bfloat16, 64, "max"),
]


@pytest.mark.parametrize("B,H,W,G,D,T,dtype,block_t,gqa", POOLED_CASES)
def test_pooled_interpret_matches_reference(B, H, W, G, D, T, dtype, block_t,
                                            gqa):
  ks = _keys(T + G + W, 2)
  q = _rand(ks[0], (B, H, W, G, D), dtype, 3.0)
  k = _rand(ks[1], (B, H, T, D), dtype)
  lengths = _ragged_lengths(np.random.default_rng(T), B, H, T)
  got = pooled_scores(q, k, lengths, gqa=gqa, block_t=block_t, interpret=True)
  want = pooled_scores_reference(q, k, lengths, gqa=gqa)
  assert got.shape == (B, H, W, T) and got.dtype == jnp.float32
  valid = np.broadcast_to(
      np.arange(T)[None, None, None, :] < np.asarray(lengths)[:, :, None, None],
      (B, H, W, T))
  np.testing.assert_array_equal(np.asarray(got)[~valid], np.float32(MASK_VALUE))
  # Scores are probabilities (<= 1): absolute tolerance.
  atol = 1e-6 if dtype == jnp.float32 else 1e-5
  np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid],
                             atol=atol, rtol=1e-4)


@pytest.mark.parametrize("gqa", ["max", "mean"])
def test_pooled_reference_matches_numpy(gqa):
  B, H, W, G, T, D, L = 1, 1, 2, 3, 11, 16, 9
  rng = np.random.default_rng(0)
  q = rng.normal(size=(B, H, W, G, D)).astype(np.float32) * 2
  k = rng.normal(size=(B, H, T, D)).astype(np.float32)
  got = np.asarray(pooled_scores_reference(jnp.asarray(q), jnp.asarray(k),
                                           jnp.array([[L]], jnp.int32),
                                           gqa=gqa))
  want = np.full((W, T), MASK_VALUE, np.float64)
  for w in range(W):
    rows = []
    for g in range(G):
      s = k[0, 0, :L].astype(np.float64) @ q[0, 0, w, g] / math.sqrt(D)
      p = np.exp(s - s.max())
      p /= p.sum()
      rows.append(np.convolve(p, np.ones(5) / 5, mode="same"))  # zero pad 2
    want[w, :L] = np.max(rows, 0) if gqa == "max" else np.mean(rows, 0)
  np.testing.assert_allclose(got[0, 0], want, rtol=1e-5, atol=1e-7)


def test_shared_scoring_pieces_by_hand():
  """The pieces every pooled score is built from (the reference, the policies' window scores,
  SyncKV's query scores): hand-computed values."""
  x = jnp.array([5.0, 0, 0, 0, 0, 0, 10])
  np.testing.assert_allclose(pk.avg_pool(x), [1, 1, 1, 0, 2, 2, 2])  # zero padding counts in the mean
  np.testing.assert_allclose(pk.avg_pool(x, 3), [5 / 3, 5 / 3, 0, 0, 0, 10 / 3, 10 / 3], rtol=1e-6)
  s = jnp.array([[0.0, math.log(3.0), 7.0], [1.0, 2.0, 3.0]])
  p = np.asarray(pk.masked_softmax(s, jnp.array([[True, True, False], [False, False, False]])))
  np.testing.assert_allclose(p, [[0.25, 0.75, 0.0], [0.0, 0.0, 0.0]], rtol=1e-6)  # nothing visible: zeros
  g = jnp.array([[1.0, 4.0], [3.0, 2.0]])
  np.testing.assert_array_equal(pk.gqa_reduce(g, "max", axis=0), [3.0, 4.0])
  np.testing.assert_array_equal(pk.gqa_reduce(g, "mean", axis=1), [2.5, 2.5])
  with pytest.raises(ValueError, match="'max' or 'mean'"):
    pk.gqa_reduce(g, "sum", axis=0)


def test_pooled_reference_ignores_keys_beyond_length():
  """Keys at t >= L never reach a valid score (the reference does not mask
  them before the dot): NaN there changes nothing."""
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.normal(size=(1, 2, 2, 3, 16)).astype(np.float32))
  k = rng.normal(size=(1, 2, 40, 16)).astype(np.float32)
  lens = jnp.array([[40, 23]], jnp.int32)
  kn = k.copy()
  kn[0, 1, 23:] = np.nan
  a = pooled_scores_reference(q, jnp.asarray(k), lens)
  b = pooled_scores_reference(q, jnp.asarray(kn), lens)
  np.testing.assert_array_equal(a, b)
  assert np.isfinite(np.asarray(b)).all()


def test_pooled_degenerate_arguments():
  """W = 0 or T = 0 (or B = 0) gives an empty [B, Hkv, W, T] array from the kernel and the reference alike (the
  kernel raised ZeroDivisionError / TypeError, the reference a reduction error); G = 0 (no query head to
  aggregate) and a q_rows of the wrong rank get a ValueError naming them."""
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, 2, 2, 3, 16)).astype(np.float32))
  k = jnp.asarray(rng.normal(size=(1, 2, 20, 16)).astype(np.float32))
  for fn in (lambda *a, **kw: pooled_scores(*a, interpret=True, **kw), pooled_scores_reference):
    for gqa in ("max", "mean"):
      for qq, kk in ((q[:, :, :0], k), (q, k[:, :, :0]), (q[:0], k[:0])):
        got = fn(qq, kk, gqa=gqa)
        assert got.shape == qq.shape[:3] + (kk.shape[2],) and got.dtype == jnp.float32
      with pytest.raises(ValueError, match="G >= 1 query heads"):
        fn(q[:, :, :, :0], k, gqa=gqa)
      with pytest.raises(ValueError, match=r"q_rows must be \[B, Hkv, W, G, D\]"):
        fn(q[:, :, 0], k, gqa=gqa)


def test_overlap_bitmap_matches_python_sets():
  rng = np.random.default_rng(5)
  T, lead, ka, kb = 50, (2, 3), 7, 5
  a = np.stack([rng.choice(T, ka, replace=False) for _ in range(6)])
  b = np.stack([rng.choice(T, kb, replace=False) for _ in range(6)])
  b[0, :] = a[0, :kb]            # full overlap
  b[1, -2:] = -1                 # padding entries are not members
  a[2, 0] = T + 3                # out of range is not a member
  got = np.asarray(overlap_bitmap(jnp.asarray(a.reshape(*lead, ka)),
                                  jnp.asarray(b.reshape(*lead, kb)), T))
  assert got.shape == lead
  for i in range(6):
    sa = {int(x) for x in a[i] if 0 <= x < T}
    sb = {int(x) for x in b[i] if 0 <= x < T}
    want = len(sa & sb) / min(len(sa), len(sb))
    assert got.reshape(-1)[i] == pytest.approx(want)
  assert got.reshape(-1)[0] == 1.0


# ---------------------------------------------------------------------------
# top-k membership without a sort (drift check)


def _numpy_topk(scores, k):
  """Indices of the k largest of a row [T], ties to the lower index; +0.0
  ranks above -0.0 (lax.top_k's total order)."""
  x = np.asarray(scores, np.float64)
  order = np.lexsort((np.arange(x.size), np.signbit(x), -x))
  return order[:k]


@pytest.fixture(params=["bisection", "sort"], scope="module")
def kth_path(request):
  """Both ways to the k-th largest key: the bisection (the CPU's) and one sort per row (what the Pallas
  backend, a GPU, traces): a function giving the context to run under. The choice is read at trace time,
  so jax's trace caches are cleared before and after each way's tests."""
  jax.clear_caches()
  yield lambda: pk.use_kernels("pallas" if request.param == "sort" else "reference")
  jax.clear_caches()


def _check_membership(scores, k, idx):
  scores = np.asarray(scores, np.float32)
  got = np.asarray(topk_membership(jnp.asarray(scores), k, jnp.asarray(idx)))
  kth, n_gt = (np.asarray(a) for a in topk_threshold(jnp.asarray(scores), k))
  lax_idx = np.asarray(jax.lax.top_k(jnp.asarray(scores), k)[1])
  for r in np.ndindex(scores.shape[:-1]):
    top = set(_numpy_topk(scores[r], k).tolist())
    assert set(lax_idx[r].tolist()) == top     # lax.top_k: lower index first
    want = [int(j) in top for j in idx[r]]
    np.testing.assert_array_equal(got[r], want, err_msg=f"row {r}")
    x = scores[r]
    assert kth[r] == x[_numpy_topk(x, k)[-1]]
    above = (x > kth[r]) | ((x == kth[r]) & ~np.signbit(x) & np.signbit(kth[r]))
    assert n_gt[r] == int(above.sum())                # +0.0 is above -0.0


# Few distinct values, so that most rows have ties at the k-th largest.
_VALUES = [MASK_VALUE, -3.5, -0.0, 0.0, 1e-30, 0.125, 0.125, 0.5, 0.75,
           1.0, 3e4]


def _draw_scores(data, rows):
  """float32 [rows, T] for T in a few lengths (each compiles once), tied at few values or not."""
  T = data.draw(st.sampled_from([1, 6, 40]))
  tied = data.draw(st.booleans())
  elem = (st.sampled_from(_VALUES) if tied else
          st.floats(-1e6, 1e6, allow_nan=False, width=32))
  return np.array(data.draw(st.lists(elem, min_size=rows * T, max_size=rows * T)),
                  np.float32).reshape(rows, T)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_topk_membership_matches_lax_top_k(kth_path, data):
  # few shapes (each k and T compiles once); rows tied or not
  with kth_path():
    _membership_case(data)


def test_base_overlap_with_an_l_base_per_row_equals_each_row_alone(kth_path):
  """base_overlap with L_base per row (a batch of prompts with their own L_base, K_base padded with -1 to the
  largest) gives each row what it gives alone with its static L_base: rows with ties across the cut and
  without, L_base 1 to the whole prompt."""
  rng = np.random.default_rng(4)
  B, H, W, T, K = 2, 3, 4, 24, 9
  scores = rng.standard_normal((B, H, W, T)).astype(np.float32)
  scores[0, 1] = np.round(scores[0, 1])  # ties at most cuts
  lengths = np.array([[T, T, T], [T - 5, T - 5, T - 5]], np.int32)
  scores = np.where(np.arange(T) < lengths[..., None, None], scores, MASK_VALUE).astype(np.float32)
  sizes = np.array([[K, 4, 1], [7, T - 5, 2]])  # T - 5 > K: the whole prompt, K_base capped at K
  k_base = np.full((B, H, K), -1, np.int32)
  for b, h in np.ndindex(B, H):
    n = min(sizes[b, h], K)
    k_base[b, h, :n] = rng.permutation(lengths[b, h])[:n]
  with kth_path():
    got = np.asarray(pk.base_overlap(jnp.asarray(scores), jnp.asarray(k_base), jnp.asarray(sizes),
                                     jnp.asarray(lengths)))
    for b, h in np.ndindex(B, H):
      n = int(sizes[b, h])
      want = pk.base_overlap(jnp.asarray(scores[b : b + 1, h : h + 1]), jnp.asarray(k_base[b : b + 1, h : h + 1]),
                             n, jnp.asarray(lengths[b : b + 1, h : h + 1]))
      np.testing.assert_allclose(got[b, h], np.asarray(want)[0, 0], atol=1e-6, err_msg=f"row {b, h}, L_base {n}")


def _membership_case(data):
  rows, n_idx = 2, 12
  scores = _draw_scores(data, rows)
  T = scores.shape[-1]
  k = data.draw(st.integers(1, T))
  idx = np.array(data.draw(st.lists(st.integers(-2, T + 2),
                                    min_size=rows * n_idx,
                                    max_size=rows * n_idx)),
                 np.int32).reshape(rows, n_idx)
  _check_membership(scores, k, idx)


@pytest.mark.parametrize("scores,k", [
    ([2.0, 2.0, 2.0, 2.0, 2.0, 2.0], 3),            # all tied: the first 3
    ([1.0, 5.0, 3.0, 3.0, 3.0, 0.0, 3.0], 3),       # 2 of the four 3.0s
    ([3.0, 5.0, 3.0, 3.0, 9.0, 3.0], 2),            # no tie at the boundary
    ([0.0, -0.0, 0.0, -0.0, 1.0], 3),               # -0 ranks below +0
    ([-0.0, 0.0, -0.0, 0.0, 1.0], 2),
    ([MASK_VALUE] * 3 + [0.5, MASK_VALUE], 3),  # k beyond the valid
    ([-1.0, -2.0, -1.0, -3.0], 2),                  # negatives
])
def test_topk_membership_ties(kth_path, scores, k):
  scores = np.array([scores], np.float32)
  T = scores.shape[-1]
  with kth_path():
    _check_membership(scores, k, np.arange(-1, T + 1, dtype=np.int32)[None])


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_topk_sets_are_lax_top_k_sets(kth_path, data):
  # each row's sets for several sizes: the numpy top-k (ties to the lower index, +0 above -0), ascending
  rows, K = 2, 3
  scores = _draw_scores(data, rows)
  T = scores.shape[-1]
  cap = data.draw(st.integers(1, T))
  sizes = np.array(data.draw(st.lists(st.integers(0, cap), min_size=rows * K, max_size=rows * K)),
                   np.int32).reshape(rows, K)
  with kth_path():
    got = np.asarray(topk_sets(jnp.asarray(scores), jnp.asarray(sizes), cap))
  assert got.shape == (rows, K, cap)
  for r in range(rows):
    for j, k in enumerate(sizes[r]):
      want = np.sort(_numpy_topk(scores[r], k))
      np.testing.assert_array_equal(got[r, j], np.r_[want, np.full(cap - k, -1)], err_msg=f"row {r} k {k}")


def test_normalised_overlap():
  # o = 6/8 with chance 8/32: (0.75 - 0.25) / 0.75; L <= L_base: 1
  got = np.asarray(normalised_overlap(jnp.array([6, 2, 0, 3]), 8,
                                      jnp.array([32, 32, 8, 5])))
  np.testing.assert_allclose(got, [2 / 3, 0.0, 1.0, 1.0], rtol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_drift_check_constructed(backend):
  """Head 0: no change; head 1: every step moved; head 2: 2 of 5 steps moved
  (median still stable); head 3: 3 of 5 moved (median drifted)."""
  T, D, G, W, L_base = 64, 64, 2, 5, 8
  rng = np.random.default_rng(1)
  keys = rng.normal(size=(1, 4, T, D)).astype(np.float32)
  x_a, x_b = 12, 48                                  # far apart

  def q_for(h, x):
    return np.stack([3.0 * keys[0, h, x], 2.5 * keys[0, h, x]])   # [G, D]

  moved = [[], list(range(W)), [1, 3], [0, 2, 4]]
  q_buf = np.zeros((1, 4, W, G, D), np.float32)
  q_base = np.zeros((1, 4, 1, G, D), np.float32)
  for h in range(4):
    q_base[0, h, 0] = q_for(h, x_a)
    for w in range(W):
      q_buf[0, h, w] = q_for(h, x_b if w in moved[h] else x_a)
  base_scores = pooled_scores_reference(jnp.asarray(q_base), jnp.asarray(keys))
  k_base = jax.lax.top_k(base_scores[:, :, 0], L_base)[1]          # [1, 4, 8]

  drift, ov, scores = drift_check(jnp.asarray(q_buf), jnp.asarray(keys),
                                  k_base, L_base, 0.5, backend=backend)
  np.testing.assert_array_equal(drift, [[False, True, False, True]])
  assert ov.shape == (1, 4) and scores.shape == (1, 4, T)
  # unmoved medians are the same set (1); moved ones share nothing with K_base
  # (below chance c = 8/64: -c / (1 - c))
  np.testing.assert_allclose(ov[0, [0, 2]], 1.0)
  np.testing.assert_allclose(ov[0, [1, 3]], -1 / 7, rtol=1e-6)
  want_last = pooled_scores_reference(jnp.asarray(q_buf[:, :, -1:]),
                                      jnp.asarray(keys))[:, :, 0]
  np.testing.assert_allclose(scores, want_last, atol=1e-6)


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), L_base=st.integers(1, 48),
       shift=st.floats(0.0, 3.0))
def test_drift_check_matches_topk_definition(seed, L_base, shift):
  """drift_check (no top-k) vs the definition: lax.top_k of every step and
  overlap_bitmap, on ragged lengths (some shorter than L_base)."""
  rng = np.random.default_rng(seed)
  B, H, W, G, D, T = 2, 3, 5, 2, 16, 48
  keys = rng.normal(size=(B, H, T, D)).astype(np.float32)
  q = (shift * rng.normal(size=(B, H, W, G, D))).astype(np.float32)
  lens = rng.integers(1, T + 1, size=(B, H)).astype(np.int32)
  base_q = rng.normal(size=(B, H, 1, G, D)).astype(np.float32)
  s0 = pooled_scores_reference(jnp.asarray(base_q), jnp.asarray(keys),
                               jnp.asarray(lens))[:, :, 0]
  vals, k_base = jax.lax.top_k(s0, L_base)
  k_base = jnp.where(vals > MASK_VALUE * 0.5, k_base, -1)
  tau = 0.3
  got = drift_check(jnp.asarray(q), jnp.asarray(keys), k_base, L_base, tau,
                    jnp.asarray(lens), backend="reference")
  want = drift_check_reference(jnp.asarray(q), jnp.asarray(keys), k_base,
                               L_base, tau, jnp.asarray(lens))
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(got[2], want[2])
  # and against numpy sets, step by step
  s = np.asarray(pooled_scores_reference(jnp.asarray(q), jnp.asarray(keys),
                                         jnp.asarray(lens)))
  for b, h in np.ndindex(B, H):
    L = int(lens[b, h])
    base = {int(x) for x in np.asarray(k_base[b, h]) if 0 <= x < L}
    o = []
    c = L_base / L
    for w in range(W):
      top = {int(x) for x in _numpy_topk(s[b, h, w], L_base) if x < L}
      o.append(1.0 if c >= 1 else (len(top & base) / L_base - c) / (1 - c))
    # float32 rounding of o and c, divided by 1 - c (as small as 1/48 here)
    tol = 1e-6 if c >= 1 else 1e-6 / (1 - c)
    assert got[1][b, h] == pytest.approx(np.median(o), abs=tol)


# ---------------------------------------------------------------------------
# backend switch


def test_backend_switch(monkeypatch):
  monkeypatch.delenv(pk.ENV_VAR, raising=False)
  assert pk.use_kernels() in ("pallas", "reference")
  assert pk.resolve_backend(native=True) in ("pallas", "native")  # auto: the CPU's pool attention is native
  if not pk.gpu_available():
    assert pk.use_kernels() == "reference"          # auto on CPU
  monkeypatch.setenv(pk.ENV_VAR, "interpret")
  assert pk.use_kernels() == "interpret"
  with pk.use_kernels("reference"):
    assert pk.use_kernels() == "reference"
  assert pk.use_kernels() == "interpret"
  monkeypatch.setenv(pk.ENV_VAR, "bogus")
  with pytest.raises(ValueError):
    pk.use_kernels()
  monkeypatch.setenv(pk.ENV_VAR, "reference")

  q, k, v = _decode_qkv(2)
  lengths = jnp.array([[5, 64], [1, 40]], jnp.int32)
  ref = pk.decode_attention(q, k, v, lengths)
  got = pk.decode_attention(q, k, v, lengths, backend="interpret", block_k=16,
                            num_splits=2)
  for a, b in zip(ref, got):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------------------
# CUDA lowering without a GPU


# name, B, Hkv, G, D, S
MODEL_SHAPES = [
    ("smollm2-135m", 1, 3, 3, 64, 8192),
    ("llama-3.1-8b", 1, 8, 4, 128, 131072),
]


@pytest.mark.parametrize("name,B,H,G,D,S", MODEL_SHAPES)
def test_decode_lowers_to_triton_for_cuda(verified_triton_modules, name, B, H,
                                          G, D, S):
  sds = jax.ShapeDtypeStruct
  for dtype in (jnp.bfloat16, jnp.float32):
    args = (sds((B, H, G, D), dtype), sds((B, H, S, D), dtype),
            sds((B, H, S, D), dtype), sds((B, H), jnp.int32))
    txt = lower_cuda(lambda *a: sparse_decode_attention(*a), *args)
    assert TRITON_CALL in txt, name
    # The dispatcher with backend="pallas" lowers to the same kernel.
    txt = lower_cuda(lambda *a: pk.decode_attention(*a, backend="pallas"),
                      *args)
    assert TRITON_CALL in txt, name
  assert verified_triton_modules and all(verified_triton_modules)


@pytest.mark.parametrize("name,B,H,G,D,S", MODEL_SHAPES)
def test_pooled_and_drift_lower_to_triton_for_cuda(verified_triton_modules,
                                                   name, B, H, G, D, S):
  sds = jax.ShapeDtypeStruct
  T = min(S, 32768)
  W = 5
  q = sds((B, H, W, G, D), jnp.bfloat16)
  keys = sds((B, H, T, D), jnp.bfloat16)
  lens = sds((B, H), jnp.int32)
  for gqa in ("max", "mean"):
    txt = lower_cuda(lambda a, b, c: pooled_scores(a, b, c, gqa=gqa), q,
                      keys, lens)
    assert TRITON_CALL in txt, name
  kbase = sds((B, H, 64), jnp.int32)
  txt = lower_cuda(
      lambda a, b, c: drift_check(a, b, c, 64, 0.5, backend="pallas"), q,
      keys, kbase)
  assert TRITON_CALL in txt, name
  assert verified_triton_modules and all(verified_triton_modules)


def test_model_greedy_output_same_with_kernels_forced_in_interpret_mode(monkeypatch):
  """The model's decode path through the Pallas kernel (interpret mode) vs the jnp reference."""
  import numpy as np

  import pallas_kernels
  from hetero_jax.model import transformer as M
  from hetero_jax.model import spec
  from hetero_jax.model.config import ModelConfig
  from hetero_jax.runtime import prefill

  cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=6, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
  params = jax.tree.map(jnp.asarray, spec.init_params(cfg, seed=1, scale=0.3))
  prompt = np.random.default_rng(0).integers(0, 64, size=21).tolist()

  def greedy(backend):
    with pallas_kernels.use_kernels(backend):
      # a fresh function object: jit caches traces per function, and the backend is read at trace time
      step = jax.jit(lambda p, c, t: M.decode_step(p, c, t, cfg))
      logits, cache = prefill(params, cfg, [prompt], tail_capacity=8)
      toks, all_logits = [], []
      tok = jnp.argmax(logits, -1).astype(jnp.int32)
      for _ in range(6):
        toks.append(int(tok[0]))
        logits, cache = step(params, cache, tok)
        all_logits.append(np.asarray(logits[0]))
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
    return toks, np.stack(all_logits)

  calls = []
  kernel = pallas_kernels.pool_attention_pallas
  monkeypatch.setattr(pallas_kernels, "pool_attention_pallas",
                      lambda *a, **k: calls.append(k.get("interpret")) or kernel(*a, **k))
  ref_toks, ref_logits = greedy("reference")
  assert calls == []
  ker_toks, ker_logits = greedy("interpret")
  assert len(calls) == cfg.num_layers and all(calls)  # one kernel call per layer: every head, prompt and tail
  assert ker_toks == ref_toks
  np.testing.assert_allclose(ker_logits, ref_logits, atol=1e-4, rtol=0)
  nat_toks, nat_logits = greedy("native")  # the CPU kernel the runtime picks on a CPU
  assert len(calls) == cfg.num_layers and nat_toks == ref_toks
  np.testing.assert_allclose(nat_logits, ref_logits, atol=1e-4, rtol=0)
