"""Conversion failures: each gives a clear message and leaves nothing behind."""

from __future__ import annotations

import json
import re
import os
import shutil
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402

from convert.cli import main as convert_main  # noqa: E402
from hetero_jax.io.checkpoint import is_checkpoint  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from fs_state import deny_write, snapshot  # noqa: E402
from hf_fixtures import convert_refused  # noqa: E402


@pytest.fixture
def out_parent(tmp_path):
    p = tmp_path / "outputs"
    p.mkdir()
    return p


_fail = convert_refused  # the CLI exits 2 naming each needle and writes nothing


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


@pytest.fixture
def tensors_read(monkeypatch):
    """The names of the tensors the conversion reads (``get_tensor``), in order."""
    import safetensors

    real, read = safetensors.safe_open, []

    class Counted:
        def __init__(self, *a, **k):
            self._f = real(*a, **k)

        def __enter__(self):
            self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def get_tensor(self, name):
            read.append(name)
            return self._f.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Counted)
    return read


def _fp8(hf):
    import torch
    from safetensors.torch import load_file as load_torch, save_file as save_torch

    path = os.path.join(hf, "model.safetensors")
    t = load_torch(path)
    t["model.layers.1.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"].to(torch.float8_e4m3fn)
    save_torch(t, path, metadata={"format": "pt"})


