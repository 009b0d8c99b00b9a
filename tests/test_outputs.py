"""No command overwrites its own input or another of its outputs, every output is written whole or not at all, and
the model cache never deletes what it did not write (issue 37, data loss)."""

from __future__ import annotations

import importlib
import os
import re
import sys
import warnings
from pathlib import Path

import pytest

import hetero_jax
from hetero_jax.cli import enable_compilation_cache, main
from hetero_jax.errors import CheckpointError, OutputError
from hetero_jax.io import hub
from hetero_jax.io.files import atomic_path, check_outputs, write_text
from hetero_jax.io.own_outputs import TEXT_MARK
from fs_state import deny_write, snapshot
from tiny_model import tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_fidelity  # noqa: E402
import bench_latency  # noqa: E402
import bench_needle  # noqa: E402
import bench_step_ops  # noqa: E402
import common  # noqa: E402

calibrate = importlib.import_module("hetero_jax.profile.calibrate")  # the package exports a function of that name
METHODS = ("heterocache", "contextkeeper", "synckv", "hcattention")
OLD = f"{TEXT_MARK} earlier\n".encode()  # an earlier output of ours, which a write may replace


def _boom(what):
    def boom(*a, **k):
        raise AssertionError(f"{what} for input that should have been refused")
    return boom


@pytest.fixture
def no_work(monkeypatch):
    """Fail if the profile command loads a model, cuts windows or calibrates."""
    monkeypatch.setattr(hub, "load", _boom("model loaded"))
    monkeypatch.setattr(calibrate, "calibration_windows", _boom("windows cut"))
    monkeypatch.setattr(calibrate, "calibrate_tokens", _boom("calibrated"))


@pytest.fixture
def tiny_loaded(monkeypatch):
    """``hub.load`` (the profile command's) gives a tiny model (3 KV heads, 256-token context); nothing is
    calibrated."""
    monkeypatch.setattr(hub, "load", lambda *a, **k: tiny_model(256))
    monkeypatch.setattr(calibrate, "calibration_windows", _boom("windows cut"))
    monkeypatch.setattr(calibrate, "calibrate_tokens", _boom("calibrated"))


