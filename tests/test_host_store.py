"""The pinned-host store's row gather (``gather_rows``) against numpy fancy indexing, and ``send_host_rows`` +
``scatter_rows`` writing host rows into the row pool (one part or several), and a store of some heads written
by layout slot (``put_heads``, ``write_head_rows``); HCAttention's host weighted sum (``host_weighted_sum``) on one
BLAS thread, in a process of its own (``blas_limit_cases.py``)."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from hetero_jax.model.cache import KVPool
from hetero_jax.model.host_store import (HostKVStore, gather_rows, scatter_rows, send_host_rows,
                                         write_head_rows, write_host_rows)


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
    # into rows of a larger buffer: those rows written, the others untouched
    n = 9
    buf = np.full((16, D), 3, dtype)
    got = gather_rows(a, b.reshape(-1)[:n], h.reshape(-1)[:n], p.reshape(-1)[:n], out=buf[4 : 4 + n])
    assert np.shares_memory(got, buf)
    assert np.array_equal(buf[4 : 4 + n].view(np.uint8),
                          a[b.reshape(-1)[:n], h.reshape(-1)[:n], p.reshape(-1)[:n]].view(np.uint8))
    assert (buf[:4].astype(np.float32) == 3).all() and (buf[4 + n :].astype(np.float32) == 3).all()


def test_gather_rows_strided_view_and_bad_indices():
    a = _store_array((1, 4, 20, 16), np.float32)
    strided = a[:, ::2]                     # not C-contiguous: plain indexing path
    b, h, p = np.zeros(5, int), np.array([0, 1, 1, 0, 1]), np.array([0, 19, 3, 7, 7])
    assert np.array_equal(gather_rows(strided, b, h, p), strided[b, h, p])
    with pytest.raises(IndexError, match="out of range"):
        gather_rows(a, b, h, np.array([0, 1, 2, 3, 20]))
    with pytest.raises(ValueError, match="out must be"):
        gather_rows(a, b, h, p, out=np.empty((4, 16), np.float32))
    out = np.empty((5, 16), np.float32)
    assert np.array_equal(gather_rows(strided, b, h, p, out=out), strided[b, h, p])


def _pool(B, S, P, D, k_fill=0.0, v_fill=0.0):
    return KVPool(k=jnp.full((B, S, P, D), k_fill, jnp.float32), v=jnp.full((B, S, P, D), v_fill, jnp.float32),
                  positions=jnp.full((B, S, P), -1, jnp.int32))


def test_send_host_rows_from_two_layers_then_scatter():
    """Rows of two layers of a store, each to (b, shard, pool row): the pool equals numpy's assignment of the
    store's rows (K, V and positions); the padding past the 11 rows writes nothing; rows and bytes counted."""
    B, H, T, D, P = 1, 2, 40, 16, 16
    k = jnp.asarray(_store_array((B, H, T, D), np.float32, 3))
    store = HostKVStore(2)
    store.put(0, k, k * 2)
    store.put(1, k + 10, k * 3)
    rng = np.random.default_rng(4)
    n0, n1 = 7, 4
    b0, h0, pos0 = np.zeros(n0, int), rng.integers(0, H, n0), rng.integers(0, T, n0)
    b1, h1, pos1 = np.zeros(n1, int), rng.integers(0, H, n1), rng.integers(0, T, n1)
    r0 = rng.choice(P, n0, replace=False)  # pool rows: layer 0 on shard h, layer 1 on shard 1 - h
    r1 = rng.choice(P, n1, replace=False)
    timings = {}
    parts, n = send_host_rows(store, [(0, b0, h0, pos0, h0, r0), (1, b1, h1, pos1, 1 - h1, r1)], P,
                              timings=timings)
    assert n == n0 + n1 and set(timings) == {"gather", "send"}
    assert [tuple(x.shape) for x in parts[0]] == [(4, 16), (16, D), (16, D)]  # padded to row_bucket(11)
    got = scatter_rows(_pool(B, H, P, D), parts)
    kh = np.asarray(k)
    want_k = np.zeros((B, H, P, D), np.float32)
    want_v = np.zeros((B, H, P, D), np.float32)
    want_pos = np.full((B, H, P), -1, np.int32)
    want_k[b0, h0, r0], want_v[b0, h0, r0], want_pos[b0, h0, r0] = kh[b0, h0, pos0], 2 * kh[b0, h0, pos0], pos0
    want_k[b1, 1 - h1, r1], want_v[b1, 1 - h1, r1] = kh[b1, h1, pos1] + 10, 3 * kh[b1, h1, pos1]
    want_pos[b1, 1 - h1, r1] = pos1
    np.testing.assert_allclose(np.asarray(got.k), want_k, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got.v), want_v, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(got.positions), want_pos)


