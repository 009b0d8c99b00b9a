"""The KV-cache pytree: one row pool per device, and per layer each KV head's offset and length in it.

Every policy keeps its device K/V in one layout:

- The pool (:class:`KVPool`, [B, S, P, D]) holds, per sequence b and shard s of the "model" mesh axis (S = 1
  on one device), the rows of every KV head that shard holds, of every layer.
- Head h of layer l (layout order) owns the region [offsets[b, h], offsets[b, h] + capacity) of
  ``pool[b, h // (H / S)]``: its kept prompt rows first (``lengths[b, h]`` of them, any subset and number
  of the prompt, each with its original position in ``positions``), then the tokens added after prefill
  (generated tokens, a session's turns), ``tail_lens[b]`` of them, the same for every head. The capacity
  is ``lengths + tail_capacity``: the one slack rule (:func:`pool_offsets`), decided at prefill; a
  session that outgrows it gets a repacked pool (:func:`resize_tail`).
- A layer's attention reads each head's ``lengths + tail_lens`` rows in place, every head of the layer in
  one call (``hetero_jax.model.pool``). Recalls, per-turn re-selections and page fetches write rows into
  the prompt part of a head's region (``host_store.scatter_rows``).

Keys are stored after RoPE (a kept key never needs re-rotation) and at ``num_kv_heads``, never at the
query-head count. A policy's per-layer device state (HeteroCache's K_base, page summaries, ...) is a typed
record in ``LayerCache.state`` whose fields declare their logical axes (``spec.axes_field``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from hetero_jax.dims import axis_size
from hetero_jax.model.sharding import to_host
from hetero_jax.model.spec import axes_field

# Pool rows are allocated in multiples of this (alignment; a few hundred rows of a pool of millions).
POOL_QUANTUM = 128


@struct.dataclass
class KVPool:
    k: jax.Array = axes_field("batch", "kv_heads", "pool_rows", "head_dim")  # [B, S, P, D] keys after RoPE
    v: jax.Array = axes_field("batch", "kv_heads", "pool_rows", "head_dim")  # [B, S, P, D]
    # [B, S, P] int32 original position of each kept prompt row; -1 elsewhere (tail rows: ``tail_positions``)
    positions: jax.Array = axes_field("batch", "kv_heads", "pool_rows")

    num_shards = axis_size("k", 1, "shards of the model axis (1 on one device)")
    num_rows = axis_size("k", 2, "rows of each shard's pool")


@struct.dataclass
class LayerCache:
    offsets: jax.Array = axes_field("batch", "kv_heads")  # [B, H] int32 first pool row of each head's region
    lengths: jax.Array = axes_field("batch", "kv_heads")  # [B, H] int32 kept prompt rows of each head
    state: Any = None  # the policy's per-layer device state (a record of axes_fields) or None
    # static: the most prompt rows any head of the layer keeps (over the batch); a region holds at most
    # capacity + tail_capacity rows, the bound a kernel's key loop is compiled for
    capacity: int = struct.field(pytree_node=False, default=0)

    num_heads = axis_size("offsets", 1, "KV heads of the layer")


@struct.dataclass
class KVCache:
    pool: KVPool
    layers: tuple[LayerCache, ...]
    seq_lens: jax.Array = axes_field("batch")  # [B] int32 tokens processed = position of the next token
    prompt_lens: jax.Array = axes_field("batch")  # [B] int32 tokens of the prefilled prompt
    tail_lens: jax.Array = axes_field("batch")  # [B] int32 rows added after prefill (every head)
    tail_positions: jax.Array = axes_field("batch", "slots")  # [B, R] int32 their positions; -1 = empty
    # the mesh the cache lives on (static; None on one device): the pool's shard axis is its "model" axis
    mesh: Any = struct.field(pytree_node=False, default=None)

    batch_size = axis_size("seq_lens", 0, "sequences in the batch")
    tail_capacity = axis_size("tail_positions", 1, "rows each head has for tokens added after prefill")


@struct.dataclass
class RowBlock:
    """Kept prompt rows of some heads of one layer, as a prefill plan hands them over (dense, padded)."""

    k: jax.Array  # [B, m, S, D]
    v: jax.Array  # [B, m, S, D]
    positions: jax.Array  # [B, m, S] int32 original position of each row; rows >= lengths are padding
    lengths: jax.Array  # [B, m] int32 kept rows of each head
    heads: tuple[int, ...] = struct.field(pytree_node=False, default=())  # the m heads' layout slots

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


@struct.dataclass
class LayerPrefill:
    """What a plan's ``build_layer`` returns: row blocks covering the layer's heads, and its state record."""

    blocks: tuple[RowBlock, ...]
    state: Any = None


def capacity_bucket(rows: int) -> int:
    """The static bound a layer's kernels are compiled for, from the most prompt rows a head of it keeps:
    ``rows`` rounded up to a multiple of max(POOL_QUANTUM, a quarter of its power of two), so prompts of
    nearby lengths share executables (the exact count compiled decode once per prompt length). The kernels
    mask every head by its own length, so the bound changes no result."""
    return bucket(rows, POOL_QUANTUM)


def block_width(t_max: int, buffer_rows: int) -> int:
    """The rows of a prefill's whole-prompt row block: the longest prompt ``t_max`` rounded up to its key bound
    (:func:`capacity_bucket`), at most the prefill buffer's ``buffer_rows``. The writer (:func:`write_blocks`)
    drops every row past a head's count and is compiled per block shape: an exact width compiled it per
    prompt length."""
    return min(int(buffer_rows), capacity_bucket(t_max))


def bucket(n: int, quantum: int, per_doubling: int = 4) -> int:
    """``n`` rounded up to a multiple of max(``quantum``, its power of two / ``per_doubling``, a power of two):
    at most 1/per_doubling more (or ``quantum - 1``), so nearby sizes share one static shape; 0 for n <= 0."""
    if n <= 0:
        return 0
    q = max(quantum, 1 << max(0, int(n).bit_length() - 1 - (per_doubling.bit_length() - 1)))
    return -(-int(n) // q) * q


def heads_per_shard(cache_or_pool, num_heads: int) -> int:
    pool = cache_or_pool.pool if isinstance(cache_or_pool, KVCache) else cache_or_pool
    return num_heads // pool.num_shards


def pool_offsets(counts: np.ndarray, tail_capacity: int, shards: int = 1) -> tuple[np.ndarray, int]:
    """The one slack rule. counts: [L, B, H] prompt rows each head keeps (layout order). Each head's region
    holds its rows plus ``tail_capacity`` rows for tokens added after prefill; shard s packs the regions of
    its heads (layout slots [s H/S, (s + 1) H/S)) layer after layer. Returns (offsets [L, B, H] int64, the
    pool's rows P: the largest (sequence, shard) total, rounded up to a bucket of at most 1/16 of it)."""
    counts = np.asarray(counts, np.int64)
    L, B, H = counts.shape
    if H % shards:
        raise ValueError(f"{shards} shards do not divide {H} KV heads")
    cap = counts + int(tail_capacity)  # [L, B, H]
    per_shard = cap.reshape(L, B, shards, H // shards).transpose(1, 2, 0, 3).reshape(B, shards, L * H // shards)
    starts = np.cumsum(per_shard, axis=-1) - per_shard  # [B, S, L * H/S] exclusive prefix sums
    offsets = starts.reshape(B, shards, L, H // shards).transpose(2, 0, 1, 3).reshape(L, B, H)
    total = int(per_shard.sum(axis=-1).max()) if per_shard.size else 0
    # rounded up to a multiple of max(POOL_QUANTUM, a sixteenth of its power of two): at most 1/16 more rows,
    # and prompts of nearby lengths share the pool's shape and so the executables that take it
    return offsets, max(POOL_QUANTUM, bucket(total, POOL_QUANTUM, per_doubling=16))


def new_pool(batch: int, shards: int, rows: int, head_dim: int, dtype, mesh=None) -> KVPool:
    """A zero pool [B, S, P, D] made where it lives (split over the mesh when given)."""
    shape = (batch, shards, rows, head_dim)

    def make():
        return KVPool(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), positions=jnp.full(shape[:3], -1, jnp.int32))

    if mesh is None:
        return make()
    from hetero_jax.model.sharding import tree_shardings

    out = tree_shardings(jax.eval_shape(make), mesh)
    return jax.jit(make, out_shardings=out)()


@functools.partial(jax.jit, donate_argnums=(0,))
def write_blocks(pool: KVPool, offsets: jax.Array, counts: jax.Array, blocks: tuple[RowBlock, ...]) -> KVPool:
    """``pool`` (donated) with each block's rows written into its heads' regions: row j of head h of sequence
    b at pool[b, shard(h), offsets[b, h] + j] for j < counts[b, h] (the rest of a block is padding and is
    dropped, so it never reaches a neighbouring region). offsets, counts: [B, H] int32 of the layer."""
    H = offsets.shape[1]
    n_local = H // pool.num_shards
    for blk in blocks:
        B, m, S = blk.positions.shape
        heads = np.asarray(blk.heads, np.int64)
        t = jnp.arange(S, dtype=jnp.int32)
        slot = jnp.where(t < counts[:, heads, None], offsets[:, heads, None] + t, pool.num_rows)  # [B, m, S]
        b = jnp.arange(B)[:, None, None]
        s = jnp.asarray(heads // n_local, jnp.int32)[None, :, None]
        pool = pool.replace(k=pool.k.at[b, s, slot].set(blk.k.astype(pool.k.dtype), mode="drop"),
                            v=pool.v.at[b, s, slot].set(blk.v.astype(pool.v.dtype), mode="drop"),
                            positions=pool.positions.at[b, s, slot].set(blk.positions, mode="drop"))
    return pool


class PoolBuilder:
    """A prefill's cache, built as the prefill goes: the pool is allocated from the plan's ``prompt_counts()``
    (:func:`pool_offsets`) before the first layer, and each layer's row blocks are written as soon as the
    plan hands them over, so only one layer's full prompt K/V ever exists beside the pool. A plan whose
    counts are decided at the end (``prompt_counts()`` is None: CAKE's cascade) keeps its blocks until
    :meth:`cache`, where its ``cut(outputs) -> (outputs, counts)`` gives the final ones."""

    def __init__(self, plan, prompt_lens, cfg, tail_capacity: int, dtype, mesh=None, compile_fn=None):
        self.plan, self.cfg, self.dtype, self.mesh = plan, cfg, dtype, mesh
        self.lens = np.asarray(prompt_lens, np.int64)
        self.tail_capacity = int(tail_capacity)
        self.shards = 1 if mesh is None else int(mesh.shape["model"])
        self.compile_fn = compile_fn or (lambda f, *a, **st: functools.partial(f, **st))
        self.pool: KVPool | None = None
        self.outputs: list = [None] * cfg.num_layers
        self.states: list = [None] * cfg.num_layers
        counts = plan.prompt_counts()
        if counts is not None:
            self._allocate(counts)

    def _allocate(self, counts) -> None:
        counts = np.asarray(counts, np.int64)
        want = (self.cfg.num_layers, len(self.lens), self.cfg.num_kv_heads)
        if counts.shape != want:
            raise ValueError(f"prompt counts have shape {counts.shape}, expected [layers, batch, KV heads] = {want}")
        if counts.min() < 0 or (counts > self.lens[None, :, None]).any():
            raise ValueError("a head cannot keep fewer than 0 or more than its prompt's rows")
        self.counts = counts
        self.offsets, rows = pool_offsets(counts, self.tail_capacity, self.shards)
        self.pool = new_pool(len(self.lens), self.shards, rows, self.cfg.head_dim, self.dtype, self.mesh)

    def _device(self, a: np.ndarray) -> jax.Array:
        a = np.asarray(a, np.int32)
        if self.mesh is None:
            return jnp.asarray(a)
        from hetero_jax.model.sharding import named_sharding

        return jax.device_put(a, named_sharding(self.mesh, ("batch", "kv_heads"), a.shape))

    def _write(self, li: int, blocks) -> KVPool:
        args = (self.pool, self._device(self.offsets[li]), self._device(self.counts[li]), tuple(blocks))
        self.pool = self.compile_fn(write_blocks, *args)(*args)
        return self.pool

    def add(self, li: int, out: LayerPrefill):
        """Take layer ``li``'s output (written now, or kept until the end); returns what to wait on."""
        self.states[li] = out.state
        if self.pool is None:
            self.outputs[li] = out
            return out
        return self._write(li, out.blocks)

    def cache(self, prompt_lens: jax.Array) -> KVCache:
        """The finished cache (the plan's ``finish`` may still add its decode state)."""
        if self.pool is None:
            outputs, counts = self.plan.cut(self.outputs)
            self.outputs = [None] * self.cfg.num_layers
            self._allocate(counts)
            for li, out in enumerate(outputs):
                self.states[li] = out.state
                self._write(li, out.blocks)
        layers = tuple(LayerCache(offsets=self._device(self.offsets[li]), lengths=self._device(self.counts[li]),
                                  state=self.states[li],
                                  capacity=capacity_bucket(int(self.counts[li].max(initial=0))))
                       for li in range(self.cfg.num_layers))
        B, R = len(self.lens), self.tail_capacity
        return KVCache(pool=self.pool, layers=layers, seq_lens=jnp.array(prompt_lens), prompt_lens=prompt_lens,
                       tail_lens=jnp.zeros((B,), jnp.int32), tail_positions=jnp.full((B, R), -1, jnp.int32),
                       mesh=self.mesh)


def layer_lengths(blocks: tuple[RowBlock, ...], num_heads: int) -> jax.Array:
    """[B, H] int32 kept rows of every head of a layer, from the blocks that cover it."""
    order = [h for blk in blocks for h in blk.heads]
    if sorted(order) != list(range(num_heads)):
        raise ValueError(f"row blocks cover heads {order}, not each of the layer's {num_heads} heads once")
    lens = jnp.concatenate([blk.lengths.astype(jnp.int32) for blk in blocks], axis=1)
    return lens[:, np.argsort(order)]


def gather_rows(pool: KVPool, offsets, lengths, max_len: int):
    """Traced: every head's first rows as dense arrays, k, v [B, H, max_len, D] (zero past each head's
    ``lengths``) and positions [B, H, max_len] (-1 there); offsets, lengths [B, H]. A copy: for tools that
    need a layer's keys whole (calibration, re-selection); the decode reads the pool in place."""
    B, H = offsets.shape
    n_local = H // pool.num_shards
    j = jnp.arange(max_len, dtype=jnp.int32)
    rows = jnp.clip(offsets[..., None] + j, 0, pool.num_rows - 1)  # [B, H, S]
    b = jnp.arange(B)[:, None, None]
    s = (jnp.arange(H) // n_local)[None, :, None]
    valid = j < lengths[..., None]
    k = jnp.where(valid[..., None], pool.k[b, s, rows], 0)
    v = jnp.where(valid[..., None], pool.v[b, s, rows], 0)
    return k, v, jnp.where(valid, pool.positions[b, s, rows], -1)


_gather_rows_jit = jax.jit(gather_rows, static_argnames=("max_len",))


def layer_rows(cache: KVCache, li: int, with_tail: bool = False) -> tuple[jax.Array, ...]:
    """Layer ``li``'s rows of every head as dense arrays (a gather, for tests and host tools; the decode reads
    the pool in place): (k [B, H, S, D], v, positions [B, H, S] (-1 past each head's rows), lengths [B, H]).
    With ``with_tail`` each head's tail rows follow its prompt rows (lengths then count them)."""
    lc = cache.layers[li]
    lengths = lc.lengths + (cache.tail_lens[:, None] if with_tail else 0)
    S = max(1, int(np.max(to_host(lengths))))
    k, v, pos = _gather_rows_jit(cache.pool, lc.offsets, lengths.astype(jnp.int32), S)
    return k, v, pos, lengths


def row_nbytes(cache: KVCache) -> int:
    """K + V bytes of one row (one token of one head)."""
    return 2 * cache.pool.k.shape[-1] * cache.pool.k.dtype.itemsize


def head_offsets(cache: KVCache) -> list[np.ndarray]:
    """Per layer [B, H] int64 each head's first pool row, on the host (what a row write from the host indexes by)."""
    return [to_host(l.offsets).astype(np.int64) for l in cache.layers]


def kept_prompt_tokens(cache: KVCache) -> np.ndarray:
    """[B] prompt rows kept on the device, summed over every head of every layer."""
    return sum(to_host(l.lengths).astype(np.int64).sum(axis=1) for l in cache.layers)


def prompt_arrays(cache: KVCache) -> list[jax.Array]:
    """The device arrays that hold K/V rows: the pool's."""
    return [cache.pool.k, cache.pool.v]


def kv_bytes(cache: KVCache) -> int:
    """All device K/V bytes of the cache as allocated (the pool), measured from the arrays themselves."""
    return int(cache.pool.k.nbytes + cache.pool.v.nbytes)


def prompt_kv_bytes(cache: KVCache) -> int:
    """Device bytes of the kept prompt rows (every head's region without its tail part), whole batch."""
    return int(kept_prompt_tokens(cache).sum()) * row_nbytes(cache)


def tail_kv_bytes(cache: KVCache) -> int:
    """The rest of the pool: each head's rows for tokens added after prefill, and the allocation's rounding."""
    return kv_bytes(cache) - prompt_kv_bytes(cache)


def used_kv_bytes(cache: KVCache) -> int:
    """K/V bytes that hold valid tokens (prompt kept + tail), whole batch."""
    n_heads = sum(l.num_heads for l in cache.layers)
    tail = int(to_host(cache.tail_lens).sum()) * n_heads
    return (int(kept_prompt_tokens(cache).sum()) + tail) * row_nbytes(cache)


@functools.partial(jax.jit, static_argnames=("rows",))
def _repack(pool: KVPool, src, rows: int) -> KVPool:
    """A new pool of ``rows`` rows whose row p is ``pool``'s row src[b, s, p] (-1: empty)."""
    take = lambda a, fill: jnp.where((src >= 0).reshape(src.shape + (1,) * (a.ndim - 3)),  # noqa: E731
                                     jnp.take_along_axis(a, jnp.maximum(src, 0).reshape(
                                         src.shape + (1,) * (a.ndim - 3)), axis=2), fill)
    return KVPool(k=take(pool.k, 0), v=take(pool.v, 0), positions=take(pool.positions, -1))


def resize_tail(cache: KVCache, capacity: int) -> KVCache:
    """A copy of the cache whose heads hold ``capacity`` rows each for tokens added after prefill (multi-turn
    sessions outgrow it; a server trims a held conversation's back to what it uses): every head's region moves
    to its offset under the slack rule, prompt rows and tail rows together, in one gather. ``capacity`` must
    hold every sequence's tail tokens."""
    if capacity == cache.tail_capacity:
        return cache
    tail_lens = to_host(cache.tail_lens).astype(np.int64)  # [B]
    if capacity < int(tail_lens.max()):
        raise ValueError(f"a tail of {capacity} rows cannot hold the {int(tail_lens.max())} tokens already in it")
    lengths = np.stack([to_host(l.lengths) for l in cache.layers])  # [L, B, H]
    old = np.stack([to_host(l.offsets) for l in cache.layers]).astype(np.int64)
    S = cache.pool.num_shards
    new, rows = pool_offsets(lengths, capacity, S)
    L, B, H = lengths.shape
    n_local = H // S
    used = lengths + tail_lens[None, :, None]  # rows each head holds now
    src = np.full((B, S, rows), -1, np.int32)
    for li in range(L):
        for b in range(B):
            for h in range(H):
                n = int(used[li, b, h])
                src[b, h // n_local, new[li, b, h] : new[li, b, h] + n] = old[li, b, h] + np.arange(n)
    src_dev = jnp.asarray(src)
    if cache.mesh is not None:
        from hetero_jax.model.sharding import named_sharding

        src_dev = jax.device_put(src, named_sharding(cache.mesh, ("batch", "kv_heads", "pool_rows"), src.shape))
    pool = _repack(cache.pool, src_dev, rows)
    layers = tuple(l.replace(offsets=jnp.asarray(new[li], jnp.int32)) for li, l in enumerate(cache.layers))
    pos = jnp.pad(cache.tail_positions[:, :capacity], ((0, 0), (0, max(0, capacity - cache.tail_capacity))),
                  constant_values=-1)
    out = cache.replace(pool=pool, layers=layers, tail_positions=pos)
    if cache.mesh is not None:
        from hetero_jax.model.sharding import shard_cache

        out = shard_cache(out, cache.mesh)
    return out