def _refused(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: {message}\n", err


# ------------------------------------------------------------------ check_outputs
def test_an_output_that_is_an_input_is_refused_through_links(tmp_path):
    data = tmp_path / "notes.txt"
    data.write_text("my notes\n")
    (tmp_path / "link.txt").symlink_to(data)
    os.link(data, tmp_path / "hard.txt")
    before = snapshot(tmp_path)
    for out in (data, tmp_path / "link.txt", tmp_path / "hard.txt", tmp_path / "sub" / ".." / "notes.txt"):
        (tmp_path / "sub").mkdir(exist_ok=True)
        with pytest.raises(OutputError, match=re.escape(
                f"--out {out} is also the --data input; writing it would overwrite your input. Choose another --out")):
            check_outputs({"--out": out}, {"--data": [tmp_path / "other.txt", data]})
        (tmp_path / "sub").rmdir()
    assert snapshot(tmp_path) == before


def test_two_outputs_that_are_one_file_are_refused(tmp_path):
    with pytest.raises(OutputError, match=re.escape(
            f"--plot {tmp_path}/x.json is the same file as --out {tmp_path}/x.json; the second write would replace "
            "the first. Choose different paths for --out and --plot")):
        check_outputs({"--out": tmp_path / "x.json", "--plot": tmp_path / "x.json"})
    assert os.listdir(tmp_path) == []


def test_an_existing_file_inside_an_input_directory_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    with pytest.raises(OutputError, match=re.escape(
            f"--out {ckpt}/config.json is a file of the --model input {ckpt}; writing it would overwrite part of "
            "your input. Choose another --out")):
        check_outputs({"--out": ckpt / "config.json"}, {"--model": ckpt})
    check_outputs({"--out": ckpt / "profile.json"}, {"--model": ckpt})  # a new file beside it is fine
    assert (ckpt / "config.json").read_text() == "{}" and os.listdir(ckpt) == ["config.json"]


@pytest.mark.parametrize("case", ["directory", "no parent", "parent is a file", "parent read-only", "read-only"])
def test_an_output_that_cannot_be_written_is_refused(tmp_path, monkeypatch, case):
    out = tmp_path / "p.json"
    if case == "directory":
        out.mkdir()
        message = f"--out {out} is a directory; give the path of a file to write (inside it or elsewhere)"
    elif case == "no parent":
        out = tmp_path / "missing" / "p.json"
        message = f"--out {out}: the directory {tmp_path}/missing does not exist; create it first (nothing was written)"
    elif case == "parent is a file":
        (tmp_path / "f").write_text("x")
        out = tmp_path / "f" / "p.json"
        message = f"--out {out}: {tmp_path}/f is not a directory; choose another --out"
    elif case == "parent read-only":
        deny_write(monkeypatch, tmp_path)
        message = (f"--out {out}: the directory {tmp_path} is not writable; choose another --out or make the "
                   "directory writable")
    else:
        out.write_text("kept")
        deny_write(monkeypatch, out)
        message = f"--out {out} exists and is read-only; choose another --out or make it writable (chmod u+w {out})"
    before = snapshot(tmp_path)
    with pytest.raises(OutputError, match=re.escape(message)):
        check_outputs({"--out": out})
    with pytest.raises(OutputError, match=re.escape(message)):  # the writer checks too
        write_text(out, "new", "--out")
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------ atomic writes
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    out = tmp_path / "roles.png"
    out.write_bytes(OLD)
    with pytest.raises(RuntimeError, match="drawing failed"):
        with atomic_path(out) as tmp:
            assert os.path.dirname(tmp) == str(tmp_path) and tmp.endswith(".png")  # matplotlib infers the format
            Path(tmp).write_bytes(b"half")
            raise RuntimeError("drawing failed")
    assert os.listdir(tmp_path) == ["roles.png"] and out.read_bytes() == OLD


def test_an_os_error_while_writing_is_an_output_error(tmp_path):
    out = tmp_path / "p.json"
    out.write_bytes(OLD)
    with pytest.raises(OutputError, match=re.escape(f"--out {out}: writing it failed (No space left on device); "
                                                    f"{out} was not changed")):
        with atomic_path(out, "--out"):
            raise OSError(28, "No space left on device")
    assert os.listdir(tmp_path) == ["p.json"] and out.read_bytes() == OLD


def test_writes_keep_permissions_and_follow_symlinks(tmp_path):
    old = os.umask(0o027)
    try:
        new = tmp_path / "new.json"
        write_text(new, "a")
        assert new.read_text() == "a" and new.stat().st_mode & 0o777 == 0o640  # the umask's, not mkstemp's 0600
    finally:
        os.umask(old)
    kept = tmp_path / "kept.json"
    kept.write_bytes(OLD)
    kept.chmod(0o604)
    link = tmp_path / "link.json"
    link.symlink_to(kept)
    write_text(link, "b")
    assert link.is_symlink() and kept.read_text() == "b" and kept.stat().st_mode & 0o777 == 0o604
    assert sorted(os.listdir(tmp_path)) == ["kept.json", "link.json", "new.json"]


# ------------------------------------------------------------------ hetero-jax profile
@pytest.mark.parametrize("method", METHODS)
def test_profile_out_that_is_the_data_is_refused(tmp_path, capsys, no_work, method):
    data = tmp_path / ("codebook.npz" if method == "hcattention" else "notes.txt")
    data.write_text("my own calibration notes\n" * 50)
    out = tmp_path / "codebook" if method == "hcattention" else data  # numpy would add .npz: the same file
    before = snapshot(tmp_path)
    _refused(capsys, ["profile", "--method", method, "--data", str(data), "--out", str(out)],
             f"--out {data} is also the --data input; writing it would overwrite your input. Choose another --out")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ["roles.png", "x.json"])
