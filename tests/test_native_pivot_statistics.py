"""The native CPU pivot statistics (pallas_kernels.native, a C++ XLA FFI call): pooled scores against numpy's
softmax / pooling / GQA max, o'_t against the top-L_base set by numpy's stable ranking of the scores the kernel
returned (lax.top_k's order: ties to the lower position), and both against pivot_statistics_reference (jnp).
Nothing is skipped when the kernel is unavailable: `make install` builds it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pallas_kernels
from pallas_kernels import native
from pallas_kernels._util import MASK_VALUE
from pallas_kernels.pool_attention import pivot_statistics_reference


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
  assert native.available(), f"native kernels unavailable: {native.unavailable_reason()}"


def np_scores(logits, n):
  """logits [G, T] float64 -> softmax over [0, n), 5-tap zero-padded average, max over G; MASK_VALUE at t >= n."""
  G, T = logits.shape
  out = np.full(T, MASK_VALUE)
  if n == 0:
    return out
  x = logits[:, :n] - logits[:, :n].max(axis=1, keepdims=True)
  p = np.exp(x) / np.exp(x).sum(axis=1, keepdims=True)
  pad = np.pad(p, ((0, 0), (2, 2)))
  pooled = sum(pad[:, i:i + n] for i in range(5)) / 5
  out[:n] = pooled.max(axis=0)
  return out


def np_overlap(scores, k_base, length):
  """Eq. 9 normalised by the definition: the top-L set by a stable ranking (ties to the lower position) of all
  T scores, L = the K_base entries >= 0, members among those below ``length``."""
  L = int((k_base >= 0).sum())
  top = set(np.argsort(-scores.astype(np.float64), kind="stable")[:min(L, scores.size)].tolist())
  inter = len(top & {int(p) for p in k_base if 0 <= p < length})
  c = L / max(length, 1)
  return 1.0 if c >= 1 else (inter / max(L, 1) - c) / (1 - c)


def make_case(seed, B, Hp, G, T, lengths, K, ties=False):
  rng = np.random.default_rng(seed)
  logits = rng.standard_normal((B, Hp, G, T)).astype(np.float32) * 3
  if ties:  # equal logits: equal pooled scores everywhere but the two rows at each end, so ties cross the cut
    logits = np.round(logits / 8).astype(np.float32) * 0 + 1.5
  lengths = np.asarray(lengths, np.int32).reshape(B, Hp)
  k_base = np.full((B, Hp, K), -1, np.int32)
  for b in range(B):
    for h in range(Hp):
      own = int(rng.integers(0, K + 1))
      k_base[b, h, :own] = rng.choice(T, size=own, replace=False)  # some past the length: never members
  return logits, lengths, k_base


def check(logits, lengths, k_base):
  scores, overlap = jax.jit(native.pivot_statistics_native)(logits, lengths, k_base)
  scores, overlap = np.asarray(scores), np.asarray(overlap)
  B, Hp, G, T = logits.shape
  assert scores.shape == (B, Hp, T) and overlap.shape == (B, Hp)
  for b in range(B):
    for h in range(Hp):
      n = int(np.clip(lengths[b, h], 0, T))
      want = np_scores(logits[b, h].astype(np.float64), n)
      np.testing.assert_allclose(scores[b, h], want, rtol=2e-6, atol=1e-12)
      assert np.all(scores[b, h, n:] == np.float32(MASK_VALUE))
      # float32 rounding, amplified by 1 / (1 - c); one member more or less moves it by 1 / (L (1 - c))
      np.testing.assert_allclose(overlap[b, h], np_overlap(scores[b, h], k_base[b, h], int(lengths[b, h])),
                                 rtol=1e-5, atol=1e-6)
  return scores, overlap


@pytest.mark.parametrize("G", [1, 4, 7])
@pytest.mark.parametrize("T", [1, 17, 130])
def test_matches_numpy(G, T):
  lens = [T, max(T - 5, 0), 1, 0, (T + 1) // 2, T][: 2 * 3]
  check(*make_case(G * 1000 + T, 2, 3, G, T, lens, K=max(1, T // 3)))


def test_a_tie_across_the_cut_keeps_the_lower_positions():
  """Equal logits: the pooled scores tie on every row but two at each end, so the top-L cut runs through a tie and
  only the lowest tied positions are members (lax.top_k's order)."""
  logits, lengths, k_base = make_case(7, 1, 2, 3, 64, [64, 50], K=20, ties=True)
  k_base[0, 0] = np.arange(44, 64)  # L = 20 of 60 tied positions: the members are 2..21, none of these
  k_base[0, 1] = np.arange(2, 22)   # all of them members
  scores, overlap = check(logits, lengths, k_base)
  assert len(set(scores[0, 0, 2:62].tolist())) == 1
  c0, c1 = 20 / 64, 20 / 50
  np.testing.assert_allclose(overlap[0], [(0 - c0) / (1 - c0), 1.0], atol=1e-6)


def test_equals_the_jnp_reference():
  """The overlaps are the reference's exactly (random scores: no near tie at the cut), the scores within ulps."""
  logits, lengths, k_base = make_case(3, 3, 2, 3, 7900, [7900, 4000, 7899, 1, 300, 7000], K=1185)
  got = native.pivot_statistics_native(logits, lengths, k_base)
  want = pivot_statistics_reference(jnp.asarray(logits), jnp.asarray(lengths), jnp.asarray(k_base))
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=2e-6, atol=1e-12)
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  with pallas_kernels.use_kernels("native"):  # the dispatcher picks the kernel
    assert pallas_kernels.native_statistics()
    np.testing.assert_array_equal(np.asarray(pallas_kernels.pivot_statistics(logits, lengths, k_base)[1]),
                                  np.asarray(got[1]))
  with pallas_kernels.use_kernels("reference"):
    assert not pallas_kernels.native_statistics()


