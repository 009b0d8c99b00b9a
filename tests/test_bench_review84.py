"""Benchmark defects of review 84, each fixed: a policy named in another case ('HeteroCache') found as HeteroCache
(its synthetic profile, its targets and weights; it crashed bench_latency after measuring, and lost what it had
measured); counts of zero refused before any work (bench_kernels' iterations, profile_step's steps); the GPU
script writes no more files under $OUT than a lent machine returns. No benchmark runs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_kernels  # noqa: E402
import bench_multiturn  # noqa: E402
import bench_tasks  # noqa: E402
import profile_step  # noqa: E402
import step_ops_policies  # noqa: E402
import step_ops_report  # noqa: E402
from harness import synthetic  # noqa: E402
from harness.args import policy_spec  # noqa: E402
from bench_cases import usage_error  # noqa: E402


def _boom(*a, **k):
    raise AssertionError("work started for arguments that should have been refused")


@pytest.mark.parametrize("spec, want", [("HeteroCache", "heterocache"), ("Hetero-Cache:copy_window=16",
                                                                            "heterocache:copy_window=16"),
                                        ("FULL", "full"), ("quest:offload=true", "quest:offload=true")])
def test_policy_specs_come_back_under_their_registry_name(spec, want):
    assert policy_spec(spec) == want
    assert step_ops_policies.parse_spec(spec + "@0.25", 0.5) == (want, 0.25)


def test_a_heterocache_named_in_another_case_gets_the_synthetic_profile(monkeypatch):
    import hetero_jax.policies as P

    made = []
    monkeypatch.setattr(P, "make_policy", lambda name, budget=None, **kw: made.append((name, budget, kw)))
    prof = object()
    synthetic.make_policies([("HeteroCache", 0.3), ("Full", 0.3), ("snapkv", 0.3)], prof)
    assert made == [("HeteroCache", 0.3, {"profile": prof}), ("Full", None, {}), ("snapkv", 0.3, {})]


def test_heterocache_in_another_case_is_judged_and_weighed_as_heterocache():
    rows = [{"policy": p, "length": 64, "kernels_vs_full": 1.3} for p in ("HeteroCache", "heterocache", "snapkv")]
    limits = {k: v["limit"] for k, v in step_ops_report.target_check(rows).items()}
    assert limits == {"HeteroCache@64": step_ops_report.HETERO_TARGET, "heterocache@64": step_ops_report.HETERO_TARGET,
                      "snapkv@64": step_ops_report.POLICY_TARGET}
    preset = dict(bench_tasks.PRESETS["cpu"])
    lower = bench_tasks.estimate_minutes({**preset, "policies": ["full", "heterocache"]})
    assert bench_tasks.estimate_minutes({**preset, "policies": ["full", "HeteroCache"]}) == lower
    # a HeteroCache variant is weighed as HeteroCache, not as a baseline (review 88)
    preset = dict(bench_multiturn.PRESETS["cpu"], policies=["full", "snapkv", "heterocache"])
    plain = bench_multiturn.estimate_minutes(preset)
    assert bench_multiturn.estimate_minutes({**preset, "policies": ["full", "snapkv", "heterocache:tau_drift=-100"]}) \
        == plain


@pytest.mark.parametrize("flag", ["--drift-iters", "--gpu-iters"])
def test_bench_kernels_refuses_zero_timed_calls_before_any_work(capsys, monkeypatch, tmp_path, flag):
    monkeypatch.setattr(bench_kernels, "drift_timing_main", _boom)
    monkeypatch.setattr(bench_kernels, "sweep_main", _boom)
    usage_error(capsys, bench_kernels.main, ["--drift-timing", flag, "0", "--out", str(tmp_path / "k.json")],
                flag, "at least 1")


@pytest.mark.parametrize("flag, value", [("--steps", "0"), ("--warmup", "-1"), ("--top", "0")])
def test_profile_step_refuses_bad_counts_before_loading(capsys, monkeypatch, tmp_path, flag, value):
    monkeypatch.setattr(profile_step, "step_setup", _boom)
    usage_error(capsys, profile_step.main, [flag, value, "--out", str(tmp_path / "p.json")], flag)


def test_the_gpu_script_writes_at_most_eight_files_under_out():
    """A lent machine returns 8 files; the kernel sweep wrote a ninth beside its --out (kernels-sweep.json)."""
    script = (BENCH / "gpu_session.sh").read_text()
    outs = set(re.findall(r'"\$OUT/([^"]+)"', script))
    sweep = [line for line in script.splitlines() if "bench_kernels.py --sweep" in line]
    assert sweep and all("$OUT/" not in line for line in sweep)  # its JSON stays with the plots
    assert "log.txt" in outs and len(outs) <= 8, sorted(outs)
