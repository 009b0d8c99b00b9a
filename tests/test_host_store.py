"""The pinned-host store's row gather (``gather_rows`` / ``HostKVStore.rows``) against numpy fancy indexing,
and ``put_rows`` + ``scatter_rows`` writing host rows into the row pool (rows padded already, or sent in
chunks)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from hetero_jax.model.cache import KVPool
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


def _pool(B, S, P, D, k_fill=0.0, v_fill=0.0):
    return KVPool(k=jnp.full((B, S, P, D), k_fill, jnp.float32), v=jnp.full((B, S, P, D), v_fill, jnp.float32),
                  positions=jnp.full((B, S, P), -1, jnp.int32))


def test_store_rows_and_padded_put_rows_scatter():
    """rows(..., total=row_bucket(n)) -> put_rows -> scatter_rows writes the same pool as unpadded rows: each row
    at (b, shard, pool row), with its position."""
    B, H, T, D, P = 1, 2, 40, 16, 16
    k = jnp.asarray(_store_array((B, H, T, D), np.float32, 3))
    store = HostKVStore(1)
    store.put(0, k, k * 2)
    rng = np.random.default_rng(4)
    n = 11
    b_idx, h_idx, pos = np.zeros(n, int), rng.integers(0, H, n), rng.integers(0, T, n)
    slots = np.arange(n)  # head h's region of the pool: shard h (one head per shard), rows from 0
    kp, vp = store.rows(0, b_idx, h_idx, pos, total=row_bucket(n))
    ku, vu = store.rows(0, b_idx, h_idx, pos)
    assert kp.shape == (row_bucket(n), D) and ku.shape == (n, D)
    np.testing.assert_array_equal(ku, np.asarray(k)[b_idx, h_idx, pos])
    np.testing.assert_array_equal(vu, 2 * np.asarray(k)[b_idx, h_idx, pos])

    p_pad = scatter_rows(_pool(B, H, P, D), put_rows(b_idx, h_idx, slots, kp, vp, pos, P))
    p_unpad = scatter_rows(_pool(B, H, P, D), put_rows(b_idx, h_idx, slots, ku, vu, pos, P))
    for x, y in zip(jax.tree.leaves(p_pad), jax.tree.leaves(p_unpad)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    want_k = np.zeros((B, H, P, D), np.float32)
    want_pos = np.full((B, H, P), -1, np.int32)
    want_k[b_idx, h_idx, slots] = np.asarray(k)[b_idx, h_idx, pos]   # later duplicates win, as in the scatter
    want_pos[b_idx, h_idx, slots] = pos
    np.testing.assert_array_equal(np.asarray(p_pad.k), want_k)
    np.testing.assert_array_equal(np.asarray(p_pad.v), 2 * want_k)
    np.testing.assert_array_equal(np.asarray(p_pad.positions), want_pos)


@pytest.mark.parametrize("chunk", [None, 8, 64])
def test_put_rows_in_chunks_writes_each_row_into_its_place(monkeypatch, chunk):
    """37 rows bound to every shard of a [2, 3, 20] pool, in one part (padded to 64) or five parts of 8: the
    pool equals numpy's assignment of the rows (K, V and positions); the padding writes nothing."""
    from hetero_jax.model import host_store as HS

    rng = np.random.default_rng(5)
    B, S, P, D = 2, 3, 20, 4
    # distinct (b, shard, row) targets: the scatter's order among duplicates is not the point here
    targets = [(b, s, r) for b in range(B) for s in range(S) for r in range(P)]
    pick = [targets[i] for i in rng.choice(len(targets), 37, replace=False)]
    b_idx, s_idx, rows = (np.array(c) for c in zip(*pick))
    k_rows, v_rows = rng.standard_normal((37, D), np.float32), rng.standard_normal((37, D), np.float32)
    pos = rng.integers(0, 1000, 37).astype(np.int32)
    want_k, want_v = np.full((B, S, P, D), 7.0, np.float32), np.full((B, S, P, D), -7.0, np.float32)
    want_pos = np.full((B, S, P), -1, np.int32)
    want_k[b_idx, s_idx, rows], want_v[b_idx, s_idx, rows], want_pos[b_idx, s_idx, rows] = k_rows, v_rows, pos
    calls = []
    real = HS._scatter
    monkeypatch.setattr(HS, "_scatter", lambda *a: calls.append(a[1].shape) or real(*a))
    parts = put_rows(b_idx, s_idx, rows, k_rows, v_rows, pos, P, chunk=chunk)
    out = scatter_rows(_pool(B, S, P, D, 7.0, -7.0), parts)
    assert calls == ([(4, 8)] * 5 if chunk == 8 else [(4, 64)])
    np.testing.assert_array_equal(np.asarray(out.k), want_k)
    np.testing.assert_array_equal(np.asarray(out.v), want_v)
    np.testing.assert_array_equal(np.asarray(out.positions), want_pos)
