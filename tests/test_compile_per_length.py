"""benchmarks/compile_per_length.py: bad arguments refused before the model loads; on a tiny checkpoint, a length
seen before compiles nothing and the JSON carries its config and one figure per length and policy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import compile_per_length  # noqa: E402
from bench_cases import usage_error  # noqa: E402


@pytest.mark.parametrize("flags, needle", [(["--budget", "0"], "--budget 0.0 must lie in (0, 1]"),
                                           (["--lengths", "1"], "--lengths must be >= 2"),
                                           (["--new-tokens", "0"], "--new-tokens >= 1"),
                                           (["--policies", "nope"], "nope")])
def test_bad_arguments_are_refused_before_loading(capsys, monkeypatch, tmp_path, flags, needle):
    import hetero_jax

    monkeypatch.setattr(hetero_jax, "load", lambda *a, **k: pytest.fail("loaded for refused arguments"))
    usage_error(capsys, compile_per_length.main, ["--out", str(tmp_path / "c.json"), *flags], needle)


def test_a_length_seen_before_compiles_nothing(tiny_checkpoint, tmp_path):
    out = tmp_path / "c.json"
    assert compile_per_length.main(["--model", tiny_checkpoint("llama")[1], "--policies", "full", "quest:full_layers=1",
                                    "--lengths", "40", "40", "--new-tokens", "3", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["config"]["lengths"] == [40, 40]
    assert [r["policy"] for r in got["rows"]] == ["full", "quest:full_layers=1"]
    for row in got["rows"]:
        first, again = row["compile_seconds"]
        assert again == 0.0 and first >= 0.0


def test_a_policy_the_model_cannot_run_is_refused_before_any_generation(tiny_checkpoint, tmp_path, capsys,
                                                                       monkeypatch):
    import hetero_jax

    monkeypatch.setattr(hetero_jax, "generate", lambda *a, **k: pytest.fail("generated for a refused policy"))
    usage_error(capsys, compile_per_length.main, ["--model", tiny_checkpoint("llama")[1], "--policies", "quest",
                                                  "--out", str(tmp_path / "c.json")],
                "--policies quest: Quest: full_layers=2 leaves no layer")


def test_an_out_that_is_not_ours_is_refused_before_loading(capsys, monkeypatch, tmp_path):
    import hetero_jax

    monkeypatch.setattr(hetero_jax, "load", lambda *a, **k: pytest.fail("loaded with an --out it may not write"))
    mine = tmp_path / "notes.json"
    mine.write_text('{"mine": true}')
    usage_error(capsys, compile_per_length.main, ["--out", str(mine)], "--out")
    assert mine.read_text() == '{"mine": true}'
