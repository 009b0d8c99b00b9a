"""bench_task_margins: full KV's greedy answer fed to every policy in lockstep, its margins, and where a policy
parts from it (hand-computed cases on fake engines)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_task_margins as btm  # noqa: E402
from harness import task_cases as tc  # noqa: E402

V = 5
EOS = 4


class _Engine:
    """``logits`` [1, V] after prefill; ``step_with_logits`` returns the next row of ``rows`` and records the fed
    token (what ``Engine`` does for one sequence)."""

    def __init__(self, first, rows):
        self.logits = np.asarray(first, np.float32)[None]
        self.rows, self.fed = rows, []

    def step_with_logits(self, tokens, temperature=0.0, top_p=1.0):
        row = np.asarray(self.rows[len(self.fed)], np.float32)
        self.fed.append(int(tokens[0]))
        return np.array([int(np.argmax(row))]), row[None]


def _logits(p):
    """Logits whose softmax is ``p`` (a probability vector)."""
    return np.log(np.asarray(p, np.float64))


def test_lockstep_feeds_full_kvs_tokens_and_records_margins_and_partings():
    full_p = [[0.1, 0.6, 0.2, 0.05, 0.05],  # token 1, margin 0.4, second 2
              [0.45, 0.05, 0.4, 0.05, 0.05],  # token 0, margin 0.05, second 2
              [0.05, 0.05, 0.1, 0.7, 0.1],  # token 3, margin 0.6, second 2 (ties with EOS broken by index)
              [0.05, 0.05, 0.05, 0.05, 0.8]]  # EOS: a last record, not part of the reply
    other_p = [[0.1, 0.6, 0.2, 0.05, 0.05],  # agrees
               [0.3, 0.05, 0.55, 0.05, 0.05],  # takes full KV's second choice (2) at margin 0.05
               [0.5, 0.05, 0.1, 0.3, 0.05],  # takes 0: not full KV's second choice
               [0.05, 0.05, 0.05, 0.05, 0.8]]
    full = _Engine(_logits(full_p[0]), [_logits(p) for p in full_p[1:]])
    other = _Engine(_logits(other_p[0]), [_logits(p) for p in other_p[1:]])
    steps = tc.lockstep_margins([full, other], max_new=10, eos={EOS})
    assert [s["token"] for s in steps] == [1, 0, 3, EOS]
    assert [s.get("eos", False) for s in steps] == [False, False, False, True]
    assert full.fed == other.fed == [1, 0, 3]  # both fed full KV's tokens, the EOS step not stepped past
    assert [s["margin"] for s in steps] == pytest.approx([0.4, 0.05, 0.6, 0.75], abs=1e-6)
    assert [s["p1"] for s in steps] == pytest.approx([0.6, 0.45, 0.7, 0.8], abs=1e-6)
    assert [s["second"] for s in steps] == [2, 2, 2, 0]
    assert [s["top1"] for s in steps] == [[1], [2], [0], [EOS]]
    part = tc.parting(steps, 0)
    assert part["step"] == 1 and part["second_choice"] is True
    assert part["margin"] == pytest.approx(0.05, abs=1e-6)


def test_a_policy_that_goes_on_where_full_kv_stops_parts_at_the_eos_step():
    full_p = [[0.1, 0.6, 0.2, 0.05, 0.05], [0.05, 0.05, 0.05, 0.05, 0.8]]  # token 1, then EOS (margin 0.75)
    other_p = [[0.1, 0.6, 0.2, 0.05, 0.05], [0.05, 0.05, 0.7, 0.1, 0.1]]  # agrees, then goes on with 2
    eos2 = [[0.1, 0.6, 0.2, 0.05, 0.05], [0.05, 0.05, 0.05, 0.8, 0.05]]  # stops at the other EOS id 3
    engines = [_Engine(_logits(p[0]), [_logits(p[1])]) for p in (full_p, other_p, eos2)]
    steps = tc.lockstep_margins(engines, max_new=10, eos={3, EOS})
    assert [s["token"] for s in steps] == [1, EOS] and steps[-1]["top1"] == [2, EOS]
    part = tc.parting(steps, 0)
    assert part["step"] == 1 and part["margin"] == pytest.approx(0.75, abs=1e-6)
    assert tc.parting(steps, 1) is None


def test_lockstep_stops_after_max_new_and_parting_is_none_when_every_step_agrees():
    p = _logits([0.7, 0.1, 0.1, 0.05, 0.05])
    full, same = _Engine(p, [p] * 5), _Engine(p, [p] * 5)
    steps = tc.lockstep_margins([full, same], max_new=3, eos={EOS})
    assert len(steps) == 3 and full.fed == [0, 0]  # the third token needs no step after it
    assert tc.parting(steps, 0) is None


def _record(label, margins, agree, part):
    return {"task": "multi-fact", "haystack": "pydoc", "length": 2000, "seed": 100, "label": label,
            "margins": margins, "agree": agree, "parting": part}


def test_summarize_bins_steps_by_full_kvs_margin():
    recs = [_record("hc@0.3", [0.05, 0.2, 0.3, 0.9], [False, True, True, True],
                    {"step": 0, "margin": 0.05, "second_choice": True}),
            _record("hc@0.3", [0.6, 0.1], [True, False], {"step": 1, "margin": 0.3, "second_choice": False}),
            _record("hc@0.3", [0.99], [True], None)]
    (s,) = btm.summarize(recs)
    # bins [0, 0.1), [0.1, 0.25), [0.25, 0.5), [0.5, 1]: 0.1 falls in the second
    assert s["bins"] == [[0, 1], [1, 2], [1, 1], [3, 3]]
    assert (s["cases"], s["parted"], s["near_tie"], s["second_choice"]) == (3, 2, 1, 1)
    assert s["median_margin"] == pytest.approx(0.175) and s["max_margin"] == pytest.approx(0.3)
    table = btm.parting_table([s])
    assert "| hc@0.3 | 2/3 | 1/2 | 1/2 | 0.175 | 0.300 |" in table
    assert "| hc@0.3 | 0/1 | 1/2 | 1/1 | 3/3 | 5/7 |" in btm.agreement_table([s])


def test_a_policy_list_without_a_compressed_policy_is_refused(capsys):
    with pytest.raises(SystemExit):
        btm.parse_args(["--policies", "full", "--out", "/tmp/x-task-margins.json"])
    assert "at least one policy besides full KV" in capsys.readouterr().err


def test_presets_run_only_tasks_that_generate_answers():
    for preset in btm.PRESETS.values():
        assert set(preset["tasks"]) <= set(btm.ANSWER_TASKS) and "fidelity" not in preset["tasks"]
        assert btm.estimate_minutes(preset) > 0
