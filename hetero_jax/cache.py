"""The KV-cache pytree.

One ``LayerKV`` per decoder layer, stored at ``num_kv_heads`` (never at the
query-head count), keys after RoPE so a kept key never needs re-rotation.
Every KV head carries its own length and the original position of every slot:
the slot index is never taken for the position, because compression policies
(later) give each head its own subset of tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from hetero_jax.config import ModelConfig


@struct.dataclass
class LayerKV:
    k: jax.Array  # [B, Hkv, S, D] keys after RoPE
    v: jax.Array  # [B, Hkv, S, D]
    positions: jax.Array  # [B, Hkv, S] int32, original token position of each slot; -1 = empty
    lengths: jax.Array  # [B, Hkv] int32, valid slots [0, length) of each head

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


@struct.dataclass
class KVCache:
    layers: tuple[LayerKV, ...]
    seq_lens: jax.Array  # [B] int32, tokens processed so far = position of the next token

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def capacity(self) -> int:
        return self.layers[0].capacity


def init_cache(cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
    """An empty cache with room for ``capacity`` tokens per head."""
    shape = (batch, cfg.num_kv_heads, capacity, cfg.head_dim)

    def layer() -> LayerKV:
        return LayerKV(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            positions=jnp.full(shape[:3], -1, jnp.int32),
            lengths=jnp.zeros(shape[:2], jnp.int32),
        )

    return KVCache(
        layers=tuple(layer() for _ in range(cfg.num_layers)),
        seq_lens=jnp.zeros((batch,), jnp.int32),
    )


def kv_bytes(cache: KVCache) -> int:
    """Bytes of K and V storage actually allocated by the cache's arrays."""
    return int(sum(l.k.nbytes + l.v.nbytes for l in cache.layers))


def used_kv_bytes(cache: KVCache) -> int:
    """Bytes of K and V that hold valid tokens (sum of per-head lengths)."""
    total = 0
    for l in cache.layers:
        per_token = l.k.shape[-1] * l.k.dtype.itemsize * 2
        total += int(np.asarray(l.lengths).sum()) * per_token
    return total
