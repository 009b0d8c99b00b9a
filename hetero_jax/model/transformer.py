"""Functional Llama / Qwen2 / Qwen3 decoder over a params pytree.

Pure functions: ``prefill_chunk`` and ``decode_step`` take the params, an
immutable :class:`~hetero_jax.model.cache.KVCache` and tokens, and return hidden
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

from pallas_kernels import MASK_VALUE  # the one finite mask value (scores beyond a prompt, masked attention)
from pallas_kernels import traced_for_gpu

from hetero_jax.model.cache import KVCache, LayerPrefill, PoolBuilder, RowBlock, block_width
from hetero_jax.model.config import ModelConfig
from hetero_jax.model.pool import LayerStep, append



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


def _one_row_as_gemm(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [1, ..., 1, K] @ w [K, N] computed as a two-row product whose first row is kept.

    XLA's GPU compiler rewrites a vector-matrix product whose weight is small (below about 10M elements:
    k_proj and v_proj of a 7-8B model, every projection of a small one) into a multiply and a reduce that
    write the weight-sized product to memory and read it back, and may fuse the reduce into the cache write
    (RESULTS `profile-step-gpu`: 70 us where the weight's bytes take 2). Two identical rows keep it a GEMM."""
    rows = jnp.broadcast_to(x.reshape(1, x.shape[-1]), (2, x.shape[-1]))
    return (rows @ w)[:1].reshape(x.shape[:-1] + w.shape[-1:])


