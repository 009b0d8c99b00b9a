"""Conversion failures: each gives a clear message and leaves nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402

from convert.cli import main as convert_main  # noqa: E402
from hetero_jax.checkpoint import is_checkpoint  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from hf_fixtures import make_tiny_hf  # noqa: E402


@pytest.fixture(scope="module")
def base_hf(tmp_path_factory):
    return make_tiny_hf("llama", tmp_path_factory.mktemp("base") / "llama")


@pytest.fixture
def hf(base_hf, tmp_path):
    """A private copy of the tiny Llama dir to damage."""
    return shutil.copytree(base_hf, tmp_path / "hf")


@pytest.fixture
def out_parent(tmp_path):
    p = tmp_path / "outputs"
    p.mkdir()
    return p


def _fail(args, out_parent, capsys, *needles):
    """Run the CLI expecting exit 2; check the message names each needle and nothing was written."""
    before = sorted(os.listdir(out_parent))
    assert convert_main([*map(str, args), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: "), err
    for n in needles:
        assert n in err, f"{n!r} not in {err!r}"
    assert sorted(os.listdir(out_parent)) == before  # no OUT_DIR, no temporary leftovers
    return err


def _rewrite(hf, fn):
    path = os.path.join(hf, "model.safetensors")
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return path


def test_missing_directory(tmp_path, out_parent, capsys):
    _fail([tmp_path / "nope", out_parent / "ck"], out_parent, capsys, "does not exist", str(tmp_path / "nope"))


def test_missing_config(hf, out_parent, capsys):
    os.remove(hf / "config.json")
    _fail([hf, out_parent / "ck"], out_parent, capsys, "no config.json", str(hf))


def test_unsupported_architecture(hf, out_parent, capsys):
    cfg = json.load(open(hf / "config.json"))
    cfg["architectures"] = ["MistralForCausalLM"]
    json.dump(cfg, open(hf / "config.json", "w"))
    _fail([hf, out_parent / "ck"], out_parent, capsys, "MistralForCausalLM",
          "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def test_missing_tensor(hf, out_parent, capsys):
    _rewrite(hf, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    _fail([hf, out_parent / "ck"], out_parent, capsys, "missing", "model.layers.1.mlp.up_proj.weight", "(128, 64)")


def test_unexpected_tensor(hf, out_parent, capsys):
    path = _rewrite(hf, lambda t: t.__setitem__("model.layers.0.extra.weight", np.zeros((3, 4), np.float32)))
    _fail([hf, out_parent / "ck"], out_parent, capsys, "unexpected", "model.layers.0.extra.weight", path)


def test_wrong_shape(hf, out_parent, capsys):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:8].copy()

    path = _rewrite(hf, shrink)
    _fail([hf, out_parent / "ck"], out_parent, capsys, "model.layers.0.self_attn.k_proj.weight", path,
          "(8, 64)", "expected (16, 64)")


def test_truncated_safetensors(hf, out_parent, capsys):
    path = hf / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _fail([hf, out_parent / "ck"], out_parent, capsys, str(path), "truncated or corrupt", "re-download")


def test_missing_tokenizer(hf, out_parent, capsys):
    os.remove(hf / "tokenizer.json")
    _fail([hf, out_parent / "ck"], out_parent, capsys, "tokenizer.json")


def test_tied_lm_head_that_differs(hf, out_parent, capsys):
    cfg = json.load(open(hf / "config.json"))
    cfg["tie_word_embeddings"] = True
    json.dump(cfg, open(hf / "config.json", "w"))
    # lm_head.weight is present and differs from the embedding.
    _fail([hf, out_parent / "ck"], out_parent, capsys, "tie_word_embeddings", "lm_head.weight")


def test_not_a_gguf_file(tmp_path, out_parent, capsys):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"this is not a gguf file at all" * 10)
    _fail(["--gguf", bogus, out_parent / "ck"], out_parent, capsys, str(bogus), "re-download")


def test_existing_output_needs_force(hf, out_parent, capsys):
    out = out_parent / "ck"
    out.mkdir()
    (out / "marker.txt").write_text("old")
    err = _fail([hf, out], out_parent, capsys, "already exists", "--force")
    assert str(out) in err and (out / "marker.txt").read_text() == "old"  # untouched

    assert convert_main([str(hf), str(out), "--force", "--no-progress"]) == 0
    assert is_checkpoint(out) and not (out / "marker.txt").exists()
    assert sorted(os.listdir(out_parent)) == ["ck"]  # the old copy and the temporary are gone


def test_force_keeps_old_output_when_conversion_fails(hf, out_parent, capsys):
    out = out_parent / "ck"
    assert convert_main([str(hf), str(out), "--no-progress"]) == 0
    capsys.readouterr()
    before = sorted(os.listdir(out))
    (hf / "model.safetensors").write_bytes(b"\0" * 16)
    _fail([hf, out, "--force"], out_parent, capsys, "truncated or corrupt")
    assert is_checkpoint(out) and sorted(os.listdir(out)) == before


def test_failure_inside_save_leaves_nothing(hf, out_parent, monkeypatch):
    """A crash while writing (here: in the Orbax save) removes the temporary dir and any parents it made."""
    import orbax.checkpoint as ocp

    from convert.hf import convert_hf

    def boom(self, *a, **k):
        raise RuntimeError("disk full (simulated)")

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        convert_hf(hf, out_parent / "new" / "deeper" / "ck", progress=False)
    assert os.listdir(out_parent) == []
