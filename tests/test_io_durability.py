"""Writes that survive a crash (the data fsynced before its rename, the directory after), chat templates
compiled when the tokenizer is loaded, and a checkpoint load that reads hetero_jax.json once."""

from __future__ import annotations

import errno
import json
import os
import sys

import numpy as np
import pytest

from hetero_jax.errors import CheckpointError, OutputError, PromptError
from hetero_jax.io import checkpoint
from hetero_jax.io.checkpoint import META_FILE, load_checkpoint, save_checkpoint
from hetero_jax.io.files import atomic_path, write_bytes, write_text
from hetero_jax.io.tokenizer import Tokenizer
from hetero_jax.model import spec
from hetero_jax.model.config import ModelConfig

sys.path.insert(0, os.path.dirname(__file__))
from hf_fixtures import CHAT_TEMPLATE, VOCAB_SIZE, convert_refused, make_tokenizer_files  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names a synced fd by /proc/self/fd")


@pytest.fixture
def calls(monkeypatch):
    """The log of os.fsync (by the synced file's path), os.replace and os.rename calls, in order."""
    log = []
    fsync, replace, rename = os.fsync, os.replace, os.rename

    def logged_fsync(fd):
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def logged(kind, fn):
        def call(src, dst, *a, **k):
            log.append((kind, os.fspath(src), os.fspath(dst)))
            return fn(src, dst, *a, **k)
        return call

    monkeypatch.setattr(os, "fsync", logged_fsync)
    monkeypatch.setattr(os, "replace", logged("replace", replace))
    monkeypatch.setattr(os, "rename", logged("rename", rename))
    return log


# ------------------------------------------------------------------------------------------- atomic writes
def _with_atomic_path(path, data):
    with atomic_path(path) as tmp:  # a writer that opens and closes the file itself
        with open(tmp, "wb") as f:
            f.write(data)


@pytest.mark.parametrize("write", [write_bytes, lambda p, d: write_text(p, d.decode()), _with_atomic_path])
def test_an_atomic_write_syncs_the_file_before_the_rename_and_the_directory_after(tmp_path, calls, write,
                                                                                   monkeypatch):
    target = tmp_path / "out.json"
    seen = []  # what each synced fd held when it was synced
    logged_fsync = os.fsync

    def reading_fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        seen.append(None if os.path.isdir(path) else open(path, "rb").read())
        logged_fsync(fd)

    monkeypatch.setattr(os, "fsync", reading_fsync)
    write(target, b'{"new": 2}')
    assert len(calls) == 3, calls
    tmp = calls[1][1]
    folder = os.path.realpath(tmp_path)
    assert calls == [("fsync", tmp), ("replace", tmp, os.path.join(folder, "out.json")), ("fsync", folder)]
    assert os.path.dirname(tmp) == folder and os.path.basename(tmp).startswith(".out.json.")
    assert seen == [b'{"new": 2}', None]  # the data was written before it was synced
    assert target.read_bytes() == b'{"new": 2}'


def test_a_directory_the_os_will_not_open_is_skipped(tmp_path, calls, monkeypatch):
    """Windows opens no directory: the file is still synced, the directory sync is skipped, the write succeeds."""
    real_open = os.open

    def no_dirs(path, flags, *a, **k):
        if os.path.isdir(path):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", no_dirs)
    write_text(tmp_path / "out.txt", "hi")
    assert [c[0] for c in calls] == ["fsync", "replace"]
    assert (tmp_path / "out.txt").read_text() == "hi"


def test_a_write_only_output_is_replaced_keeping_its_mode(tmp_path, monkeypatch):
    """The temporary file is synced before it gets the output's mode: a mode without read (0o200) would not let
    a user other than root open it to sync. The os.open below refuses as the kernel does for such a user."""
    import stat

    real_open = os.open

    def as_a_user(path, flags, *a, **k):
        if flags & (os.O_WRONLY | os.O_RDWR) == 0 and os.path.isfile(path) and not os.stat(path).st_mode & 0o400:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *a, **k)

    target = tmp_path / "log.txt"
    target.write_text("old")
    target.chmod(0o200)
    monkeypatch.setattr(os, "open", as_a_user)
    write_text(target, "new", updating=True)
    assert stat.S_IMODE(target.stat().st_mode) == 0o200
    target.chmod(0o600)
    assert target.read_text() == "new"