@pytest.mark.parametrize("damage, needles", [
    (lambda hf: _rewrite(hf, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
     ["'model.layers.1.mlp.up_proj.weight' is missing"]),
    (lambda hf: _rewrite(hf, lambda t: t.__setitem__("model.layers.1.extra.weight", np.zeros((3, 4), np.float32))),
     ["unexpected tensor 'model.layers.1.extra.weight'"]),
    (_fp8, ["'model.layers.1.mlp.up_proj.weight'", "has dtype F8_E4M3: quantised weights are not supported",
            "unquantised release"]),  # was "truncated or corrupt; re-download it"
])
def test_what_the_headers_show_is_refused_before_any_tensor_is_read(hf, out_parent, capsys, tensors_read, damage,
                                                                     needles):
    """A missing tensor was found after every tensor was read and held (tens of GB on a large model)."""
    damage(hf)
    _fail([hf, out_parent / "ck"], out_parent, capsys, *needles)
    assert tensors_read == []


def test_a_quantised_checkpoint_is_refused_by_its_config(hf, out_parent, capsys, no_weights_read):
    """GPTQ / AWQ / bitsandbytes / FP8 releases got 'the weights do not match config.json' or 'corrupt'."""
    cfg = json.load(open(hf / "config.json"))
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    json.dump(cfg, open(hf / "config.json", "w"))
    _fail([hf, out_parent / "ck"], out_parent, capsys, "has a quantization_config (quant_method 'gptq')",
          "convert the unquantised release")


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


# ------------------------------------------- what OUT_DIR --force may replace (review of issue 20)
def _meta_dtype(out):
    return json.load(open(os.path.join(out, "hetero_jax.json")))["dtype"]


@pytest.mark.parametrize("force", [False, True])
def test_a_folder_that_is_not_a_checkpoint_is_never_replaced(hf, out_parent, capsys, no_weights_read, force):
    """`--force` used to delete any OUT_DIR: a folder holding a user's thesis.txt was replaced."""
    out = out_parent / "ck"
    out.mkdir()
    (out / "thesis.txt").write_text("four years of work")
    err = _fail([hf, out] + (["--force"] if force else []), out_parent, capsys,
                str(out), "is not a hetero-jax checkpoint", "thesis.txt", "Choose another OUT_DIR", "remove")
    assert "pass --force" not in err  # --force would not be allowed, so it is not suggested
    assert os.listdir(out) == ["thesis.txt"] and (out / "thesis.txt").read_text() == "four years of work"


@pytest.mark.parametrize("force", [False, True])
def test_a_file_as_out_dir_is_refused(hf, out_parent, capsys, no_weights_read, force):
    out = out_parent / "ck"
    out.write_text("notes")
    err = _fail([hf, out] + (["--force"] if force else []), out_parent, capsys,
                str(out), "is not a directory", "choose another OUT_DIR")
    assert "pass --force" not in err and out.read_text() == "notes"


def test_force_replaces_a_previous_conversion(hf, out_parent, capsys):
    out = out_parent / "ck"
    assert convert_main([str(hf), str(out), "--dtype", "bfloat16", "--no-progress"]) == 0
    capsys.readouterr()
    err = _fail([hf, out], out_parent, capsys, str(out), "already holds a converted checkpoint", "pass --force")
    assert _meta_dtype(out) == "bfloat16"  # untouched by the refusal

    assert convert_main([str(hf), str(out), "--force", "--no-progress"]) == 0
    assert is_checkpoint(out) and _meta_dtype(out) == "float32"
    assert sorted(os.listdir(out_parent)) == ["ck"]  # the old copy and the temporary are gone


def test_force_replaces_an_empty_directory(hf, out_parent, capsys):
    out = out_parent / "ck"
    out.mkdir()
    _fail([hf, out], out_parent, capsys, str(out), "already exists (empty)", "pass --force")
    assert os.listdir(out) == []
    assert convert_main([str(hf), str(out), "--force", "--no-progress"]) == 0
    assert is_checkpoint(out) and sorted(os.listdir(out_parent)) == ["ck"]


@pytest.mark.parametrize("force", [False, True])
def test_an_empty_out_dir_is_refused(hf, tmp_path, capsys, monkeypatch, no_weights_read, force):
    """`OUT_DIR=""` with --force used to replace the current working directory."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "thesis.txt").write_text("draft")
    monkeypatch.chdir(cwd)
    before = snapshot(tmp_path)
    assert convert_main([str(hf), "", "--no-progress"] + (["--force"] if force else [])) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "output directory is an empty string" in err, err
    assert snapshot(tmp_path) == before and os.getcwd() == str(cwd)


@pytest.mark.parametrize("args, needle", [(["", "OUT"], "HF_DIR is an empty string"),
                                          (["--gguf", "", "OUT"], "--gguf FILE is an empty string")])
def test_an_empty_input_is_refused(tmp_path, capsys, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    assert convert_main(args + ["--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err, err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("sub", ["sub", "sub/deeper"])
def test_out_dir_under_a_file_is_refused_before_converting(hf, out_parent, capsys, no_weights_read, sub):
    afile = out_parent / "afile"
    afile.write_text("keep")
    out = afile / sub
    _fail([hf, out, "--force"], out_parent, capsys, str(out), "cannot be created",
          f"{afile} is a file, not a directory", "choose another OUT_DIR")
    assert afile.read_text() == "keep"


@pytest.mark.parametrize("sub", ["ck", "missing/ck"])
def test_out_dir_in_a_read_only_directory_is_refused_before_converting(hf, out_parent, capsys, monkeypatch,
                                                                        no_weights_read, sub):
    ro = out_parent / "ro"
    ro.mkdir()
    deny_write(monkeypatch, ro)
    out = ro / sub
    _fail([hf, out], out_parent, capsys, str(out), "cannot be created", f"{ro} is not writable")
    assert os.listdir(ro) == []


def test_an_os_error_while_saving_names_out_dir(hf, out_parent, capsys, monkeypatch):
    """A failure the up-front check could not foresee (a permission changed meanwhile, a full disk) is an
    error of our own naming OUT_DIR, not a traceback, and leaves nothing behind."""
    from hetero_jax.io import checkpoint

    def mkdtemp(*a, **k):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(checkpoint.tempfile, "mkdtemp", mkdtemp)
    out = out_parent / "new" / "ck"
    _fail([hf, out], out_parent, capsys, f"output directory {out}", "writing the checkpoint failed",
          "Permission denied", "nothing was written")


def test_a_failed_final_rename_keeps_the_previous_checkpoint(hf, out_parent, capsys, monkeypatch):
    out = out_parent / "ck"
    assert convert_main([str(hf), str(out), "--dtype", "bfloat16", "--no-progress"]) == 0
    capsys.readouterr()
    real_rename = os.rename

    def rename(src, dst, **kw):
        if os.path.basename(src).startswith(".ck.tmp-"):  # the new checkpoint's move into place
            raise OSError(28, "No space left on device")
        return real_rename(src, dst, **kw)
    monkeypatch.setattr(os, "rename", rename)
    _fail([hf, out, "--force"], out_parent, capsys, f"output directory {out}", "No space left on device")
    assert is_checkpoint(out) and _meta_dtype(out) == "bfloat16"


@pytest.mark.parametrize("holds, needles", [
    (["model.gguf"], ["is a directory", "--gguf takes the path of a GGUF file", "model.gguf"]),
    (["config.json"], ["is a directory", "leave out --gguf"]),
    ([], ["is a directory", "--gguf takes the path of a GGUF file"]),
])
def test_gguf_path_that_is_a_directory_says_so(tmp_path, out_parent, capsys, holds, needles):
    d = tmp_path / "models"
    d.mkdir()
    for name in holds:
        (d / name).write_bytes(b"x")
    err = _fail(["--gguf", d, out_parent / "ck"], out_parent, capsys, str(d), *needles)
    assert "does not exist" not in err


# --force through a symlinked OUT_DIR used to rename the link aside and leave it dangling as .OUT.old-xxxx.
def test_force_through_a_symlink_replaces_the_checkpoint_it_points_at(hf, tmp_path, out_parent, capsys):
    real_parent = tmp_path / "disk"
    real_parent.mkdir()
    target = real_parent / "ck"
    assert convert_main([str(hf), str(target), "--dtype", "bfloat16", "--no-progress"]) == 0
    link = out_parent / "ck"
    os.symlink(target, link)
    capsys.readouterr()
    _fail([hf, link], out_parent, capsys, str(link), f"a symlink to {target}", "already holds a converted checkpoint")

    assert convert_main([str(hf), str(link), "--force", "--no-progress"]) == 0
    assert os.path.islink(link) and os.readlink(link) == str(target)  # the link is kept, pointing where it did
    assert is_checkpoint(target) and _meta_dtype(target) == "float32"
    assert os.listdir(out_parent) == ["ck"] and os.listdir(real_parent) == ["ck"]  # no hidden leftovers


@pytest.mark.parametrize("force", [False, True])
def test_a_symlink_to_a_users_folder_is_refused(hf, tmp_path, out_parent, capsys, no_weights_read, force):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("draft")
    link = out_parent / "ck"
    os.symlink(mine, link)
    err = _fail([hf, link] + (["--force"] if force else []), out_parent, capsys, f"a symlink to {mine}",
                "is not a hetero-jax checkpoint", "thesis.txt")
    assert "pass --force" not in err
    assert os.path.islink(link) and os.listdir(mine) == ["thesis.txt"] and (mine / "thesis.txt").read_text() == "draft"


def test_a_dangling_symlink_is_refused(hf, tmp_path, out_parent, capsys, no_weights_read):
    link = out_parent / "ck"
    os.symlink(tmp_path / "gone", link)
    _fail([hf, link, "--force"], out_parent, capsys, str(link), "is a symlink to", "which does not exist")
    assert not os.path.lexists(tmp_path / "gone") and os.path.islink(link)


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

    from hetero_jax.io.hf import convert_hf

    def boom(self, *a, **k):
        raise RuntimeError("disk full (simulated)")

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        convert_hf(hf, out_parent / "new" / "deeper" / "ck", progress=False)
    assert os.listdir(out_parent) == []


# --------------------------------------------------------------- output vs input (issue 20)
@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("where", ["same", "inside", "contains", "symlink"])
def test_output_that_is_contains_or_is_inside_the_input_is_refused(hf, tmp_path, capsys, where, force):
    """`hetero-jax-convert D D --force` used to exit 0 after deleting D's weights."""
    before = snapshot(tmp_path)
    out, needle = {
        "same": (hf, "is the input"),
        "inside": (hf / "converted", "is inside the input directory"),
        "contains": (tmp_path, "contains the input"),
        "symlink": (tmp_path / "alias", "is the input"),
    }[where]
    if where == "symlink":
        os.symlink(hf, out)
        before = snapshot(tmp_path)
    args = [str(hf), str(out), "--no-progress"] + (["--force"] if force else [])
    assert convert_main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and str(out) in err and "outside the input" in err, err
    assert snapshot(tmp_path) == before  # the input is intact and nothing was written anywhere


@pytest.mark.parametrize("force", [False, True])
def test_gguf_output_that_contains_the_gguf_file_is_refused(tmp_path, capsys, force):
    src_dir = tmp_path / "models"
    src_dir.mkdir()
    gguf = src_dir / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    before = snapshot(tmp_path)
    args = ["--gguf", str(gguf), str(src_dir), "--no-progress"] + (["--force"] if force else [])
    assert convert_main(args) == 2
    err = capsys.readouterr().err
    assert "contains the input" in err and str(gguf) in err, err
    assert snapshot(tmp_path) == before


# ------------------------------------------------------ config.json values (issue 20)
def _set(cfg, key, value):
    if "." in key:
        outer, inner = key.split(".")
        cfg[outer] = dict(cfg[outer])
        if value is _DROP:
            cfg[outer].pop(inner)
        else:
            cfg[outer][inner] = value
    else:
        cfg[key] = value


_DROP = object()


@pytest.mark.parametrize("key, value, needles", [
    ("hidden_size", "64", ["hidden_size = '64'", "a positive integer"]),
    ("hidden_size", 64.5, ["hidden_size = 64.5", "a positive integer"]),
    ("num_attention_heads", 0, ["num_attention_heads = 0", "a positive integer"]),
    ("num_key_value_heads", 0, ["num_key_value_heads = 0", "a positive integer"]),
    ("num_hidden_layers", -1, ["num_hidden_layers = -1", "a positive integer"]),
    ("vocab_size", None, ["vocab_size = None", "a positive integer"]),
    ("head_dim", [16], ["head_dim = [16]", "a positive integer (or absent)"]),
    ("rms_norm_eps", -1e-5, ["rms_norm_eps = -1e-05", "a finite number > 0"]),
    ("rope_theta", "big", ["rope_theta = 'big'", "a finite number > 0"]),
    ("max_position_embeddings", 1, ["max_position_embeddings = 1", "an integer >= 2"]),
    ("tie_word_embeddings", "no", ["tie_word_embeddings = 'no'", "true or false"]),
    ("eos_token_id", "</s>", ["eos_token_id = '</s>'", "a token id"]),
    ("architectures", "LlamaForCausalLM", ["architectures = 'LlamaForCausalLM'", "a list of class names"]),
    ("rope_scaling", [8.0], ["rope_scaling = [8.0]", "an object"]),
    ("rope_parameters", "llama3", ["rope_parameters = 'llama3'", "an object"]),
    ("rope_parameters.factor", _DROP, ["rope_parameters has rope_type 'llama3' but no 'factor'",
                                       "factor, low_freq_factor and high_freq_factor"]),
    ("rope_parameters.low_freq_factor", "1", ["rope_parameters.low_freq_factor = '1'", "a finite number > 0"]),
    ("rope_parameters.high_freq_factor", 1.0, ["rope_parameters.high_freq_factor = 1.0",
                                               "greater than low_freq_factor"]),
    ("rope_parameters.original_max_position_embeddings", 0, ["original_max_position_embeddings = 0",
                                                             "a positive integer"]),
])
def test_nonsensical_config_values_are_config_errors(hf, out_parent, capsys, key, value, needles):
    cfg = json.load(open(hf / "config.json"))
    _set(cfg, key, value)
    json.dump(cfg, open(hf / "config.json", "w"))
    before = snapshot(hf)
    _fail([hf, out_parent / "ck"], out_parent, capsys, *needles, "fix config.json")
    assert snapshot(hf) == before


def test_config_errors_are_config_error_from_the_api(hf):
    from hetero_jax.model.config import ModelConfig
    from hetero_jax.errors import ConfigError

    cfg = json.load(open(hf / "config.json"))
    for bad in ([cfg], {**cfg, "num_attention_heads": 0}, {**cfg, "hidden_size": 60, "head_dim": None}):
        with pytest.raises(ConfigError, match="config.json"):
            ModelConfig.from_hf_dict(bad)


@pytest.mark.parametrize("name, content, needles", [
    ("config.json", b"\xff\xfe not utf-8", ["config.json", "not valid JSON"]),
    ("config.json", b"[1, 2]", ["must hold a JSON object", "got list"]),
    ("tokenizer_config.json", b"{not json", ["tokenizer_config.json", "not a valid JSON object"]),
    ("tokenizer_config.json", b"[]", ["tokenizer_config.json", "not an object"]),
    # these two converted, and every load of the checkpoint then failed (review 76)
    ("tokenizer.json", b"{1: 2}", ["tokenizer.json", "is corrupt or not an HF tokenizers file", "re-download"]),
    ("tokenizer.json", b"", ["tokenizer.json", "is corrupt"]),
])
def test_unreadable_json_files_are_refused_before_any_weight_is_read(hf, out_parent, capsys, monkeypatch, name,
                                                                    content, needles):
    import safetensors

    (hf / name).write_bytes(content)
    opened = []
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: opened.append(a) or (_ for _ in ()).throw(
        AssertionError("weights read")))
    _fail([hf, out_parent / "ck"], out_parent, capsys, *needles)
    assert opened == []


