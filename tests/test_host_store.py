"""The pinned-host store's row gather (``gather_rows`` / ``HostKVStore.rows``) against numpy fancy indexing,
and ``put_rows`` taking rows that are padded already."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from hetero_jax.model.cache import HeadGroup
from hetero_jax.model.host_store import HostKVStore, gather_rows, put_rows, row_bucket, scatter_rows


def _store_array(shape, dtype, seed=0):
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32).astype(dtype)


@pytest.mark.parametrize("dtype,D", [(ml_dtypes.bfloat16, 64), (np.float32, 64), (np.float16, 3), (np.float32, 5)])
def test_gather_rows_equals_fancy_indexing(dtype, D):
    a = _store_array((2, 3, 50, D), dtype)
    rng = np.random.default_rng(1)
    b, h, p = rng.integers(0, 2, (4, 7)), rng.integers(0, 3, (4, 7)), rng.integers(0, 50, (4, 7))
    got = gather_rows(a, b, h, p)
    want = a[b, h, p]
    assert got.shape == want.shape == (4, 7, D) and got.dtype == a.dtype
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))   # bit for bit (NaN-safe)
    # 1-D indices padded to `total` rows: the rows, then zeros
    n = 9
    got = gather_rows(a, b.reshape(-1)[:n], h.reshape(-1)[:n], p.reshape(-1)[:n], total=16)
    assert got.shape == (16, D)
    assert np.array_equal(got[:n].view(np.uint8), a[b.reshape(-1)[:n], h.reshape(-1)[:n], p.reshape(-1)[:n]].view(np.uint8))
    assert not got[n:].astype(np.float32).any()


def test_gather_rows_strided_view_and_bad_indices():
    a = _store_array((1, 4, 20, 16), np.float32)
    strided = a[:, ::2]                     # not C-contiguous: plain indexing path
    b, h, p = np.zeros(5, int), np.array([0, 1, 1, 0, 1]), np.array([0, 19, 3, 7, 7])
    assert np.array_equal(gather_rows(strided, b, h, p), strided[b, h, p])
    with pytest.raises(IndexError, match="out of range"):
        gather_rows(a, b, h, np.array([0, 1, 2, 3, 20]))
    with pytest.raises(ValueError, match="total"):
        gather_rows(a, b, h, p, total=4)


def test_store_rows_and_padded_put_rows_scatter():
    """rows(..., total=row_bucket(n)) -> put_rows -> scatter_rows writes the same group as unpadded rows."""
    B, H, T, D = 1, 2, 40, 16
    k = jnp.asarray(_store_array((B, H, T, D), np.float32, 3))
    store = HostKVStore(1)
    store.put(0, k, k * 2)
    rng = np.random.default_rng(4)
    n = 11
    b_idx, h_idx, pos = np.zeros(n, int), rng.integers(0, H, n), rng.integers(0, T, n)
    slots = np.arange(n)
    kp, vp = store.rows(0, b_idx, h_idx, pos, total=row_bucket(n))
    ku, vu = store.rows(0, b_idx, h_idx, pos)
    assert kp.shape == (row_bucket(n), D) and ku.shape == (n, D)
    np.testing.assert_array_equal(ku, np.asarray(k)[b_idx, h_idx, pos])
    np.testing.assert_array_equal(vu, 2 * np.asarray(k)[b_idx, h_idx, pos])

    def group():
        return HeadGroup(k=jnp.zeros((B, H, 16, D)), v=jnp.zeros((B, H, 16, D)),
                         positions=jnp.full((B, H, 16), -1, jnp.int32), lengths=jnp.full((B, H), 16, jnp.int32))

    g_pad = scatter_rows(group(), put_rows(b_idx, h_idx, slots, kp, vp, pos, 16))
    g_unpad = scatter_rows(group(), put_rows(b_idx, h_idx, slots, ku, vu, pos, 16))
    for x, y in zip(jax.tree.leaves(g_pad), jax.tree.leaves(g_unpad)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    want_k = np.zeros((B, H, 16, D), np.float32)
    want_k[b_idx, h_idx, slots] = np.asarray(k)[b_idx, h_idx, pos]   # later duplicates win, as in the scatter
    np.testing.assert_array_equal(np.asarray(g_pad.k), want_k)


@pytest.mark.parametrize("chunk", [None, 8, 64])
def test_scatter_rows_many_writes_each_row_into_its_group(monkeypatch, chunk):
    """37 rows bound to three groups of different shapes, in one call (padded to 64) or five calls of 8:
    each group equals numpy's assignment of its own rows; the padding writes nothing."""
    from hetero_jax.model import host_store as HS

    rng = np.random.default_rng(5)
    D, shapes = 4, [(2, 3, 10), (2, 1, 6), (2, 2, 12)]  # [B, H, capacity] per group
    groups = tuple(HeadGroup(k=jnp.full((*s, D), 7.0), v=jnp.full((*s, D), -7.0),
                             positions=jnp.full(s, -1, jnp.int32), lengths=jnp.full(s[:2], s[2], jnp.int32))
                   for s in shapes)
    want = [(np.full((*s, D), 7.0, np.float32), np.full((*s, D), -7.0, np.float32), np.full(s, -1, np.int32))
            for s in shapes]
    # distinct (group, b, h, slot) targets: the scatter's order among duplicates is not the point here
    targets = [(g, b, h, sl) for g, s in enumerate(shapes) for b in range(s[0]) for h in range(s[1])
               for sl in range(s[2])]
    pick = [targets[i] for i in rng.choice(len(targets), 37, replace=False)]
    which, b_idx, h_idx, slots = (np.array(c) for c in zip(*pick))
    k_rows, v_rows = rng.standard_normal((37, D), np.float32), rng.standard_normal((37, D), np.float32)
    pos = rng.integers(0, 1000, 37).astype(np.int32)
    for i, (g, b, h, sl) in enumerate(pick):
        want[g][0][b, h, sl], want[g][1][b, h, sl], want[g][2][b, h, sl] = k_rows[i], v_rows[i], pos[i]
    calls = []
    real = HS._scatter_many
    monkeypatch.setattr(HS, "_scatter_many", lambda *a: calls.append(a[1].shape) or real(*a))
    out = HS.scatter_rows_many(groups, which, b_idx, h_idx, slots, k_rows, v_rows, pos, chunk=chunk)
    assert calls == ([(5, 8)] * 5 if chunk == 8 else [(5, 64)])
    for g, (wk, wv, wp) in zip(out, want):
        np.testing.assert_array_equal(np.asarray(g.k), wk)
        np.testing.assert_array_equal(np.asarray(g.v), wv)
        np.testing.assert_array_equal(np.asarray(g.positions), wp)
