"""Test helpers on the row pool, built with the cache module's own primitives (never a policy's code): a layer's
view of the pool from dense per-head arrays (attention tests), a copy of a cache whose one layer keeps given
rows (reference caches for the decode-time retrieval tests: Quest, FreeKV), and a pool of paged heads (the
kernels' block tables)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from hetero_jax.model.cache import (KVCache, KVPool, LayerCache, RowBlock, gather_rows, layer_rows, new_pool,
                                    pool_offsets, write_blocks)
from hetero_jax.model.pool import LayerStep, append
from hetero_jax.model.sharding import to_host


def step_from_dense(k, v, lengths, tail_k, tail_v, tail_lens, state=None, positions=None) -> LayerStep:
    """A ``LayerStep`` whose pool holds, for head h of sequence b, the rows k[b, h, :lengths[b, h]] (positions
    0.. unless given) and right after them the tail rows tail_k[b, h, :tail_lens[b]]; every other pool row
    is NaN (attention must never read it). k, v: [B, H, S, D]; tail_k, tail_v: [B, H, R, D]; lengths [B, H];
    tail_lens [B] (the rows each head attends past its prompt rows)."""
    k, v, tail_k, tail_v = (np.asarray(a, np.float32) for a in (k, v, tail_k, tail_v))
    lengths, tail_lens = np.asarray(lengths, np.int64), np.asarray(tail_lens, np.int64)
    B, H, S, D = k.shape
    R = tail_k.shape[2]
    offsets, P = pool_offsets(lengths[None], R, 1)
    offsets = offsets[0]
    pk = np.full((B, 1, P, D), np.nan, np.float32)
    pv = np.full((B, 1, P, D), np.nan, np.float32)
    pos = np.full((B, 1, P), -1, np.int32)
    for b in range(B):
        for h in range(H):
            o, n, t = offsets[b, h], lengths[b, h], tail_lens[b]
            pk[b, 0, o : o + n], pv[b, 0, o : o + n] = k[b, h, :n], v[b, h, :n]
            pos[b, 0, o : o + n] = np.arange(n) if positions is None else np.asarray(positions)[b, h, :n]
            pk[b, 0, o + n : o + n + t], pv[b, 0, o + n : o + n + t] = tail_k[b, h, :t], tail_v[b, h, :t]
    layer = LayerCache(offsets=jnp.asarray(offsets, jnp.int32), lengths=jnp.asarray(lengths, jnp.int32), state=state,
                       capacity=int(lengths.max()))
    return LayerStep(pool=KVPool(k=jnp.asarray(pk), v=jnp.asarray(pv), positions=jnp.asarray(pos)), layer=layer,
                     tail_lens=jnp.asarray(tail_lens, jnp.int32), seq_lens=jnp.asarray(lengths.max(1), jnp.int32),
                     tail_capacity=R)


def dense_attention(q, k, v, lengths, tail_k, tail_v, tail_lens):
    """The plain attention of one query per head over its first ``lengths`` rows and ``tail_lens`` tail rows
    (numpy float64): q [B, H, G, D] -> [B, H, G, D]."""
    q, k, v, tail_k, tail_v = (np.asarray(a, np.float64) for a in (q, k, v, tail_k, tail_v))
    B, H, G, D = q.shape
    out = np.zeros((B, H, G, D))
    for b in range(B):
        for h in range(H):
            n, t = int(lengths[b, h]), int(tail_lens[b])
            keys = np.concatenate([k[b, h, :n], tail_k[b, h, :t]])
            vals = np.concatenate([v[b, h, :n], tail_v[b, h, :t]])
            s = q[b, h] @ keys.T / np.sqrt(D)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, h] = (p / p.sum(-1, keepdims=True)) @ vals
    return out


def keep_rows(cache: KVCache, li: int, idx) -> KVCache:
    """A copy of ``cache`` whose layer ``li`` keeps, of its prompt rows, only the rows ``idx`` [B, H, S] (rows of
    each head's prompt part, every head S of them, in that order); every other layer's prompt rows and every
    tail row (tokens added after prefill) as they are. The default attention over it attends exactly those rows
    and the tail."""
    idx = np.asarray(idx, np.int64)
    B, S = cache.batch_size, cache.pool.num_shards
    counts = np.stack([to_host(l.lengths) for l in cache.layers]).astype(np.int64)  # [L, B, H]
    counts[li] = idx.shape[-1]
    offsets, rows = pool_offsets(counts, cache.tail_capacity, S)
    D = cache.pool.k.shape[-1]
    pool = new_pool(B, S, rows, D, cache.pool.k.dtype)
    R = cache.tail_capacity
    layers = []
    for l, lc in enumerate(cache.layers):
        k, v, pos, _ = layer_rows(cache, l)
        if l == li:
            take = lambda a: jnp.take_along_axis(a, jnp.asarray(idx).reshape(idx.shape + (1,) * (a.ndim - 3)), axis=2)  # noqa: E731
            k, v, pos = take(k), take(v), take(pos)
        H = lc.num_heads
        off, cnt = jnp.asarray(offsets[l], jnp.int32), jnp.asarray(counts[l], jnp.int32)
        block = RowBlock(k=k, v=v, positions=pos, lengths=cnt, heads=tuple(range(H)))
        pool = write_blocks(pool, off, cnt, (block,))
        new = lc.replace(offsets=off, lengths=cnt, capacity=int(counts[l].max()))
        tail = jnp.broadcast_to(cache.tail_lens[:, None], (B, H)).astype(jnp.int32)
        tk, tv, _ = gather_rows(cache.pool, lc.offsets + lc.lengths, tail, R)  # [B, H, R, D], zero past tail_lens
        pool = append(pool, new, jnp.zeros((B,), jnp.int32), tk, tv, R)
        layers.append(new)
    return cache.replace(pool=pool, layers=tuple(layers))


def make_paged_pool(rng, lengths, n_blocks, region_blocks, bs, D, dtype):
    """A pool whose heads each own ``region_blocks`` blocks of ``bs`` rows (regions at shuffled offsets with
    gaps) and a block table [B, H, n_blocks] naming distinct blocks of the region in a random order. Rows of
    the blocks a head sees (its first ``lengths`` logical keys) are finite, every other row is NaN; returns
    (k_nan, v_nan, offsets, table) and the numpy [B, H] list of each head's visible pool rows in logical order."""
    lengths = np.asarray(lengths, np.int32)
    B, H = lengths.shape
    cap = region_blocks * bs
    P = H * (cap + 5) + 3
    offsets = np.zeros((B, H), np.int32)
    table = np.zeros((B, H, n_blocks), np.int32)
    k = rng.standard_normal((B, P, D)).astype(np.float32)
    v = rng.standard_normal((B, P, D)).astype(np.float32)
    seen = np.zeros((B, P), bool)
    rows = {}
    for b in range(B):
        pos = 2
        for h in rng.permutation(H):
            offsets[b, h] = pos
            table[b, h] = rng.permutation(region_blocks)[:n_blocks] * bs
            r = (pos + table[b, h][:, None] + np.arange(bs)).reshape(-1)[: lengths[b, h]]
            rows[b, h] = r
            seen[b, r] = True
            pos += cap + int(rng.integers(1, 6))
    k, v = np.where(seen[..., None], k, np.nan), np.where(seen[..., None], v, np.nan)
    cast = lambda x: jnp.asarray(x, jnp.float32).astype(dtype)       # noqa: E731
    return cast(k), cast(v), jnp.asarray(offsets), jnp.asarray(table), rows