def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N]; one token's product (a batch-1 decode step) stays a GEMM when the step is traced
    for a GPU (``pallas_kernels.traced_for_gpu``; a CPU's vector-matrix product is already its fastest form)."""
    if math.prod(x.shape[:-1]) == 1 and traced_for_gpu():
        return _one_row_as_gemm(x, w)
    return x @ w


def _linear(x, layer, name, bias_name=None):
    y = _matmul(x, layer[name])
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
    return _matmul(h, w).astype(jnp.float32)


# ------------------------------------------------------------------ prefill
def chunk_attention(q: jax.Array, k_buf: jax.Array, v_buf: jax.Array, start: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Causal attention of a prefill chunk against the layer's prompt KV, flash-style.

    q: [B, C, Nq, D] queries at slots [start, start + C) (start a multiple of C);
    k_buf, v_buf: [B, Nkv, Tp, D] already holding the chunk. Key blocks of
    size C are visited with an online softmax up to the chunk's own block, so
    at most a [B, Nq, C, C] score block exists at a time (never T x T).
    Returns [B, C, Nq, D].
    """
    B, C, Nq, D = q.shape
    G, Nkv = cfg.group_size, cfg.num_kv_heads
    qg = q.reshape(B, C, Nkv, G, D).transpose(0, 2, 3, 1, 4).astype(jnp.float32)  # [B,Nkv,G,C,D]
    qg = qg * (1.0 / math.sqrt(D))
    q_slot = start + jnp.arange(C, dtype=jnp.int32)

    def body(j, carry):
        m, l, acc = carry
        ks = jax.lax.dynamic_slice_in_dim(k_buf, j * C, C, axis=2).astype(jnp.float32)
        vs = jax.lax.dynamic_slice_in_dim(v_buf, j * C, C, axis=2).astype(jnp.float32)
        s = jnp.einsum("bhgqd,bhkd->bhgqk", qg, ks)  # [B,Nkv,G,C,C]
        k_slot = j * C + jnp.arange(C, dtype=jnp.int32)
        s = jnp.where(k_slot[None, :] <= q_slot[:, None], s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        return m_new, l * corr + p.sum(-1), acc * corr[..., None] + jnp.einsum("bhgqk,bhkd->bhgqd", p, vs)

    init = (
        jnp.full((B, Nkv, G, C), MASK_VALUE, jnp.float32),
        jnp.zeros((B, Nkv, G, C), jnp.float32),
        jnp.zeros((B, Nkv, G, C, D), jnp.float32),
    )
    # the first block always holds key 0 <= every query slot, so no row is ever fully masked
    _, l, acc = jax.lax.fori_loop(0, start // C + 1, body, init)
    out = acc / l[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, C, Nq, D).astype(q.dtype)


def layer_prefill_chunk(
    layer: dict, x_in: jax.Array, x_out: jax.Array, k_buf: jax.Array, v_buf: jax.Array,
    start: jax.Array, chunk: int, cfg: ModelConfig,
):
    """Run one decoder layer on prompt slots [start, start + chunk).

    x_in, x_out: [B, Tp, H] the layer's input and output hidden states (the
    chunk's rows of x_out are written); k_buf, v_buf: [B, Nkv, Tp, D] the
    layer's prompt KV (the chunk is written). Returns (x_out, k_buf, v_buf).
    """
    B = x_in.shape[0]
    start = jnp.asarray(start, jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    x = jax.lax.dynamic_slice_in_dim(x_in, start, chunk, axis=1)  # [B, C, H]
    positions = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (B, chunk))
    h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
    q, k, v = project_qkv(layer, h, positions, cfg)
    k_buf = jax.lax.dynamic_update_slice(k_buf, jnp.swapaxes(k, 1, 2).astype(k_buf.dtype), (zero, zero, start, zero))
    v_buf = jax.lax.dynamic_update_slice(v_buf, jnp.swapaxes(v, 1, 2).astype(v_buf.dtype), (zero, zero, start, zero))
    attn = chunk_attention(q, k_buf, v_buf, start, cfg)
    x = x + output_projection(layer, attn.reshape(B, chunk, -1))
    x = x + mlp(layer, rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps))
    return jax.lax.dynamic_update_slice(x_out, x.astype(x_out.dtype), (zero, start, zero)), k_buf, v_buf


@functools.partial(jax.jit, static_argnames=("chunk", "cfg"), donate_argnames=("x_out", "k_buf", "v_buf"))
def _layer_prefill_chunk_jit(layer, x_in, x_out, k_buf, v_buf, start, chunk, cfg):
    return layer_prefill_chunk(layer, x_in, x_out, k_buf, v_buf, start, chunk, cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _embed_jit(params, tokens, cfg):
    return params["embed"][tokens]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _final_logits_jit(params, x, prompt_lens, cfg):
    """x: [B, Tp, H] last layer's output -> logits of each prompt's last token [B, V]."""
    last = jnp.take_along_axis(x, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    return lm_logits(params, rms_norm(last, params["final_norm"], cfg.rms_norm_eps), cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _all_logits_jit(params, x, cfg):
    return lm_logits(params, rms_norm(x, params["final_norm"], cfg.rms_norm_eps), cfg)


def full_rows(k_buf: jax.Array, v_buf: jax.Array, lens: jax.Array, t_max: int) -> LayerPrefill:
    """A layer's prefill under full KV: every head keeps its whole prompt, a block of ``block_width`` rows for
    the longest prompt ``t_max`` (a host int; the rows past each prompt are not written). k_buf, v_buf:
    [B, Hkv, Tp, D]; lens: [B]."""
    B, H = k_buf.shape[:2]
    w = block_width(t_max, k_buf.shape[2])
    positions = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (B, H, w))
    lengths = jnp.broadcast_to(lens[:, None], (B, H)).astype(jnp.int32)
    return LayerPrefill(blocks=(RowBlock(k=k_buf[:, :, :w], v=v_buf[:, :, :w], positions=positions,
                                         lengths=lengths, heads=tuple(range(H))),))


class FullKVPlan:
    """Full KV's prefill plan: every head keeps its whole prompt (no scoring, no selection)."""

    def __init__(self, prompt_lens, num_layers: int, num_kv_heads: int):
        self.lens = np.asarray(prompt_lens, np.int64)
        self.t_max = int(self.lens.max())
        self.shape = (num_layers, len(self.lens), num_kv_heads)

    def prompt_counts(self) -> np.ndarray:
        return np.broadcast_to(self.lens[None, :, None], self.shape)

    def build_layer(self, li, layer, x_in, k_buf, v_buf, lens) -> LayerPrefill:
        return full_rows(k_buf, v_buf, lens, self.t_max)


class DropKVPlan(FullKVPlan):
    """A prefill that keeps no prompt row (for ``observe`` hooks that only read each layer's K/V)."""

    def prompt_counts(self) -> np.ndarray:
        return np.zeros(self.shape, np.int64)

    def build_layer(self, li, layer, x_in, k_buf, v_buf, lens) -> LayerPrefill:
        B, H, _, D = k_buf.shape
        return LayerPrefill(blocks=(RowBlock(k=jnp.zeros((B, H, 0, D), k_buf.dtype), v=jnp.zeros((B, H, 0, D), v_buf.dtype),
                                             positions=jnp.zeros((B, H, 0), jnp.int32),
                                             lengths=jnp.zeros((B, H), jnp.int32), heads=tuple(range(H))),))


def prefill(
    params: dict, cfg: ModelConfig, tokens: np.ndarray, prompt_lens: np.ndarray, *,
    chunk: int, tail_capacity: int, dtype=None, plan=None, observe=None, compile_fn=None,
    all_logits: bool = False, mesh=None,
) -> tuple[jax.Array, KVCache]:
    """Layer-major chunked prefill of a right-padded batch into the row pool.

    tokens: [B, Tp] int32 (Tp a multiple of ``chunk``); prompt_lens: [B].
    Each layer runs over all chunks before the next layer starts, so only one layer's full prompt KV exists
    at a time: ``observe(li, layer, x_in, k_buf, v_buf, lens)`` (calibration) sees it, then ``plan.build_layer``
    (a policy's selection; default: full KV) turns it into row blocks that go into the pool right away
    (``cache.PoolBuilder``; the pool is allocated from ``plan.prompt_counts()`` before the first layer).
    One compiled chunk function serves every layer (they share shapes). ``mesh``: the pool is split over it.
    Returns (logits of each prompt's last token [B, V] float32, or of every slot [B, Tp, V] with
    ``all_logits``; cache).
    """
    compile_fn = compile_fn or (lambda f, *a, **st: functools.partial(f, **st))
    B, Tp = tokens.shape
    assert Tp % chunk == 0
    dtype = dtype or params["embed"].dtype
    lens = jnp.asarray(prompt_lens, jnp.int32)
    tok = jnp.asarray(tokens, jnp.int32)
    plan = plan or FullKVPlan(prompt_lens, cfg.num_layers, cfg.num_kv_heads)
    builder = PoolBuilder(plan, prompt_lens, cfg, tail_capacity, dtype, mesh=mesh, compile_fn=compile_fn)
    x = compile_fn(_embed_jit, params, tok, cfg=cfg)(params, tok)
    kv_shape = (B, cfg.num_kv_heads, Tp, cfg.head_dim)
    for li, layer in enumerate(params["layers"]):
        x_out = jnp.zeros_like(x)
        k_buf, v_buf = jnp.zeros(kv_shape, dtype), jnp.zeros(kv_shape, dtype)
        for start in range(0, Tp, chunk):
            args = (layer, x, x_out, k_buf, v_buf, np.int32(start))
            x_out, k_buf, v_buf = compile_fn(_layer_prefill_chunk_jit, *args, chunk=chunk, cfg=cfg)(*args)
        if observe is not None:
            observe(li, layer, x, k_buf, v_buf, lens)
        done = builder.add(li, plan.build_layer(li, layer, x, k_buf, v_buf, lens))
        # one sync per layer: compile work in the next layer's hooks then never overlaps
        # with this layer's compute, so the timings that exclude compile time stay honest
        jax.block_until_ready(done)
        del k_buf, v_buf
        x = x_out
    if all_logits:
        logits = compile_fn(_all_logits_jit, params, x, cfg=cfg)(params, x)
    else:
        logits = compile_fn(_final_logits_jit, params, x, lens, cfg=cfg)(params, x, lens)
    return logits, builder.cache(lens)


# ------------------------------------------------------------------- decode
def decode_step(
    params: dict, cache: KVCache, tokens: jax.Array, cfg: ModelConfig, return_queries: bool = False,
    policy=None, host: tuple = (),
):
    """One new token per sequence. tokens: [B] int32. Returns logits [B, V] (float32) and the cache; a
    sequence whose tail is full (``tail_lens`` = ``tail_capacity``) gets NaN logits (:func:`overflowed`).

    The token's K/V goes into every head's region of the pool, after its prompt rows and its ``tail_lens``
    earlier tokens; then each layer attends every head in one call (``LayerStep.attend``). With
    ``return_queries`` also returns each layer's query (after RoPE) as a tuple of [B, Nkv, G, D] arrays.

    ``policy`` (static; None = attention over every kept row): an object whose
    ``attend(li, q, step) -> (out, step, extra)`` replaces ``step.attend`` in every layer (a decode-time
    policy selects or fetches there and may update the pool and its layer's state). Then the per-layer
    ``extra`` outputs come back too, as a tuple over layers (through ``policy.finish_step``), last. ``host``:
    per layer, the host operands the policy's ``attend`` reads (``LayerStep.host``; () for none).
    """
    B = tokens.shape[0]
    pos = cache.seq_lens  # [B]
    b = jnp.arange(B)
    slot = cache.tail_lens  # [B]
    R = cache.tail_capacity
    x = params["embed"][tokens][:, None, :]  # [B, 1, H]
    pool = cache.pool
    new_layers, queries, extras = [], [], []
    for li, (layer, lc) in enumerate(zip(params["layers"], cache.layers)):
        h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
        q, k, v = project_qkv(layer, h, pos[:, None], cfg)
        pool = append(pool, lc, slot, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), R, cache.mesh)
        qg = q[:, 0].reshape(B, cfg.num_kv_heads, cfg.group_size, cfg.head_dim)
        queries.append(qg)
        step = LayerStep(pool=pool, layer=lc, tail_lens=slot + 1, seq_lens=pos, host=host[li] if host else None,
                         tail_capacity=R, mesh=cache.mesh)
        if policy is None:
            attn = step.attend(qg)[0]
        else:
            attn, step, extra = policy.attend(li, qg, step)
            extras.append(extra)
        pool, lc = step.pool, step.layer
        x = x + output_projection(layer, attn.reshape(B, 1, -1))
        x = x + mlp(layer, rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps))
        new_layers.append(lc)
    h = rms_norm(x[:, 0], params["final_norm"], cfg.rms_norm_eps)
    cache = cache.replace(
        pool=pool,
        layers=tuple(new_layers),
        seq_lens=pos + 1,
        tail_lens=slot + 1,
        tail_positions=cache.tail_positions.at[b, slot].set(pos, mode="drop"),
    )
    out = (overflowed(lm_logits(params, h, cfg), slot + 1, R), cache)
    if return_queries:
        out += (tuple(queries),)
    if policy is not None:
        out += (policy.finish_step(tuple(extras)),)
    return out


