"""Reference caches on the row pool for the decode-time retrieval tests (Quest, FreeKV): a copy of a cache
whose one layer keeps exactly some of its prompt rows, built with the cache module's own primitives
(``pool_offsets``, ``write_blocks``, ``pool.append``), never with a policy's code."""

import jax.numpy as jnp
import numpy as np

from hetero_jax.model.cache import KVCache, RowBlock, gather_rows, layer_rows, new_pool, pool_offsets, write_blocks
from hetero_jax.model.pool import append
from hetero_jax.model.sharding import to_host


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
