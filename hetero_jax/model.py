"""Functional Llama / Qwen2 / Qwen3 decoder over a params pytree.

Pure functions: ``prefill_chunk`` and ``decode_step`` take the params, an
immutable :class:`~hetero_jax.cache.KVCache` and tokens, and return hidden
states or logits with a new cache. ``ModelConfig`` is a static argument.

Numerics follow HF transformers: RMSNorm in float32, RoPE tables in float32
(rotate-half convention), attention scores and softmax in float32 with a
finite mask value, weights in the params' dtype.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.cache import KVCache, LayerKV
from hetero_jax.config import ModelConfig

# Finite: -inf minus -inf is NaN, and a fully masked row must stay finite.
MASK_VALUE = -1e30


# ----------------------------------------------------------------- primitives
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x: [..., H]; weight: [H]. Computed in float32, cast back like HF."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


@functools.lru_cache(maxsize=None)
def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """[D/2] float32 inverse frequencies, with llama3 scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    rs = cfg.rope_scaling
    if rs is not None:
        low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wl, inv / rs.factor, inv)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """x: [B, T, N, D]; positions: [B, T] int32. Rotate-half RoPE."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _linear(x, layer, name, bias_name=None):
    y = x @ layer[name]
    if bias_name is not None and bias_name in layer:
        y = y + layer[bias_name]
    return y


def project_qkv(layer: dict, x: jax.Array, positions: jax.Array, cfg: ModelConfig):
    """x: [B, T, H] normed hidden; positions: [B, T].

    Returns q [B, T, Nq, D], k [B, T, Nkv, D] (both after RoPE) and v [B, T, Nkv, D].
    """
    B, T, _ = x.shape
    D = cfg.head_dim
    q = _linear(x, layer, "q_proj", "q_bias").reshape(B, T, cfg.num_heads, D)
    k = _linear(x, layer, "k_proj", "k_bias").reshape(B, T, cfg.num_kv_heads, D)
    v = _linear(x, layer, "v_proj", "v_bias").reshape(B, T, cfg.num_kv_heads, D)
    if cfg.qk_norm:
        q = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
    inv = rope_inv_freq(cfg)
    return apply_rope(q, positions, inv), apply_rope(k, positions, inv), v


def mlp(layer: dict, x: jax.Array) -> jax.Array:
    """SwiGLU MLP. x: [..., H]."""
    gate = _linear(x, layer, "gate_proj", "gate_bias")
    up = _linear(x, layer, "up_proj", "up_bias")
    return _linear(jax.nn.silu(gate) * up, layer, "down_proj", "down_bias")


def output_projection(layer: dict, attn: jax.Array) -> jax.Array:
    """attn: [B, T, Nq*D] -> [B, T, H]."""
    return _linear(attn, layer, "o_proj", "o_bias")


def lm_logits(params: dict, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """h: [..., H] after the final norm -> logits [..., V] in float32."""
    w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return (h @ w).astype(jnp.float32)


# ------------------------------------------------------------------ attention
def _write_chunk(layer_kv: LayerKV, k, v, positions, start) -> LayerKV:
    """Write a prefill chunk at slots [start, start + C) of every head.

    k, v: [B, C, Nkv, D]; positions: [B, C]; start: scalar int32.
    Lengths are set by the caller once the whole prompt is in.
    """
    kt = jnp.swapaxes(k, 1, 2).astype(layer_kv.k.dtype)  # [B, Nkv, C, D]
    vt = jnp.swapaxes(v, 1, 2).astype(layer_kv.v.dtype)
    nkv = kt.shape[1]
    pos = jnp.broadcast_to(positions[:, None, :], (positions.shape[0], nkv, positions.shape[1]))
    zero = jnp.zeros((), jnp.int32)
    return layer_kv.replace(
        k=jax.lax.dynamic_update_slice(layer_kv.k, kt, (zero, zero, start, zero)),
        v=jax.lax.dynamic_update_slice(layer_kv.v, vt, (zero, zero, start, zero)),
        positions=jax.lax.dynamic_update_slice(layer_kv.positions, pos.astype(jnp.int32), (zero, zero, start)),
    )


def chunk_attention(q: jax.Array, layer_kv: LayerKV, start: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Causal attention of a prefill chunk against the cache, flash-style.

    q: [B, C, Nq, D] queries at slots [start, start + C); the cache already
    holds the chunk. Key blocks of size C are visited with an online softmax
    up to the chunk's own block, so at most a [B, Nq, C, C] score block exists
    at a time (never T x T). Returns [B, C, Nq, D].
    """
    B, C, Nq, D = q.shape
    G = cfg.group_size
    Nkv = cfg.num_kv_heads
    qg = q.reshape(B, C, Nkv, G, D).transpose(0, 2, 3, 1, 4).astype(jnp.float32)  # [B,Nkv,G,C,D]
    qg = qg * (1.0 / math.sqrt(D))
    q_slot = start + jnp.arange(C, dtype=jnp.int32)  # [C]
    n_blocks = start // C + 1

    def body(j, carry):
        m, l, acc = carry
        ks = jax.lax.dynamic_slice_in_dim(layer_kv.k, j * C, C, axis=2).astype(jnp.float32)
        vs = jax.lax.dynamic_slice_in_dim(layer_kv.v, j * C, C, axis=2).astype(jnp.float32)
        s = jnp.einsum("bhgqd,bhkd->bhgqk", qg, ks)  # [B,Nkv,G,C,C]
        k_slot = j * C + jnp.arange(C, dtype=jnp.int32)
        causal = k_slot[None, :] <= q_slot[:, None]  # [C, C]
        s = jnp.where(causal, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        l_new = l * corr + p.sum(-1)
        acc_new = acc * corr[..., None] + jnp.einsum("bhgqk,bhkd->bhgqd", p, vs)
        return m_new, l_new, acc_new

    init = (
        jnp.full((B, Nkv, G, C), MASK_VALUE, jnp.float32),
        jnp.zeros((B, Nkv, G, C), jnp.float32),
        jnp.zeros((B, Nkv, G, C, D), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    out = acc / l[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, C, Nq, D).astype(q.dtype)


def decode_attention_reference(q: jax.Array, layer_kv: LayerKV) -> jax.Array:
    """One query token per sequence over each head's valid slots.

    q: [B, Nkv, G, D]; the cache's lengths [B, Nkv] bound each head. Returns [B, Nkv, G, D].
    """
    D = q.shape[-1]
    s = jnp.einsum("bhgd,bhsd->bhgs", q.astype(jnp.float32), layer_kv.k.astype(jnp.float32))
    s = s * (1.0 / math.sqrt(D))
    valid = jnp.arange(layer_kv.capacity)[None, None, :] < layer_kv.lengths[:, :, None]  # [B,Nkv,S]
    s = jnp.where(valid[:, :, None, :], s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhgs,bhsd->bhgd", p, layer_kv.v.astype(jnp.float32)).astype(q.dtype)


def _append_token(layer_kv: LayerKV, k, v, pos) -> LayerKV:
    """Append one token at slot ``lengths[b, h]`` of every head.

    k, v: [B, Nkv, D]; pos: [B] int32 original position.
    """
    B, Nkv = layer_kv.lengths.shape
    b = jnp.arange(B)[:, None]
    h = jnp.arange(Nkv)[None, :]
    slot = layer_kv.lengths  # [B, Nkv]
    return layer_kv.replace(
        k=layer_kv.k.at[b, h, slot].set(k.astype(layer_kv.k.dtype)),
        v=layer_kv.v.at[b, h, slot].set(v.astype(layer_kv.v.dtype)),
        positions=layer_kv.positions.at[b, h, slot].set(jnp.broadcast_to(pos[:, None], (B, Nkv))),
        lengths=layer_kv.lengths + 1,
    )


# ------------------------------------------------------------------- forward
def prefill_chunk(
    params: dict, cache: KVCache, tokens: jax.Array, start: jax.Array, cfg: ModelConfig
) -> tuple[jax.Array, KVCache]:
    """Run one prefill chunk for a right-padded batch.

    tokens: [B, C] int32 at slots/positions [start, start + C) (start a
    multiple of C). Returns the final-normed hidden states [B, C, H] and the
    cache with the chunk written. Per-head lengths and ``seq_lens`` are set by
    :func:`finish_prefill` once every chunk is in, so padding never counts.
    """
    B, C = tokens.shape
    start = jnp.asarray(start, jnp.int32)
    positions = jnp.broadcast_to(start + jnp.arange(C, dtype=jnp.int32), (B, C))
    x = params["embed"][tokens]
    new_layers = []
    for layer, layer_kv in zip(params["layers"], cache.layers):
        h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
        q, k, v = project_qkv(layer, h, positions, cfg)
        layer_kv = _write_chunk(layer_kv, k, v, positions, start)
        attn = chunk_attention(q, layer_kv, start, cfg)
        x = x + output_projection(layer, attn.reshape(B, C, -1))
        x = x + mlp(layer, rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps))
        new_layers.append(layer_kv)
    h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return h, cache.replace(layers=tuple(new_layers))


def finish_prefill(cache: KVCache, prompt_lens) -> KVCache:
    """Set every head's length and the sequence lengths to the true prompt lengths [B]."""
    prompt_lens = jnp.asarray(prompt_lens, jnp.int32)
    layers = []
    for l in cache.layers:
        valid = jnp.arange(l.capacity)[None, None, :] < prompt_lens[:, None, None]
        layers.append(
            l.replace(
                lengths=jnp.broadcast_to(prompt_lens[:, None], l.lengths.shape).astype(jnp.int32),
                positions=jnp.where(valid, l.positions, -1),
            )
        )
    return cache.replace(layers=tuple(layers), seq_lens=prompt_lens)


def decode_step(
    params: dict, cache: KVCache, tokens: jax.Array, cfg: ModelConfig
) -> tuple[jax.Array, KVCache]:
    """One new token per sequence. tokens: [B] int32. Returns logits [B, V] (float32) and the cache."""
    B = tokens.shape[0]
    pos = cache.seq_lens  # [B]
    x = params["embed"][tokens][:, None, :]  # [B, 1, H]
    new_layers = []
    for layer, layer_kv in zip(params["layers"], cache.layers):
        h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
        q, k, v = project_qkv(layer, h, pos[:, None], cfg)
        layer_kv = _append_token(layer_kv, k[:, 0], v[:, 0], pos)
        qg = q[:, 0].reshape(B, cfg.num_kv_heads, cfg.group_size, cfg.head_dim)
        attn = decode_attention_reference(qg, layer_kv)
        x = x + output_projection(layer, attn.reshape(B, 1, -1))
        x = x + mlp(layer, rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps))
        new_layers.append(layer_kv)
    h = rms_norm(x[:, 0], params["final_norm"], cfg.rms_norm_eps)
    return lm_logits(params, h, cfg), cache.replace(layers=tuple(new_layers), seq_lens=pos + 1)