def test_profile_out_and_plot_that_are_one_file_are_refused(tmp_path, capsys, no_work, name):
    out = tmp_path / name
    _refused(capsys, ["profile", "--data", "pydoc", "--out", str(out), "--plot", str(out)],
             f"--plot {out} is the same file as --out {out}; the second write would replace the first. Choose "
             "different paths for --out and --plot")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("method", METHODS)
def test_profile_read_only_out_is_refused(tmp_path, capsys, monkeypatch, no_work, method):
    out = tmp_path / ("c.npz" if method == "hcattention" else "p.json")
    out.write_text("an earlier result")
    deny_write(monkeypatch, out)
    _refused(capsys, ["profile", "--method", method, "--data", "pydoc", "--out", str(out)],
             f"--out {out} exists and is read-only; choose another --out or make it writable (chmod u+w {out})")
    assert snapshot(tmp_path) == {Path(out.name): b"an earlier result"}


def test_profile_out_inside_the_model_checkpoint_is_refused(tmp_path, capsys, no_work):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "llama"}')
    before = snapshot(tmp_path)
    _refused(capsys, ["profile", "--model", str(ckpt), "--data", "pydoc", "--out", str(ckpt / "config.json")],
             f"--out {ckpt}/config.json is a file of the --model input {ckpt}; writing it would overwrite part of "
             "your input. Choose another --out")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("method", ["contextkeeper", "synckv", "hcattention"])
def test_profile_plot_for_a_method_that_draws_nothing_is_refused(tmp_path, capsys, no_work, method):
    _refused(capsys, ["profile", "--method", method, "--data", "pydoc", "--out", str(tmp_path / "o.npz"),
                      "--plot", str(tmp_path / "roles.png")],
             f"--plot draws the HeteroCache role figure; --method {method} draws nothing. Drop --plot (it would "
             "write no file)")
    assert os.listdir(tmp_path) == []


