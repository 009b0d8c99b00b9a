"""benchmarks/gpu_session.sh: its dry run on this CPU (every stage at tiny shapes, each writing its JSON), and
its refusal to start a GPU run without the authors' profile it needs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"


def _run(tmp_path, *args, **env):
    full = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "BUDGET_S": "540", **env}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_dry_run_writes_each_stage_json(tmp_path):
    r = _run(tmp_path, "--dry-run")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / "out"
    log = (out / "log.txt").read_text()
    assert "=== done" in log and "rc=0" in log and "rc=1" not in log
    # FreeKV's stage leaves its JSON on the machine (8 files come back at most) and its table in the log
    assert "=== latency 32768, FreeKV: rc=0" in log
    freekv_stage = log.split("=== latency 32768, FreeKV")[1]  # from its start line to its rc line
    assert "| 256 | real | full | — | 1.000 |" in freekv_stage and "| 256 | real | freekv | 0.5 |" in freekv_stage
    lat = json.loads((out / "lat-32768.json").read_text())
    assert [r["policy"] for r in lat["runs"]] == ["full", "heterocache"]
    assert all(r["decode"]["n"] == 4 and "decode_plain" in r for r in lat["runs"])
    off = json.loads((out / "offload.json").read_text())["result"]
    assert off["rows"] and all(x["rows_correct"] for x in off["rows"]) and off["overlap"] is not None
    assert off["d2h"] and all(0 < x["first_seconds"] and 0 < x["seconds"] for x in off["d2h"])
    prof = json.loads((out / "profile-32k.json").read_text())
    assert [r["policy"] for r in prof["rows"]] == ["full", "heterocache"]
    assert all(r["steps"] == 2 and r["kernels_per_step"] > 0 for r in prof["rows"])
    pipe = json.loads((out / "pipeline.json").read_text())
    assert [r["policy"] for r in pipe["rows"]] == ["full", "heterocache"]
    assert all(r["summary"][m]["n"] == 2 for r in pipe["rows"] for m in ("one at a time", "pipelined"))
    assert sorted(p.name for p in out.iterdir()) == ["lat-32768.json", "log.txt", "offload.json", "pipeline.json",
                                                     "profile-32k.json"]


def test_gpu_run_without_the_profile_stops_before_any_stage(tmp_path):
    (tmp_path / "empty").mkdir()
    r = _run(tmp_path, HETERO_JAX_REFERENCE_DIR=str(tmp_path / "empty"))
    assert r.returncode == 2
    assert "make gpu-bundle" in r.stderr and "carry .gpuref" in r.stderr
    assert not (tmp_path / "out").exists()