@pytest.mark.parametrize("name, key, value", [
    ("tokenizer_config.json", "eos_token", 5),
    ("tokenizer_config.json", "bos_token", {"content": 1}),
    ("special_tokens_map.json", "eos_token", ["</s>"]),
])
def test_a_special_token_that_is_not_text_is_refused_at_conversion_and_load(hf, converted, out_parent, tmp_path, capsys,
                                                                           name, key, value):
    """An id written where a token's text belongs ("eos_token": 5) made the token spelled "5" an EOS, so answers
    ended silently at that digit; transformers refuses such a file."""
    import hetero_jax
    from hetero_jax.errors import CheckpointError

    def damage(folder):
        path = folder / name
        entries = json.load(open(path)) if path.exists() else {}
        if name == "special_tokens_map.json":  # read only in the legacy layout, without added_tokens_decoder
            tc = json.load(open(folder / "tokenizer_config.json"))
            tc.pop("added_tokens_decoder", None)
            json.dump(tc, open(folder / "tokenizer_config.json", "w"))
        json.dump({**entries, key: value}, open(path, "w"))

    damage(hf)
    _fail([hf, out_parent / "ck"], out_parent, capsys, name, f"{key} = {json.dumps(value)}", "is not a token's text")
    ck = shutil.copytree(converted, tmp_path / "ck")
    damage(ck)
    with pytest.raises(CheckpointError, match=f"{key} = .* is not a token's text"):
        hetero_jax.load(ck)