def test_profile_plot_in_a_format_matplotlib_cannot_write_is_refused(tmp_path, capsys, no_work):
    assert main(["profile", "--data", "pydoc", "--out", str(tmp_path / "p.json"),
                 "--plot", str(tmp_path / "roles.txt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --plot {tmp_path}/roles.txt: .txt is not a format matplotlib writes; use one of ")
    assert ".png" in err and os.listdir(tmp_path) == []


@pytest.mark.parametrize("method, flags, message", [
    ("hcattention", ["--codebook-size", "40000"],
     "--codebook-size 40000 does not fit the int16 codes; use --codebook-size 32767 or fewer"),
    ("contextkeeper", ["--tokens", "300", "--sink", "100", "--recent", "200"],
     "--tokens 300 leaves no middle to score between --sink 100 and --recent 200; use --tokens above 300, or lower "
     "--sink or --recent"),
])
def test_profile_method_flags_are_refused_before_loading(tmp_path, capsys, no_work, method, flags, message):
    _refused(capsys, ["profile", "--method", method, "--data", "pydoc", "--out", str(tmp_path / "o.npz"), *flags],
             message)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("method, flags, message", [
    ("synckv", ["--n-r", "4", "--tokens", "64"],
     "--n-r 4 exceeds the model's 3 KV heads per layer (SyncKV groups a layer's KV heads into R-head clusters); use "
     "--n-r 3 or fewer"),
    ("heterocache", ["--tokens", "250", "--decode-steps", "50"],
     "--tokens 250 plus --decode-steps 50 exceeds the model's context of 256 tokens; use --tokens 206 or fewer"),
    ("synckv", ["--tokens", "256", "--decode-steps", "1"],
     "--tokens 256 plus --decode-steps 1 exceeds the model's context of 256 tokens; use --tokens 255 or fewer"),
    ("contextkeeper", ["--tokens", "257", "--sink", "4", "--recent", "8"],
     "--tokens 257 exceeds the model's context of 256 tokens; use --tokens 256 or fewer"),
    ("hcattention", ["--tokens", "300"],
     "--tokens 300 exceeds the model's context of 256 tokens; use --tokens 256 or fewer"),
    ("hcattention", ["--tokens", "64", "--sub-dim", "3"],
     "--sub-dim 3 does not divide the model's head_dim 16 (each key is cut into head_dim / d sub-vectors); use one "
     "of 1, 2, 4, 8, 16"),
    ("hcattention", ["--tokens", "10", "--samples", "2", "--sub-dim", "8", "--codebook-size", "121"],
     "--codebook-size 121 exceeds the 120 key sub-vectors per layer that 2 window(s) of 10 tokens give; use "
     "--codebook-size 120 or fewer, or more --samples or --tokens"),
])
def test_profile_flags_past_the_model_are_refused_before_calibrating(tmp_path, capsys, tiny_loaded, method, flags,
                                                                     message):
    _refused(capsys, ["profile", "--method", method, "--data", "pydoc", "--out", str(tmp_path / "o.npz"), *flags],
             message)
    assert os.listdir(tmp_path) == []


def test_profile_writes_each_output_whole_and_leaves_no_temporary(tiny_checkpoint, tmp_path, capsys):
    """The writers behind the command (profile JSON, figure, codebook) replace their files through a temporary
    sibling; a codebook --out without .npz is written (and reported) with it."""
    from hetero_jax.policies.hcattention.codebook import load_codebook
    from hetero_jax.profile import load_profile

    _, ours = tiny_checkpoint("llama")
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"word{i % 97} and{i % 13}" for i in range(3000)))
    out, plot = tmp_path / "p.json", tmp_path / "roles"  # no extension: PNG, at exactly this path
    out.write_text('{"format": "hetero-jax-head-profile", "earlier": true}')  # an earlier profile: replaced
    common_flags = ["--model", ours, "--data", str(text), "--tokens", "64", "--samples", "2", "--no-progress"]
    assert main(["profile", *common_flags, "--decode-steps", "3", "--copy-steps", "0", "--out", str(out),
                 "--plot", str(plot)]) == 0
    assert load_profile(str(out)).roles.shape[0] == hetero_jax.load(ours).config.num_layers
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["profile", "--method", "hcattention", *common_flags, "--codebook-size", "8", "--kmeans-steps", "2",
                 "--kmeans-batch", "64", "--out", str(tmp_path / "cb")]) == 0
    assert f"wrote {tmp_path}/cb.npz" in capsys.readouterr().out and load_codebook(tmp_path / "cb.npz").size == 8
    assert sorted(os.listdir(tmp_path)) == ["cb.npz", "p.json", "roles", "t.txt"]


def test_calibrate_tokens_refuses_more_r_heads_than_kv_heads(monkeypatch):
    from hetero_jax.model import transformer
    from hetero_jax.profile import ProfileError

    monkeypatch.setattr(transformer, "prefill", _boom("prefill ran"))
    model = tiny_model(256)
    with pytest.raises(ProfileError, match=re.escape(
            "n_r=4 R-heads per layer exceeds the model's 3 KV heads per layer; use at most 3")):
        calibrate.calibrate_tokens(model.config, model.params, [list(range(3, 67))], scoring="synckv", n_r=4,
                                   decode_steps=2, progress=False)


# ------------------------------------------------------------------ the model cache
@pytest.fixture
def no_conversion(monkeypatch):
    """Fail if a known model's conversion starts (nothing is downloaded or converted)."""
    monkeypatch.setitem(hub.KNOWN_MODELS, "smollm2-135m",
                        hub.KnownModel(description="test", source=_boom("conversion started")))


def _load_refused_unchanged(folder: Path, message: str) -> None:
    """Loading smollm2-135m raises CheckpointError with exactly ``message`` and leaves ``folder`` byte for byte."""
    before = snapshot(folder)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        hetero_jax.load("smollm2-135m")
    assert snapshot(folder) == before