@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize("chunk", [None, 8, 64])
def test_send_host_rows_in_chunks_writes_each_row_into_its_place(monkeypatch, chunk, pinned):
    """37 rows bound to every shard of a [2, 3, 20] pool, in one part (padded to 64) or five parts of 8, from
    pageable staging rows or pinned host arrays written in place (a GPU's staging; here forced on the CPU):
    the pool equals numpy's assignment of the rows (K, V and positions); the padding writes nothing."""
    from hetero_jax.model import host_store as HS

    rng = np.random.default_rng(5)
    B, S, P, D = 2, 3, 20, 4
    # distinct (b, shard, row) targets: the scatter's order among duplicates is not the point here
    targets = [(b, s, r) for b in range(B) for s in range(S) for r in range(P)]
    pick = [targets[i] for i in rng.choice(len(targets), 37, replace=False)]
    b_idx, s_idx, rows = (np.array(c) for c in zip(*pick))
    T = 1000
    k_store, v_store = (rng.standard_normal((B, 1, T, D), np.float32) for _ in range(2))
    store = HostKVStore(1)
    store.staging = HS.Staging(pinned=pinned)
    store.put(0, jnp.asarray(k_store), jnp.asarray(v_store))
    pos = rng.integers(0, T, 37).astype(np.int32)
    k_rows, v_rows = k_store[b_idx, 0, pos], v_store[b_idx, 0, pos]
    want_k, want_v = np.full((B, S, P, D), 7.0, np.float32), np.full((B, S, P, D), -7.0, np.float32)
    want_pos = np.full((B, S, P), -1, np.int32)
    want_k[b_idx, s_idx, rows], want_v[b_idx, s_idx, rows], want_pos[b_idx, s_idx, rows] = k_rows, v_rows, pos
    calls = []
    real = HS._scatter
    monkeypatch.setattr(HS, "_scatter", lambda *a: calls.append(a[1].shape) or real(*a))
    parts, _ = send_host_rows(store, [(0, b_idx, np.zeros(37, int), pos, s_idx, rows)], P, chunk=chunk)
    out = scatter_rows(_pool(B, S, P, D, 7.0, -7.0), parts)
    assert calls == ([(4, 8)] * 5 if chunk == 8 else [(4, 64)])
    held = [len(parts) for parts in store.staging.held.values()]
    assert store.staging.pinned == pinned and held == ([] if not pinned else [5] if chunk == 8 else [1])
    np.testing.assert_array_equal(np.asarray(out.k), want_k)
    np.testing.assert_array_equal(np.asarray(out.v), want_v)
    np.testing.assert_array_equal(np.asarray(out.positions), want_pos)


@pytest.mark.parametrize("shape,dtype", [((8192, 128), np.float32), ((3, 5), np.float16), ((7, 64), ml_dtypes.bfloat16),
                                         ((0, 4), np.float32)])
def test_aligned_empty_starts_on_a_cache_line(shape, dtype):
    from hetero_jax.model.host_store import aligned_empty

    a = aligned_empty(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype) and a.flags.c_contiguous and a.flags.writeable
    if a.size:
        assert a.ctypes.data % 64 == 0
        a[...] = 1  # the whole array is ours to write
        assert (a == 1).all()


@pytest.mark.parametrize("dtype,D", [(np.float32, 128), (ml_dtypes.bfloat16, 64), (np.float32, 5)])
def test_pageable_staging_rows_start_on_a_cache_line_and_a_cpu_device_takes_them_in_place(dtype, D):
    """A CPU store's staging rows (pageable) start on a cache line for any dtype and row width, so the native
    gather's non-temporal stores fill whole lines; and the device arrays ``send_host_rows`` makes of them are the
    staging rows themselves (jax copies a numpy buffer that is not 64-byte aligned), K and V."""
    import jax
    from hetero_jax.model.host_store import Staging

    assert jax.devices()[0].platform == "cpu"
    k = _store_array((1, 2, 300, D), dtype, 3)
    store = HostKVStore(1)
    store.staging = Staging(pinned=False)
    store.put(0, jnp.asarray(k), jnp.asarray(k))
    n = 100
    pos = np.random.default_rng(2).integers(0, 300, n)
    parts, sent = send_host_rows(store, [(0, np.zeros(n, int), np.arange(n) % 2, pos, np.zeros(n, int), np.arange(n))],
                                 rows=128)
    staging = store.staging
    assert sent == n and len(parts) == 1
    assert staging.k.ctypes.data % 64 == 0 and staging.v.ctypes.data % 64 == 0
    _, k_sent, v_sent = parts[0]
    assert k_sent.unsafe_buffer_pointer() == staging.k.ctypes.data
    assert v_sent.unsafe_buffer_pointer() == staging.v.ctypes.data
    np.testing.assert_array_equal(np.asarray(k_sent)[:n], k[0, np.arange(n) % 2, pos])