def test_a_chat_template_file_that_is_not_utf8(hf, out_parent, capsys):
    """It was a UnicodeDecodeError traceback (review 76). (A .jinja file wins over tokenizer_config.json's
    template, as in transformers; the config's is removed here only to keep the case minimal.)"""
    tc = json.load(open(hf / "tokenizer_config.json"))
    del tc["chat_template"]
    json.dump(tc, open(hf / "tokenizer_config.json", "w"))
    (hf / "chat_template.jinja").write_bytes(b"\xff{{ messages }}")
    _fail([hf, out_parent / "ck"], out_parent, capsys, "chat_template.jinja", "is not UTF-8 text", "re-download")


def test_index_with_a_malformed_weight_map_is_a_checkpoint_error(hf, out_parent, capsys):
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    _fail([hf, out_parent / "ck"], out_parent, capsys, "model.safetensors.index.json", "is corrupt", "re-download")


def test_a_file_given_as_the_hf_directory_says_so(hf, out_parent, capsys):
    _fail([hf / "config.json", out_parent / "ck"], out_parent, capsys, "is a file, not a directory", "--gguf")


# ------------------------------------------------ damaged converted checkpoints (issue 20)
@pytest.mark.parametrize("name, content, needles", [
    ("hetero_jax.json", b"not json at all", ["hetero_jax.json", "is not valid JSON", "re-convert"]),
    ("hetero_jax.json", b"\xff\xfe\x00", ["hetero_jax.json", "is not valid JSON"]),
    ("hetero_jax.json", b"[1]", ["hetero_jax.json", "not an object"]),
    ("config.json", b"\xff\xfe\x00", ["config.json", "not valid JSON"]),
    ("config.json", json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 0,
                                "num_hidden_layers": 2, "vocab_size": 320, "intermediate_size": 128}).encode(),
     ["num_attention_heads = 0"]),
])
def test_load_of_a_damaged_checkpoint_is_a_project_error(converted, tmp_path, name, content, needles):
    import hetero_jax
    from hetero_jax.errors import HeteroJaxError

    ck = shutil.copytree(converted, tmp_path / "ck")
    (ck / name).write_bytes(content)
    before = snapshot(ck)
    with pytest.raises(HeteroJaxError) as ei:
        hetero_jax.load(ck)
    for n in needles:
        assert n in str(ei.value), str(ei.value)
    assert snapshot(ck) == before  # load never repairs or rewrites


