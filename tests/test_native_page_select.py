"""The native page selection (``pallas_kernels.native.page_select_native``) against the plain-JAX reference
(``pallas_kernels.page_select_reference``: Quest's bound, the group rule, ``lax.top_k``): at odd GQA ratios, head
dims 64 and 128, both group rules, sequences with no page, one page and fewer pages than slots, slot counts
below ``n_select``, exact ties (lower page first), the dispatcher, vmap, and the errors. The native sums run in
another order than XLA's, so the selection is checked as a top-k of the reference's scores within a tolerance
(a near tie may go either way), and exactly where no two scores are that close. Nothing is skipped when the
kernel is unavailable: `make install` builds it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import MASK_VALUE, native
from pallas_kernels.page_select import group_page_scores


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
  assert native.available(), f"native kernels unavailable: {native.unavailable_reason()}"


def make_case(seed, B, H, G, D, P, n_pages):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, H, G, D)).astype(np.float32)
  a = rng.standard_normal((B, H, P, D)).astype(np.float32)
  b = a + np.abs(rng.standard_normal((B, H, P, D))).astype(np.float32)
  return jnp.asarray(q), jnp.asarray(a), jnp.asarray(b), jnp.asarray(np.asarray(n_pages, np.int32))


def assert_top_pages(pages, valid, ref_pages, ref_valid, scores, rtol=1e-5):
  """pages / valid (native) against the reference's: the same valid slots; the valid pages distinct and a top-k
  of the reference's scores [B, H, P] up to rtol, best first; an invalid slot holds the first page (or 0); and
  where the reference's k-th and (k+1)-th scores are further apart than rtol, exactly the reference's pages."""
  pages, valid, ref_pages, ref_valid, scores = map(np.asarray, (pages, valid, ref_pages, ref_valid, scores))
  np.testing.assert_array_equal(valid, ref_valid)
  B, H, n = pages.shape
  for b in range(B):
    for h in range(H):
      s, ok = scores[b, h], valid[b, h]
      k = int(ok.sum())
      chosen = pages[b, h, :k]
      assert len(set(chosen.tolist())) == k
      tol = rtol * max(1e-30, float(np.abs(s[s > MASK_VALUE]).max(initial=1.0)))
      got = s[chosen]
      assert (np.diff(got) <= tol).all(), "not best first"
      rest = np.setdiff1d(np.flatnonzero(s > MASK_VALUE), chosen)
      if k and rest.size:
        assert got.min() >= s[rest].max() - tol
      filler = pages[b, h, 0] if ok[0] else 0
      assert (pages[b, h, k:] == filler).all()
      top = np.sort(s)[::-1]
      if k and (k == len(top) or top[k - 1] - top[k] > tol) and (np.abs(np.diff(top[:k])) > tol).all():
        np.testing.assert_array_equal(pages[b, h], ref_pages[b, h])


@pytest.mark.parametrize("how", ["max", "mean_softmax"])
@pytest.mark.parametrize("G, D", [(1, 64), (4, 128), (7, 64)])
def test_matches_the_reference(how, G, D):
  B, H, P, n = 3, 3, 37, 9
  q, kmin, kmax, n_pages = make_case(G * 100 + D, B, H, G, D, P, [P, 1, 5])  # 1 and 5 pages: fewer than slots
  counts = jnp.asarray([n, 4, n], jnp.int32)
  got = jax.jit(lambda *a: native.page_select_native(*a, n, counts, how))(q, kmin, kmax, n_pages)
  ref = pallas_kernels.page_select_reference(q, kmin, kmax, n_pages, n, counts, how)
  assert got[0].shape == (B, H, n) and got[0].dtype == jnp.int32 and got[1].dtype == jnp.bool_
  assert_top_pages(*got, *ref, group_page_scores(q, kmin, kmax, n_pages, how))


def test_no_pages_and_every_slot():
  """A sequence without pages has no valid slot and page 0 everywhere; n_select = P takes every page."""
  B, H, G, D, P = 2, 2, 3, 64, 6
  q, kmin, kmax, n_pages = make_case(5, B, H, G, D, P, [0, P])
  for how in ("max", "mean_softmax"):
    pages, valid = native.page_select_native(q, kmin, kmax, n_pages, P, None, how)
    assert not np.asarray(valid)[0].any() and (np.asarray(pages)[0] == 0).all()
    assert np.asarray(valid)[1].all()
    assert (np.sort(np.asarray(pages)[1], axis=-1) == np.arange(P)).all()


def test_ties_go_to_the_lower_page():
  """Pages with the same summary tie exactly: lax.top_k's order (the lower page first), as the reference."""
  B, H, G, D, P = 1, 2, 2, 64, 8
  q, kmin, kmax, n_pages = make_case(9, B, H, G, D, P, [P])
  kmin = kmin.at[:, :, 5].set(kmin[:, :, 2]).at[:, :, 7].set(kmin[:, :, 2])
  kmax = kmax.at[:, :, 5].set(kmax[:, :, 2]).at[:, :, 7].set(kmax[:, :, 2])
  for how in ("max", "mean_softmax"):
    scores = np.asarray(group_page_scores(q, kmin, kmax, n_pages, how))
    for n in range(1, P + 1):
      pages = np.asarray(native.page_select_native(q, kmin, kmax, n_pages, n, None, how)[0])
      for h in range(H):
        chosen = pages[0, h]
        if 7 in chosen:
          assert 5 in chosen and 2 in chosen
        if 5 in chosen:
          assert 2 in chosen
        assert (np.diff(scores[0, h, chosen]) <= 1e-5 * np.abs(scores[0, h]).max()).all()


