"""HF safetensors -> our checkpoint, checked tensor by tensor against transformers' own loading of the dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import warnings

pytest.importorskip("torch")
pytest.importorskip("transformers")

import ml_dtypes  # noqa: E402

from convert.cli import main as convert_main  # noqa: E402
from hetero_jax.io import hub  # noqa: E402
from hetero_jax.io.checkpoint import load_checkpoint, load_params  # noqa: E402
from hetero_jax.errors import CheckpointError  # noqa: E402
from hetero_jax.model.spec import hf_tensor_map  # noqa: E402
from hetero_jax.io.tokenizer import Tokenizer  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from hf_fixtures import ARCHS, make_tiny_hf  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """arch -> tiny HF dir; qwen2 saved in shards (with model.safetensors.index.json)."""
    root = tmp_path_factory.mktemp("hf")
    return {a: make_tiny_hf(a, root / a, max_shard_size="50KB" if a == "qwen2" else None) for a in ARCHS}


def _reference_state_dict(hf_dir):
    """The state dict transformers itself loads from the dir: the independent reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def _get(params, path):
    return np.asarray(params[path[0]] if len(path) == 1 else params["layers"][path[1]][path[2]])


@pytest.mark.parametrize("arch", ARCHS)
def test_convert_matches_transformers(arch, hf_dirs, tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert convert_main([str(hf_dirs[arch]), str(out), "--no-progress"]) == 0
    assert "tensors" in capsys.readouterr().out
    cfg, params, tok = load_checkpoint(out)
    ref = _reference_state_dict(hf_dirs[arch])

    used = set()
    for hf_name, path, hf_shape, transpose in hf_tensor_map(cfg):
        ours = _get(params, path)
        assert ours.dtype == np.float32
        np.testing.assert_array_equal(ours.T if transpose else ours, ref[hf_name], err_msg=hf_name)
        used.add(hf_name)
    # Every tensor transformers has is covered (a tied lm_head is the embedding itself).
    leftover = set(ref) - used
    if cfg.tie_word_embeddings:
        assert leftover == {"lm_head.weight"} and "lm_head" not in params
        np.testing.assert_array_equal(np.asarray(params["embed"]), ref["lm_head.weight"])
    else:
        assert leftover == set()
    # Hand-written spot checks of the layout (independent of spec's name table).
    np.testing.assert_array_equal(np.asarray(params["layers"][1]["q_proj"]),
                                  ref["model.layers.1.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(params["layers"][0]["down_proj"]),
                                  ref["model.layers.0.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(params["final_norm"]), ref["model.norm.weight"])
    if arch == "qwen2":
        np.testing.assert_array_equal(np.asarray(params["layers"][1]["k_bias"]),
                                      ref["model.layers.1.self_attn.k_proj.bias"])
        assert cfg.group_size == 7
    if arch == "qwen3":
        np.testing.assert_array_equal(np.asarray(params["layers"][0]["q_norm"]),
                                      ref["model.layers.0.self_attn.q_norm.weight"])
        assert cfg.head_dim == 32 and cfg.hidden_size == 64
    if arch == "llama":
        assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0 and cfg.group_size == 4

    # config.json copied verbatim; tokenizer files copied and working.
    assert json.load(open(out / "config.json")) == json.load(open(os.path.join(hf_dirs[arch], "config.json")))
    from tokenizers import Tokenizer as HFTok

    orig = HFTok.from_file(os.path.join(hf_dirs[arch], "tokenizer.json"))
    text = "The quick brown fox, 42 times."
    assert tok.encode(text) == orig.encode(text, add_special_tokens=False).ids
    # tokenizer_config eos "<|im_end|>" is id 2, the same id config.json gives: listed once.
    assert tok.token_to_id("<|im_end|>") == 2 and tok.eos_token_ids == (2,)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    meta = json.load(open(out / "hetero_jax.json"))
    assert meta["format_version"] == 1 and meta["dtype"] == "float32" and meta["source"]["type"] == "hf"


def test_sharded_input_has_index(hf_dirs):
    assert os.path.isfile(os.path.join(hf_dirs["qwen2"], "model.safetensors.index.json"))
    shards = [f for f in os.listdir(hf_dirs["qwen2"]) if f.endswith(".safetensors")]
    assert len(shards) > 1


def test_bfloat16_conversion(hf_dirs, tmp_path):
    from hetero_jax.io.hf import convert_hf

    out = tmp_path / "bf16"
    res = convert_hf(hf_dirs["llama"], out, dtype="bfloat16", progress=False)
    assert json.load(open(out / "hetero_jax.json"))["dtype"] == "bfloat16"
    raw = load_params(out)
    assert isinstance(raw["layers"], list)
    assert raw["embed"].dtype == ml_dtypes.bfloat16 and raw["layers"][0]["q_proj"].dtype == ml_dtypes.bfloat16
    assert res.num_bytes == sum(a.nbytes for a in [raw["embed"], raw["final_norm"], raw["lm_head"]]) + \
        sum(a.nbytes for layer in raw["layers"] for a in layer.values())
    ref = _reference_state_dict(hf_dirs["llama"])
    expect = ref["model.layers.1.mlp.up_proj.weight"].T.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(raw["layers"][1]["up_proj"], expect)
    # Loading with a dtype casts; bf16 -> f32 is exact.
    cfg, params, _ = load_checkpoint(out, dtype="float32")
    assert params["embed"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(params["layers"][1]["up_proj"]), expect.astype(np.float32))
    _, params16, _ = load_checkpoint(out)
    assert params16["lm_head"].dtype == ml_dtypes.bfloat16


def test_cli_subprocess(hf_dirs, tmp_path):
    out = tmp_path / "sub"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "convert.cli", str(hf_dirs["qwen3"]), str(out), "--no-progress"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"-> {out}" in r.stdout and "parameters" in r.stdout
    # An error path through the real entry point: exit code 2, one-line message, no traceback.
    r = subprocess.run([sys.executable, "-m", "convert.cli", str(hf_dirs["qwen3"]), str(out), "--no-progress"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "--force" in r.stderr
    assert "Traceback" not in r.stderr


def test_hub_load_path_and_unknown(hf_dirs, tmp_path):
    out = tmp_path / "hubck"
    assert convert_main([str(hf_dirs["qwen3"]), str(out), "--no-progress"]) == 0
    with pytest.warns(RuntimeWarning, match="bfloat16 on a CPU decodes tens of times slower"):
        m = hub.load(str(out), dtype="bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # float32 on a CPU: no warning
        hub.load(str(out), dtype="float32")
    assert m.config.architecture == "qwen3" and m.path == str(out) and m.name == "hubck"
    assert m.params["embed"].dtype == ml_dtypes.bfloat16
    assert isinstance(m.tokenizer, Tokenizer)
    with pytest.raises(CheckpointError, match="smollm2-135m") as e:
        hub.load("no-such-model-xyz")
    assert "path" in str(e.value)
    with pytest.raises(CheckpointError, match="not a hetero-jax checkpoint"):
        hub.load(str(hf_dirs["qwen3"]))


def test_hub_converts_known_model_once(hf_dirs, tmp_path, monkeypatch):
    """A registry entry is converted into $HETERO_JAX_CACHE/<name> once, then reused; an empty directory there is
    replaced (one holding anything else is refused: tests/test_outputs.py)."""
    monkeypatch.setenv("HETERO_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(hub.KNOWN_MODELS, "tiny-qwen3",
                        hub.KnownModel(description="test", source=lambda: str(hf_dirs["qwen3"]), kind="hf"))
    target = tmp_path / "cache" / "tiny-qwen3"
    target.mkdir(parents=True)  # empty: may be replaced
    m = hub.load("tiny-qwen3")
    assert m.path == str(target) and m.name == "tiny-qwen3" and (target / "hetero_jax.json").is_file()
    stamp = os.stat(target / "hetero_jax.json").st_mtime_ns
    m2 = hub.load("tiny-qwen3")
    assert os.stat(target / "hetero_jax.json").st_mtime_ns == stamp and m2.config == m.config
    assert sorted(os.listdir(tmp_path / "cache")) == ["tiny-qwen3"]