@pytest.mark.parametrize("arg, kw, needle", [
    (None, {}, "load takes a known model name"),
    (123, {}, "got 123"),
    ("", {}, "got ''"),
    ("smollm2-135m", {"dtype": "float16"}, "unsupported dtype 'float16'; choose one of float32, bfloat16"),
])
def test_load_arguments(arg, kw, needle, monkeypatch):
    import hetero_jax
    from hetero_jax.io import hub
    from hetero_jax.errors import CheckpointError

    monkeypatch.setattr(hub, "ensure_converted", lambda *a, **k: (_ for _ in ()).throw(AssertionError("converted")))
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        hetero_jax.load(arg, **kw)


@pytest.mark.parametrize("extra", ["profile.json", "notes"])
def test_force_keeps_files_the_converter_did_not_write(hf, out_parent, capsys, extra):
    """`--force` replaced a checkpoint directory whole, deleting a profile written next to the weights (or any
    user file): it is now refused, naming the file, and the checkpoint and the file are left as they were."""
    out = out_parent / "ck"
    assert convert_main([str(hf), str(out), "--dtype", "bfloat16", "--no-progress"]) == 0
    written = sorted(os.listdir(out))
    assert json.load(open(out / "hetero_jax.json"))["entries"] == written
    path = out / extra
    if extra == "notes":
        path.mkdir()
        (path / "a.txt").write_text("mine")
    else:
        path.write_text('{"format": "hetero-jax-profile"}')
    capsys.readouterr()
    _fail([hf, out, "--force"], out_parent, capsys, str(out), extra, "the converter did not write",
          f"Move them out of {out}")
    assert sorted(os.listdir(out)) == sorted([*written, extra]) and _meta_dtype(out) == "bfloat16"
    shutil.move(str(path), str(out_parent / extra))
    assert convert_main([str(hf), str(out), "--force", "--no-progress"]) == 0
    assert sorted(os.listdir(out)) == written and _meta_dtype(out) == "float32"