def test_the_dispatcher_and_vmap():
  B, H, G, D, P, n = 2, 3, 3, 64, 20, 6
  q, kmin, kmax, n_pages = make_case(11, B, H, G, D, P, [P, 13])
  ref = pallas_kernels.page_select(q, kmin, kmax, n_pages, n, None, "max", backend="reference")
  nat = pallas_kernels.page_select(q, kmin, kmax, n_pages, n, None, "max", backend="native")
  assert_top_pages(*nat, *ref, group_page_scores(q, kmin, kmax, n_pages, "max"))
  cases = [make_case(s, B, H, G, D, P, [P, 13]) for s in (1, 2)]
  stacked = [jnp.stack(x) for x in zip(*cases)]
  got = jax.vmap(lambda *a: native.page_select_native(*a, n, None, "mean_softmax"))(*stacked)
  for i, case in enumerate(cases):
    for g, w in zip(got, native.page_select_native(*case, n, None, "mean_softmax")):
      np.testing.assert_array_equal(np.asarray(g[i]), np.asarray(w))


@pytest.mark.parametrize("how", ["max", "mean_softmax"])
def test_a_call_on_helper_threads_matches_the_reference_and_one_thread(how, monkeypatch):
  """Enough heads and pages for the kernel to take helper threads (10 heads of 300 pages, each head one work
  item taken from a shared counter): every head's pages are the reference's top-k, and exactly the pages of
  the same call on one thread (HETERO_JAX_NATIVE_THREADS=1)."""
  B, H, G, D, P, n = 2, 5, 3, 64, 300, 40
  q, kmin, kmax, n_pages = make_case(23, B, H, G, D, P, [P, 217])
  counts = jnp.asarray([n, 31], jnp.int32)
  got = native.page_select_native(q, kmin, kmax, n_pages, n, counts, how)
  ref = pallas_kernels.page_select_reference(q, kmin, kmax, n_pages, n, counts, how)
  assert_top_pages(*got, *ref, group_page_scores(q, kmin, kmax, n_pages, how))
  monkeypatch.setenv("HETERO_JAX_NATIVE_THREADS", "1")
  for g, w in zip(got, native.page_select_native(q, kmin, kmax, n_pages, n, counts, how)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_errors_name_the_problem():
  q, kmin, kmax, n_pages = make_case(0, 1, 2, 3, 64, 10, [10])
  with pytest.raises(ValueError, match="n_select"):
    native.page_select_native(q, kmin, kmax, n_pages, 11)
  with pytest.raises(ValueError, match="rule"):
    native.page_select_native(q, kmin, kmax, n_pages, 3, None, "mean")
  with pytest.raises(ValueError, match=r"\[B, H, P, D\]"):
    native.page_select_native(q, kmin[:, :1], kmax[:, :1], n_pages, 3)
  with pytest.raises(ValueError, match="rule"):
    pallas_kernels.page_select(q, kmin, kmax, n_pages, 3, None, "min")
