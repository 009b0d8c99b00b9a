"""``--merge`` (bench_tasks, bench_latency), ``--render`` (bench_step_ops) and ``--section`` on hand-built result
files: runs that do not compare are refused naming both files and the field, the merged config is the union of
the runs', a merged section names every run's commit, machine and command and each combo's missing cases, the
section follows the runs' preset (or ``--section``), and a file of another benchmark or a malformed one is a usage
error (exit 2, no traceback). No model is loaded."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_latency  # noqa: E402
import bench_step_ops  # noqa: E402
import bench_tasks as bt  # noqa: E402
from harness import latency_report as lr  # noqa: E402
from bench_cases import MACHINE, usage_error  # noqa: E402

REPR = {"full": "FullKV(budget=1.0)", "snapkv@0.3": "SnapKV(budget=0.3, window=32)",
        "heterocache@0.3": "HeteroCache(budget=0.3, window=5)"}


# ------------------------------------------------------------------ bench_tasks --merge
def _rec(label, seed, score=1.0, length=600, task="multi-key"):
    policy, _, rho = label.partition("@")
    return {"task": task, "label": label, "policy": policy, "rho": float(rho or 1), "haystack": "pydoc",
            "length": length, "seed": seed, "score": score, "n": 1, "found": round(score), "solved": score == 1.0,
            "achieved_rho": 1.0 if policy == "full" else 0.3, "recall": {}, "prompt_sha256": f"sha{length}-{seed}",
            "text": " 4761.", "values": ["4761"]}


def _tasks_part(tmp_path, name, recs, *, commit=None, machine=MACHINE, **cfg):
    """A bench_tasks result (as run() writes it, trimmed to what merge and the section read) of ``recs``."""
    combos = list(dict.fromkeys(r["label"] for r in recs))
    config = {"model": "smollm2-135m", "dtype": "float32", "preset": None, "tasks": ["multi-key"],
              "lengths": sorted({r["length"] for r in recs}), "seeds": sorted({r["seed"] for r in recs}),
              "haystacks": ["pydoc"], "budgets": [0.3], "policies": list(dict.fromkeys(r["policy"] for r in recs)),
              "combos": combos, "policy_reprs": [REPR[c] for c in combos], "skipped": {}, "smallest_budgets": {},
              "digits": 4, "haystack_sources": {"pydoc": {"name": "pydoc", "source": "s", "python": "3.11",
                                                          "sha256": "ab" * 32, "tokens": 100}},
              "temperature": 0.0, "batch": 1, "chat_template": True, "prefill": "shared", "grading": bt.GRADING,
              "compile_cache": True, "out": f"{name}.json", "plot": f"{name}.png", **cfg}
    prompts = [{k: r[k] for k in ("task", "haystack", "length", "seed")} for r in recs if r["label"] == "full"]
    payload = {"format": "hetero-jax-benchmark", "benchmark": "tasks", "timestamp": f"time-{name}",
               "command": f"python benchmarks/bench_tasks.py --run {name}", "config": config,
               "machine": machine, "git": {"commit": commit or f"c0mm1t{name}", "dirty": False, "changed_files": []},
               "load_seconds": 1.0, "prompts": prompts, "records": recs, "total_seconds": 60.0, "peak_rss_bytes": 2**20}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(payload))
    return path


def _merge_ns(tmp_path, *files, preset=None):
    return argparse.Namespace(merge=list(files), out=tmp_path / "m.json", plot=tmp_path / "m.png", preset=preset)


@pytest.mark.parametrize("field, value", [("temperature", 0.7), ("chat_template", False), ("batch", 4),
                                          ("prefill", "per policy"), ("dtype", "bfloat16")])
def test_tasks_merge_refuses_other_decoding_naming_both_files_and_the_field(tmp_path, field, value):
    a = _tasks_part(tmp_path, "a", [_rec("full", 0), _rec("snapkv@0.3", 0)])
    b = _tasks_part(tmp_path, "b", [_rec("full", 1), _rec("snapkv@0.3", 1)], **{field: value})
    with pytest.raises(SystemExit, match=rf"--merge: {re.escape(str(b))} was run with another {field} "
                                         rf"\({re.escape(repr(value))}\) than {re.escape(str(a))}"):
        bt.merge(_merge_ns(tmp_path, a, b), "tasks")


def test_tasks_merge_refuses_another_policy_under_one_label_and_another_haystack_text(tmp_path):
    a = _tasks_part(tmp_path, "a", [_rec("full", 0), _rec("snapkv@0.3", 0)])
    b = _tasks_part(tmp_path, "b", [_rec("full", 1), _rec("snapkv@0.3", 1)],
                    policy_reprs=[REPR["full"], "SnapKV(budget=0.3, window=8)"])
    with pytest.raises(SystemExit, match=rf"{re.escape(str(b))} was run with another policy configuration of "
                                         rf"snapkv@0.3 \(.*window=8.*\) than {re.escape(str(a))} \(.*window=32"):
        bt.merge(_merge_ns(tmp_path, a, b), "tasks")
    c = _tasks_part(tmp_path, "c", [_rec("full", 1), _rec("snapkv@0.3", 1)],
                    haystack_sources={"pydoc": {"sha256": "cd" * 32}})
    with pytest.raises(SystemExit, match=rf"{re.escape(str(c))} was run with another haystack text \(sha256\) of "
                                         rf"haystack 'pydoc' .* than {re.escape(str(a))}"):
        bt.merge(_merge_ns(tmp_path, a, c), "tasks")


def test_tasks_merge_config_is_the_union_and_names_each_combos_missing_cases(tmp_path):
    a = _tasks_part(tmp_path, "a", [_rec("full", 0), _rec("snapkv@0.3", 0)])
    b = _tasks_part(tmp_path, "b", [_rec("full", 1), _rec("snapkv@0.3", 1)])
    c = _tasks_part(tmp_path, "c", [_rec("full", 0), _rec("heterocache@0.3", 0, score=0.0)],
                    policies=["full", "heterocache"], budgets=[0.3, 0.5])
    m = bt.merge(_merge_ns(tmp_path, a, b, c), "tasks")
    cfg = m["config"]
    assert cfg["combos"] == ["full", "snapkv@0.3", "heterocache@0.3"]
    assert cfg["policy_reprs"] == [REPR["full"], REPR["snapkv@0.3"], REPR["heterocache@0.3"]]
    assert cfg["policies"] == ["full", "snapkv", "heterocache"] and cfg["budgets"] == [0.3, 0.5]
    assert cfg["missing"] == {"heterocache@0.3": ["seed 1"]}
    text = bt.results_section(m, None)
    assert "heterocache@0.3 lacks seed 1." in text
    assert "Merged (`--merge`) from 3 runs" in text
    for name in "abc":  # every run's commit, machine and command
        assert f"- `{tmp_path / name}.json`: c0mm1t{name} (clean), Test CPU, 2 cores" in text
        assert f"`python benchmarks/bench_tasks.py --run {name}`" in text
    assert "- Command: `python benchmarks/bench_tasks.py --run" not in text  # the header is the merge's


def test_missing_cases_by_hand():
    from harness.task_report import missing_cases

    cfg = {"tasks": ["multi-key", "span-copy"], "haystacks": ["pydoc"], "lengths": [2000, 4000], "seeds": [0, 1],
           "combos": ["full", "snapkv@0.3", "quest@0.3"], "skipped": {"quest@0.3": {"4000": "budget too small"}}}
    every = [(t, L, s) for t in cfg["tasks"] for L in cfg["lengths"] for s in cfg["seeds"]]
    recs = [_rec("full", s, length=L, task=t) for t, L, s in every if (L, s) != (4000, 1)]
    recs += [_rec("snapkv@0.3", s, length=L, task=t) for t, L, s in every if (t, L, s) != ("span-copy", 2000, 0)]
    recs += [_rec("quest@0.3", 0, length=2000, task=t) for t in cfg["tasks"]]  # refused at 4000: not missing there
    assert missing_cases(recs, cfg) == {"full": ["4,000 tokens seed 1"],
                                        "snapkv@0.3": ["span-copy 2,000 tokens seed 0"], "quest@0.3": ["seed 1"]}
    assert missing_cases([], {**cfg, "combos": ["full"]}) == {"full": ["every case"]}


def _as_command_line(monkeypatch, script, argv):
    """``argv`` as the command line the merge records (``command_line`` reads sys.argv)."""
    monkeypatch.setattr(sys, "argv", [str(BENCH / script), *argv])
    return argv


def test_tasks_merge_writes_its_presets_section_and_refuses_mixed_presets(tmp_path, capsys):
    a = _tasks_part(tmp_path, "a", [_rec("full", 0), _rec("snapkv@0.3", 0)], preset="cpu")
    b = _tasks_part(tmp_path, "b", [_rec("full", 1), _rec("snapkv@0.3", 1)], preset="cpu")
    results = tmp_path / "RESULTS.md"
    results.write_text("# r\n\n<!-- BEGIN tasks-full -->\nthe full grid's table\n<!-- END tasks-full -->\n")
    assert bt.main(["--merge", str(a), str(b), "--out", str(tmp_path / "m.json"), "--write-results",
                    "--results-file", str(results)]) == 0
    text = results.read_text()
    assert "the full grid's table" in text and "<!-- BEGIN tasks -->" in text
    assert "updated the 'tasks' section" in capsys.readouterr().out
    full = _tasks_part(tmp_path, "f", [_rec("full", 1), _rec("snapkv@0.3", 1)])
    with pytest.raises(SystemExit, match=rf"{re.escape(str(full))} was run with another --preset .*'full'.* than "
                                         rf"{re.escape(str(a))} \('cpu'\)"):
        bt.merge(_merge_ns(tmp_path, a, full), "tasks")
    with pytest.raises(SystemExit, match="were run with --preset cpu .*not --preset full"):
        bt.merge(_merge_ns(tmp_path, a, b, preset="full"), "tasks")


def test_section_flag_names_the_section_and_is_checked(tmp_path, capsys, monkeypatch):
    a = _tasks_part(tmp_path, "a", [_rec("full", 0), _rec("snapkv@0.3", 0)])
    b = _tasks_part(tmp_path, "b", [_rec("full", 1), _rec("snapkv@0.3", 1)])
    results = tmp_path / "RESULTS.md"
    argv = _as_command_line(monkeypatch, "bench_tasks.py", [
        "--merge", str(a), str(b), "--out", str(tmp_path / "m.json"), "--write-results", "--results-file",
        str(results), "--section", "tasks-2k-three-seeds"])
    for _ in range(2):  # rewritten in place, never repeated
        assert bt.main(argv) == 0
    text = results.read_text()
    assert text.count("<!-- BEGIN tasks-2k-three-seeds -->") == 1 and "tasks-full" not in text
    assert "--section tasks-2k-three-seeds`" in text  # the command it records regenerates it
    usage_error(capsys, bt.parse_args, ["--merge", str(a), "--section", "tasks-x"],
                 "--section tasks-x names the section --write-results rewrites: add --write-results")
    for bad in ("latency-full", "tasks x", "tasksfoo"):
        usage_error(capsys, bt.parse_args, ["--merge", str(a), "--write-results", "--section", bad],
                     f"--section {bad!r}: give 'tasks' or 'tasks-'")
    usage_error(capsys, bench_latency.parse_args, ["--write-results", "--section", "tasks-x"],
                 "--section 'tasks-x': give 'latency' or 'latency-'")


# ------------------------------------------------------------------ bench_latency --merge
def _lat_run(length, label, p50):
    policy, _, rho = label.partition("@")
    return {"length": length, "weights": "real", "label": label, "policy": policy, "rho": float(rho or 1),
            "achieved_rho": 1.0 if policy == "full" else 0.3, "ttft_median_seconds": 1.0, "ttft_ratio": 1.0,
            "decode": {"mean_ms": p50, "p50_ms": p50, "p95_ms": p50, "p99_ms": p50, "p99_over_p50": 1.0},
            "kv_bytes_device": 2**20, "kv_bytes_host": 0, "kv_bytes_read_per_step": length * 1000,
            "decode_ratio_p50": 1.0, "roofline_ratio": 1.0, "measured_over_roofline": 1.0, "within_10pct": True}


def _lat_part(tmp_path, name, length, *, git=None, machine=MACHINE):
    config = {"model": "smollm2-135m", "dtype": "float32", "real_lengths": [length], "synthetic_lengths": [],
              "policies": ["full", "snapkv"], "budgets": [0.3], "decode_steps": 4, "warmup_steps": 0,
              "ttft_warmup": 0, "ttft_repeats": 1, "decode_block": 2, "seed": 0, "preset": None,
              "out": f"{name}.json", "plot": f"{name}.png"}
    payload = {"benchmark": "latency", "timestamp": f"time-{name}", "command": f"python bench_latency.py --run {name}",
               "config": config, "machine": machine, "git": git or {"commit": "aaaaaaa", "dirty": False},
               "load_seconds": 1.0, "refused": {},
               "lengths": [{"length": length, "weights": "real", "max_position_embeddings": 8192,
                            "weight_bytes_per_token": 2**20, "tail_capacity": 128}],
               "runs": [_lat_run(length, "full", 10.0), _lat_run(length, "snapkv@0.3", 9.0)],
               "targets": {"measured": False}, "total_seconds": 30.0, "peak_rss_bytes": 2**20}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(payload))
    return path


def test_latency_merge_refuses_a_length_twice(tmp_path):
    a = _lat_part(tmp_path, "a", 256)
    b = _lat_part(tmp_path, "b", 256)
    for files in ([a, a], [a, b]):
        with pytest.raises(SystemExit, match=rf"256 tokens \(real weights\) are in {re.escape(str(files[0]))} and "
                                             rf"{re.escape(str(files[1]))}"):
            lr.merge(_merge_ns(tmp_path, *files))


def test_latency_merge_names_every_runs_commit_machine_and_command(tmp_path, capsys, monkeypatch):
    a = _lat_part(tmp_path, "a", 256)
    b = _lat_part(tmp_path, "b", 384, git={"commit": "deadbee", "dirty": True, "changed_files": ["x.py"]},
                  machine={**MACHINE, "cpu_model": "Other CPU"})
    results = tmp_path / "RESULTS.md"
    assert bench_latency.main(_as_command_line(monkeypatch, "bench_latency.py", [
        "--merge", str(a), str(b), "--out", str(tmp_path / "m.json"), "--write-results", "--results-file",
        str(results)])) == 0
    text = results.read_text()
    assert "updated the 'latency-full' section" in capsys.readouterr().out
    m = json.loads((tmp_path / "m.json").read_text())
    assert [r["length"] for r in m["runs"]] == [256, 256, 384, 384] and m["total_seconds"] == 60.0
    assert [x["commit"] for x in m["config"]["merged_from"]] == ["aaaaaaa", "deadbee"]
    assert "benchmarks/bench_latency.py --merge" in m["command"]  # the merge's own
    assert "Merged (`--merge`) from 2 runs" in text
    assert f"- `{a}`: aaaaaaa (clean), Test CPU, 2 cores" in text and "`python bench_latency.py --run a`" in text
    assert f"- `{b}`: deadbee (dirty: 1 changed/untracked paths), Other CPU, 2 cores" in text
    assert "`python bench_latency.py --run b`" in text
    assert "- Machine: 2 different machines" in text
    assert "- Command: `python bench_latency.py --run a`" not in text  # the header is the merge's own


# ------------------------------------------------------------------ another benchmark's file, malformed files
def test_another_benchmarks_result_is_refused_as_such(tmp_path, capsys):
    a = _tasks_part(tmp_path, "a", [_rec("full", 0)])
    needle = json.loads(a.read_text()) | {"benchmark": "needle"}  # a bench_needle result has records and prompts
    nd = tmp_path / "nd.json"
    nd.write_text(json.dumps(needle))
    for files in ([nd], [a, nd]):
        usage_error(capsys, bt.parse_args, ["--merge", *map(str, files), "--out", str(tmp_path / "m.json")],
                     f"--merge {nd} is a result of bench_needle.py, not of bench_tasks.py")
    usage_error(capsys, bench_latency.parse_args, ["--merge", str(a), "--out", str(tmp_path / "m.json")],
                 f"--merge {a} is a result of bench_tasks.py, not of bench_latency.py")
    usage_error(capsys, bench_step_ops.main, ["--render", str(a)],
                 f"--render {a} is a result of bench_tasks.py, not of bench_step_ops.py")


def _edited(tmp_path, path, name, edit):
    data = json.loads(path.read_text())
    edit(data)
    out = tmp_path / name
    out.write_text(json.dumps(data))
    return out


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["config"].pop("combos"), "its 'config' has no 'combos'"),
    (lambda d: d.update(records={"a": 1}), "its 'records' is a JSON object, not a list of objects"),
    (lambda d: d.update(records=[1]), "its records[0] is a JSON number, not an object"),
    (lambda d: d["records"][0].pop("label"), "its records[0] has no 'label'"),
    (lambda d: d.update(prompts=[{}]), "its prompts[0] has no 'task', 'haystack', 'length', 'seed'"),
    (lambda d: d.pop("benchmark"), "(it has no 'benchmark')"),
], ids=["no combos", "records a dict", "record a number", "record without label", "empty prompt", "no benchmark"])
def test_tasks_merge_of_a_malformed_result_is_a_usage_error(tmp_path, capsys, edit, message):
    a = _tasks_part(tmp_path, "a", [_rec("full", 0)])
    bad = _edited(tmp_path, _tasks_part(tmp_path, "b", [_rec("full", 1)]), "bad.json", edit)
    usage_error(capsys, bt.parse_args, ["--merge", str(a), str(bad), "--out", str(tmp_path / "m.json")],
                 f"--merge {bad} is not a ", message, "give a JSON file that bench_tasks.py wrote")


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["config"].pop("real_lengths"), "its 'config' has no 'real_lengths'"),
    (lambda d: d["runs"][0].pop("decode"), "its runs[0] has no 'decode'"),
    (lambda d: d.update(lengths="256"), "its 'lengths' is a JSON string, not a list of objects"),
], ids=["no real_lengths", "run without decode", "lengths a string"])
def test_latency_merge_of_a_malformed_result_is_a_usage_error(tmp_path, capsys, edit, message):
    bad = _edited(tmp_path, _lat_part(tmp_path, "a", 256), "bad.json", edit)
    usage_error(capsys, bench_latency.parse_args, ["--merge", str(bad), "--out", str(tmp_path / "m.json")],
                 f"--merge {bad} is not a complete result file of bench_latency.py ({message})")


def test_step_ops_render_of_a_malformed_result_is_a_usage_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_step_ops, "run", lambda *a: pytest.fail("compiled for a file to render"))
    base = {"benchmark": "bench_step_ops", "config": {}, "rows": [], "errors": [], "targets": {}, "total_seconds": 1}
    cases = [({"rows": [{}]}, "its rows[0] has no 'length', 'policy'"),
             ({"errors": {}}, "its 'errors' is a JSON object, not a list of objects"),
             ({"targets": {"snapkv@1024": {"ratio": 1.0}}}, "its targets['snapkv@1024'] has no 'limit', 'met'")]
    for i, (change, message) in enumerate(cases):
        path = tmp_path / f"so{i}.json"
        path.write_text(json.dumps({**base, **change}))
        usage_error(capsys, bench_step_ops.main, ["--render", str(path)],
                     f"--render {path} is not a complete result file of bench_step_ops.py (", message)
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps(base))
    assert bench_step_ops.main(["--render", str(ok)]) == 0  # its tables need nothing more
    capsys.readouterr()
    results = tmp_path / "RESULTS.md"  # its section needs the header and the config it names
    usage_error(capsys, bench_step_ops.main, ["--render", str(ok), "--write-results", "--results-file", str(results)],
                 "(it has no 'command', 'git', 'machine', 'peak_rss_bytes')")
    assert not results.exists()
