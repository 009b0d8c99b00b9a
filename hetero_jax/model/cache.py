"""The KV-cache pytree.

Per decoder layer the cache holds the prompt's KV in one or more *head
groups* plus an append-only *tail*:

- A ``HeadGroup`` is a set of the layer's KV heads that share one static
  capacity ``S``: a contiguous slice on one device; under tensor parallelism
  (``LayerCache.head_tp`` = tp > 1) the same ``m`` local slots of every shard,
  so a group splits over the "model" axis like the projections do
  (:func:`group_spans`). Each head has its own valid length and the original
  token position of every slot, so a compression policy can keep a different
  subset (and number) of prompt tokens per head; the slot index is never taken
  for the position. Full KV is one group holding the whole prompt.
- The tail holds every token added after prefill (generated tokens, later
  question turns) for every head; no policy evicts from it.

Keys are stored after RoPE (a kept key never needs re-rotation) and at
``num_kv_heads``, never at the query-head count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from hetero_jax.dims import axis_size
from hetero_jax.model.layout import group_spans_of
from hetero_jax.model.sharding import to_host


@struct.dataclass
class HeadGroup:
    k: jax.Array  # [B, Hg, S, D] keys after RoPE
    v: jax.Array  # [B, Hg, S, D]
    positions: jax.Array  # [B, Hg, S] int32 original position of each slot; -1 = empty
    lengths: jax.Array  # [B, Hg] int32 valid slots [0, length) of each head

    num_heads = axis_size("k", 1, "KV heads in the group")
    capacity = axis_size("k", 2, "slots per head (the longest head's kept tokens)")


@struct.dataclass
class PooledGroup:
    """A head group whose rows live in the cache's :class:`PromptPool` (tensor parallelism): each head a
    window of ``capacity`` slots from ``offsets`` in its shard's pool, valid in [0, length)."""

    offsets: jax.Array  # [B, Hg] int32 first pool slot of each head's window (in its own shard's pool)
    lengths: jax.Array  # [B, Hg] int32 valid slots of each head
    capacity: int = struct.field(pytree_node=False)

    num_heads = axis_size("offsets", 1, "KV heads in the group")


@struct.dataclass
class PromptPool:
    """Every shard's kept prompt rows of all layers in one buffer, so a shard allocates what its own heads
    keep (the SPMD shape is the largest shard's total, not each layer's largest head times the layers)."""

    k: jax.Array  # [B, tp, P, D] keys after RoPE, shard s's pool at [:, s]
    v: jax.Array  # [B, tp, P, D]
    positions: jax.Array  # [B, tp, P] int32 original position of each pool slot; -1 = empty


@struct.dataclass
class LayerCache:
    groups: tuple[HeadGroup, ...]  # cover the layer's KV heads 0..Hkv-1 in order
    tail_k: jax.Array  # [B, Hkv, R, D] tokens added after prefill, keys after RoPE
    tail_v: jax.Array  # [B, Hkv, R, D]
    # policy state that changes while decoding (HeteroCache: each pivot's K_base [B, Np, L_base])
    aux: dict = struct.field(default_factory=dict)
    # tensor-parallel shards the groups are cut for (static): group head s*m + i is layer head
    # s*(Hkv/head_tp) + o + i (``group_spans``); 1 = groups are contiguous slices of the heads
    head_tp: int = struct.field(pytree_node=False, default=1)

    @property
    def num_heads(self) -> int:
        return sum(g.num_heads for g in self.groups)


def group_spans(layer_cache: "LayerCache") -> list[tuple[int, int]]:
    """Per group (o, m): on each of the ``head_tp`` shards the group holds the m local head slots [o, o + m)."""
    return group_spans_of([g.num_heads for g in layer_cache.groups], layer_cache.head_tp)