# ------------------------------------- settings that change the maths this port does not implement (review 76)
def _qwen2(**over):
    cfg = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 320, "intermediate_size": 96,
           "max_position_embeddings": 1024}
    return {**cfg, **over}


@pytest.mark.parametrize("over, needles", [
    (dict(hidden_act="gelu"), ["hidden_act = 'gelu' is not supported", "hidden_act 'silu'"]),
    (dict(hidden_act="relu"), ["hidden_act = 'relu'"]),
    # transformers' rule: layers from max_window_layers on slide when use_sliding_window is true
    (dict(use_sliding_window=True, sliding_window=64, max_window_layers=2),
     ["sliding_window = 64", "for 2 of 4 layers", "use_sliding_window false"]),
    (dict(use_sliding_window=True, sliding_window=64, layer_types=["sliding_attention"] * 4), ["for 4 of 4 layers"]),
])
def test_settings_this_port_does_not_compute_are_refused(over, needles):
    """A GELU MLP or Qwen's sliding-window layers converted without a word and gave logits 0.17-2.2 away from
    transformers' (review 76): refused by name."""
    from hetero_jax.errors import ConfigError
    from hetero_jax.model.config import ModelConfig

    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf_dict(_qwen2(**over))
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


@pytest.mark.parametrize("over", [
    dict(hidden_act="silu"), dict(hidden_act="swish"),
    # Qwen2.5's published configs: a window, but use_sliding_window false (every layer full)
    dict(use_sliding_window=False, sliding_window=131072, max_window_layers=2),
    # sliding, but no layer does (max_window_layers past the last layer), or the window covers the context
    dict(use_sliding_window=True, sliding_window=64, max_window_layers=4),
    dict(use_sliding_window=True, sliding_window=1024, max_window_layers=0),
    dict(use_sliding_window=True, sliding_window=64, layer_types=["full_attention"] * 4),
])
def test_settings_whose_maths_is_full_attention_with_silu_are_accepted(over):
    from hetero_jax.model.config import ModelConfig

    assert ModelConfig.from_hf_dict(_qwen2(**over)).architecture == "qwen2"


