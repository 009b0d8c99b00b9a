"""Traced operations on the row pool inside a decode step or a session's turn: append the new tokens' K/V
to every head's region, and attend every head of a layer in one call (``pallas_kernels.pool_attention``).

On a mesh both run inside ``jax.shard_map`` over ("data", "model"): each device writes and reads only its
own shard of the pool with its own heads, so a kernel's custom call is never replicated or gathered.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec

import pallas_kernels
from hetero_jax.model.cache import KVPool, LayerCache
from hetero_jax.model.sharding import partition_spec, tree_specs
from hetero_jax.model.spec import field_axes

# the per-head [B, H] arrays (offsets, lengths) split as the layer's own declaration says
HEAD_AXES = field_axes(LayerCache, "offsets")


def _spec(mesh, axes, shape) -> PartitionSpec:
    return partition_spec(axes, shape, mesh)


def _pool_and_head_specs(mesh, pool: KVPool, heads_shape):
    """shard_map specs of the pool and of per-head [B, H] arrays, from their declared axes."""
    return tree_specs(pool, mesh), _spec(mesh, HEAD_AXES, heads_shape)


def _local_append(pool: KVPool, offsets, lengths, tail_start, k_new, v_new, capacity):
    """One shard: k_new, v_new [B, h, C, D] at rows offsets + lengths + tail_start + c of each head's region,
    dropped past its tail capacity (a padded chunk never spills into the next head's region)."""
    B, h, C, _ = k_new.shape
    c = jnp.arange(C, dtype=jnp.int32)
    t = tail_start[:, None, None] + c  # [B, 1, C] tail slot of each new row
    slot = jnp.where(t < capacity, (offsets + lengths)[..., None] + t, pool.num_rows)  # [B, h, C]
    b = jnp.arange(B)[:, None, None]
    n_local = h // pool.num_shards
    s = (jnp.arange(h) // n_local)[None, :, None]
    return pool.replace(k=pool.k.at[b, s, slot].set(k_new.astype(pool.k.dtype), mode="drop"),
                        v=pool.v.at[b, s, slot].set(v_new.astype(pool.v.dtype), mode="drop"))


def append(pool: KVPool, layer: LayerCache, tail_start: jax.Array, k_new: jax.Array, v_new: jax.Array,
           tail_capacity: int, mesh=None) -> KVPool:
    """``pool`` with each head's new rows k_new, v_new [B, H, C, D] appended after its ``tail_start`` [B]
    tail rows (rows past ``tail_capacity`` are dropped)."""
    if mesh is None:
        return _local_append(pool, layer.offsets, layer.lengths, tail_start, k_new, v_new, tail_capacity)
    pool_spec, bh = _pool_and_head_specs(mesh, pool, layer.offsets.shape)
    new_spec = _spec(mesh, ("batch", "kv_heads", "slots", "head_dim"), k_new.shape)
    fn = jax.shard_map(lambda p, o, l, t, k, v: _local_append(p, o, l, t, k, v, tail_capacity), mesh=mesh,
                       in_specs=(pool_spec, bh, bh, _spec(mesh, ("batch",), tail_start.shape), new_spec, new_spec),
                       out_specs=pool_spec, check_vma=False)
    return fn(pool, layer.offsets, layer.lengths, tail_start, k_new, v_new)


def _local_attend(q, pool: KVPool, offsets, lengths, score_heads, block_rows, max_len, score_len, block_size):
    """One shard: q [B, h, T, G, D] over its pool [B, 1, P, D] (heads of this shard)."""
    return pallas_kernels.pool_attention(q, pool.k[:, 0], pool.v[:, 0], offsets, lengths, score_heads, block_rows,
                                         max_len=max_len, score_len=score_len, block_size=block_size)


def attend(q: jax.Array, pool: KVPool, offsets: jax.Array, lengths: jax.Array, *, max_len: int, mesh=None,
           score_heads=None, score_len: int = 0, block_rows=None, block_size: int = 0):
    """Every head of a layer in one call: q [B, H, T, G, D], query position t of head h seeing the first
    lengths[b, h] + t rows of its region at offsets[b, h]. ``max_len`` (static) bounds lengths + T - 1.
    With ``score_len`` (T = 1) the heads flagged in ``score_heads`` [H] also return their logits over their
    first ``score_len`` rows. With ``block_rows`` [B, H, NB] the heads are paged: their logical row j is
    region row block_rows[..., j // block_size] + j % block_size. Returns (out [B, H, T, G, D], lse
    [B, H, T, G] float32, logits [B, H, G, score_len] or None): ``pallas_kernels.pool_attention``, which
    picks the kernel for the platform."""
    if mesh is None:
        if pool.num_shards == 1:
            return _local_attend(q, pool, offsets, lengths, score_heads, block_rows, max_len, score_len, block_size)
        # shards on one device (tests of the layout): each shard's heads over its own pool, in turn
        n = q.shape[1] // pool.num_shards
        part = lambda a, s: None if a is None else a[:, s * n:(s + 1) * n]  # noqa: E731
        parts = [_local_attend(part(q, s), jax.tree.map(lambda a: a[:, s:s + 1], pool), part(offsets, s),
                               part(lengths, s), None if score_heads is None else score_heads[s * n:(s + 1) * n],
                               part(block_rows, s), max_len, score_len, block_size)
                 for s in range(pool.num_shards)]
        return tuple(None if p[0] is None else jnp.concatenate(p, axis=1) for p in zip(*parts))
    pool_spec, bh = _pool_and_head_specs(mesh, pool, offsets.shape)
    q_spec = _spec(mesh, ("batch", "kv_heads", "slots", "group", "head_dim"), q.shape)
    lse_spec = _spec(mesh, ("batch", "kv_heads", "slots", "group"), q.shape[:4])
    flags = score_heads if score_heads is not None else jnp.ones((q.shape[1],), jnp.int32)
    flag_spec = _spec(mesh, ("kv_heads",), flags.shape)
    logit_spec = _spec(mesh, ("batch", "kv_heads", "group", "slots"), q.shape[:2] + (q.shape[3], max(score_len, 1)))
    args, in_specs = [q, pool, offsets, lengths, flags], [q_spec, pool_spec, bh, bh, flag_spec]
    if block_rows is not None:
        args.append(block_rows)
        in_specs.append(_spec(mesh, ("batch", "kv_heads", "slots"), block_rows.shape))

    def local(q_, p_, o_, l_, f_, t_=None):
        out, lse, logits = _local_attend(q_, p_, o_, l_, f_, t_, max_len, score_len, block_size)
        return (out, lse) + ((logits,) if score_len else ())

    outs = (q_spec, lse_spec) + ((logit_spec,) if score_len else ())
    res = jax.shard_map(local, mesh=mesh, in_specs=tuple(in_specs), out_specs=outs, check_vma=False)(*args)
    return res[0], res[1], (res[2] if score_len else None)


@struct.dataclass
class LayerStep:
    """What one layer's attention sees inside a decode step or a turn's chunk: the pool (the new tokens'
    rows already appended), the layer's offsets, lengths and state, and how many rows past its prompt rows
    each head holds. A policy's ``attend`` returns it, with the pool or the layer's state updated if it
    fetched rows."""

    pool: KVPool
    layer: LayerCache
    tail_lens: jax.Array  # [B] rows after each head's prompt rows that the first query sees (itself included)
    seq_lens: jax.Array  # [B] position of the first new token
    host: Any = None  # the layer's host operands (``DecodeState.host_operands``), read in the step, never donated
    tail_capacity: int = struct.field(pytree_node=False, default=0)
    mesh: Any = struct.field(pytree_node=False, default=None)

    @property
    def max_len(self) -> int:
        """The most rows any query of the layer sees (a region's capacity): the kernels' static bound."""
        return self.layer.capacity + self.tail_capacity

    def attend(self, q: jax.Array, score_heads=None, score_len: int = 0):
        """One query per head, q [B, H, G, D], over the prompt rows and the tail of every head. Returns
        (out [B, H, G, D], lse [B, H, G] float32, logits [B, H, G, score_len] or None; see :func:`attend`)."""
        out, lse, logits = attend(q[:, :, None], self.pool, self.layer.offsets,
                                  self.layer.lengths + self.tail_lens[:, None], max_len=self.max_len,
                                  mesh=self.mesh, score_heads=score_heads, score_len=score_len)
        return out[:, :, 0], lse[:, :, 0], logits

    @property
    def local(self) -> bool:
        """Whether the layer's heads are in one pool on one device (no mesh, one shard): what
        :meth:`attend_statistics` needs."""
        return self.mesh is None and self.pool.num_shards == 1

    def attend_statistics(self, q: jax.Array, score_slots: tuple, stat_lengths: jax.Array, k_base: jax.Array):
        """:meth:`attend` with the drift statistics of the heads ``score_slots`` (static) over their first
        ``capacity`` rows instead of their logits (``pallas_kernels.pool_attention_statistics``; one native
        call on a CPU). q [B, H, G, D], stat_lengths [B, Hs], k_base [B, Hs, K]. Returns (out [B, H, G, D],
        scores [B, Hs, capacity] float32, o'_t [B, Hs] float32). Only where :attr:`local`."""
        if not self.local:
            raise ValueError("attend_statistics reads one pool on one device; on a mesh use attend with "
                             "score_heads and pallas_kernels.pivot_statistics")
        out, _, scores, overlap = pallas_kernels.pool_attention_statistics(
            q[:, :, None], self.pool.k[:, 0], self.pool.v[:, 0], self.layer.offsets,
            self.layer.lengths + self.tail_lens[:, None], score_slots, stat_lengths, k_base, max_len=self.max_len,
            score_len=self.layer.capacity)
        return out[:, :, 0], scores, overlap

    def attend_blocks(self, q: jax.Array, block_rows: jax.Array, lengths: jax.Array, block_size: int) -> jax.Array:
        """One query per head, q [B, H, G, D], over chosen blocks of its region read in place: logical row j is
        region row block_rows[b, h, j // block_size] + j % block_size (block_rows [B, H, NB] int32), the first
        ``lengths`` [B, H] of them visible (a paged policy lists its selected pages, then its prompt's last
        rows and the tail as consecutive blocks). Returns out [B, H, G, D]."""
        out, _, _ = attend(q[:, :, None], self.pool, self.layer.offsets, lengths,
                           max_len=block_rows.shape[-1] * block_size, mesh=self.mesh, block_rows=block_rows,
                           block_size=block_size)
        return out[:, :, 0]

    def attend_tail(self, q: jax.Array):
        """Queries q [B, H, T, G, D] over each head's tail rows only (query t sees tail_lens + t of them),
        to be merged by log-sum-exp with a prompt part attended elsewhere. Returns (out [B, H, T, G, D],
        lse [B, H, T, G] float32)."""
        out, lse, _ = attend(q, self.pool, self.layer.offsets + self.layer.lengths,
                             jnp.broadcast_to(self.tail_lens[:, None], self.layer.lengths.shape),
                             max_len=self.tail_capacity, mesh=self.mesh)
        return out, lse

    def attend_chunk(self, q: jax.Array) -> jax.Array:
        """A chunk's C queries per head, q [B, H, G, C, D] (query c at tail row tail_lens - 1 + c, causal over
        the tail, every prompt row visible). Returns [B, H, G, C, D]."""
        out, _, _ = attend(q.transpose(0, 1, 3, 2, 4), self.pool, self.layer.offsets,
                           self.layer.lengths + self.tail_lens[:, None], max_len=self.max_len, mesh=self.mesh)
        return out.transpose(0, 1, 3, 2, 4)