@pytest.mark.parametrize("pinned", [False, True])
def test_recalls_reuse_the_staging_rows_one_after_another(pinned):
    """Three recalls in a row from one store (the second larger, so the staging grows; the third reuses it),
    through ``write_host_rows`` as the policies make them, from pageable or pinned staging rows: every pool
    row holds its own recall's store row (numpy), none a later recall's, though they passed through the same
    host rows."""
    from hetero_jax.model.host_store import Staging

    B, H, T, D, P = 1, 2, 64, 8, 256
    k = jnp.asarray(_store_array((B, H, T, D), np.float32, 7))
    store = HostKVStore(1)
    store.staging = Staging(pinned=pinned)
    store.put(0, k, -k)
    pool = _pool(B, H, P, D)
    kh = np.asarray(k)
    rng = np.random.default_rng(8)
    want = np.zeros((B, H, P, D), np.float32)
    start = 0
    for n in (5, 40, 12):
        h, pos = rng.integers(0, H, n), rng.integers(0, T, n)
        rows = start + np.arange(n)
        start += n
        pool, sent, nbytes = write_host_rows(pool, store, [(0, np.zeros(n, int), h, pos, h, rows)], chunk=16)
        assert sent == n and nbytes == 2 * n * D * 4
        want[0, h, rows] = kh[0, h, pos]
    # grown once, to the largest recall's 3 parts of 16 rows of K and of V (pageable: row_bucket(48) rows)
    assert store.staging.nbytes() == 2 * (48 if pinned else 64) * D * 4
    # another part size keeps its own pinned parts beside these (no re-allocation when sizes alternate)
    pool, _, _ = write_host_rows(pool, store, [(0, np.zeros(3, int), np.zeros(3, int), np.arange(3), np.zeros(3, int),
                                                P - 3 + np.arange(3))], chunk=8)
    want[0, 0, P - 3 :] = kh[0, 0, :3]
    assert store.staging.nbytes() == 2 * ((48 + 8) if pinned else 64) * D * 4
    np.testing.assert_array_equal(np.asarray(pool.k), want)
    np.testing.assert_array_equal(np.asarray(pool.v), -want)