def test_a_failed_sync_of_the_data_leaves_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "out.txt"
    target.write_text("old")  # a file the writer updates (RESULTS.md): it need not be an output of ours

    def eio(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", eio)
    with pytest.raises(OutputError) as ei:
        write_text(target, "new", updating=True)
    assert str(ei.value) == f"output {target}: writing it failed (Input/output error); {target} was not changed"
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["out.txt"]  # the temporary file is gone


def test_a_failed_sync_of_the_directory_says_the_file_may_not_last(tmp_path, monkeypatch):
    real_fsync = os.fsync

    def eio_on_dirs(fd):
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", eio_on_dirs)
    target = tmp_path / "out.txt"
    with pytest.raises(OutputError) as ei:
        write_text(target, "new", "--out")
    folder = os.path.realpath(tmp_path)
    assert str(ei.value) == (f"--out {target} was written, but flushing its directory {folder} to disk failed "
                             "(Input/output error), so a crash or power loss may still lose it; check the disk, "
                             "then write it again")


def test_a_file_system_that_cannot_sync_is_written_anyway(tmp_path, monkeypatch):
    def einval(fd):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "fsync", einval)
    write_text(tmp_path / "out.txt", "new")
    assert (tmp_path / "out.txt").read_text() == "new"


# ------------------------------------------------------------------------------------------------ checkpoints
def _tiny():
    cfg = ModelConfig(architecture="llama", vocab_size=VOCAB_SIZE, hidden_size=16, intermediate_size=32,
                      num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5,
                      max_position_embeddings=64, eos_token_ids=(0,))
    return cfg, spec.init_params(cfg, seed=0)


@pytest.fixture(scope="module")
def tok_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer_files(d)
    return d


def test_a_checkpoint_is_synced_whole_before_its_rename_and_its_parents_after(tmp_path, tok_files, calls):
    cfg, params = _tiny()
    out = tmp_path / "a" / "b" / "ck"  # a and b are created
    save_checkpoint(out, cfg, params, tokenizer_dir_or_files=tok_files)
    root = os.path.realpath(tmp_path)
    target = os.path.join(root, "a", "b", "ck")
    commit = [i for i, c in enumerate(calls) if c[0] in ("rename", "replace") and c[2] == target]
    assert len(commit) == 1, calls
    tmp = calls[commit[0]][1]
    before = [c[1] for c in calls[:commit[0]] if c[0] == "fsync"]
    written = []
    for r, dirs, names in os.walk(target):
        rel = os.path.relpath(r, target)
        written += [os.path.normpath(os.path.join(tmp, rel, n)) for n in names]
        written.append(os.path.normpath(os.path.join(tmp, rel)))
    assert sorted(before) == sorted(written)  # every file and directory of the tree, each once
    assert before[-1] == tmp  # the tree's directories after their files
    assert os.path.join(tmp, META_FILE) in before and os.path.join(tmp, "params") in before
    after = [c[1] for c in calls[commit[0]:] if c[0] == "fsync"]
    assert after == [os.path.join(root, "a", "b"), os.path.join(root, "a"), root]


def test_a_failed_sync_after_a_checkpoint_replaced_another_keeps_the_old_one(tmp_path, tok_files, monkeypatch):
    cfg, params = _tiny()
    out = tmp_path / "ck"
    save_checkpoint(out, cfg, params, tokenizer_dir_or_files=tok_files)
    real_fsync = os.fsync

    def eio_on_the_parent(fd):
        if os.readlink(f"/proc/self/fd/{fd}") == os.path.realpath(tmp_path):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", eio_on_the_parent)
    with pytest.raises(OutputError, match="flushing its directory") as ei:
        save_checkpoint(out, cfg, params, tokenizer_dir_or_files=tok_files, force=True)
    monkeypatch.undo()
    (old,) = [n for n in os.listdir(tmp_path) if n.startswith(".ck.old-")]
    assert f"the checkpoint it replaced is kept in {os.path.join(os.path.realpath(tmp_path), old)}" in str(ei.value)
    for ck in (out, tmp_path / old):  # both whole
        _, loaded, _ = load_checkpoint(ck)
        np.testing.assert_array_equal(np.asarray(loaded["embed"]), params["embed"])