def take_heads(x: jax.Array, o: int, m: int, tp: int) -> jax.Array:
    """Group heads of ``x`` [B, H, ...] (H = the layer's KV heads in layout order): the local slots
    [o, o + m) of each of ``tp`` shards, [B, tp*m, ...]. A reshape and a slice, so heads split over
    "model" stay on their device; tp = 1: ``x[:, o:o+m]``."""
    if tp == 1:
        return x[:, o : o + m]
    B, H = x.shape[:2]
    return x.reshape(B, tp, H // tp, *x.shape[2:])[:, :, o : o + m].reshape(B, tp * m, *x.shape[2:])


def join_heads(parts: list, tp: int) -> jax.Array:
    """Inverse of :func:`take_heads` over a layer's groups in order: [B, tp*m_g, ...] each -> [B, H, ...]."""
    if len(parts) == 1:
        return parts[0]
    if tp == 1:
        return jnp.concatenate(parts, axis=1)
    B, rest = parts[0].shape[0], parts[0].shape[2:]
    split = [p.reshape(B, tp, p.shape[1] // tp, *rest) for p in parts]
    joined = jnp.concatenate(split, axis=2)
    return joined.reshape(B, joined.shape[1] * joined.shape[2], *rest)


@struct.dataclass
class KVCache:
    layers: tuple[LayerCache, ...]
    seq_lens: jax.Array  # [B] int32 tokens processed = position of the next token
    prompt_lens: jax.Array  # [B] int32 tokens of the prefilled prompt
    tail_lens: jax.Array  # [B] int32 valid tail slots (same for every head and layer)
    tail_positions: jax.Array  # [B, R] int32 original positions of tail slots; -1 = empty
    # the layers' rows of PooledGroups (None: every group holds its own rows)
    pool: PromptPool | None = None

    batch_size = axis_size("seq_lens", 0, "sequences in the batch")
    tail_capacity = axis_size("tail_positions", 1, "tail slots for tokens added after prefill")


def full_group(k: jax.Array, v: jax.Array, prompt_lens: jax.Array) -> HeadGroup:
    """A group that keeps every prompt token: k, v [B, Hg, S, D]; prompt_lens [B]."""
    B, Hg, S, _ = k.shape
    slots = jnp.arange(S, dtype=jnp.int32)
    valid = slots[None, None, :] < prompt_lens[:, None, None]
    return HeadGroup(
        k=k,
        v=v,
        positions=jnp.where(valid, slots[None, None, :], -1).astype(jnp.int32),
        lengths=jnp.broadcast_to(prompt_lens[:, None], (B, Hg)).astype(jnp.int32),
    )


def materialize(layer_cache: LayerCache, pool: PromptPool | None) -> LayerCache:
    """The layer with each :class:`PooledGroup` read out of ``pool`` as a :class:`HeadGroup` [B, Hg,
    capacity, D] (a per-shard window gather: it stays on each head's device); unchanged without a pool."""
    if pool is None or not any(isinstance(g, PooledGroup) for g in layer_cache.groups):
        return layer_cache
    tp = layer_cache.head_tp
    groups = []
    for g, (_, m) in zip(layer_cache.groups, group_spans(layer_cache)):
        if not isinstance(g, PooledGroup):
            groups.append(g)
            continue
        B = g.offsets.shape[0]
        idx = g.offsets.reshape(B, tp, m)[..., None] + jnp.arange(g.capacity, dtype=jnp.int32)  # [B,tp,m,S]
        take = lambda a: jnp.take_along_axis(a[:, :, None], idx.reshape(idx.shape + (1,) * (a.ndim - 3)),
                                             axis=3)  # noqa: E731
        k, v, pos = take(pool.k), take(pool.v), take(pool.positions)
        groups.append(HeadGroup(k=k.reshape(B, tp * m, g.capacity, -1), v=v.reshape(B, tp * m, g.capacity, -1),
                                positions=pos.reshape(B, tp * m, g.capacity), lengths=g.lengths))
    return layer_cache.replace(groups=tuple(groups))


def prompt_arrays(cache: KVCache) -> list[jax.Array]:
    """The device K and V arrays of the prompt part: every group's, and the pool's."""
    out = [a for l in cache.layers for g in l.groups if isinstance(g, HeadGroup) for a in (g.k, g.v)]
    return out + ([cache.pool.k, cache.pool.v] if cache.pool is not None else [])


def prompt_kv_bytes(cache: KVCache) -> int:
    """Device bytes of the prompt part (all head groups' K and V arrays and the pool's, as allocated)."""
    return int(sum(a.nbytes for a in prompt_arrays(cache)))


def tail_kv_bytes(cache: KVCache) -> int:
    """Device bytes of the tail K and V arrays, as allocated."""
    return int(sum(l.tail_k.nbytes + l.tail_v.nbytes for l in cache.layers))


def kv_bytes(cache: KVCache) -> int:
    """All device K/V bytes of the cache, measured from the arrays themselves."""
    return prompt_kv_bytes(cache) + tail_kv_bytes(cache)


def kept_prompt_tokens(cache: KVCache) -> np.ndarray:
    """[B] prompt tokens kept on the device, summed over every head of every layer."""
    return sum(to_host(g.lengths).sum(axis=1) for l in cache.layers for g in l.groups)


def used_kv_bytes(cache: KVCache) -> int:
    """K/V bytes that hold valid tokens (prompt kept + tail), whole batch."""
    l0 = cache.layers[0]
    per_token = 2 * l0.tail_k.shape[-1] * l0.tail_k.dtype.itemsize
    n_heads = sum(l.num_heads for l in cache.layers)
    tail = int(to_host(cache.tail_lens).sum()) * n_heads
    return (int(kept_prompt_tokens(cache).sum()) + tail) * per_token


def grow_tail(cache: KVCache, capacity: int) -> KVCache:
    """A copy of the cache whose tail holds ``capacity`` tokens (multi-turn sessions outgrow it)."""
    extra = capacity - cache.tail_capacity
    if extra <= 0:
        return cache
    pad = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, extra), (0, 0)))  # noqa: E731
    layers = tuple(l.replace(tail_k=pad(l.tail_k), tail_v=pad(l.tail_v)) for l in cache.layers)
    pos = jnp.pad(cache.tail_positions, ((0, 0), (0, extra)), constant_values=-1)
    return cache.replace(layers=layers, tail_positions=pos)
