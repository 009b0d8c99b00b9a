"""The host recall's native row gather (``native.gather_rows_native``, host_gather.cc) against numpy fancy indexing:
several pieces of different dtypes and row sizes split over 1-8 threads (a thread's rows crossing pieces), empty
pieces and pieces shorter than the prefetch distance; rows shared by pieces; calls from several threads at once on
the helper threads it keeps, and in a forked child; rows out of range and layouts it cannot take refused. The whole
recall's call (``native.gather_requests_native``) against numpy indexing of each request's (b, h, position), its
index rows against the indices, indices out of range reported before anything is written; and ``send_host_rows``
giving the same staged rows through it as through numpy's take (its fallback), and refusing an index out of
range before any transfer."""

import os
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from hetero_jax.model import host_store
from hetero_jax.model.host_store import HostKVStore, send_host_rows
from pallas_kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler for the native kernels")


def _pieces(seed: int):
    """(src, rows, dst) pieces: bfloat16 rows of 64, float32 of 5 (20 bytes), float16 of 3 (6 bytes), uint8
    [4, 3] rows; row counts 0, 1, 7, 40 and 300 (numbers drawn with repeats, in no order)."""
    rng = np.random.default_rng(seed)
    specs = [(ml_dtypes.bfloat16, (64,), 300), (np.float32, (5,), 7), (np.float16, (3,), 0), (np.uint8, (4, 3), 40),
             (np.float32, (64,), 1)]
    pieces = []
    for i, (dtype, row, n) in enumerate(specs):
        n_src = 50 + 30 * i
        src = (rng.standard_normal((n_src, *row)) * 40).astype(dtype)
        rows = rng.integers(0, n_src, n)
        pieces.append((src, rows, np.full((n, *row), 7, dtype)))
    return pieces


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_pieces_equal_fancy_indexing(threads):
    pieces = _pieces(threads)
    native.gather_rows_native(pieces, threads=threads)
    for src, rows, dst in pieces:
        assert np.array_equal(dst.view(np.uint8), src[rows].view(np.uint8))  # bit for bit


def _equal(pieces) -> bool:
    return all(np.array_equal(dst.view(np.uint8), src[rows].view(np.uint8)) for src, rows, dst in pieces)


def test_calls_from_several_threads_at_once_and_helper_counts_that_change():
    """Six Python threads gathering their own pieces at once, each asking for 1-8 threads (the helpers serve one
    call at a time; a call that finds them taken copies on its own thread), then calls on 8, 2, 5, 1 and 3
    threads one after another on the helpers kept from the first: every piece equals numpy's indexing."""
    results = {}

    def run(i):
        pieces = _pieces(10 + i)
        for _ in range(20):
            native.gather_rows_native(pieces, threads=1 + i % 8)
        results[i] = _equal(pieces)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: True for i in range(6)}
    for n in (8, 2, 5, 1, 3):
        pieces = _pieces(20 + n)
        native.gather_rows_native(pieces, threads=n)
        assert _equal(pieces)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # jax warns that a fork of a threaded process is unsafe
def test_a_forked_child_gathers_on_helpers_of_its_own():
    """A child forked after the parent's helper threads exist has none of them: its call starts its own helpers
    (with the parent's it would wait forever for threads the fork did not copy) and gathers right."""
    native.gather_rows_native(_pieces(30), threads=4)  # the parent's helpers exist
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 when its rows are right, never back into pytest
        code = 1
        try:
            pieces = _pieces(31)
            native.gather_rows_native(pieces, threads=4)
            code = 0 if _equal(pieces) else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's gather did not return within 60 s")


def test_pieces_that_share_their_rows():
    """A K and a V piece of different dtypes naming one rows object (a list, not an array), a third piece its
    own rows; a row out of range in shared rows is reported for them."""
    rng = np.random.default_rng(4)
    k, v = rng.standard_normal((30, 8)).astype(np.float32), rng.standard_normal((30, 8)).astype(ml_dtypes.bfloat16)
    rows = [29, 0, 3, 3, 17]
    pieces = [(k, rows, np.empty((5, 8), np.float32)), (v, rows, np.empty((5, 8), ml_dtypes.bfloat16)),
              (k, np.array([1, 2]), np.empty((2, 8), np.float32))]
    native.gather_rows_native(pieces, threads=2)
    assert _equal([(s, np.asarray(r), d) for s, r, d in pieces])
    bad = [1, 30]
    with pytest.raises(IndexError, match="row 30 is out of range for a source of 30 rows"):
        native.gather_rows_native([(k, bad, np.empty((2, 8), np.float32)), (v, bad, np.empty((2, 8), ml_dtypes.bfloat16))])


