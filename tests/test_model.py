"""Model internals against independent numpy references on tiny random configs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetero_jax.model import transformer as M
from hetero_jax.model import spec
from hetero_jax.model.cache import kv_bytes, layer_rows, pool_offsets, prompt_kv_bytes, tail_kv_bytes
from hetero_jax.model.config import ModelConfig, RopeScaling
from hetero_jax.runtime import prefill


def tiny_cfg(**kw) -> ModelConfig:
    base = dict(
        architecture="llama", vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2,
        num_heads=6, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=512,
    )
    base.update(kw)
    return ModelConfig(**base)


def np_forward(params, cfg: ModelConfig, ids: np.ndarray) -> np.ndarray:
    """Plain numpy float64 forward pass over a whole sequence -> logits [T, V]."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    T = len(ids)
    D, G = cfg.head_dim, cfg.group_size

    def norm(x, w):
        return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps))

    inv = M.rope_inv_freq(cfg).astype(np.float64)
    ang = np.arange(T)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(x):  # [T, N, D]
        h = D // 2
        rot = np.concatenate([-x[..., h:], x[..., :h]], -1)
        return x * cos[:, None] + rot * sin[:, None]

    x = p["embed"][ids]
    for L in p["layers"]:
        h = norm(x, L["attn_norm"])
        q = (h @ L["q_proj"] + L.get("q_bias", 0)).reshape(T, cfg.num_heads, D)
        k = (h @ L["k_proj"] + L.get("k_bias", 0)).reshape(T, cfg.num_kv_heads, D)
        v = (h @ L["v_proj"] + L.get("v_bias", 0)).reshape(T, cfg.num_kv_heads, D)
        if cfg.qk_norm:
            q, k = norm(q, L["q_norm"]), norm(k, L["k_norm"])
        q, k = rope(q), rope(k)
        out = np.zeros((T, cfg.num_heads, D))
        causal = np.tril(np.ones((T, T), bool))
        for hq in range(cfg.num_heads):
            s = q[:, hq] @ k[:, hq // G].T / math.sqrt(D)
            s = np.where(causal, s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[:, hq] = w @ v[:, hq // G]
        x = x + out.reshape(T, -1) @ L["o_proj"]
        h = norm(x, L["mlp_norm"])
        g = h @ L["gate_proj"]
        x = x + ((g / (1 + np.exp(-g))) * (h @ L["up_proj"])) @ L["down_proj"]
    x = norm(x, p["final_norm"])
    w = p["embed"].T if cfg.tie_word_embeddings else p["lm_head"]
    return x @ w


CONFIGS = {
    "llama-gqa3": tiny_cfg(),
    "llama3-rope": tiny_cfg(
        num_heads=8, num_kv_heads=2,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 32), rope_theta=500000.0,
    ),
    "qwen2-bias-gqa5": tiny_cfg(architecture="qwen2", num_heads=5, num_kv_heads=1, hidden_size=40, qkv_bias=True),
    "qwen3-qknorm": tiny_cfg(architecture="qwen3", qk_norm=True, head_dim=16, tie_word_embeddings=True),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("chunk_len", [37, 70])
def test_chunked_prefill_and_decode_match_numpy(name, chunk_len):
    cfg = CONFIGS[name]
    params = jax.tree.map(jnp.asarray, spec.init_params(cfg, seed=1, scale=0.15))
    rng = np.random.default_rng(3)
    ids = rng.integers(0, cfg.vocab_size, size=chunk_len + 5)
    ref = np_forward(params, cfg, ids)
    # prefill the first chunk_len tokens in several chunks, then decode the rest one at a time
    logits, cache = prefill(params, cfg, [ids[:chunk_len].tolist()], tail_capacity=8)
    np.testing.assert_allclose(np.asarray(logits[0]), ref[chunk_len - 1], atol=2e-4, rtol=0)
    for t in range(chunk_len, len(ids)):
        logits, cache = M.decode_step_jit(params, cache, jnp.asarray([ids[t]], jnp.int32), cfg)
        np.testing.assert_allclose(np.asarray(logits[0]), ref[t], atol=2e-4, rtol=0)
    # per-head bookkeeping: each head's region holds the prompt at its positions, then the decoded tokens
    assert np.asarray(cache.seq_lens).tolist() == [len(ids)]
    assert np.asarray(cache.tail_lens).tolist() == [len(ids) - chunk_len]
    tail_pos = np.asarray(cache.tail_positions[0])
    assert np.all(tail_pos[: len(ids) - chunk_len] == np.arange(chunk_len, len(ids)))
    assert np.all(tail_pos[len(ids) - chunk_len :] == -1)
    for li, layer in enumerate(cache.layers):
        assert layer.lengths.shape == (1, cfg.num_kv_heads)
        assert np.all(np.asarray(layer.lengths) == chunk_len)
        _, _, pos, _ = layer_rows(cache, li)
        assert np.all(np.asarray(pos[0]) == np.arange(chunk_len))


def test_llama3_rope_inv_freq_matches_hf():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=2, head_dim=128, max_position_embeddings=8192,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        rope_theta=500000.0,
    )
    d = hf_cfg.to_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    cfg = ModelConfig.from_hf_dict(d)
    inv_hf, scale = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    assert scale == 1.0
    np.testing.assert_allclose(M.rope_inv_freq(cfg), inv_hf.numpy(), rtol=1e-6)


@pytest.mark.parametrize("where", ["absent", "top level", "both"])
def test_llama3_rope_original_max_is_found_where_transformers_finds_it(where):
    """A llama3 rope without original_max_position_embeddings was refused, though transformers takes
    max_position_embeddings; a top-level one (Phi-3's place) wins over the RoPE dict's, as there."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    if where == "both":
        rope["original_max_position_embeddings"] = 4096
    d = dict(architectures=["LlamaForCausalLM"], hidden_size=256, num_attention_heads=2, head_dim=128,
             intermediate_size=512, num_hidden_layers=1, vocab_size=32, max_position_embeddings=16384,
             rope_theta=500000.0, rope_scaling=rope)
    if where != "absent":
        d["original_max_position_embeddings"] = 2048
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in d.items() if k != "architectures"})
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.rope_scaling.original_max_position_embeddings == (16384 if where == "absent" else 2048)
    inv_hf, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    np.testing.assert_allclose(M.rope_inv_freq(cfg), inv_hf.numpy(), rtol=1e-6)


def test_cache_is_stored_at_kv_heads_and_counts_bytes():
    cfg = CONFIGS["llama-gqa3"]
    params = jax.tree.map(jnp.asarray, spec.init_params(cfg, seed=0))
    _, cache = prefill(params, cfg, [[1, 2, 3], [4, 5, 6, 7, 8]], tail_capacity=32)
    assert np.asarray(cache.layers[0].lengths).tolist() == [[3, 3], [5, 5]]
    # one pool: per sequence, every head of every layer holds its prompt (chunk padding not kept) + 32 rows
    B, S, P, D = cache.pool.k.shape
    need = cfg.num_layers * cfg.num_kv_heads * (5 + 32)  # the longer sequence
    assert (B, S, D) == (2, 1, cfg.head_dim) and need <= P < need + 128
    per_token = 2 * cfg.head_dim * 4  # K and V, float32
    assert prompt_kv_bytes(cache) == cfg.num_layers * cfg.num_kv_heads * (3 + 5) * per_token
    assert kv_bytes(cache) == B * P * per_token
    assert kv_bytes(cache) == prompt_kv_bytes(cache) + tail_kv_bytes(cache)
    # regions: sequence 1's heads one after another, each 5 prompt rows + 32 tail rows
    offsets = np.stack([np.asarray(l.offsets) for l in cache.layers])
    assert offsets[:, 1].reshape(-1).tolist() == list(range(0, need, 37))


def test_pool_offsets_pack_each_shards_heads_layer_after_layer():
    counts = np.array([[[3, 1, 4, 1]], [[5, 9, 2, 6]]])  # [L=2, B=1, H=4]
    offsets, rows = pool_offsets(counts, tail_capacity=2, shards=2)
    # shard 0 holds slots 0, 1 of each layer, shard 1 slots 2, 3: regions of counts + 2 rows, in order
    assert offsets[:, 0].tolist() == [[0, 5, 0, 6], [8, 15, 9, 13]]
    assert rows == 128  # the largest shard total (26 rows) rounded up to the pool quantum


def test_bfloat16_close_to_float32():
    cfg = CONFIGS["llama-gqa3"]
    p32 = jax.tree.map(jnp.asarray, spec.init_params(cfg, seed=2, scale=0.15))
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p32)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=40).tolist()
    l32, _ = prefill(p32, cfg, [ids], tail_capacity=8)
    l16, c16 = prefill(p16, cfg, [ids], tail_capacity=8)
    assert c16.pool.k.dtype == jnp.bfloat16
    assert l16.dtype == jnp.float32  # logits always float32
    err = np.abs(np.asarray(l16) - np.asarray(l32)).max()
    assert err < 0.05 * np.abs(np.asarray(l32)).max()


@pytest.mark.parametrize("lead", [(1,), (1, 1), (2, 3)])
def test_matmul_for_a_gpu_equals_numpy(lead):
    """The products traced for a GPU (one token's as a two-row GEMM) equal numpy's, one row or several."""
    import pallas_kernels

    rng = np.random.default_rng(0)
    x = rng.standard_normal(lead + (48,)).astype(np.float32)
    w = rng.standard_normal((48, 20)).astype(np.float32)
    with pallas_kernels.use_kernels("pallas"):
        assert pallas_kernels.traced_for_gpu()
        got = jax.jit(M._matmul)(jnp.asarray(x), jnp.asarray(w))
    assert got.shape == lead + (20,)
    np.testing.assert_allclose(np.asarray(got), x @ w, rtol=1e-5, atol=1e-5)