def test_vmap_and_errors():
  logits, lengths, k_base = make_case(5, 2, 2, 3, 40, [40, 30, 20, 10], K=9)
  stacked = [np.stack([a, a[::-1]]) for a in (logits, lengths, k_base)]
  got = jax.jit(jax.vmap(native.pivot_statistics_native))(*stacked)
  for i in range(2):
    want = native.pivot_statistics_native(*(a[i] for a in stacked))
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g[i]), np.asarray(w))
  with pytest.raises(ValueError, match=r"logits must be \[B, Hp, G, T\]"):
    native.pivot_statistics_native(logits[0], lengths, k_base)
  with pytest.raises(ValueError, match=r"lengths must be \[B, Hp\]"):
    native.pivot_statistics_native(logits, lengths[:, :1], k_base)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 3), Hp=st.integers(1, 3), G=st.sampled_from([1, 2, 3, 7]), T=st.integers(1, 300),
       seed=st.integers(0, 10_000), ties=st.booleans(), data=st.data())
def test_property_random_shapes(B, Hp, G, T, seed, ties, data):
  lens = data.draw(st.lists(st.integers(0, T), min_size=B * Hp, max_size=B * Hp))
  K = data.draw(st.integers(1, T))
  check(*make_case(seed, B, Hp, G, T, lens, K, ties=ties))


def np_top_positions(scores, k):
  """lax.top_k's set of size k by a stable sort of IEEE total-order keys (-0.0 below +0.0, ties to the lower
  position), ascending."""
  bits = scores.astype(np.float32).view(np.uint32).astype(np.int64)
  key = np.where(bits >> 31 == 1, (~bits) & 0xFFFFFFFF, bits | 0x80000000)
  return np.sort(np.argsort(-key, kind="stable")[:k])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 4), K=st.integers(1, 4), T=st.integers(1, 200), tied=st.booleans(), data=st.data())
def test_topk_sets_are_lax_top_k_sets(rows, K, T, tied, data):
  """Each size's set is lax.top_k's (ties to the lower position, -0 below +0, MASK_VALUE rows), ascending, -1
  past the size; sizes of 0 and the cap included."""
  values = [0.0, -0.0, 1.0, 2.5, -3.0, MASK_VALUE] if tied else None
  elem = st.sampled_from(values) if tied else st.floats(-1e6, 1e6, allow_nan=False, width=32)
  scores = np.array(data.draw(st.lists(elem, min_size=rows * T, max_size=rows * T)), np.float32).reshape(rows, T)
  cap = data.draw(st.integers(1, T))
  sizes = np.array(data.draw(st.lists(st.integers(0, cap), min_size=rows * K, max_size=rows * K)),
                   np.int32).reshape(rows, K)
  got = np.asarray(jax.jit(native.topk_sets_native, static_argnums=2)(scores, sizes, cap))
  assert got.shape == (rows, K, cap)
  for r in range(rows):
    for j, k in enumerate(sizes[r]):
      want = np_top_positions(scores[r], k)
      np.testing.assert_array_equal(got[r, j], np.r_[want, np.full(cap - k, -1)], err_msg=f"row {r} k {k}")
    np.testing.assert_array_equal(got[r], np.asarray(pallas_kernels.topk_sets_xla(scores[r], sizes[r], cap)))


def test_topk_sets_at_a_check_s_size_equal_the_xla_sets():
  """Fourteen pivots of 7,900 prompt rows with masked tails, sizes up to 1,185: the dispatcher's native sets equal
  the XLA implementation's (bisection and compaction)."""
  rng = np.random.default_rng(1)
  scores = rng.random((1, 14, 7900)).astype(np.float32)
  scores[0, 3, 7000:] = MASK_VALUE
  sizes = np.tile(np.array([1185, 1185, 600, 0], np.int32), (1, 14, 1))
  with pallas_kernels.use_kernels("native"):
    got = pallas_kernels.topk_sets(scores, sizes, 1185)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(pallas_kernels.topk_sets_xla(scores, sizes, 1185)))
