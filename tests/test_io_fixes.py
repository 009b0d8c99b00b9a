"""The io floor's review fixes: tokenizer files read as transformers reads them (chat_template.jinja first,
special_tokens_map.json, generation_config.json ids, tools/documents), weight files checked against the digests
recorded at save, --force deleting only what the checkpoint lists, save methods keeping to their own kind of
output, a failed restore ending in one line, and a damaged cached model naming the directory to delete."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from convert.cli import main as convert_main  # noqa: E402
from hetero_jax.errors import CheckpointError, HeteroJaxError, OutputError, PromptError  # noqa: E402
from hetero_jax.io import params_store  # noqa: E402
from hetero_jax.io.checkpoint import load_checkpoint, load_params  # noqa: E402
from hetero_jax.io.tokenizer import Tokenizer  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from fs_state import snapshot  # noqa: E402
from hf_fixtures import convert_refused, make_tokenizer_files  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HI = [{"role": "user", "content": "hi"}]
NEW_TEMPLATE = ("{% for m in messages %}NEW<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}NEW<assistant>{% endif %}")


def _hf_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _hf_render(path, messages=HI, **kw):
    return _hf_tokenizer(path).apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)


@pytest.fixture
def tok_dir(tmp_path):
    """tokenizer.json + tokenizer_config.json (with a chat template) of the tiny test tokenizer."""
    d = tmp_path / "tok"
    d.mkdir()
    make_tokenizer_files(d)
    return d


def _edit_json(path, fn):
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


@pytest.fixture
def ck(converted, tmp_path):
    """A private copy of the converted tiny Llama to damage."""
    return shutil.copytree(converted, tmp_path / "ck")


@pytest.fixture
def no_restore(monkeypatch):
    """Fail if a weight is restored: the problem must be reported before."""
    def boom(*a, **k):
        raise AssertionError("params were restored")
    monkeypatch.setattr(params_store, "restore_tree", boom)
    monkeypatch.setattr("hetero_jax.io.checkpoint.restore_tree", boom)


def _convert_fails(args, capsys, *needles):
    """The CLI exits 2 naming each needle and writes nothing beside OUT_DIR (``args[1]``)."""
    return convert_refused(args, os.path.dirname(str(args[1])), capsys, *needles)


def _data_files(ck):
    files = [f for f in glob.glob(os.path.join(ck, "params", "**", "d", "*"), recursive=True) if os.path.isfile(f)]
    return sorted(files, key=os.path.getsize)


def _drop_digests(ck):
    _edit_json(ck / "hetero_jax.json", lambda m: m.pop(params_store.DIGESTS_KEY, None))


def _leaves(params):
    out = {k: np.asarray(v) for k, v in params.items() if k != "layers"}
    out.update({f"layers.{i}.{k}": np.asarray(v) for i, layer in enumerate(params["layers"]) for k, v in layer.items()})
    return out


# ------------------------------------------------------------------------ 1. chat_template.jinja wins
def test_a_chat_template_file_wins_over_tokenizer_config_as_in_transformers(tok_dir):
    (tok_dir / "chat_template.jinja").write_text(NEW_TEMPLATE)
    expected = "NEW<user>hiNEW<assistant>"
    assert _hf_render(tok_dir) == expected  # the reference: transformers' priority
    assert Tokenizer.from_dir(tok_dir).apply_chat_template(HI) == expected


def test_the_converter_keeps_the_winning_template(hf, tmp_path):
    (hf / "chat_template.jinja").write_text(NEW_TEMPLATE)
    out = tmp_path / "ck"
    assert convert_main([str(hf), str(out), "--no-progress"]) == 0
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == NEW_TEMPLATE
    expected = "NEW<user>hiNEW<assistant>"
    assert Tokenizer.from_dir(out).apply_chat_template(HI) == expected == _hf_render(out)


# --------------------------------------------------------------- 2. special_tokens_map.json (legacy layout)
def _special_template(tok_dir, special_map, **config):
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **config}))
    (tok_dir / "special_tokens_map.json").write_text(json.dumps(special_map))


def test_special_tokens_map_names_the_special_tokens_in_the_legacy_layout(tok_dir):
    _special_template(tok_dir, {"bos_token": {"content": "<|im_start|>", "lstrip": False, "normalized": False,
                                              "rstrip": False, "single_word": False},
                                "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    ours, ref = Tokenizer.from_dir(tok_dir), _hf_tokenizer(tok_dir)
    rendered = ours.apply_chat_template(HI, add_generation_prompt=False)
    assert rendered == "<|im_start|>[user]hi<|im_end|>"
    assert rendered == ref.apply_chat_template(HI, tokenize=False)
    assert ours.eos_token_ids == (ours.token_to_id("<|im_end|>"),) == (ref.eos_token_id,)
    assert ours.bos_token_id == ref.bos_token_id == ours.token_to_id("<|im_start|>")
    assert ours.pad_token_id == ref.pad_token_id == ours.token_to_id("<|endoftext|>")


def test_special_tokens_map_is_not_read_when_tokenizer_config_has_added_tokens_decoder(tok_dir):
    decoder = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                        "special": True} for i, t in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])}
    _special_template(tok_dir, {"eos_token": "<|endoftext|>"}, eos_token="<|im_end|>", bos_token="<|im_start|>",
                      added_tokens_decoder=decoder)
    ours, ref = Tokenizer.from_dir(tok_dir), _hf_tokenizer(tok_dir)
    assert ref.eos_token == ours.eos_token == "<|im_end|>"
    assert ours.apply_chat_template(HI, add_generation_prompt=False) == ref.apply_chat_template(HI, tokenize=False)


# ------------------------------------------------------------------ 3. weight bytes changed in place
def test_digest_is_the_sha256_of_the_pieces_sha256(tmp_path, monkeypatch):
    data = os.urandom(2500)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "f").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    monkeypatch.setattr(params_store, "PIECE_BYTES", 1000)
    record = params_store.digest_record(str(tmp_path))
    want = hashlib.sha256(b"".join(hashlib.sha256(data[i:i + 1000]).digest() for i in (0, 1000, 2000))).hexdigest()
    assert record == {"piece_bytes": 1000, "files": {"empty": [0, hashlib.sha256().hexdigest()],
                                                     "sub/f": [2500, want]}}


def test_every_params_file_is_recorded_at_save(converted):
    meta = json.loads((converted / "hetero_jax.json").read_text())
    files = meta[params_store.DIGESTS_KEY]["files"]
    on_disk = sorted(os.path.relpath(p, converted / "params").replace(os.sep, "/")
                     for p in glob.glob(str(converted / "params" / "**"), recursive=True) if os.path.isfile(p))
    assert sorted(files) == on_disk
    big = _data_files(converted)[-1]
    rel = os.path.relpath(big, converted / "params").replace(os.sep, "/")
    data = open(big, "rb").read()
    assert files[rel][0] == len(data) and len(data) < params_store.PIECE_BYTES
    assert files[rel][1] == hashlib.sha256(hashlib.sha256(data).digest()).hexdigest()


def test_bytes_changed_in_a_weight_file_are_refused_before_restoring(ck, converted, monkeypatch):
    import hetero_jax

    f = _data_files(ck)[-1]
    n = os.path.getsize(f)
    with open(f, "r+b") as h:
        h.seek(n // 2)
        b = h.read(8)
        h.seek(n // 2)
        h.write(bytes(x ^ 0x55 for x in b))
    assert os.path.getsize(f) == n
    restored = []
    real_restore = params_store.restore_tree
    monkeypatch.setattr("hetero_jax.io.checkpoint.restore_tree", lambda p: restored.append(p) or real_restore(p))
    before = snapshot(ck)
    with pytest.raises(CheckpointError) as ei:
        hetero_jax.load(ck)
    assert str(ei.value) == (
        f"{f} does not match the sha256 digest hetero_jax.json recorded when the checkpoint was written: its bytes "
        "changed since (disk or copy damage, or an edit), so its weights are wrong; the checkpoint is corrupt, "
        "re-convert it with hetero-jax-convert --force")
    assert restored == [] and snapshot(ck) == before
    # the opt-out restores the damaged bytes as they are: some tensor differs from the good checkpoint's
    damaged = _leaves(hetero_jax.load(ck, verify=False).params)
    good = _leaves(load_checkpoint(converted)[1])
    assert [k for k in good if not np.array_equal(good[k], damaged[k])]


@pytest.mark.parametrize("damage, needle", [
    ("truncate", "bytes where"), ("remove", "is missing (hetero_jax.json lists it")])
def test_a_short_or_missing_weight_file_is_named(ck, no_restore, damage, needle):
    f = _data_files(ck)[-1]
    n = os.path.getsize(f)
    if damage == "truncate":
        open(f, "r+b").truncate(n - 1)
        needle = f"{f} is {n - 1:,} bytes where {n:,} were written"
    else:
        os.remove(f)
        needle = f"{f} {needle}"
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        load_params(ck)


@pytest.mark.parametrize("record", [[1], {"piece_bytes": 0, "files": {}},
                                    {"piece_bytes": 64, "files": {"../../etc/passwd": [1, "00"]}},
                                    {"piece_bytes": 64, "files": {"_METADATA": ["1", "00"]}}])
def test_a_malformed_digest_record_is_refused(ck, no_restore, record):
    _edit_json(ck / "hetero_jax.json", lambda m: m.update({params_store.DIGESTS_KEY: record}))
    with pytest.raises(CheckpointError, match=re.escape(f"{ck / 'hetero_jax.json'}: its params_sha256 entry is "
                                                        "malformed, so the weights cannot be checked")):
        load_params(ck)


def test_a_checkpoint_written_before_digests_loads_as_before(ck, converted):
    _drop_digests(ck)
    a, b = _leaves(load_checkpoint(ck)[1]), _leaves(load_checkpoint(converted)[1])
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------- 4. --force deletes only the listed entries
def test_force_keeps_a_file_the_conversion_did_not_write_even_with_a_converter_name(hf, tmp_path, capsys):
    out = tmp_path / "ck"
    assert convert_main([str(hf), str(out), "--no-progress"]) == 0
    assert "chat_template.jinja" not in json.loads((out / "hetero_jax.json").read_text())["entries"]
    (out / "chat_template.jinja").write_text("mine")
    capsys.readouterr()
    _convert_fails([hf, out, "--force"], capsys, f"{out} holds a converted checkpoint and also "
                   "chat_template.jinja, which the converter did not write")
    assert (out / "chat_template.jinja").read_text() == "mine"


def test_force_falls_back_to_every_converter_name_without_an_entries_list(hf, tmp_path):
    out = tmp_path / "ck"
    assert convert_main([str(hf), str(out), "--no-progress"]) == 0
    _edit_json(out / "hetero_jax.json", lambda m: m.pop("entries"))
    (out / "special_tokens_map.json").write_text("{}")  # a name the converter may write: ours then
    assert convert_main([str(hf), str(out), "--force", "--no-progress"]) == 0
    assert not (out / "special_tokens_map.json").exists()


# ------------------------------------------------------------------ 5. save methods keep to their kind
def _ranking():
    from hetero_jax.policies.contextkeeper.ranking import CARanking

    return CARanking(scores=np.ones((2, 2)), votes=np.ones((2, 2), np.int64))


def _codebook():
    from hetero_jax.policies.hcattention.codebook import KeyCodebook

    return KeyCodebook(centroids=np.ones((1, 2, 2), np.float32))


def test_save_methods_never_replace_another_kind_of_our_output(tmp_path):
    from hetero_jax.io.files import write_text

    profile = '{"format": "hetero-jax-head-profile"}'
    for path, save, kind in [(tmp_path / "ranking.json", _ranking().save, "hetero-jax-contextkeeper-ranking"),
                             (tmp_path / "codebook.npz", _codebook().save, "hetero-jax-hcattention-codebook")]:
        path.write_text(profile)
        with pytest.raises(OutputError, match=re.escape(
                f"output {path} exists and is another kind of hetero-jax output (hetero-jax-head-profile, where "
                f"this command writes a {kind}), so it was not replaced")):
            save(path)
        assert path.read_text() == profile
    with pytest.raises(OutputError, match="another kind of hetero-jax output"):
        write_text(tmp_path / "ranking.json", "{}", kind="hetero-jax-synckv")
    # its own earlier output is replaced
    _ranking().save(tmp_path / "r2.json")
    _ranking().save(tmp_path / "r2.json")
    _codebook().save(tmp_path / "c2.npz")
    _codebook().save(tmp_path / "c2.npz")


# ------------------------- 6. generation_config.json (and special_tokens_map.json), config.json token ids
BAD_FILES = [
    ("generation_config.json", b"[1, 2]", "is not a valid JSON object (it holds a JSON list, not an object)"),
    ("generation_config.json", b"{nope", "is not a valid JSON object"),
    ("generation_config.json", b'{"eos_token_id": "</s>"}', "eos_token_id is '</s>'; it must be a token id"),
    ("generation_config.json", b'{"eos_token_id": [2, null]}', "eos_token_id is [2, None]; it must be a token id"),
    ("generation_config.json", b'{"eos_token_id": -1}', "eos_token_id is -1"),
    ("generation_config.json", b'{"bos_token_id": [1]}', "bos_token_id is [1]; it must be a token id (an integer"),
    ("generation_config.json", b'{"bos_token_id": true}', "bos_token_id is True"),
    ("special_tokens_map.json", b'["<s>"]', "is not a valid JSON object (it holds a JSON list, not an object)"),
]


@pytest.mark.parametrize("name, content, needle", BAD_FILES)
def test_bad_tokenizer_side_files_are_refused_before_any_weight_is_read(hf, tmp_path, capsys, no_weights_read, name,
                                                                       content, needle):
    (hf / name).write_bytes(content)
    _convert_fails([hf, tmp_path / "ck"], capsys, str(hf / name), needle)


@pytest.mark.parametrize("name, content, needle", BAD_FILES)
def test_bad_tokenizer_side_files_in_a_checkpoint_are_refused_before_restoring(ck, no_restore, name, content,
                                                                             needle):
    import hetero_jax

    (ck / name).write_bytes(content)
    with pytest.raises(CheckpointError) as ei:
        hetero_jax.load(ck)
    msg = str(ei.value)
    assert str(ck / name) in msg and needle in msg and msg.endswith(
        "the checkpoint is corrupt, re-convert it with hetero-jax-convert --force"), msg


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_the_tokenizer_refuses_bad_token_ids_in_a_model_directory(tok_dir, name):
    """A raw ValueError (int('</s>')) from Tokenizer.from_dir; config.json is the tokenizer's to check in an HF
    directory, which no ModelConfig has read."""
    (tok_dir / name).write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(CheckpointError, match=re.escape(
            f"{tok_dir / name}: eos_token_id is '</s>'; it must be a token id (an integer >= 0), a list of them or "
            "null; re-create or re-download it")):
        Tokenizer.from_dir(tok_dir)


def test_token_ids_in_every_allowed_form_load(tok_dir):
    (tok_dir / "config.json").write_text(json.dumps({"eos_token_id": None, "bos_token_id": None}))
    (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    tok = Tokenizer.from_dir(tok_dir)
    assert tok.eos_token_ids == (2, 0) and tok.bos_token_id == 1


# --------------------------------------------------------- 7. tokenizer_config.json that is not an object
def test_a_tokenizer_config_that_is_not_an_object_is_refused_before_restoring(ck, no_restore):
    import hetero_jax

    (ck / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=re.escape(
            f"{ck / 'tokenizer_config.json'} is not a valid JSON object (it holds a JSON list, not an object); "
            "the checkpoint is corrupt, re-convert it with hetero-jax-convert --force")):
        hetero_jax.load(ck)


def test_a_chat_template_entry_of_the_wrong_type_is_refused(tok_dir):
    _edit_json(tok_dir / "tokenizer_config.json", lambda c: c.update(chat_template=7))
    with pytest.raises(CheckpointError, match=re.escape(f"{tok_dir / 'tokenizer_config.json'}: chat_template is a "
                                                        "JSON int that is neither a template string")):
        Tokenizer.from_dir(tok_dir)


# ------------------------------------------------------------------- 8. tools / documents are None
def test_tools_and_documents_are_none_in_the_template_context(tok_dir):
    template = ("{% if tools is defined %}<tools>{{ tools }}</tools>{% endif %}"
                "{% if documents is not none %}{{ documents | tojson }}{% endif %}{{ messages[0]['content'] }}")
    _edit_json(tok_dir / "tokenizer_config.json", lambda c: c.update(chat_template=template))
    expected = "<tools>None</tools>hi"
    assert _hf_render(tok_dir) == expected
    assert Tokenizer.from_dir(tok_dir).apply_chat_template(HI) == expected


# -------------------------------------------------------------------- list-form templates (minor)
def test_named_templates_without_a_default_are_refused_as_in_transformers(tok_dir):
    named = [{"name": "tool_use", "template": "T{{ messages[0]['content'] }}"},
             {"name": "rag", "template": "R{{ messages[0]['content'] }}"}]
    _edit_json(tok_dir / "tokenizer_config.json", lambda c: c.update(chat_template=named))
    with pytest.raises(ValueError, match="no default specified"):
        _hf_render(tok_dir)
    with pytest.raises(PromptError, match=re.escape(
            "the checkpoint's chat template is a list of named templates (rag, tool_use) with none named 'default'")):
        Tokenizer.from_dir(tok_dir).apply_chat_template(HI)
    named.append({"name": "default", "template": "D{{ messages[0]['content'] }}"})
    _edit_json(tok_dir / "tokenizer_config.json", lambda c: c.update(chat_template=named))
    assert Tokenizer.from_dir(tok_dir).apply_chat_template(HI) == "Dhi" == _hf_render(tok_dir)


# --------------------------------------------------------------- 9. a failed restore ends in one line
def test_a_failed_restore_prints_one_line_and_no_traceback(ck):
    """Orbax closed its event loop while tensorstore still completed other reads, which then printed "Event
    loop is closed" tracebacks after the error, in most runs: several runs, each must be clean."""
    _drop_digests(ck)  # a checkpoint from before digests: the damage reaches the restore
    f = _data_files(ck)[-1]
    open(f, "r+b").truncate(os.path.getsize(f) // 2)
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    for _ in range(4):
        r = subprocess.run([sys.executable, "-m", "hetero_jax.cli", "generate", "--model", str(ck), "--prompt", "hi",
                            "--max-new-tokens", "2"], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: cannot restore params from {ck / 'params'} ("), \
            r.stderr
        assert lines[0].endswith("the checkpoint is corrupt, re-convert it with hetero-jax-convert --force")


def test_the_event_loop_policy_is_put_back(ck):
    import asyncio

    before = asyncio.get_event_loop_policy()
    load_params(ck)
    assert asyncio.get_event_loop_policy() is before


# ------------------------------------------------------------ 10. a damaged cached known model
@pytest.mark.parametrize("damage", ["params", "tokenizer_config", "config"])
def test_a_damaged_cached_model_says_to_delete_its_directory(converted, tmp_path, monkeypatch, damage):
    import hetero_jax

    cache = tmp_path / "cache"
    copy = shutil.copytree(converted, cache / "smollm2-135m")  # a converted copy stands in for SmolLM2's
    if damage == "params":
        os.remove(copy / "params" / "_METADATA")
    elif damage == "tokenizer_config":
        (copy / "tokenizer_config.json").write_text("[]")
    else:
        (copy / "config.json").write_bytes(b"\xff")
    monkeypatch.setenv("HETERO_JAX_CACHE", str(cache))
    with pytest.raises(HeteroJaxError) as ei:
        hetero_jax.load("smollm2-135m", progress=False)
    msg = str(ei.value)
    assert msg.endswith(f"delete {copy} and load 'smollm2-135m' again, which converts it anew"), msg
    assert "hetero-jax-convert" not in msg