def test_a_user_directory_in_the_cache_is_never_deleted(tmp_path, monkeypatch, no_conversion):
    monkeypatch.setenv("HETERO_JAX_CACHE", str(tmp_path))
    mine = tmp_path / "smollm2-135m"
    mine.mkdir()
    (mine / "thesis.txt").write_text("three years of work")
    (mine / "data").mkdir()
    (mine / "data" / "a.bin").write_bytes(b"\x00\x01")
    _load_refused_unchanged(tmp_path, (
        f"{mine} exists but is not a converted smollm2-135m checkpoint (it has no hetero_jax.json); hetero-jax "
        f"converts smollm2-135m there and will not delete files it did not write. Move {mine} away, or point "
        "HETERO_JAX_CACHE at another directory"))


def test_a_cache_entry_that_is_a_file_is_refused(tmp_path, monkeypatch, no_conversion):
    monkeypatch.setenv("HETERO_JAX_CACHE", str(tmp_path))
    (tmp_path / "smollm2-135m").write_text("not a model")
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path}/smollm2-135m exists but is not a converted")):
        hetero_jax.load("smollm2-135m")
    assert (tmp_path / "smollm2-135m").read_text() == "not a model"


def test_only_our_own_stale_temporaries_are_removed(tmp_path, monkeypatch, no_conversion):
    monkeypatch.setenv("HETERO_JAX_CACHE", str(tmp_path))
    ours = [tmp_path / ".smollm2-135m.tmp-ab_d12z9", tmp_path / ".smollm2-135m.old-0123abcd"]
    theirs = [tmp_path / ".smollm2-135m.tmp-my-notes", tmp_path / ".smollm2-135m.old-backup"]
    (tmp_path / "smollm2-135m").mkdir()  # empty: the one thing that may be replaced
    for d in ours + theirs:
        d.mkdir()
        (d / "f").write_text(d.name)
        os.utime(d, (0, 0))  # killed long ago
    with pytest.raises(AssertionError, match="conversion started"):
        hetero_jax.load("smollm2-135m")
    assert sorted(os.listdir(tmp_path)) == sorted(d.name for d in theirs)
    assert all((d / "f").read_text() == d.name for d in theirs)


@pytest.mark.parametrize("case", ["file", "under a file", "read-only"])
def test_an_unusable_cache_is_refused_before_converting(tmp_path, monkeypatch, no_conversion, case):
    root = tmp_path / "cache"
    if case == "file":
        root.write_text("HETERO_JAX_CACHE is not meant to be this file")
        problem = "it is a file, not a directory"
    elif case == "under a file":
        (tmp_path / "f").write_text("x")
        root = tmp_path / "f" / "cache"
        problem = f"{tmp_path}/f is a file, not a directory"
    else:
        root.mkdir()
        deny_write(monkeypatch, root)
        problem = "it is not writable"
    monkeypatch.setenv("HETERO_JAX_CACHE", str(root))
    _load_refused_unchanged(tmp_path, (
        f"the model cache {root} cannot hold a converted model ({problem}); point HETERO_JAX_CACHE at a "
        "writable directory (it is created if missing)"))


def test_a_read_only_cache_holding_the_model_still_loads_it(tmp_path, monkeypatch, no_conversion):
    monkeypatch.setenv("HETERO_JAX_CACHE", str(tmp_path))
    target = tmp_path / "smollm2-135m"
    (target / "params").mkdir(parents=True)
    (target / "hetero_jax.json").write_text("{}")
    deny_write(monkeypatch, tmp_path, target)
    assert hub.ensure_converted("smollm2-135m") == str(target)


def test_an_unusable_compile_cache_warns_and_runs_uncached(tmp_path, monkeypatch):
    import jax

    (tmp_path / "cache").write_text("a file")
    monkeypatch.setenv("HETERO_JAX_CACHE", str(tmp_path / "cache"))
    before = jax.config.jax_compilation_cache_dir
    with pytest.warns(RuntimeWarning, match=re.escape(
            f"the compile cache {tmp_path}/cache/xla cannot be used ({tmp_path}/cache is a file, not a directory); "
            "compiling without it")):
        assert enable_compilation_cache() is False
    assert jax.config.jax_compilation_cache_dir == before and (tmp_path / "cache").read_text() == "a file"


