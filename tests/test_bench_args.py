"""The benchmark scripts refuse bad paths with a usage error (exit 2, no traceback) before any work: an output
inside the --model checkpoint, bench_profile's and contextkeeper_rankings' output folders, bench_kernels' --out,
and --merge / --render files that are missing, not JSON or not a result of the script. Nothing here runs a
benchmark: the work each script would do next is replaced by a function that fails the test."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hetero_jax
from hetero_jax.profile import load_profile, shipped_profile_path
from fs_state import deny_write, snapshot

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_extend  # noqa: E402
import bench_fidelity  # noqa: E402
import bench_foundation  # noqa: E402
import bench_kernels  # noqa: E402
import bench_latency  # noqa: E402
import bench_mesh  # noqa: E402
import bench_multiturn  # noqa: E402
import bench_needle  # noqa: E402
import bench_policies  # noqa: E402
import bench_profile  # noqa: E402
import bench_serve  # noqa: E402
import bench_step_ops  # noqa: E402
import bench_task_margins  # noqa: E402
import bench_tasks  # noqa: E402
import contextkeeper_rankings  # noqa: E402
from bench_cases import usage_error  # noqa: E402

calibrate = importlib.import_module("hetero_jax.profile.calibrate")  # the package exports a function of that name


def _boom(what):
    def boom(*a, **k):
        raise AssertionError(f"{what} for input that should have been refused")
    return boom


def _unusable_folder(tmp_path, monkeypatch, case: str) -> tuple[Path, str]:
    """(a folder path no script can write into, the reason its refusal gives) for ``case``: an existing file, a
    path under a file, or a read-only directory."""
    existing = tmp_path / "existing_file"
    existing.write_text("keep me")
    if case == "file":
        return existing, "(it is a file, not a directory)"
    if case == "under a file":
        return existing / "sub", f"({existing} is a file, not a directory)"
    out = tmp_path / "ro"
    out.mkdir()
    deny_write(monkeypatch, out)
    return out, "(it is not writable)"


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    ck = tmp_path / "ck2"
    ck.mkdir()
    (ck / "config.json").write_text('{"model_type": "llama"}')
    (ck / "params.safetensors").write_bytes(b"weights")
    return ck


# ------------------------------------------------------------------ 1. --model is an input
# every script whose --model loads a checkpoint (its own --model or common.add_model_arguments)
MODEL_SCRIPTS = [bench_extend, bench_fidelity, bench_foundation, bench_latency, bench_mesh, bench_policies,
                 bench_serve, bench_tasks, bench_task_margins, bench_needle, bench_multiturn]


@pytest.mark.parametrize("script", MODEL_SCRIPTS, ids=lambda m: m.__name__)
def test_an_out_inside_the_model_checkpoint_is_refused(script, checkpoint, capsys):
    before = snapshot(checkpoint)
    config = checkpoint / "config.json"
    flag = "--json" if script is bench_mesh else "--out"  # bench_mesh's JSON output
    usage_error(capsys, script.parse_args, ["--model", str(checkpoint), flag, str(config)],
                 f"{flag} {config} is a file of the --model input {checkpoint}", f"Choose another {flag}")
    assert snapshot(checkpoint) == before


def test_the_model_checkpoint_is_protected_from_every_output(checkpoint, capsys):
    params = checkpoint / "params.safetensors"
    usage_error(capsys, bench_fidelity.parse_args,
                 ["--model", str(checkpoint), "--out", str(checkpoint.parent / "f.json"), "--plot", str(params)],
                 f"--plot {params} is a file of the --model input {checkpoint}")
    usage_error(capsys, bench_latency.parse_args,
                 ["--model", str(checkpoint), "--out", str(checkpoint.parent / "l.json"), "--write-results",
                  "--results-file", str(checkpoint / "config.json")],
                 f"--results-file {checkpoint / 'config.json'} is a file of the --model input {checkpoint}")
    # a symlink to the checkpoint is seen through
    link = checkpoint.parent / "link"
    link.symlink_to(checkpoint)
    usage_error(capsys, bench_foundation.parse_args, ["--model", str(link), "--out", str(checkpoint / "config.json")],
                 "is a file of the --model input")
    assert (checkpoint / "config.json").read_text() == '{"model_type": "llama"}'


def test_a_known_model_name_protects_its_converted_copy(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    converted = cache / "smollm2-135m"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("converted")
    monkeypatch.setenv("HETERO_JAX_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)  # no directory named smollm2-135m here: the name resolves to the cache
    usage_error(capsys, bench_foundation.parse_args,
                 ["--model", "smollm2-135m", "--out", str(converted / "config.json")],
                 f"--out {converted / 'config.json'} is a file of the --model input {converted}")
    assert (converted / "config.json").read_text() == "converted"


def test_outputs_beside_or_new_inside_the_checkpoint_are_allowed(checkpoint, tmp_path, monkeypatch):
    args = bench_foundation.parse_args(["--model", str(checkpoint), "--out", str(tmp_path / "f.json")])
    assert args.out == tmp_path / "f.json" and args.model == str(checkpoint)
    args = bench_foundation.parse_args(["--model", str(checkpoint), "--out", str(checkpoint / "new.json")])
    assert args.out == checkpoint / "new.json"  # a new file replaces nothing of the checkpoint
    monkeypatch.setenv("HETERO_JAX_CACHE", str(tmp_path / "empty-cache"))
    assert bench_mesh.parse_args(["--json", str(tmp_path / "m.json")]).model == "smollm2-135m"


# ------------------------------------------------------------------ 2. bench_profile --out DIR
@pytest.fixture
def no_calibration(monkeypatch):
    monkeypatch.setattr(hetero_jax, "load", _boom("model loaded"))
    monkeypatch.setattr(calibrate, "calibration_windows", _boom("windows cut"))
    monkeypatch.setattr(calibrate, "calibrate_tokens", _boom("calibrated"))


@pytest.mark.parametrize("case", ["file", "under a file", "read-only"])
def test_profile_out_that_cannot_hold_the_json_is_refused_before_calibrating(tmp_path, capsys, monkeypatch,
                                                                             no_calibration, case):
    out, problem = _unusable_folder(tmp_path, monkeypatch, case)
    before = snapshot(tmp_path)
    usage_error(capsys, bench_profile.main, ["--out", str(out)],
                 f"--out {out} cannot be used as a folder to write into {problem}; choose another --out")
    assert snapshot(tmp_path) == before


def test_profile_writes_its_json_atomically_into_the_out_folder(tmp_path, monkeypatch, capsys):
    """The calibration replaced by the shipped profile itself (so the roles reproduce): the JSON goes through
    hetero_jax.io.files.write_text into a folder created under --out, and no temporary is left."""
    shipped = load_profile(shipped_profile_path("smollm2-135m"))

    class Loaded:
        tokenizer = config = params = None
        name = "smollm2-135m"
    monkeypatch.setattr(hetero_jax, "load", lambda *a, **k: Loaded())
    monkeypatch.setattr(calibrate, "pydoc_text", lambda: "text")
    monkeypatch.setattr(calibrate, "calibration_windows", lambda *a, **k: [])
    monkeypatch.setattr(calibrate, "calibrate_tokens", lambda *a, **k: shipped)
    files = importlib.import_module("hetero_jax.io.files")
    written = []
    real_write_text = files.write_text

    def spy(path, text, flag="output", **kw):
        written.append((os.fspath(path), flag))
        return real_write_text(path, text, flag, **kw)
    monkeypatch.setattr(files, "write_text", spy)
    out = tmp_path / "new" / "dir"
    assert bench_profile.main(["--out", str(out), "--no-progress"]) == 0
    (made,) = os.listdir(out)
    assert made.startswith("bench_profile-") and made.endswith(".json")
    assert written == [(str(out / made), "--out")]
    data = json.loads((out / made).read_text())
    assert data["reproduces_shipped_roles"] is True and data["roles"] == shipped.role_counts()
    assert f"wrote {out / made}" in capsys.readouterr().out


def test_profile_existing_file_out_fails_fast_from_the_command_line(tmp_path):
    existing = tmp_path / "existing_file"
    existing.write_text("keep me")
    r = subprocess.run([sys.executable, str(BENCH / "bench_profile.py"), "--out", str(existing)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"error: --out {existing} cannot be used as a folder to write into (it is a file" in r.stderr
    assert existing.read_text() == "keep me"


# ------------------------------------------------------------------ 3. bench_kernels --out
@pytest.fixture
def no_kernels(monkeypatch):
    monkeypatch.setattr(bench_kernels.common, "machine_info", _boom("work started"))
    monkeypatch.setattr(bench_kernels, "gpu_present", _boom("work started"))
    monkeypatch.setattr(bench_kernels, "lowering_jobs", _boom("lowering started"))
    monkeypatch.setattr(bench_kernels, "drift_timing", _boom("drift timing started"))


@pytest.mark.parametrize("case", ["directory", "under a file", "read-only directory", "read-only file"])
def test_kernels_out_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys, monkeypatch, no_kernels,
                                                                     case):
    blocker = tmp_path / "a_file"
    blocker.write_text("keep me")
    if case == "directory":
        out, message = tmp_path, f"--out {tmp_path} is a directory"
    elif case == "under a file":
        out, message = blocker / "k.json", f"--out {blocker / 'k.json'}: {blocker} is not a directory"
    elif case == "read-only directory":
        ro = tmp_path / "ro"
        ro.mkdir()
        deny_write(monkeypatch, ro)
        out, message = ro / "k.json", f"the directory {ro} is not writable"
    else:
        out, message = blocker, f"--out {blocker} exists and is read-only"
        deny_write(monkeypatch, blocker)
    before = snapshot(tmp_path)
    usage_error(capsys, bench_kernels.main, ["--out", str(out)], message)
    assert snapshot(tmp_path) == before


def test_kernels_drift_timing_checks_the_file_it_writes_beside_out(tmp_path, capsys, no_kernels):
    (tmp_path / "kernels-drift-check.json").mkdir()
    usage_error(capsys, bench_kernels.main, ["--drift-timing", "--out", str(tmp_path / "k.json")],
                 f"{tmp_path / 'kernels-drift-check.json'} is a directory")


# ------------------------------------------------------------------ 4. --render, --merge, --out-dir
def _bad_inputs(tmp_path) -> dict[str, tuple[Path, str]]:
    """Input files that are not a result: {case: (path, what the error says)}."""
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"config": ')
    folder = tmp_path / "folder.json"
    folder.mkdir()
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00")
    a_list = tmp_path / "list.json"
    a_list.write_text("[1, 2]")
    missing = tmp_path / "missing.json"
    return {
        "missing": (missing, f"{missing}: no such file"),
        "not JSON": (bad_json, f"{bad_json} is not JSON (Expecting value at line 1 column 12)"),
        "not UTF-8": (binary, f"{binary} is not JSON"),
        "directory": (folder, f"{folder} is a directory, not a file"),
        "a list": (a_list, f"{a_list} is not a result file of"),
    }


BAD_CASES = ["missing", "not JSON", "not UTF-8", "directory", "a list"]


@pytest.fixture
def no_step_ops_run(monkeypatch):
    monkeypatch.setattr(bench_step_ops, "run", _boom("compile started"))
    monkeypatch.setattr(bench_step_ops, "recount", _boom("recount started"))


@pytest.mark.parametrize("case", BAD_CASES)
def test_step_ops_render_of_a_bad_file_is_a_usage_error(tmp_path, capsys, no_step_ops_run, case):
    path, message = _bad_inputs(tmp_path)[case]
    usage_error(capsys, bench_step_ops.main, ["--render", str(path)], f"--render {message}",
                 "give a JSON file that bench_step_ops.py wrote")


def test_step_ops_render_of_a_json_that_is_not_its_result_is_a_usage_error(tmp_path, capsys, no_step_ops_run):
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    usage_error(capsys, bench_step_ops.main, ["--render", str(empty)],
                 f"--render {empty} is not a result file of bench_step_ops.py (it has no 'config', 'rows', "
                 "'errors', 'targets', 'total_seconds')")
    no_rows = tmp_path / "latency.json"
    no_rows.write_text(json.dumps({"config": {}, "runs": [], "errors": [], "targets": {}, "total_seconds": 1}))
    usage_error(capsys, bench_step_ops.main, ["--render", str(no_rows)], "(it has no 'rows')")
    bad_config = tmp_path / "bad_config.json"
    bad_config.write_text(json.dumps({"config": [], "rows": [], "errors": [], "targets": {}, "total_seconds": 1}))
    usage_error(capsys, bench_step_ops.main, ["--render", str(bad_config)], "its 'config' is not an object")


def test_step_ops_recount_must_be_a_folder_given_with_render(tmp_path, capsys, no_step_ops_run):
    saved = tmp_path / "s.json"
    saved.write_text(json.dumps({"benchmark": "bench_step_ops", "config": {}, "rows": [], "errors": [], "targets": {},
                                 "total_seconds": 1}))
    usage_error(capsys, bench_step_ops.main, ["--render", str(saved), "--recount", str(tmp_path / "nope")],
                 f"--recount {tmp_path / 'nope'} is not a directory")
    usage_error(capsys, bench_step_ops.parse_args, ["--recount", str(tmp_path)], "--recount", "--render")
    p = bench_step_ops.make_parser()
    args = bench_step_ops.parse_args(["--render", str(saved)], p)
    assert bench_step_ops.load_render(p, args) == json.loads(saved.read_text())


def test_step_ops_render_of_a_missing_file_fails_fast_from_the_command_line(tmp_path):
    r = subprocess.run([sys.executable, str(BENCH / "bench_step_ops.py"), "--render", str(tmp_path / "X")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"error: --render {tmp_path / 'X'}: no such file" in r.stderr


MERGE = {  # script: (a minimal result file it merges, the script's name in the error)
    bench_latency: ({"benchmark": "latency", "config": {
        "synthetic_lengths": [], "real_lengths": [], "ttft_warmup": 0, "ttft_repeats": 1, "decode_steps": 1,
        "warmup_steps": 0, "model": "m", "dtype": "float32", "seed": 0}, "lengths": [], "runs": [],
        "total_seconds": 1.0, "command": "c", "git": {}, "machine": {}, "peak_rss_bytes": 1}, "bench_latency.py"),
    bench_tasks: ({"benchmark": "tasks", "config": {"tasks": [], "lengths": [], "seeds": [], "haystacks": [],
                                                    "combos": []},
                   "records": [], "prompts": [], "command": "c", "git": {}, "machine": {},
                   "load_seconds": 1.0, "total_seconds": 1.0, "peak_rss_bytes": 1}, "bench_tasks.py"),
}


@pytest.mark.parametrize("script", list(MERGE), ids=lambda m: m.__name__)
@pytest.mark.parametrize("case", BAD_CASES)
def test_merge_of_a_bad_file_is_a_usage_error(tmp_path, capsys, script, case):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(MERGE[script][0]))
    path, message = _bad_inputs(tmp_path)[case]
    usage_error(capsys, script.parse_args, ["--merge", str(good), str(path), "--out", str(tmp_path / "m.json")],
                 f"--merge {message}", f"give a JSON file that {MERGE[script][1]} wrote")


@pytest.mark.parametrize("script, drop", [(bench_latency, "config"), (bench_latency, "runs"),
                                          (bench_tasks, "config"), (bench_tasks, "records")],
                         ids=lambda x: x if isinstance(x, str) else x.__name__)
def test_merge_of_a_json_without_its_parts_is_a_usage_error(tmp_path, capsys, script, drop):
    payload, name = MERGE[script]
    part = tmp_path / "part.json"
    part.write_text(json.dumps({k: v for k, v in payload.items() if k != drop}))
    usage_error(capsys, script.parse_args, ["--merge", str(part), "--out", str(tmp_path / "m.json")],
                 f"--merge {part} is not a result file of {name} (it has no '{drop}')")


@pytest.mark.parametrize("script", list(MERGE), ids=lambda m: m.__name__)
def test_merge_of_result_files_parses(tmp_path, script):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for f in (a, b):
        f.write_text(json.dumps(MERGE[script][0]))
    args = script.parse_args(["--merge", str(a), str(b), "--out", str(tmp_path / "m.json")])
    assert args.merge == [a, b]


def test_a_latency_result_is_not_a_tasks_result(tmp_path, capsys):
    lat = tmp_path / "lat.json"
    lat.write_text(json.dumps(MERGE[bench_latency][0]))
    usage_error(capsys, bench_tasks.parse_args, ["--merge", str(lat), "--out", str(tmp_path / "m.json")],
                 f"--merge {lat} is a result of bench_latency.py, not of bench_tasks.py (its 'benchmark' is "
                 "'latency', bench_tasks.py's 'tasks')")
    lat.write_text(json.dumps({k: v for k, v in MERGE[bench_latency][0].items() if k != "benchmark"}))
    usage_error(capsys, bench_tasks.parse_args, ["--merge", str(lat), "--out", str(tmp_path / "m.json")],
                 f"--merge {lat} is not a result file of bench_tasks.py (it has no 'records', 'prompts',")


@pytest.fixture
def no_rankings(monkeypatch):
    monkeypatch.setattr(contextkeeper_rankings, "load_ranking", _boom("ranking loaded"))


@pytest.mark.parametrize("case", ["file", "under a file", "read-only"])
def test_rankings_out_dir_that_cannot_hold_them_is_refused(tmp_path, capsys, monkeypatch, no_rankings, case):
    out, problem = _unusable_folder(tmp_path, monkeypatch, case)
    before = snapshot(tmp_path)
    usage_error(capsys, contextkeeper_rankings.main, ["--out-dir", str(out)],
                 f"--out-dir {out} cannot be used as a folder to write into {problem}; choose another --out-dir")
    assert snapshot(tmp_path) == before


def test_rankings_that_exist_are_refused_before_any_work(tmp_path, no_rankings):
    (tmp_path / "ck-random.json").write_text("mine")
    with pytest.raises(SystemExit, match="ck-random.json exist.*nothing is overwritten"):
        contextkeeper_rankings.main(["--out-dir", str(tmp_path)])
    assert snapshot(tmp_path) == {Path("ck-random.json"): b"mine"}


# ------------------------------------------------------- repeated grid values
GRID_FLAGS = ["--lengths", "2000", "2000", "--seeds", "0", "0", "--policies", "full", "snapkv", "snapkv",
              "--budgets", "0.5", "0.5"]


@pytest.mark.parametrize("script, extra, want", [
    (bench_tasks, ["--tasks", "multi-key", "multi-key"], {"tasks": ["multi-key"]}),
    (bench_needle, ["--depths", "0.5", "0.5"], {"depths": [0.5]}),
    (bench_multiturn, ["--haystacks", "pydoc", "pydoc"], {"haystacks": ["pydoc"]}),
], ids=lambda v: getattr(v, "__name__", None))
def test_a_repeated_grid_value_runs_once_with_a_note(script, extra, want, capsys):
    """The grid scripts drop a repeated --lengths / --seeds / --depths / --policies / ... value (as they always
    did --haystacks and --budgets), naming it: each case would otherwise run, and count, twice."""
    args = script.parse_args([*GRID_FLAGS, *extra])
    assert (args.lengths, args.seeds, args.policies, args.budgets) == ([2000], [0], ["full", "snapkv"], [0.5])
    assert {k: getattr(args, k) for k in want} == want
    err = capsys.readouterr().err
    for note in ("--lengths repeats 2000", "--seeds repeats 0", "--policies repeats snapkv", "--budgets repeats 0.5",
                 f"--{next(iter(want))} repeats"):
        assert f"note: {note}" in err
    assert bench_tasks.common.make_combos(args.policies, args.budgets) == [("full", 1.0), ("snapkv", 0.5)]


def test_two_specs_of_one_policy_or_one_label_twice_are_refused(capsys):
    from hetero_jax.errors import ConfigError
    from harness.grid import make_combos

    with pytest.raises(ConfigError, match="the combo snapkv@0.3 is given twice"):
        make_combos(["snapkv", "snapkv"], [0.3])
    with pytest.raises(ConfigError, match="the combo snapkv@0.3 is given twice"):
        make_combos(["snapkv"], [0.3, 0.3000001])  # one label for two budgets
    with pytest.raises(ConfigError, match=r"--policies snapkv and SnapKV are one policy \(SnapKV\(budget="):
        make_combos(["snapkv", "SnapKV"], [0.3])
    assert make_combos(["heterocache", "heterocache:tau_drift=-1"], [0.3])[1:] == [
        ("heterocache", 0.3), ("heterocache:tau_drift=-1", 0.3)]
    with pytest.raises(SystemExit) as e:
        bench_tasks.parse_args(["--policies", "snapkv", "snapkv:window=32"])
    assert e.value.code == 2
    assert "--policies snapkv and snapkv:window=32 are one policy" in capsys.readouterr().err
