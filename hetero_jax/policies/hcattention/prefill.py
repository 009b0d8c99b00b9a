"""HCAttention's prefill: every layer's prompt values to the host store, its keys (or their codes) to the
layer's state record (``attention.HCState``), no prompt row in the pool."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.model.cache import KVCache, LayerPrefill, RowBlock
from hetero_jax.model.config import ModelConfig
from hetero_jax.model.host_store import HostKVStore
from hetero_jax.policies.base import PolicyError
from hetero_jax.policies.hcattention.attention import HCState
from hetero_jax.policies.hcattention.decode import HCDecode
from hetero_jax.policies.protocol import PrefillPlan


ENCODE_CHUNK = 128  # tokens encoded at a time: bounds the [B, H, chunk, g, c] distance block


@jax.jit
def encode_keys(keys, centroids, lens):
    """Codes [B, H, T, g] int16 of keys [B, H, T, D]: per sub-vector the nearest centroid of ``centroids``
    [c, d] (squared L2, ties to the lower index); 0 past each sequence's length ``lens`` [B]."""
    B, H, T, D = keys.shape
    c, d = centroids.shape
    g = D // d
    cb = centroids.astype(jnp.float32)
    cn = (cb * cb).sum(-1)
    n = -(-T // ENCODE_CHUNK)
    x = jnp.pad(keys.astype(jnp.float32), ((0, 0), (0, 0), (0, n * ENCODE_CHUNK - T), (0, 0)))
    x = jnp.moveaxis(x.reshape(B, H, n, ENCODE_CHUNK, g, d), 2, 0)

    def one(xc):  # [B, H, chunk, g, d]; ||x||^2 is the same for every centroid
        dist = cn - 2.0 * jnp.einsum("bhtid,cd->bhtic", xc, cb, precision=jax.lax.Precision.HIGHEST)
        return jnp.argmin(dist, axis=-1).astype(jnp.int16)

    codes = jnp.moveaxis(jax.lax.map(one, x), 0, 2).reshape(B, H, n * ENCODE_CHUNK, g)[:, :, :T]
    valid = jnp.arange(T)[None, :] < lens[:, None]
    return jnp.where(valid[:, None, :, None], codes, 0).astype(jnp.int16)


def _no_rows(B: int, H: int, D: int, dtype) -> RowBlock:
    """The layer's heads keep no prompt row in the pool (count 0): their regions hold only the tail."""
    return RowBlock(k=jnp.zeros((B, H, 0, D), dtype), v=jnp.zeros((B, H, 0, D), dtype),
                    positions=jnp.zeros((B, H, 0), jnp.int32), lengths=jnp.zeros((B, H), jnp.int32),
                    heads=tuple(range(H)))



class HCPrefill(PrefillPlan):
    """Dense prefill; each layer's prompt V to the host store, its keys (or codes + codebook) to its state
    record; no prompt row in the pool. ``policy.plan`` checks every prompt's budget first."""

    def __init__(self, policy, cfg: ModelConfig, prompt_lens, compile_fn=None):
        self.policy, self.cfg = policy, cfg
        self.lens = np.asarray(prompt_lens, np.int64)
        self.compile_fn = compile_fn or (lambda f, *a, **st: functools.partial(f, **st))
        self.point = policy.plan(cfg, self.lens)  # validates every prompt first
        f = policy.k_cap_fraction  # in Python floats: ceil(0.2 * 5) is 1, in float32 2
        self.k_caps = np.array([max(1, min(L, math.ceil(f * L))) for L in self.lens.tolist()], np.int32)
        self.store = HostKVStore(cfg.num_layers)

    def prompt_counts(self) -> np.ndarray:
        return np.zeros((self.cfg.num_layers, len(self.lens), self.cfg.num_kv_heads), np.int64)

    def build_layer(self, li, layer, x_in, k_buf, v_buf, lens) -> LayerPrefill:
        B, H, _, D = k_buf.shape
        want = self.policy.kv_itemsize or 4
        if k_buf.dtype.itemsize != want:
            raise PolicyError(f"HCAttention planned its bytes for a {want}-byte KV dtype but the prefill runs in "
                              f"{k_buf.dtype}; bind the policy to the model first (policy.bind(model))")
        t_max = int(self.lens.max())
        self.store.put(li, None, v_buf[:, :, :t_max])
        # fresh arrays per layer: the decode step donates every cache leaf separately
        st = HCState(prompt_lens=jnp.asarray(self.lens.astype(np.int32)), k_caps=jnp.asarray(self.k_caps),
                     store=self.store.handle_array())
        cb = self.point.codebook
        if cb is None:
            st = st.replace(keys=jnp.array(k_buf[:, :, :t_max]))  # a copy: k_buf may be shared (benchmarks)
        else:
            cents = jnp.asarray(cb.centroids[li])
            args = (k_buf[:, :, :t_max], cents, lens)
            st = st.replace(codes=self.compile_fn(encode_keys, *args)(*args), codebook=cents)
        return LayerPrefill(blocks=(_no_rows(B, H, D, k_buf.dtype),), state=st)

    def finish(self, cache: KVCache) -> tuple[KVCache, HCDecode]:
        self.store.materialize()  # the in-step callbacks read numpy views only (waits for the copies)
        itemsize = self.policy.kv_itemsize or 4
        return cache, HCDecode(self.policy, self.cfg, self.lens, self.point, self.store, itemsize)