@pytest.mark.parametrize("when", ["between the renames", "after the second rename"])
@pytest.mark.parametrize("existing", [True, False])
def test_an_interrupt_at_the_renames_leaves_out_dir_as_it_was(tmp_path, tok_files, monkeypatch, when, existing):
    """Ctrl-C after OUT_DIR was moved aside left no OUT_DIR (the old one in a hidden folder) while the converter
    said nothing was written; now the save is undone whenever the interrupt lands."""
    cfg, params = _tiny()
    out = tmp_path / "ck"
    if existing:
        save_checkpoint(out, cfg, params, tokenizer_dir_or_files=tok_files)
        inode = os.stat(out).st_ino  # tells the old checkpoint's directory from the new one
    real_rename, fired = os.rename, []

    def interrupted(src, dst):  # one Ctrl-C, right after the rename it lands behind
        real_rename(src, dst)
        moved_aside = ".ck.old-" in os.fspath(dst)
        if not fired and ((when == "between the renames" and (moved_aside or not existing)) or (
                when == "after the second rename" and os.fspath(dst) == os.path.realpath(out))):
            fired.append(1)
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "rename", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(out, cfg, params, tokenizer_dir_or_files=tok_files, force=True)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == (["ck"] if existing else [])  # no hidden leftovers
    if existing:
        assert os.stat(out).st_ino == inode
        _, loaded, _ = load_checkpoint(out)
        np.testing.assert_array_equal(np.asarray(loaded["embed"]), params["embed"])


# ----------------------------------------------------------------------------------------- chat templates
def _tok_dir(tmp_path, template, jinja: str | None = None):
    d = tmp_path / "tok"
    d.mkdir()
    make_tokenizer_files(d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    if jinja is not None:
        (d / "chat_template.jinja").write_text(jinja)
    return d


@pytest.mark.parametrize("jinja, problem, where, what", [
    (None, "unexpected '}'", "tokenizer_config.json's chat_template",
     "chat_template in the checkpoint's tokenizer_config.json"),  # a syntax error
    ("{% for m in messages %}\n{{ m['content'] | shout }}{% endfor %}", "No filter named 'shout'.",
     "chat_template.jinja", "the checkpoint's chat_template.jinja"),  # an unknown filter outside a branch
])
def test_a_template_that_does_not_compile_is_refused_at_load_naming_its_file(tmp_path, jinja, problem, where, what):
    d = _tok_dir(tmp_path, "{% for m in messages %}{{ m['content'] }" if jinja is None else CHAT_TEMPLATE,
                 jinja=jinja)
    line = 1 if jinja is None else 2
    with pytest.raises(CheckpointError) as ei:
        Tokenizer.from_dir(d)
    assert str(ei.value) == (
        f"the checkpoint's chat template is not valid Jinja (line {line}: {problem}), in {d / where}; fix {what}, "
        "or remove it and pass chat=False (CLI: --no-chat) to use the raw prompt")


def test_an_unknown_filter_in_a_branch_loads_and_fails_only_where_it_renders(tmp_path):
    """As in transformers: a template whose tools branch is broken still serves prompts without tools."""
    d = _tok_dir(tmp_path, "{% if tools %}{{ tools | shout }}{% endif %}[{{ messages[0]['content'] }}]")
    tok = Tokenizer.from_dir(d)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"
    with pytest.raises(PromptError, match="shout"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[{"name": "f"}])


GENERATION_TEMPLATE = (
    "{% set ns = namespace(n=0) %}{% set d = dict(a=1) %}"
    "{% for m in messages %}{% set ns.n = ns.n + d['a'] %}"
    "{% if m['role'] == 'assistant' %}<a>{% generation %}{{ m['content'] }}{% endgeneration %}</a>"
    "{% else %}<{{ m['role'] }} {{ ns.n }}>{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}")


def test_transformers_generation_block_dict_and_namespace_render_as_in_transformers(tmp_path):
    """transformers' chat environment has a {% generation %} block (assistant masks) and guarded dict/namespace
    globals; a template using them loads, and renders byte for byte as transformers renders it."""
    from transformers import AutoTokenizer

    d = _tok_dir(tmp_path, GENERATION_TEMPLATE)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "and?"}]
    ours = Tokenizer.from_dir(d).apply_chat_template(msgs)
    theirs = AutoTokenizer.from_pretrained(str(d)).apply_chat_template(msgs, tokenize=False,
                                                                       add_generation_prompt=True)
    assert ours == theirs == "<user 1>hi<a>yo</a><user 3>and?<a>"


def test_a_namespace_attribute_with_an_underscore_is_refused_as_in_transformers(tmp_path):
    d = _tok_dir(tmp_path, "{% set ns = namespace(_x=1) %}{{ messages[0]['content'] }}")
    with pytest.raises(PromptError, match="underscore-prefixed attributes"):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "hi"}])


