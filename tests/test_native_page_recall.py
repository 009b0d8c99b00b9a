"""pallas_kernels.page_recall: the native kernel and the plain-JAX reference against a numpy loop over heads and
slots (the host recall's pairing: the m-th new page into the m-th freed slot), in place under jit with the pool
donated, at odd shapes, bfloat16 and float32; bad page ids refused."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import native

needs_native = pytest.mark.skipif(not native.available(), reason="no C++ compiler for the native kernels")

B, H, D, PS, N = 3, 3, 8, 4, 5


def numpy_recall(pool_k, pool_v, pool_pos, store_k, store_v, offsets, pending, resident, start, k_sel, ps):
    """The recall one head and slot at a time (module docstring)."""
    pk, pv, pp, res = (np.array(a) for a in (pool_k, pool_v, pool_pos, resident))
    moved = np.zeros(len(start), np.int32)
    for b in range(pending.shape[0]):
        ks = int(k_sel[b])
        for h in range(pending.shape[1]):
            want, held = list(pending[b, h, :ks]), list(resident[b, h, :ks])
            fresh = [p for p in want if p not in held]
            freed = [j for j in range(ks) if held[j] not in want]
            for page, slot in zip(fresh, freed):
                src = start[b] + page * ps + np.arange(ps)
                dst = offsets[b, h] + start[b] + slot * ps + np.arange(ps)
                pk[b, 0, dst], pv[b, 0, dst], pp[b, 0, dst] = store_k[b, h, src], store_v[b, h, src], src
                res[b, h, slot] = page
            moved[b] += min(len(fresh), len(freed))
    return pk, pv, pp, res, moved


def case(seed: int, dtype):
    """Random store and pool; each head's region [start | N slots | window] at its own offset; k_sel 5, 3, 1;
    resident distinct pages, pending a mix of resident pages (some in other slots) and new ones."""
    rng = np.random.default_rng(seed)
    start = np.array([2, 0, 5], np.int32)
    k_sel = np.array([5, 3, 1], np.int32)
    n_pages = 12
    T = int(start.max()) + n_pages * PS + 3
    store_k = rng.normal(size=(B, H, T, D)).astype(dtype)
    store_v = rng.normal(size=(B, H, T, D)).astype(dtype)
    region = int(start.max()) + N * PS + 6
    offsets = (np.arange(H)[None, :] * region + np.array([0, 3, 7])[:, None]).astype(np.int32)
    R = int(offsets.max()) + region + 2
    pool_k = rng.normal(size=(B, 1, R, D)).astype(dtype)
    pool_v = rng.normal(size=(B, 1, R, D)).astype(dtype)
    pool_pos = rng.integers(-1, 50, size=(B, 1, R)).astype(np.int32)
    resident = np.stack([np.stack([rng.permutation(n_pages)[:N] for _ in range(H)]) for _ in range(B)]).astype(np.int32)
    pending = resident.copy()
    for b in range(B):
        for h in range(H):
            keep = rng.permutation(N)[: rng.integers(0, N + 1)]
            others = [p for p in rng.permutation(n_pages) if p not in resident[b, h]]
            fill = iter(others)
            pending[b, h] = [resident[b, h, j] if j in keep else next(fill) for j in range(N)]
            pending[b, h] = pending[b, h, rng.permutation(N)]  # kept pages may sit in other slots
    return (pool_k, pool_v, pool_pos, store_k, store_v, offsets, pending, resident, start, k_sel)


@functools.partial(jax.jit, static_argnames=("backend",), donate_argnums=(0, 1, 2))
def recall_jit(pool_k, pool_v, pool_pos, store_k, store_v, offsets, pending, resident, start, k_sel, backend):
    return pallas_kernels.page_recall(pool_k, pool_v, pool_pos, store_k, store_v, offsets, pending, resident, start,
                                      k_sel, PS, backend=backend)


def check(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g).astype(np.float32) if g.dtype == jnp.bfloat16 else np.asarray(g),
                                      np.asarray(w).astype(np.float32) if w.dtype == jnp.bfloat16 else w)


@pytest.mark.parametrize("backend", ["reference", pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recall_equals_a_numpy_loop(backend, dtype, seed):
    args = case(seed, dtype)
    want = numpy_recall(*args, PS)
    assert want[4].sum() > 0 and (want[3] != args[7]).any()  # pages really move
    got = recall_jit(*(jnp.asarray(a) for a in args), backend=backend)
    check(got, want)


def test_nothing_moves_when_the_selection_is_resident():
    args = list(case(4, np.float32))
    args[6] = args[7].copy()
    for b, ks in enumerate(args[9]):
        args[6][b, :, :ks] = args[7][b, :, :ks][:, ::-1]  # the same pages, other slots
    got = recall_jit(*(jnp.asarray(a) for a in args), backend="reference")
    check(got, (args[0], args[1], args[2], args[7], np.zeros(B, np.int32)))
    if native.available():
        got = recall_jit(*(jnp.asarray(a) for a in args), backend="native")
        check(got, (args[0], args[1], args[2], args[7], np.zeros(B, np.int32)))


@needs_native
def test_native_refuses_a_page_outside_the_store():
    args = list(case(5, np.float32))
    args[6] = args[6].copy()
    args[6][0, 0, 0] = 10_000
    with pytest.raises(Exception, match="page id outside the store"):
        jax.block_until_ready(recall_jit(*(jnp.asarray(a) for a in args), backend="native"))


@needs_native
def test_native_wrapper_checks_shapes_and_dtypes():
    args = [jnp.asarray(a) for a in case(6, np.float32)]
    with pytest.raises(ValueError, match="pool's dtype"):
        native.page_recall_native(*args[:3], args[3].astype(jnp.bfloat16), args[4], *args[5:], PS)
    with pytest.raises(ValueError, match=r"\[B, 1, R, D\]"):
        native.page_recall_native(args[0][:, 0], *args[1:], PS)
    with pytest.raises(ValueError, match="page_size"):
        native.page_recall_native(*args, 0)
