"""Arguments outside a kernel's contract get a clear error on every backend, before any compute (a review found
the CPU paths converting or broadcasting what the GPU kernel, or the native one, refuses), and topk_sets keeps
its in-contract sets when a size exceeds the cap."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk


def _pool(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    B, H, G, D, P = 1, 2, 3, 16, 40
    q = jnp.asarray(rng.standard_normal((B, H, 1, G, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, P, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, P, D)), dtype)
    return q, k, v, jnp.asarray([[0, 20]], jnp.int32), jnp.asarray([[5, 7]], jnp.int32)


def test_queries_of_another_dtype_than_the_pool_are_refused_naming_both():
    """Triton's own error ('a and b must have the same element type') named no argument; the CPU backends
    widened silently."""
    q, k, v, off, lens = _pool(jnp.bfloat16)
    with pytest.raises(ValueError, match=r"q, k_pool, v_pool must share one dtype, got q float32, k_pool bfloat16"):
        pk.pool_attention_reference(q, k, v, off, lens, max_len=8)
    with pytest.raises(ValueError, match="q, k, v must share one dtype"):
        pk.sparse_decode_attention_reference(q[:, :, 0], k[:, None].repeat(2, 1), v[:, None].repeat(2, 1), lens)
    out = pk.pool_attention_reference(q.astype(jnp.bfloat16), k, v, off, lens, max_len=8)[0]  # one dtype: runs
    assert out.dtype == jnp.bfloat16


def test_float_lengths_or_offsets_are_refused():
    q, k, v, off, lens = _pool()
    with pytest.raises(ValueError, match="lengths must hold integers"):
        pk.pool_attention_reference(q, k, v, off, lens.astype(jnp.float32) + 0.5, max_len=8)
    with pytest.raises(ValueError, match="offsets must hold integers"):
        pk.pool_attention_reference(q, k, v, off.astype(jnp.float32), lens, max_len=8)


def test_topk_sets_keep_each_in_contract_set_beside_a_size_above_the_cap():
    """Sizes [3, 8] with cap 4 gave the size-3 set {0, 2, 3} (the first 4 of the top 8 by position) instead of the
    top 3 by score {2, 6, 7}; a size above the cap is its top-cap set."""
    scores = jnp.asarray([[0.1, 0.2, 0.9, 0.3, 0.4, 0.5, 0.8, 0.7]], jnp.float32)
    got = np.asarray(pk.topk_sets_xla(scores, jnp.asarray([[3, 8]], jnp.int32), 4))
    assert got[0, 0].tolist() == [2, 6, 7, -1]
    assert got[0, 1].tolist() == [2, 5, 6, 7]  # the top 4, ascending


def test_the_references_refuse_the_shapes_the_native_kernels_refuse():
    rng = np.random.default_rng(1)
    B, H, G, D, P = 3, 2, 2, 8, 5
    q = jnp.asarray(rng.standard_normal((B, H, G, D)), jnp.float32)
    kmin = jnp.asarray(rng.standard_normal((B, H, P, D)), jnp.float32)
    with pytest.raises(ValueError, match=r"n_pages and counts must be \[B\]"):
        pk.page_select_reference(q, kmin, kmin + 1, jnp.asarray([4], jnp.int32), 2)
    logits = jnp.zeros((1, 2, 3, 10), jnp.float32)
    with pytest.raises(ValueError, match=r"lengths must be \[B, Hp\]"):
        pk.pivot_statistics_reference(logits, jnp.asarray([5], jnp.int32), jnp.full((1, 2, 4), -1, jnp.int32))
    n, ps, T, R = 2, 4, 16, 40
    pool = jnp.zeros((1, 1, R, D), jnp.float32)
    store = jnp.zeros((1, 2, T, D), jnp.float32)
    ids = jnp.zeros((1, 2, n), jnp.int32)
    with pytest.raises(ValueError, match=r"offsets \[B, H\]"):
        pk.page_recall_reference(pool, pool, jnp.zeros((1, 1, R), jnp.int32), store, store,
                                 jnp.zeros((1, 1), jnp.int32), ids, ids, jnp.zeros((1,), jnp.int32),
                                 jnp.full((1,), n, jnp.int32), ps)
