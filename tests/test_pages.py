"""Page primitives (Quest / FreeKV) against independent float64 numpy references, traced under jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from hetero_jax.policies.pages import (
    group_page_scores, page_summaries, quest_page_scores, top_pages,
)
from pallas_kernels import MASK_VALUE

# Jitted once per static configuration: each test below goes through these, which proves they trace.
summaries_int = jax.jit(page_summaries, static_argnames=("page_size", "start"))
summaries_arr = jax.jit(page_summaries, static_argnames=("page_size",))  # start is a traced [B] array
quest_jit = jax.jit(quest_page_scores)
group_jit = jax.jit(group_page_scores, static_argnames=("how",))
top_jit = jax.jit(top_pages, static_argnames=("n_select",))

B, H, G, T, D, PS = 3, 2, 3, 40, 8, 4


# ----------------------------------------------------------------------------- numpy references


def np_summaries(k, lengths, ps, start, P):
    k = np.asarray(k, np.float64)
    b_, h_, t_, d_ = k.shape
    starts = np.broadcast_to(np.asarray(start), (b_,))
    kmin, kmax = np.zeros((b_, h_, P, d_)), np.zeros((b_, h_, P, d_))
    n = np.zeros(b_, np.int64)
    for b in range(b_):
        n[b] = max(0, (min(int(lengths[b]), t_) - int(starts[b])) // ps)
        for h in range(h_):
            for j in range(n[b]):
                page = k[b, h, starts[b] + j * ps : starts[b] + (j + 1) * ps]
                kmin[b, h, j], kmax[b, h, j] = page.min(axis=0), page.max(axis=0)
    return kmin, kmax, n


def np_quest(q, kmin, kmax, n):
    q, kmin, kmax = (np.asarray(a, np.float64) for a in (q, kmin, kmax))
    b_, h_, g_, _ = q.shape
    P = kmin.shape[2]
    u = np.full((b_, h_, g_, P), MASK_VALUE)
    for b in range(b_):
        for h in range(h_):
            for g in range(g_):
                for p in range(n[b]):
                    terms = zip(q[b, h, g], kmin[b, h, p], kmax[b, h, p])
                    u[b, h, g, p] = sum(max(qd * lo, qd * hi) for qd, lo, hi in terms)
    return u


def np_group(u, n, how):
    b_, h_, g_, P = u.shape
    out = np.full((b_, h_, P), MASK_VALUE)
    for b in range(b_):
        if n[b] == 0:
            continue
        v = u[b, :, :, : n[b]]
        if how == "max":
            out[b, :, : n[b]] = v.max(axis=1)
        else:
            e = np.exp(v - v.max(axis=-1, keepdims=True))
            out[b, :, : n[b]] = (e / e.sum(axis=-1, keepdims=True)).mean(axis=1)
    return out


def np_top(scores, n_sel):
    """Stable top-n (ties to the lower page), valid ones best first; {(b, h): pages list} per head."""
    res = {}
    for b in range(scores.shape[0]):
        for h in range(scores.shape[1]):
            order = np.argsort(-scores[b, h], kind="stable")[:n_sel]
            res[b, h] = [int(p) for p in order if scores[b, h, p] > MASK_VALUE]
    return res


def with_garbage(k, lengths, start=None):
    """Padding slots (>= length) hold huge garbage; slots before ``start`` (sinks) too."""
    k = np.array(k)
    garbage = np.array([1e30, -1e30, np.nan, 3e38], np.float32)
    for b, n in enumerate(lengths):
        k[b, :, n:] = np.resize(garbage, k[b, :, n:].shape)
        if start is not None:
            k[b, :, : start[b]] = -3e38
    return k


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# ----------------------------------------------------------------------------- summaries


def test_summaries_int_start_ragged_with_garbage():
    rng = np.random.default_rng(0)
    lengths = np.array([40, 23, 3], np.int32)  # full, ragged (partial page), zero full pages
    k = with_garbage(rand(rng, B, H, T, D), lengths)
    for start in (0, 5):
        kmin, kmax, n = summaries_int(jnp.asarray(k), jnp.asarray(lengths), page_size=PS, start=start)
        P = (T - start) // PS
        rmin, rmax, rn = np_summaries(k, lengths, PS, start, P)
        assert kmin.shape == kmax.shape == (B, H, P, D) and kmin.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(n), rn)
        np.testing.assert_array_equal(np.asarray(kmin), rmin.astype(np.float32))
        np.testing.assert_array_equal(np.asarray(kmax), rmax.astype(np.float32))
    assert rn.tolist() == [8, 4, 0]
    assert np.all(np.asarray(kmin)[2] == 0) and np.all(np.asarray(kmax)[2] == 0)


def test_summaries_array_start_excludes_sinks_and_padding():
    rng = np.random.default_rng(1)
    lengths = np.array([40, 30, 9], np.int32)
    start = np.array([4, 7, 6], np.int32)  # the last sequence has no full page after its sinks
    k = with_garbage(rand(rng, B, H, T, D), lengths, start)
    kmin, kmax, n = summaries_arr(jnp.asarray(k), jnp.asarray(lengths), page_size=PS, start=jnp.asarray(start))
    P = T // PS
    rmin, rmax, rn = np_summaries(k, lengths, PS, start, P)
    assert kmin.shape == (B, H, P, D)
    assert rn.tolist() == [9, 5, 0]
    np.testing.assert_array_equal(np.asarray(n), rn)
    np.testing.assert_array_equal(np.asarray(kmin), rmin.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(kmax), rmax.astype(np.float32))


def test_summaries_bf16_stay_finite():
    rng = np.random.default_rng(2)
    lengths = np.array([17, 0, 40], np.int32)
    k = jnp.asarray(rand(rng, B, H, T, D)).astype(jnp.bfloat16)
    kmin, kmax, n = summaries_int(k, jnp.asarray(lengths), page_size=PS, start=0)
    assert kmin.dtype == jnp.bfloat16
    rmin, rmax, rn = np_summaries(np.asarray(k.astype(jnp.float32)), lengths, PS, 0, T // PS)
    assert np.all(np.isfinite(np.asarray(kmin, np.float32))) and np.all(np.isfinite(np.asarray(kmax, np.float32)))
    np.testing.assert_array_equal(np.asarray(kmin, np.float32), rmin)
    np.testing.assert_array_equal(np.asarray(kmax, np.float32), rmax)


# ----------------------------------------------------------------------------- scores


def _scored_case(seed=3):
    rng = np.random.default_rng(seed)
    lengths = np.array([40, 13, 2], np.int32)  # 10, 3 and 0 pages
    k = with_garbage(rand(rng, B, H, T, D), lengths)
    q = rand(rng, B, H, G, D)
    kmin, kmax, n = summaries_int(jnp.asarray(k), jnp.asarray(lengths), page_size=PS, start=0)
    return jnp.asarray(q), kmin, kmax, n


def test_quest_scores_match_numpy():
    q, kmin, kmax, n = _scored_case()
    u = np.asarray(quest_jit(q, kmin, kmax, n))
    ref = np_quest(q, kmin, kmax, np.asarray(n))
    assert u.shape == (B, H, G, T // PS) and u.dtype == np.float32
    assert np.all(np.isfinite(u))
    invalid = ref == MASK_VALUE
    assert invalid[2].all() and invalid[1, ..., 3:].all() and not invalid[0].any()
    np.testing.assert_array_equal(u == np.float32(MASK_VALUE), invalid)
    np.testing.assert_allclose(u[~invalid], ref[~invalid], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["max", "mean_softmax"])
def test_group_scores_match_numpy(how):
    q, kmin, kmax, n = _scored_case()
    s = np.asarray(group_jit(q, kmin, kmax, n, how=how))
    ref = np_group(np_quest(q, kmin, kmax, np.asarray(n)), np.asarray(n), how)
    assert s.shape == (B, H, T // PS) and s.dtype == np.float32
    assert not np.isnan(s).any()
    invalid = ref == MASK_VALUE
    np.testing.assert_array_equal(s == np.float32(MASK_VALUE), invalid)
    assert invalid[2].all()  # zero valid pages: all MASK_VALUE
    np.testing.assert_allclose(s[~invalid], ref[~invalid], rtol=1e-5, atol=1e-6)
    if how == "mean_softmax":  # a distribution over each head's valid pages
        np.testing.assert_allclose(s[0].sum(-1), 1.0, rtol=1e-5)
        np.testing.assert_allclose(s[1, :, :3].sum(-1), 1.0, rtol=1e-5)


def test_group_scores_reject_unknown_rule():
    q, kmin, kmax, n = _scored_case()
    with pytest.raises(ValueError, match="mean_softmax"):
        group_page_scores(q, kmin, kmax, n, how="mean")


# ----------------------------------------------------------------------------- top pages


def test_top_pages_stable_best_first_and_valid_mask():
    rng = np.random.default_rng(4)
    P, n_sel = 9, 4
    scores = rng.integers(0, 3, size=(B, H, P)).astype(np.float32)  # many ties
    scores[1, :, 2:] = MASK_VALUE  # 2 valid pages < n_select
    scores[2] = MASK_VALUE  # none valid
    pages, valid = top_jit(jnp.asarray(scores), n_select=n_sel)
    pages, valid = np.asarray(pages), np.asarray(valid)
    assert pages.shape == valid.shape == (B, H, n_sel) and pages.dtype == np.int32
    assert np.all((pages >= 0) & (pages < P))
    ref = np_top(scores, n_sel)
    for (b, h), want in ref.items():
        nv = len(want)
        assert valid[b, h].tolist() == [True] * nv + [False] * (n_sel - nv)
        assert pages[b, h, :nv].tolist() == want  # best first, ties to the lower page
        filler = {want[0]} if want else {0}  # the best page, or page 0 where none is valid
        assert set(pages[b, h, nv:].tolist()) <= filler
    assert [len(ref[1, h]) for h in range(H)] == [2, 2] and ref[2, 0] == []


def test_top_pages_rejects_oversized_selection():
    with pytest.raises(ValueError, match="n_select"):
        top_pages(jnp.zeros((1, 1, 3)), 4)


# ----------------------------------------------------------------------------- the bound is a bound


@st.composite
def bound_case(draw):
    ps = draw(st.integers(1, 4))
    t = draw(st.integers(1, 12))
    d = draw(st.integers(1, 5))
    g = draw(st.integers(1, 3))
    length = draw(st.integers(0, t))
    start = draw(st.integers(0, 3))
    vals = st.floats(-8, 8, width=32)
    k = draw(hnp.arrays(np.float32, (1, 1, t, d), elements=vals))
    q = draw(hnp.arrays(np.float32, (1, 1, g, d), elements=vals))
    return ps, length, start, k, q


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bound_case())
def test_quest_bound_upper_bounds_every_key_in_page(case):
    """u(q, p) >= max over the page's tokens of q.k, for every valid page (so for the chosen one)."""
    ps, length, start, k, q = case
    kmin, kmax, n = page_summaries(jnp.asarray(k), jnp.asarray([length], jnp.int32), ps, start)
    u = np.asarray(quest_page_scores(jnp.asarray(q), kmin, kmax, n))
    n = int(n[0])
    assert n == max(0, (length - start) // ps) and np.all(np.isfinite(u))
    assert np.all(u[..., n:] == np.float32(MASK_VALUE))
    q64, k64 = q[0, 0].astype(np.float64), k[0, 0].astype(np.float64)
    for p in range(n):
        page = k64[start + p * ps : start + (p + 1) * ps]
        true = (q64 @ page.T).max(axis=1)  # [G]: the best real q.k in the page
        tol = 1e-5 * (np.abs(q64) @ np.abs(page).max(axis=0)) + 1e-6
        assert np.all(u[0, 0, :, p] >= true - tol)


def test_page_bucket_rounds_up_by_at_most_a_quarter_or_the_quantum():
    """Hand-computed: multiples of 4 up to 16 pages, then of a quarter of the power of two (8 from 32, 16 from 64)."""
    from hetero_jax.policies.pages import page_bucket

    assert [page_bucket(n) for n in (0, 1, 4, 5, 11, 12, 13, 17, 33, 37, 40, 41, 65)] == \
        [0, 4, 4, 8, 12, 12, 16, 20, 40, 40, 40, 48, 80]
    for n in range(1, 600):
        b = page_bucket(n)
        assert n <= b <= max(n + 3, n * 5 // 4) and page_bucket(b) == b