def test_rows_into_a_slice_of_a_larger_buffer_leave_the_rest():
    src = np.arange(40 * 8, dtype=np.float32).reshape(40, 8)
    buf = np.full((20, 8), -1, np.float32)
    rows = np.array([39, 0, 5, 5, 17])
    native.gather_rows_native([(src, rows, buf[6:11])], threads=2)
    assert np.array_equal(buf[6:11], src[rows])
    assert (buf[:6] == -1).all() and (buf[11:] == -1).all()


@pytest.mark.parametrize("bad", [40, -1])
def test_row_out_of_range_raises(bad):
    src = np.zeros((40, 8), np.float32)
    rows = np.array([1, 2, bad, 3])
    with pytest.raises(IndexError, match=f"row {bad} is out of range for a source of 40 rows"):
        native.gather_rows_native([(src, np.array([0]), np.empty((1, 8), np.float32)),
                                   (src, rows, np.empty((4, 8), np.float32))], threads=2)


def test_layouts_it_cannot_take_are_refused():
    src = np.zeros((40, 8), np.float32)
    with pytest.raises(ValueError, match="C-contiguous"):
        native.gather_rows_native([(src[:, ::2], np.array([0]), np.empty((1, 4), np.float32))])
    with pytest.raises(ValueError, match="dst must be"):
        native.gather_rows_native([(src, np.array([0, 1]), np.empty((1, 8), np.float32))])
    with pytest.raises(ValueError, match="dst must be"):
        native.gather_rows_native([(src, np.array([0]), np.empty((1, 8), np.float64))])


def test_send_host_rows_same_rows_natively_and_with_numpy(monkeypatch):
    """A recall of two layers' rows in parts of 64 rows (pieces cut at part ends), gathered by the native gather
    and by numpy's take on the thread pool: the same staged rows and row ints."""
    rng = np.random.default_rng(3)
    store = HostKVStore(2)
    for li in range(2):
        k = rng.standard_normal((2, 3, 90, 16)).astype(np.float32)
        store.put(li, k, k + 1)
    store.materialize()
    requests = [(li, rng.integers(0, 2, 70), rng.integers(0, 3, 70), rng.integers(0, 90, 70), np.zeros(70, int),
                 rng.permutation(200)[:70]) for li in range(2)]

    def staged(use_native):
        if not use_native:
            monkeypatch.setattr(native, "available", lambda: False)
        monkeypatch.setattr(host_store, "GATHER_THREADS", 2)
        parts, n = send_host_rows(store, requests, rows=200, chunk=64, staging=host_store.Staging(pinned=False))
        monkeypatch.undo()
        return n, [tuple(np.asarray(x) for x in part) for part in parts]

    n_native, got = staged(True)
    n_numpy, want = staged(False)
    assert n_native == n_numpy == 140 and len(got) == len(want) == 3
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert np.array_equal(a, b)
    k0 = np.asarray(store.k[0])
    b, h, p = requests[0][1:4]
    assert np.array_equal(got[0][1], k0[b[:64], h[:64], p[:64]])  # against numpy indexing of the store itself


@pytest.mark.parametrize("shift", [0, 4, 8, 16, 32])
@pytest.mark.parametrize("D", [18, 64])
def test_destinations_at_any_alignment(shift, D):
    """Rows of 72 and 256 bytes into destinations 4-32 bytes past a 64-byte boundary: the aligned rows take the
    non-temporal stores (a 72-byte row its last 8 bytes by memcpy), the others memcpy; all equal numpy's."""
    rng = np.random.default_rng(shift + D)
    src = rng.standard_normal((100, D)).astype(np.float32)
    rows = rng.integers(0, 100, 37)
    raw = np.zeros(37 * D * 4 + 128, np.uint8)
    at = (-raw.ctypes.data) % 64 + shift
    dst = raw[at : at + 37 * D * 4].view(np.float32).reshape(37, D)
    native.gather_rows_native([(src, rows, dst)], threads=2)
    assert np.array_equal(dst, src[rows])
    assert not raw[:at].any() and not raw[at + 37 * D * 4 :].any()