def test_rope_parameters_with_only_a_theta():
    """transformers writes rope_parameters {"rope_theta": X} (no rope_type) for the default rope: it was taken for
    the per-layer-type form and failed with AttributeError: 'float' object has no attribute 'get'."""
    from hetero_jax.model.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(_qwen2(rope_parameters={"rope_theta": 500000.0}))
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is None
    per_type = ModelConfig.from_hf_dict(_qwen2(rope_parameters={"full_attention": {"rope_theta": 250000.0,
                                                                                  "rope_type": "default"}}))
    assert per_type.rope_theta == 250000.0


L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("rope", [dict(rope_theta=500000.0, rope_scaling=L3),
                                  dict(rope_scaling={**L3, "rope_theta": 250000.0}),
                                  dict(rope_theta=10000.0, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 123456.0}),
                                  dict(rope_theta=77777.0), dict()])
def test_rope_theta_is_read_where_transformers_reads_it(rope):
    """The RoPE dict's own rope_theta first, then the top level's: a legacy rope_scaling holding the theta fell
    back to 10000, and a stale top-level value beside rope_parameters won (logits 0.1 off transformers')."""
    transformers = pytest.importorskip("transformers")
    from hetero_jax.model.config import ModelConfig

    d = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, num_attention_heads=4,
             num_key_value_heads=2, num_hidden_layers=1, intermediate_size=128, vocab_size=100,
             max_position_embeddings=16384, **rope)
    want = transformers.LlamaConfig.from_dict(d).rope_parameters["rope_theta"]
    assert ModelConfig.from_hf_dict(d).rope_theta == want


def test_a_qwen3_config_keeps_its_attention_bias_through_the_hf_dict():
    from hetero_jax.model.config import ModelConfig

    for bias in (True, False):
        cfg = ModelConfig.from_hf_dict(_qwen2(architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                                              attention_bias=bias))
        assert cfg.architecture == "qwen3" and cfg.qkv_bias is bias
        assert ModelConfig.from_hf_dict(cfg.to_hf_dict()).qkv_bias is bias  # the round trip to_hf_dict promises


