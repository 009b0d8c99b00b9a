"""The native pool attention with the scored heads' drift statistics in the same call
(``pallas_kernels.native.pool_attention_statistics_native``): out and lse against the plain-JAX pool attention,
scores and o'_t against ``pivot_statistics_reference`` on the reference's logits, and against the two native
calls it replaces (the attention's logits, then ``pivot_statistics_native``): out and lse equal, scores within
a few ulps (the fused call takes the softmax from the attention's own exponentials), and o'_t exactly what
``pallas_kernels.base_overlap`` gives on the scores returned, at odd GQA ratios, head
lengths around the kernel's block, heads of length 0 and 1, statistics over fewer rows than the query sees
(the pivots' prompt rows, the generated tail after them), split heads merged on several threads, a bfloat16
pool, vmap, and the errors. Nothing is skipped when the kernel is unavailable: `make install` builds it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import native
from pallas_kernels.pool_attention import pool_attention_statistics_reference


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
  assert native.available(), f"native kernels unavailable: {native.unavailable_reason()}"


def make_case(seed, B, H, G, D, cap, slots, dtype=np.float32, K=40):
  """A pool of H regions of cap + 16 rows each (NaN between regions: a read outside a head's rows shows), head
  lengths around the kernel's 64-row block and 0 / 1, statistics over up to 3 rows fewer (the tail after the
  prompt rows), K_base rows of their own sizes with -1 after them and some positions past the length."""
  rng = np.random.default_rng(seed)
  stride = cap + 16
  k = rng.standard_normal((B, H * stride, D)).astype(np.float32)
  v = rng.standard_normal((B, H * stride, D)).astype(np.float32)
  lengths = rng.integers(0, cap + 1, (B, H))
  picks = [0, 1, 63, 65, cap]
  for b in range(B):
    for h in range(H):
      if (b + h) % 2 == 0:
        lengths[b, h] = picks[(b * H + h) % len(picks)]
      k[b, h * stride + lengths[b, h]:(h + 1) * stride] = np.nan
      v[b, h * stride + lengths[b, h]:(h + 1) * stride] = np.nan
  offsets = np.broadcast_to(np.arange(H) * stride, (B, H))
  q = (rng.standard_normal((B, H, 1, G, D)) * 2).astype(np.float32)
  Hs = len(slots)
  stat_lengths = np.maximum(lengths[:, list(slots)] - rng.integers(0, 4, (B, Hs)), 0)
  k_base = np.full((B, Hs, K), -1, np.int32)
  for b in range(B):
    for r in range(Hs):
      own = int(rng.integers(0, K + 1))
      k_base[b, r, :own] = np.sort(rng.choice(cap, size=own, replace=False))
  as_j = lambda a, t=jnp.int32: jnp.asarray(a, t)  # noqa: E731
  return (as_j(q, dtype), as_j(k, dtype), as_j(v, dtype), as_j(offsets), as_j(lengths), as_j(stat_lengths),
          as_j(k_base))


def assert_matches_two_calls(got, pair, stat_lengths, k_base):
  """out and lse equal to the two calls', scores within a few ulps of theirs (a different but equally exact
  softmax), MASK_VALUE at the same places, and o'_t exactly the overlap of the scores returned (Eq. 9 by
  ``pallas_kernels.base_overlap``, lax.top_k's set)."""
  for g, p in zip(got[:2], pair[:2]):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(p))
  scores, want = np.asarray(got[2]), np.asarray(pair[2])
  np.testing.assert_array_equal(scores == pallas_kernels.MASK_VALUE, want == pallas_kernels.MASK_VALUE)
  np.testing.assert_allclose(scores, want, rtol=2e-6, atol=1e-30)
  sizes = (np.asarray(k_base) >= 0).sum(-1).astype(np.int32)
  ref = pallas_kernels.base_overlap(jnp.asarray(scores)[:, :, None], k_base, jnp.maximum(sizes, 1), stat_lengths)
  ref = np.where(sizes == 0, np.asarray(pair[3]), np.asarray(ref)[:, :, 0])
  np.testing.assert_array_equal(np.asarray(got[3]), ref)


def two_calls(q, k, v, offsets, lengths, slots, stat_lengths, k_base, score_len, chunk_rows=None):
  """What the fused call replaces: the native attention with the scored heads' logits, then the native statistics."""
  flags = pallas_kernels.score_flags(q.shape[1], slots)
  out, lse, logits = native.pool_attention_native(q, k, v, offsets, lengths, flags, score_len=score_len,
                                                  chunk_rows=chunk_rows)
  scores, overlap = native.pivot_statistics_native(logits[:, list(slots)], stat_lengths, k_base)
  return out, lse, scores, overlap


@pytest.mark.parametrize("G, D, slots", [(1, 64, (0,)), (4, 128, (3, 0)), (7, 64, (2, 4, 1))])
@pytest.mark.parametrize("chunk_rows", [None, 64])
def test_matches_the_reference_and_the_two_native_calls(G, D, slots, chunk_rows):
  B, H, cap = 3, 5, 130
  q, k, v, offsets, lengths, stat_lengths, k_base = make_case(G * 10 + D, B, H, G, D, cap, slots)
  got = jax.jit(lambda *a: native.pool_attention_statistics_native(
      *a[:5], slots, *a[5:], score_len=cap, chunk_rows=chunk_rows))(q, k, v, offsets, lengths, stat_lengths, k_base)
  ref = pool_attention_statistics_reference(q, k, v, offsets, lengths, slots, stat_lengths, k_base,
                                            max_len=cap + 16, score_len=cap)
  assert [g.shape for g in got] == [(B, H, 1, G, D), (B, H, 1, G), (B, len(slots), cap), (B, len(slots))]
  for g, r in zip(got[:3], ref[:3]):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-5, atol=2e-5)
  # o'_t counts set members: the scores' last ulps may move a tie, so the exact check is on the scores returned
  np.testing.assert_allclose(np.asarray(got[3]), np.asarray(ref[3]), atol=0.1)
  pair = two_calls(q, k, v, offsets, lengths, slots, stat_lengths, k_base, cap, chunk_rows)
  assert_matches_two_calls(got, pair, stat_lengths, k_base)
  assert np.isfinite(np.asarray(got[0])).all()