def _requests(seed: int):
    """Three requests of a recall: bfloat16 K [2, 3, 50, 64] with float32 V [.., 5] rows (K and V of different
    sizes), then uint8 [2, 3, 50, 4, 3] pairs; 37, 1 and 90 rows, one with b and shard as one value for all."""
    rng = np.random.default_rng(seed)
    out = []
    for i, (kd, kr, vd, vr, m) in enumerate([(ml_dtypes.bfloat16, (64,), np.float32, (5,), 37),
                                             (ml_dtypes.bfloat16, (64,), np.float32, (5,), 1),
                                             (ml_dtypes.bfloat16, (64,), np.float32, (5,), 90)]):
        k = (rng.standard_normal((2, 3, 50, *kr)) * 40).astype(kd)
        v = (rng.standard_normal((2, 3, 50, *vr)) * 40).astype(vd)
        b = np.array([1]) if i == 2 else rng.integers(0, 2, m)
        shard = np.array([7]) if i == 2 else rng.integers(0, 4, m)
        out.append((k, v, b, rng.integers(0, 3, m), rng.integers(0, 50, m), shard, rng.integers(0, 999, m)))
    return out


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("chunk", [16, 128])
def test_requests_equal_numpy_indexing_rows_and_ints(threads, chunk):
    """128 rows of three requests into parts of 16 rows (requests and threads crossing part ends) or one part:
    each staged K and V row equals numpy's indexing of its request's arrays, bit for bit, and the index rows
    hold (b, shard, pool row, position); what lies past the rows is left as it was."""
    requests = _requests(threads + chunk)
    n_parts = -(-128 // chunk)
    k_parts = [np.full((chunk, 64), 3, ml_dtypes.bfloat16) for _ in range(n_parts)]
    v_parts = [np.full((chunk, 5), 3, np.float32) for _ in range(n_parts)]
    ints = np.full((4, 140), -5, np.int32)
    assert native.gather_requests_native(requests, k_parts, v_parts, ints, threads=threads) is None
    k_all, v_all = np.concatenate(k_parts), np.concatenate(v_parts)
    at = 0
    for k, v, b, h, p, shard, pool_rows in requests:
        m = len(p)
        b, shard = np.broadcast_to(b, (m,)), np.broadcast_to(shard, (m,))
        assert np.array_equal(k_all[at : at + m].view(np.uint16), k[b, h, p].view(np.uint16))
        assert np.array_equal(v_all[at : at + m].view(np.uint32), v[b, h, p].view(np.uint32))
        assert np.array_equal(ints[:, at : at + m], np.stack([b, shard, pool_rows, p]))
        at += m
    assert at == 128 and (ints[:, 128:] == -5).all()


@pytest.mark.parametrize("axis,where", [(0, 2), (1, 0), (2, 1), (2, 2)])
@pytest.mark.parametrize("bad", ["above", "negative"])
def test_request_index_out_of_range_is_reported_before_anything_is_written(axis, where, bad):
    """One (b, h or position) index of one request out of range (its size, or -1): the call returns (request,
    axis) and neither the staging rows nor the index rows were written (the other requests' rows included)."""
    requests = _requests(5)
    k, v, *indices = requests[where]
    indices = [np.array(x) for x in indices]
    indices[axis][-1] = k.shape[axis] if bad == "above" else -1
    requests[where] = (k, v, *indices)
    k_parts, v_parts = [np.full((128, 64), 3, ml_dtypes.bfloat16)], [np.full((128, 5), 3, np.float32)]
    ints = np.full((4, 128), -5, np.int32)
    assert native.gather_requests_native(requests, k_parts, v_parts, ints, threads=2) == (where, axis)
    assert (k_parts[0] == 3).all() and (v_parts[0] == 3).all() and (ints == -5).all()


def test_requests_layouts_it_cannot_take_are_refused():
    (k, v, *indices), = _requests(6)[:1]
    parts = ([np.empty((64, 64), ml_dtypes.bfloat16)], [np.empty((64, 5), np.float32)])
    ints = np.empty((4, 64), np.int32)
    with pytest.raises(ValueError, match="C-contiguous K and V"):
        native.gather_requests_native([(k[:, :, ::2], v[:, :, ::2], *indices)], *parts, ints)
    with pytest.raises(ValueError, match="as many values as its positions"):
        native.gather_requests_native([(k, v, indices[0][:2], *indices[1:])], *parts, ints)
    with pytest.raises(ValueError, match="staging parts"):
        native.gather_requests_native([(k, v, *indices)], [np.empty((64, 64), np.float32)], parts[1], ints)
    with pytest.raises(ValueError, match="int32 ints"):
        native.gather_requests_native([(k, v, *indices)], *parts, np.empty((4, 20), np.int32))
    with pytest.raises(ValueError, match="int32 ints"):
        native.gather_requests_native([(k, v, *indices)], [parts[0][0][:20]], [parts[1][0][:20]], ints)


def test_send_host_rows_refuses_an_index_out_of_range_before_any_transfer(monkeypatch):
    """A recall whose second request names position T: IndexError naming the axis and the store's shape, from
    the native call and from the numpy fallback alike, and no transfer started."""
    store = HostKVStore(2)
    for li in range(2):
        k = np.ones((1, 2, 30, 8), np.float32)
        store.put(li, k, k)
    store.materialize()
    requests = [(0, 0, np.array([0, 1]), np.array([3, 29]), 0, np.array([0, 1])),
                (1, 0, np.array([1]), np.array([30]), 0, np.array([2]))]
    sent = []
    monkeypatch.setattr(host_store, "_send", lambda *a: sent.append(a))
    for use_native in (True, False):
        if not use_native:
            monkeypatch.setattr(native, "available", lambda: False)
        with pytest.raises(IndexError, match=r"position index out of range for a \[1, 2, 30, 8\] store"):
            send_host_rows(store, requests, rows=8, staging=host_store.Staging(pinned=False))
    assert not sent
