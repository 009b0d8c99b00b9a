"""HCAttention's host weighted sum (``host_store.host_weighted_sum``) runs numpy's BLAS on one thread inside its
callback, and overlapping callbacks restore BLAS's count once the last one leaves.

Collected only by ``tests/test_host_store.py``, which starts pytest on this file in a process of its own: BLAS's
thread count is process-wide, so nothing else may run beside these cases. scipy's linear algebra is loaded so
that two BLAS libraries (numpy's and scipy's) are in the process, as in the whole suite's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg  # noqa: F401  (scipy's own BLAS, a second library the limit must reach)
from threadpoolctl import threadpool_info, threadpool_limits

import pallas_kernels
from hetero_jax.model.host_store import HostKVStore, _one_blas_thread, host_weighted_sum


def _blas_thread_counts() -> list[int]:
    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


def test_two_blas_libraries_are_loaded():
    assert len(_blas_thread_counts()) == 2, threadpool_info()


def test_host_weighted_sum_on_a_cpu_backend_runs_blas_on_one_thread():
    # the callback runs on one of XLA's CPU threads: BLAS threads of its own would fight XLA's for the cores
    B, H, Q, T, D = 1, 2, 3, 64, 8
    rng = np.random.default_rng(0)
    v = rng.standard_normal((B, H, T, D)).astype(np.float32)
    w = rng.random((B, H, Q, T)).astype(np.float32)
    w[0, 1, :, 8:] = 0.0  # head 1 weighs 8 rows: the gathered product; head 0 every row: the whole one
    store = HostKVStore(1)
    store.put(0, None, jnp.asarray(v))
    store.materialize()
    blas_threads = []

    class Spy(np.ndarray):  # the store's values, recording BLAS's thread count at each product
        def __rmatmul__(self, other):
            blas_threads.append(_blas_thread_counts())
            return np.asarray(other) @ np.asarray(self)

    store._views[0] = (None, store._views[0][1].view(Spy))
    # traced for a CPU (the reference kernels), two BLAS threads outside the callback whatever this machine has
    with pallas_kernels.use_kernels("reference"), threadpool_limits(limits=2, user_api="blas"):
        y = jax.jit(lambda h, w: host_weighted_sum(h, 0, w, D))(store.handle_array(), jnp.asarray(w))
        y.block_until_ready()
        after = _blas_thread_counts()
    np.testing.assert_allclose(np.asarray(y), np.einsum("bhqt,bhtd->bhqd", w, v), rtol=1e-5, atol=1e-5)
    assert len(blas_threads) == B * H and all(n == [1] * len(n) and n for n in blas_threads), blas_threads
    assert after == [2] * len(after)  # restored after the callback
    assert store.counters["decode"][0] == 1 and store.counters["decode"][2] == T + 8


def test_one_blas_thread_overlapping_callbacks_restore_the_count_once_the_last_leaves():
    # a mesh's per-device callbacks may overlap: the first in sets one thread, the last out restores the count
    with threadpool_limits(limits=2, user_api="blas"):
        first, second = _one_blas_thread(), _one_blas_thread()
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)  # the first out while the second is still inside
        inside = _blas_thread_counts()
        second.__exit__(None, None, None)
        assert inside == [1] * len(inside) and inside and _blas_thread_counts() == [2] * len(inside)