def test_bfloat16_pool_and_a_head_scored_past_its_rows():
  """bfloat16 rows are widened as the plain call widens them; a scored head of length 0 has MASK scores and
  no K_base member; score_len below a head's rows scores only its first score_len rows."""
  B, H, G, D, cap = 2, 3, 3, 64, 200
  slots = (1, 2)
  q, k, v, offsets, lengths, stat_lengths, k_base = make_case(7, B, H, G, D, cap, slots, dtype=jnp.bfloat16)
  lengths = lengths.at[0, 1].set(0)
  stat_lengths = stat_lengths.at[0, 0].set(0)
  for score_len in (cap, 100):
    sl = jnp.minimum(stat_lengths, score_len)
    got = native.pool_attention_statistics_native(q, k, v, offsets, lengths, slots, sl, k_base, score_len=score_len)
    pair = two_calls(q, k, v, offsets, lengths, slots, sl, k_base, score_len)
    assert_matches_two_calls(got, pair, sl, k_base)
    assert (np.asarray(got[2])[0, 0] == pallas_kernels.MASK_VALUE).all()


def test_the_dispatcher_gives_the_same_on_every_cpu_backend():
  """``pallas_kernels.pool_attention_statistics``: native (one call) and reference (attention, then statistics)."""
  B, H, G, D, cap = 2, 4, 4, 64, 90
  slots = (3, 1)
  args = make_case(3, B, H, G, D, cap, slots)
  q, k, v, offsets, lengths, stat_lengths, k_base = args
  outs = {b: pallas_kernels.pool_attention_statistics(q, k, v, offsets, lengths, slots, stat_lengths, k_base,
                                                      max_len=cap + 16, score_len=cap, backend=b)
          for b in ("native", "reference")}
  for a, r in zip(outs["native"][:3], outs["reference"][:3]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=2e-5, atol=2e-5)


def test_vmap_is_one_call_over_the_batched_axes():
  B, H, G, D, cap = 2, 3, 2, 64, 70
  slots = (0, 2)
  cases = [make_case(s, B, H, G, D, cap, slots) for s in (1, 2)]
  stacked = [jnp.stack(x) for x in zip(*cases)]
  f = lambda q, k, v, o, l, sl, kb: native.pool_attention_statistics_native(  # noqa: E731
      q, k, v, o, l, slots, sl, kb, score_len=cap)
  got = jax.vmap(f)(*stacked)
  for i, case in enumerate(cases):
    for g, w in zip(got, f(*case)):
      np.testing.assert_array_equal(np.asarray(g[i]), np.asarray(w))


def test_a_sequence_gives_the_same_bits_alone_in_a_batch_and_on_one_thread(monkeypatch):
  """Heads of up to 1,600 rows, cut into work items on helper threads: each sequence of the batch gets the bits
  it gets alone (out, lse, scores and o'_t), and the batch on one thread those on the pool's threads."""
  B, H, G, D, cap = 2, 3, 3, 64, 1600
  slots = (0, 2)
  q, k, v, offsets, lengths, stat_lengths, k_base = make_case(5, B, H, G, D, cap, slots)
  f = lambda *a: native.pool_attention_statistics_native(*a[:5], slots, *a[5:], score_len=cap)  # noqa: E731
  both = f(q, k, v, offsets, lengths, stat_lengths, k_base)
  assert_matches_two_calls(both, two_calls(q, k, v, offsets, lengths, slots, stat_lengths, k_base, cap),
                           stat_lengths, k_base)
  for b in range(B):
    one = slice(b, b + 1)
    alone = f(q[one], k[one], v[one], offsets[one], lengths[one], stat_lengths[one], k_base[one])
    for x, y in zip(both, alone):
      np.testing.assert_array_equal(np.asarray(x[one]), np.asarray(y))
  monkeypatch.setenv("HETERO_JAX_NATIVE_THREADS", "1")
  for x, y in zip(both, f(q, k, v, offsets, lengths, stat_lengths, k_base)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_errors_name_the_operand():
  B, H, G, D, cap = 1, 3, 2, 64, 40
  q, k, v, offsets, lengths, stat_lengths, k_base = make_case(0, B, H, G, D, cap, (0, 1))
  call = native.pool_attention_statistics_native
  with pytest.raises(ValueError, match="score_slots"):
    call(q, k, v, offsets, lengths, (0, 0), stat_lengths, k_base, score_len=cap)
  with pytest.raises(ValueError, match="score_slots"):
    call(q, k, v, offsets, lengths, (0, 3), stat_lengths, k_base, score_len=cap)
  with pytest.raises(ValueError, match="stat_lengths"):
    call(q, k, v, offsets, lengths, (0,), stat_lengths, k_base, score_len=cap)
  with pytest.raises(ValueError, match="score_len"):
    call(q, k, v, offsets, lengths, (0, 1), stat_lengths, k_base, score_len=0)
  with pytest.raises(ValueError, match=r"\[B, H, 1, G, D\]"):
    call(jnp.concatenate([q, q], axis=2), k, v, offsets, lengths, (0, 1), stat_lengths, k_base, score_len=cap)
  with pytest.raises(ValueError, match="score_slots"):
    pallas_kernels.score_flags(3, ())