def extend(params: dict, cache: KVCache, tokens: jax.Array, n_new: jax.Array, cfg: ModelConfig, policy=None,
           host: tuple = ()):
    """Append a chunk of tokens to every head's region in one pass (a session's turn, chunked).

    tokens: [B, C] int32, of which the first ``n_new`` [B] are real (the rest is padding: its K/V lands in
    tail rows past the new length, never read, and rows past the tail's capacity are dropped).
    Equal, up to float summation order, to ``n_new`` calls of :func:`decode_step` (under the default
    attention); ``policy`` (static, None = that default) may replace ``step.attend_chunk`` through its
    ``attend_chunk(li, q, step)`` (Quest offloaded attends the prompt it keeps on the host; ``host`` as in
    :func:`decode_step`).
    Returns (logits of each sequence's last real token [B, V] float32, the cache, and each layer's
    queries (after RoPE) as a tuple of [B, Nkv, C, G, D] arrays, the layout of ``pallas_kernels.scores``).
    """
    B, C = tokens.shape
    pos0, slot0 = cache.seq_lens, cache.tail_lens  # [B]
    R = cache.tail_capacity
    offs = jnp.arange(C, dtype=jnp.int32)
    positions = pos0[:, None] + offs[None, :]  # [B, C]
    slots = slot0[:, None] + offs[None, :]
    real = offs[None, :] < n_new[:, None]
    b = jnp.arange(B)[:, None]
    x = params["embed"][tokens]  # [B, C, H]
    pool = cache.pool
    new_layers, queries = [], []
    for li, (layer, lc) in enumerate(zip(params["layers"], cache.layers)):
        h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
        q, k, v = project_qkv(layer, h, positions, cfg)  # q [B, C, Nq, D]; k, v [B, C, Nkv, D]
        pool = append(pool, lc, slot0, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), R, cache.mesh)
        qg = q.reshape(B, C, cfg.num_kv_heads, cfg.group_size, cfg.head_dim).transpose(0, 2, 3, 1, 4)
        queries.append(qg.transpose(0, 1, 3, 2, 4))  # [B, Nkv, C, G, D]
        step = LayerStep(pool=pool, layer=lc, tail_lens=slot0 + 1, seq_lens=pos0, host=host[li] if host else None,
                         tail_capacity=R, mesh=cache.mesh)
        if policy is None:
            attn = step.attend_chunk(qg)
        else:
            attn = policy.attend_chunk(li, qg, step)
        x = x + output_projection(layer, attn.transpose(0, 3, 1, 2, 4).reshape(B, C, -1))
        x = x + mlp(layer, rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps))
        new_layers.append(lc)
    last = jnp.take_along_axis(x, jnp.maximum(n_new - 1, 0)[:, None, None], axis=1)[:, 0]
    h = rms_norm(last, params["final_norm"], cfg.rms_norm_eps)
    cache = cache.replace(
        pool=pool,
        layers=tuple(new_layers),
        seq_lens=pos0 + n_new,
        tail_lens=slot0 + n_new,
        tail_positions=cache.tail_positions.at[b, jnp.where(real, slots, cache.tail_capacity)].set(
            positions, mode="drop"),
    )
    return overflowed(lm_logits(params, h, cfg), slot0 + n_new, R), cache, tuple(queries)