def test_the_template_is_compiled_once_at_load_and_nothing_rendered(tmp_path, monkeypatch):
    from jinja2.environment import Environment, Template

    compiled, rendered = [], []
    compile_, render = Environment.compile, Template.render
    monkeypatch.setattr(Environment, "compile", lambda self, *a, **k: (compiled.append(1), compile_(self, *a, **k))[1])
    monkeypatch.setattr(Template, "render", lambda self, *a, **k: (rendered.append(1), render(self, *a, **k))[1])
    tok = Tokenizer.from_dir(_tok_dir(tmp_path, CHAT_TEMPLATE))
    assert (len(compiled), len(rendered)) == (1, 0)
    hi = [{"role": "user", "content": "hi"}]
    for _ in range(2):
        assert tok.apply_chat_template(hi) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert (len(compiled), len(rendered)) == (1, 2)


def test_load_checkpoint_refuses_a_broken_template_before_any_weight_is_restored(tmp_path, tok_files, monkeypatch):
    cfg, params = _tiny()
    ck = save_checkpoint(tmp_path / "ck", cfg, params, tokenizer_dir_or_files=tok_files)
    with open(os.path.join(ck, "chat_template.jinja"), "w") as f:
        f.write("{{ messages[0]['content'] | shout }}")

    def boom(*a, **k):
        raise AssertionError("params were restored")

    monkeypatch.setattr(checkpoint, "restore_tree", boom)
    with pytest.raises(CheckpointError, match=r"^the checkpoint's chat template is not valid Jinja \(line 1: No "
                                              r"filter named 'shout'\.\), in .*chat_template\.jinja; "):
        load_checkpoint(ck)


# ------------------------------------------------------------------------------------------ hetero_jax.json
def test_load_checkpoint_reads_hetero_jax_json_once(tmp_path, tok_files, monkeypatch):
    cfg, params = _tiny()
    ck = save_checkpoint(tmp_path / "ck", cfg, params, tokenizer_dir_or_files=tok_files)
    reads = []
    read_json = checkpoint.read_json

    def counted(path, *a, **k):
        reads.append(os.path.basename(path))
        return read_json(path, *a, **k)

    monkeypatch.setattr(checkpoint, "read_json", counted)
    opened = []
    real_open = open

    def counted_open(path, *a, **k):
        opened.append(os.path.basename(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else path)
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", counted_open)
    _, loaded, _ = load_checkpoint(ck)
    monkeypatch.undo()
    assert reads.count(META_FILE) == 1 and opened.count(META_FILE) == 1, (reads, opened)
    np.testing.assert_array_equal(np.asarray(loaded["embed"]), params["embed"])
    # the digests are still checked, against the one read
    data = max((os.path.join(r, n) for r, _, ns in os.walk(os.path.join(ck, "params")) for n in ns),
               key=os.path.getsize)
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match="does not match the sha256 digest hetero_jax.json recorded"):
        load_checkpoint(ck)


# ------------------------------------------------------------------------------------------ the converter
BROKEN = "{% for m in messages %}{{ m['content'] }"


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json", "named default",
                                   "the last of two named default"])
def test_the_converter_refuses_a_template_every_load_would_refuse(hf, tmp_path, capsys, no_weights_read, where):
    if where == "chat_template.jinja":
        (hf / where).write_text(BROKEN)
        shown, what = str(hf / where), str(hf / where)
    else:
        tc = json.loads((hf / "tokenizer_config.json").read_text())
        tc["chat_template"] = {
            "tokenizer_config.json": BROKEN,
            "named default": [{"name": "tool_use", "template": "{{ tools }}"}, {"name": "default", "template": BROKEN}],
            # transformers and the loader take the last "default": the converter checks that one
            "the last of two named default": [{"name": "default", "template": CHAT_TEMPLATE},
                                              {"name": "default", "template": BROKEN}]}[where]
        (hf / "tokenizer_config.json").write_text(json.dumps(tc))
        shown = f"{hf / 'tokenizer_config.json'}'s chat_template"
        what = f"chat_template in {hf / 'tokenizer_config.json'}"
    convert_refused([hf, tmp_path / "ck"], tmp_path, capsys,
                    f"the model's chat template is not valid Jinja (line 1: unexpected '}}'), in {shown}; fix {what} "
                    "and convert again (or remove it: the checkpoint then has no chat template and is prompted raw, "
                    "chat=False / --no-chat)")


def test_of_two_named_default_templates_the_last_is_the_chat_template_as_in_transformers():
    from hetero_jax.io.tokenizer import default_chat_template

    entry = [{"name": "default", "template": "A"}, {"name": "tool_use", "template": "T"},
             {"name": "default", "template": "B"}]
    assert default_chat_template(entry) == ("B", [])
    assert default_chat_template([{"name": "tool_use", "template": "T"}, {"name": "rag", "template": "R"}]) == (
        None, ["rag", "tool_use"])
    assert default_chat_template("S") == ("S", []) and default_chat_template(None) == (None, [])