def test_an_unusable_native_kernel_cache_builds_for_the_process(tmp_path, monkeypatch):
    from pallas_kernels import native

    (tmp_path / "cache").write_text("a file")
    monkeypatch.setenv("HETERO_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_compiler", lambda: "/bin/true")
    monkeypatch.setattr(native, "_compile", lambda cxx, out: Path(out).write_bytes(b"library"))
    monkeypatch.setattr(native, "_private", [])
    with pytest.warns(RuntimeWarning, match=re.escape(
            f"the native kernel cache {tmp_path}/cache/native cannot be used ({tmp_path}/cache is a file, not a "
            "directory); building it for this process only")):
        path = native.build()
    assert Path(path).read_bytes() == b"library" and not path.startswith(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per process
        assert native.build() == path
    assert (tmp_path / "cache").read_text() == "a file"


# ------------------------------------------------------------------ benchmark scripts
def _usage_error(capsys, parse, argv, message):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.rstrip("\n").endswith(f"error: {message}"), err


def test_bench_output_that_is_a_path_input_is_refused(tmp_path, capsys):
    a = tmp_path / "a.json"
    a.write_text('{"config": {}}')
    _usage_error(capsys, bench_latency.parse_args, ["--merge", str(tmp_path / "b.json"), str(a), "--out", str(a)],
                 f"--out {a} is also the --merge input; writing it would overwrite your input. Choose another --out")
    text = tmp_path / "notes.txt"
    text.write_text("my text")
    _usage_error(capsys, bench_fidelity.parse_args, ["--text", str(text), "--plot", str(text)],
                 f"--plot {text} is also the --text input; writing it would overwrite your input. Choose another "
                 "--plot")
    _usage_error(capsys, bench_step_ops.parse_args, ["--profile", str(a), "--out", str(a)],
                 f"--out {a} is also the --profile input; writing it would overwrite your input. Choose another --out")
    assert sorted(os.listdir(tmp_path)) == ["a.json", "notes.txt"] and a.read_text() == '{"config": {}}'


def test_bench_outputs_that_are_one_file_are_refused(tmp_path, capsys):
    out = tmp_path / "x.png"  # --plot defaults to --out with .png: the same file
    _usage_error(capsys, bench_fidelity.parse_args, ["--out", str(out)],
                 f"--plot {out} is the same file as --out {out}; the second write would replace the first. Choose "
                 "different paths for --out and --plot")
    _usage_error(capsys, bench_needle.parse_args, ["--preset", "cpu", "--out", str(out)],
                 f"--plot {out} is the same file as --out {out}; the second write would replace the first. Choose "
                 "different paths for --out and --plot")
    res = tmp_path / "r.md"
    _usage_error(capsys, bench_latency.parse_args, ["--out", str(res), "--results-file", str(res), "--write-results"],
                 f"--results-file {res} is the same file as --out {res}; the second write would replace the first. "
                 "Choose different paths for --out and --results-file")
    assert os.listdir(tmp_path) == []


def test_bench_paths_that_are_not_written_are_not_refused(tmp_path):
    a = tmp_path / "a.json"
    res = tmp_path / "r.md"
    args = bench_step_ops.parse_args(["--render", str(a), "--out", str(a)])  # --render writes no --out
    assert args.render == args.out == a
    args = bench_latency.parse_args(["--out", str(res), "--results-file", str(res)])  # no --write-results
    assert args.results_file == res
    args = bench_fidelity.parse_args(["--out", str(tmp_path / "new" / "f.json")])  # out/ is created when missing
    assert args.plot == tmp_path / "new" / "f.png"


def test_bench_parser_checks_json_outputs(tmp_path, capsys):
    p = common.argument_parser("test")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--profile", type=Path, default=None)
    f = tmp_path / "p.json"
    _usage_error(capsys, p.parse_args, ["--json", str(f), "--profile", str(f)],
                 f"--json {f} is also the --profile input; writing it would overwrite your input. Choose another "
                 "--json")