def test_put_heads_then_write_head_rows_by_layout_slot():
    """A store that holds some heads of a layer (``put_heads``, one device: those heads alone, in the given
    order) is read and written by layout slot: ``head_index`` / ``head_keys`` equal numpy's indexing of the
    heads kept, a head it lacks is refused, and ``write_head_rows`` puts each row at its head's offset + slot
    in the shard that holds the head (H / S consecutive heads a shard), as numpy's assignment does."""
    B, H, T, D, S, P = 2, 4, 24, 8, 2, 64
    k = _store_array((B, H, T, D), np.float32, 11)
    store = HostKVStore(2)
    store.put_heads(0, jnp.asarray(k), jnp.asarray(-k), [3, 1])  # not consecutive: a gather, in this order
    store.put_heads(1, jnp.asarray(k + 5), jnp.asarray(k * 2), [2, 3])  # consecutive: a slice
    assert store.k[0].shape == (B, 2, T, D) and store.k[1].shape == (B, 2, T, D)
    np.testing.assert_array_equal(store.head_index(0, [[1, 3], [3, 3]]), [[1, 0], [0, 0]])
    np.testing.assert_array_equal(store.head_keys(0, [1]), k[:, [1]])
    np.testing.assert_array_equal(store.head_keys(1, [2, 3]), k[:, 2:4] + 5)
    with pytest.raises(ValueError, match=r"holds heads \[3, 1\], not all of \[0, 1\]"):
        store.head_index(0, [1, 0])
    offsets = [np.array([[0, 8, 0, 20], [4, 12, 2, 30]]), np.array([[0, 0, 40, 50], [0, 0, 40, 50]])]  # disjoint
    rng = np.random.default_rng(12)
    requests, want_k, want_v = [], np.zeros((B, S, P, D), np.float32), np.zeros((B, S, P, D), np.float32)
    want_pos = np.full((B, S, P), -1, np.int32)
    for li, heads, kk, vv in ((0, [3, 1], k, -k), (1, [2, 3], k + 5, k * 2)):
        n = 6
        b, h, pos = rng.integers(0, B, n), rng.choice(heads, n), rng.integers(0, T, n)
        slots = np.arange(n)  # distinct (b, head, slot): every row its own target
        requests.append((li, b, h, pos, slots))
        rows = offsets[li][b, h] + slots
        want_k[b, h // (H // S), rows], want_v[b, h // (H // S), rows] = kk[b, h, pos], vv[b, h, pos]
        want_pos[b, h // (H // S), rows] = pos
    pool, n, nbytes = write_head_rows(_pool(B, S, P, D), store, offsets, requests)
    assert n == 12 and nbytes == 2 * 12 * D * 4
    np.testing.assert_array_equal(np.asarray(pool.k), want_k)
    np.testing.assert_array_equal(np.asarray(pool.v), want_v)
    np.testing.assert_array_equal(np.asarray(pool.positions), want_pos)


def test_part_spans_split_a_range_at_each_part_end():
    """[lo, hi) cut at every multiple of the part size inside it (hand-computed cases)."""
    from hetero_jax.model.host_store import _part_spans

    assert _part_spans(0, 8, 8) == [(0, 8)]
    assert _part_spans(3, 20, 8) == [(3, 8), (8, 16), (16, 20)]
    assert _part_spans(8, 9, 8) == [(8, 9)]
    assert _part_spans(5, 7, 64) == [(5, 7)]


def test_host_callbacks_run_blas_on_one_thread_in_a_fresh_process():
    """``tests/blas_limit_cases.py`` in a process of its own. BLAS's thread count is process-wide, and in this
    suite's process a computation of an earlier test still running (jax dispatches asynchronously) may move it
    in the middle of the cases: twice the one-thread limit read two threads here, and a fixture that waited for
    every live array and for the limit's count to reach zero still saw it once more in CI."""
    from case_files import run_case_file

    out = run_case_file("blas_limit_cases.py", timeout=300)
    assert "deselected" not in out, out


def test_a_cpu_store_settles_into_aligned_numpy_buffers_jax_uses_in_place():
    """``settle_on_huge_pages`` on one CPU device: each layer of at least a huge page moves into a 64-byte aligned
    numpy buffer that the pinned-host jax array uses without a copy (numpy asks for huge pages; XLA's allocator
    would not), bit for bit, in float32 and bfloat16, K and values-only layers; the numpy views follow the new
    arrays; a smaller layer stays as it was; a second call and a layer put again after it behave."""
    import jax
    from hetero_jax.model import host_store as hs

    assert jax.devices()[0].platform == "cpu"
    store = hs.HostKVStore(4)
    layers = {}
    for li, dtype in enumerate((jnp.float32, jnp.bfloat16)):
        k = (jnp.arange(2 * 4 * 1024 * 128, dtype=jnp.float32).reshape(2, 4, 1024, 128) / 7).astype(dtype)
        layers[li] = (k, k + 1)
        store.put(li, k, k + 1)
    layers[2] = (None, jnp.ones((2, 4, 1024, 128), jnp.float32) * 3)
    store.put(2, None, layers[2][1])
    small = jnp.ones((1, 1, 8, 16), jnp.float32)
    layers[3] = (small, small)
    store.put(3, small, small)
    before = store.v[3]
    store.view(0)  # a view made before the move must not outlive it
    seen = []
    real_copyto = np.copyto

    def spy(dst, src, *a, **k):
        seen.append(dst.ctypes.data)
        return real_copyto(dst, src, *a, **k)

    np.copyto = spy
    try:
        store.materialize()
        n = len(seen)
        store.settle_on_huge_pages()  # nothing left to move
        assert len(seen) == n == 5  # K and V of layers 0 and 1, V of layer 2
    finally:
        np.copyto = real_copyto
    for li, (k, v) in layers.items():
        for got, want in ((store.k[li], k), (store.v[li], v)):
            if want is None:
                assert got is None
                continue
            assert got.sharding.memory_kind == "pinned_host" and got.dtype == want.dtype
            assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
            if li < 3:
                assert got.unsafe_buffer_pointer() in seen and got.unsafe_buffer_pointer() % 64 == 0
        kv, vv = store.view(li)
        assert np.shares_memory(vv, np.asarray(store.v[li])) or li == 3
        assert np.array_equal(vv.view(np.uint8), np.asarray(v).view(np.uint8))
    assert store.v[3] is before
    store.put(0, layers[0][0] * 2, layers[0][1])  # put again: moved again on the next settle
    store.settle_on_huge_pages()
    assert store.k[0].unsafe_buffer_pointer() % 64 == 0
    assert np.array_equal(np.asarray(store.k[0]).astype(np.float32), np.asarray(layers[0][0] * 2).astype(np.float32))