@pytest.mark.parametrize("rope, key", [(dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
                                       (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_parameters"),
                                       (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
                                        "rope_parameters")])
def test_an_unported_rope_type_names_its_key_and_the_fix(rope, key):
    from hetero_jax.errors import ConfigError
    from hetero_jax.model.config import ModelConfig

    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf_dict(_qwen2(**rope))
    rtype = next(iter(rope.values())).get("rope_type", next(iter(rope.values())).get("type"))
    for needle in (f"{key} has rope_type {rtype!r}", "'default', 'llama3'", "Use a checkpoint"):
        assert needle in str(e.value), (needle, str(e.value))


@pytest.mark.parametrize("arch, model_type", [("LlamaForCausalLM", "llama"), ("Qwen2ForCausalLM", "qwen2"),
                                              ("Qwen3ForCausalLM", "qwen3")])
def test_a_missing_context_length_is_transformers_default(arch, model_type):
    """No max_position_embeddings in config.json: the context limit is transformers' class default (2048 for
    Llama, 32768 for Qwen), not a guess of the port's own."""
    transformers = pytest.importorskip("transformers")
    from hetero_jax.model.config import ModelConfig

    d = _qwen2(architectures=[arch], model_type=model_type)
    del d["max_position_embeddings"]
    want = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in d.items()
                                                            if k != "model_type"}).max_position_embeddings
    assert ModelConfig.from_hf_dict(d).max_position_embeddings == want


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_keys_config_json_leaves_out_take_transformers_defaults(arch):
    """A Qwen config without num_key_value_heads (or Qwen3's head_dim) took Llama's defaults, and a checkpoint
    transformers loads was refused as 'the weights do not match config.json' (review 85): the family's own
    defaults now, read from transformers' config classes."""
    import transformers

    from hetero_jax.model.config import ModelConfig

    base = {"architectures": [arch], "hidden_size": 64, "num_attention_heads": 32, "num_hidden_layers": 2,
            "vocab_size": 320, "intermediate_size": 96, "max_position_embeddings": 1024}
    # left out; an explicit null (the query heads, review 88); a hidden size the heads do not divide (Qwen3: 128)
    variants = [base, {**base, "num_attention_heads": 8, "num_key_value_heads": None}]
    if arch == "Qwen3ForCausalLM":
        variants.append({**base, "hidden_size": 260, "num_attention_heads": 8, "num_key_value_heads": 4})
    for cfg in variants:
        hf = getattr(transformers, arch.replace("ForCausalLM", "Config")).from_dict(cfg)
        ours = ModelConfig.from_hf_dict(cfg)
        assert ours.num_kv_heads == hf.num_key_value_heads, cfg
        assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads), cfg
    if arch == "Qwen3ForCausalLM":  # an explicit null head_dim is refused, as transformers refuses it (review 89)
        from hetero_jax.errors import ConfigError

        with pytest.raises(ConfigError, match="hidden_size = 260 is not a multiple of num_attention_heads = 8"):
            ModelConfig.from_hf_dict({**variants[-1], "head_dim": None})


def test_a_sliding_window_left_out_is_transformers_default_and_refused_when_it_slides():
    """use_sliding_window true without a sliding_window key: transformers slides at 4096, this port ran full
    attention and its logits parted past 4,096 tokens (review 85); refused as an explicit window is."""
    import transformers

    from hetero_jax.errors import ConfigError
    from hetero_jax.model.config import ModelConfig

    over = dict(use_sliding_window=True, max_window_layers=0, max_position_embeddings=8192)
    assert transformers.Qwen2Config.from_dict(_qwen2(**over)).sliding_window == 4096
    with pytest.raises(ConfigError, match="sliding_window = 4096 .shorter than the 8192-token context. for 4 of 4"):
        ModelConfig.from_hf_dict(_qwen2(**over))
    assert ModelConfig.from_hf_dict(_qwen2(**{**over, "max_position_embeddings": 4096})).architecture == "qwen2"