def overflowed(logits: jax.Array, tail_lens: jax.Array, tail_capacity: int) -> jax.Array:
    """``logits`` [B, V] with NaN rows for the sequences whose tail outgrew its capacity (tail_lens [B] > it):
    their new rows were not written and the attention read past their regions, so their logits mean nothing
    (``Engine.reserve`` makes room first; a caller stepping the model itself must too)."""
    return jnp.where((tail_lens > tail_capacity)[:, None], jnp.nan, logits)


def prompt_queries(layer: dict, x_in: jax.Array, rows: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Queries (after RoPE) of selected prompt rows, recomputed from the layer's input.

    x_in: [B, Tp, H] the layer's input hidden states; rows: [B, W] int32 slot
    (= position) of each wanted prompt token. Returns [B, Nkv, W, G, D], the
    layout of ``pallas_kernels.pooled_scores``. Used by prefill selection
    (observation windows, last-token attention) without keeping every query.
    """
    B, W = rows.shape
    x = jnp.take_along_axis(x_in, rows[:, :, None], axis=1)  # [B, W, H]
    h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
    q, _, _ = project_qkv(layer, h, rows, cfg)  # [B, W, Nq, D]
    q = q.reshape(B, W, cfg.num_kv_heads, cfg.group_size, cfg.head_dim)
    return q.transpose(0, 2, 1, 3, 4)


# Jitted entry points for callers that step the model themselves (tests, calibration,
# benchmarks). generate() uses its own AOT-compiled, cache-donating variant.
decode_step_jit = jax.jit(decode_step, static_argnames=("cfg", "return_queries", "policy"))
extend_jit = jax.jit(extend, static_argnames=("cfg", "policy"))
