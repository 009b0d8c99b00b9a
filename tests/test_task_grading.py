"""How bench_tasks grades and counts: multi-fact by (thing, value) pairs, variable tracking with its distractors,
multi-fact's reply cap, number matching, full KV's solve rate on each row's own cases, and the case hash that
--merge and --resume check. Hand-made replies and records against hand-computed scores; no model weights (the cap
test uses SmolLM2's tokenizer alone)."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_tasks as bt  # noqa: E402
from harness import task_cases as tc  # noqa: E402
from harness.needles import answer_correct, find_answer, numbers_in  # noqa: E402

# make_case("multi-fact", 1) as the review found it: asked in this order, the prefix names the opera
THINGS = ("opera", "cable car", "ferry", "museum")
VALUES = ("9669", "3855", "3639", "8410")
S = " The ticket number for the {} is {}."


def _reply(pairs, first=None, sep=" "):
    """The reply after the answer prefix: the first thing's value, then a sentence per (thing, value)."""
    return f" {first}." + "".join(sep + S.format(t, v).lstrip() for t, v in pairs)


# --------------------------------------------------------------- multi-fact
@pytest.mark.parametrize("reply, right, wrong", [
    # every pair right, in the asked order, blank lines between
    (_reply(zip(THINGS[1:], VALUES[1:]), VALUES[0], "\n\n"), 4, 0),
    # every stated pair wrong although the numbers come in the asked order (the old grader gave 0.75)
    (_reply([("cable car", "3639"), ("ferry", "8410")], "3855"), 0, 3),
    # full KV's published reply (RESULTS tasks, stdlib-docs 4K seed 1): opera, cable car and ferry all wrong
    (" 3855. The ticket number for the cable car is 3639. The ticket number for the ferry is 3855. The ticket "
     "number for the m", 0, 3),
    # every pair right, the later things in reverse order (the old grader gave 0.5)
    (_reply([("museum", "8410"), ("ferry", "3639"), ("cable car", "3855")], "9669"), 4, 0),
    # the opera's value repeated under the cable car: the cable car is wrong, the rest right
    (_reply([("cable car", "9669"), ("ferry", "3639"), ("museum", "8410")], "9669"), 3, 1),
    # the ferry stated twice with two values: it earns nothing
    (_reply([("cable car", "3855"), ("ferry", "3639"), ("museum", "8410"), ("ferry", "3855")], "9669"), 3, 1),
    # the ferry stated twice with its own value: no conflict
    (_reply([("ferry", "3639"), ("ferry", "3639")], "9669"), 2, 0),
    # a list without the things' names states only the first thing's value
    (" 9669, 3855, 3639 and 8410.", 1, 0),
    # case, extra spaces and thousands separators do not matter; a plural name is still the thing
    (" 9,669. THE CABLE  CAR is 3 855; the museums: 8410", 3, 0),
    # a value written as part of a longer number is not stated
    (" 96690. The ticket number for the ferry is 3639", 1, 1),
    # a right reply followed by a 3-digit number (digit groups join only as a thousands grouping)
    (_reply(zip(THINGS[1:], VALUES[1:]), VALUES[0]) + " 100", 4, 0),
    # a name written with a hyphen or underscore is still the thing (review 92: its value was lost)
    (" 9669. The cable-car is 3855. The ferry is 3639. The museum is 8410.", 4, 0),
    (" 9669. cable_car: 3855", 2, 0),
    ("", 0, 0),
])
def test_multi_fact_grades_each_thing_by_the_value_stated_for_it(reply, right, wrong):
    g = tc.grade_pairs(reply, THINGS, VALUES)
    assert (g["found"], g["wrong"], g["n"]) == (right, wrong, 4)
    assert g["score"] == right / 4


def test_multi_fact_cases_carry_their_things_and_grade_by_pairs():
    for seed in range(6):
        c = tc.make_case("multi-fact", seed)
        # the things in the needles, in depth order, are the ones asked, and the prefix names the first
        assert c.things == tuple(s.split("for the ")[1].split(" is")[0] for _, s in c.needles)
        assert c.answer_prefix == f"The ticket number for the {c.things[0]} is"
        shifted = _reply(zip(c.things[1:], c.values[2:]), c.values[1])  # each thing given the next one's value
        assert tc.grade(c, shifted)["score"] == 0.0
        backwards = _reply(reversed(list(zip(c.things[1:], c.values[1:]))), c.values[0])
        assert tc.grade(c, backwards)["score"] == 1.0
    with pytest.raises(ValueError, match="one number per thing"):
        tc.grade_pairs("x", ("ferry",), ("1234", "5678"))


def test_multi_fact_reply_cap_holds_a_complete_reply_with_blank_lines(tokenizer):
    """The complete reference reply with '\\n\\n' between its sentences fits max_new_tokens (the old 12 a value cut
    its last value: 52-53 of 48 tokens), with the rest of the reply still graded whole."""
    for seed in range(50):
        c = tc.make_case("multi-fact", seed)
        reply = _reply(zip(c.things[1:], c.values[1:]), c.values[0], "\n\n")
        ids = tokenizer.encode(reply, add_special_tokens=False)
        assert len(ids) <= c.max_new_tokens, (seed, len(ids), c.max_new_tokens)
        assert tc.grade(c, tokenizer.decode(ids[:c.max_new_tokens]))["score"] == 1.0


# -------------------------------------------------------- variable tracking
@pytest.mark.parametrize("seed", range(10))
def test_a_variable_tracking_reply_naming_every_variable_scores_nothing(seed):
    c = tc.make_case("variable-tracking", seed)
    names = [*c.values, *c.distractors]
    assert tc.grade(c, " " + ", VAR ".join(names))["score"] == 0.0  # the old grader gave 2/3
    assert tc.grade(c, " " + ", VAR ".join(c.values))["score"] == 1.0
    assert tc.grade(c, " " + ", VAR ".join(c.values[:2]))["score"] == pytest.approx(2 / 3)
    assert tc.grade(c, f" {c.values[0]} and VAR {c.distractors[0]}")["score"] == 0.0


def test_grading_text_states_the_rules():
    assert "order not graded" in bt.GRADING["multi-fact"] and "another thing" in bt.GRADING["multi-fact"]
    assert "0 when any distractor" in bt.GRADING["variable-tracking"]


# ------------------------------------------------------------ number matching
@pytest.mark.parametrize("text, answer, where", [
    ("ticket 1732 123", "1732", [7]),  # the old join made it 1732123
    ("48,213", "48213", [0]),
    ("48 213", "48213", [0]),
    ("48\u202f213 and 12,345,678", "12345678", [11]),
    ("The number is 48213 500", "48213", [14]),
    ("48,213 500", "48213", [0]),  # one separator throughout a grouping
    ("48 2130", "48213", []),
    ("482130", "48213", []),
    ("1 2345", "12345", []),  # a group is exactly 3 digits
])
def test_find_answer_joins_only_thousands_groupings(text, answer, where):
    assert find_answer(text, answer) == where
    assert answer_correct(text, answer) is bool(where)


def test_numbers_in_reads_each_number_once():
    assert numbers_in("1732 123, 9,302 and 7 720.") == [(0, "1732"), (5, "123"), (10, "9302"), (20, "7720")]


# ---------------------------------------------------- full KV on the same cases
def _rec(label, length, seed, score):
    policy = label.partition("@")[0]
    return {"task": "multi-key", "label": label, "policy": policy, "rho": 1.0 if policy == "full" else 0.3,
            "haystack": "pydoc", "length": length, "seed": seed, "score": score, "n": 1, "found": int(score),
            "solved": score == 1.0, "achieved_rho": 1.0, "recall": {}}


def test_full_kv_solves_is_counted_on_each_rows_own_cases():
    """SnapKV refused at 4K: its row compares with full KV's 2K cases only (full solves 2/2 there, 0/2 at 4K)."""
    recs = [_rec("full", 2000, 0, 1.0), _rec("full", 2000, 1, 1.0), _rec("full", 4000, 0, 0.0),
            _rec("full", 4000, 1, 0.0), _rec("snapkv@0.3", 2000, 0, 1.0), _rec("snapkv@0.3", 2000, 1, 1.0)]
    full, snap = bt.summarize(recs, ["full", "snapkv@0.3"], ["multi-key"])
    assert (full["full_solved"], full["full_cases"]) == (2, 4)
    assert (snap["full_solved"], snap["full_cases"]) == (2, 2)  # was 2/4, as if SnapKV doubled full KV
    table = bt.results_table({"summary": [full, snap]})
    assert "| multi-key | snapkv | 0.3 | 1.000 | 100 % | 2/2 cases | 2/2 | 0 / 0 | 2/2 (100 %) | — |" in table
    assert "full KV solves (these cases)" in table


# ------------------------------------------------------------------ case hash
def test_case_sha256_is_the_hash_of_the_generated_case():
    c = tc.make_case("multi-fact", 3)
    want = hashlib.sha256(json.dumps(dataclasses.asdict(c), sort_keys=True).encode()).hexdigest()
    assert tc.case_sha256(c) == want != tc.case_sha256(tc.make_case("multi-fact", 4))


def _part(tmp_path, name, recs):
    config = {"model": "smollm2-135m", "dtype": "float32", "digits": 4, "grading": bt.GRADING, "tasks": ["multi-key"],
              "lengths": [2000], "seeds": sorted({r["seed"] for r in recs}), "haystacks": ["pydoc"],
              "combos": list(dict.fromkeys(r["label"] for r in recs)), "skipped": {}, "smallest_budgets": {}}
    payload = {"config": config, "records": recs, "prompts": [
        {"task": r["task"], "haystack": r["haystack"], "length": r["length"], "seed": r["seed"]}
        for r in recs if r["label"] == "full"], "git": {"commit": name}, "command": f"run {name}", "timestamp": "t",
        "load_seconds": 1.0, "machine": {"cpu": "x"}, "total_seconds": 1.0, "peak_rss_bytes": 1}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(payload))
    return path


def _hashed(label, seed, sha=None):
    r = {**_rec(label, 2000, seed, 1.0), "prompt_sha256": f"p{seed}", "text": " 1.", "values": ["1"]}
    r["case_sha256"] = sha or tc.case_sha256(tc.make_case("multi-key", seed))
    return r


def test_merge_and_resume_refuse_a_case_the_generator_no_longer_makes(tmp_path, capsys):
    def merge(*paths):
        return bt.merge(argparse.Namespace(merge=list(paths), out=tmp_path / "m.json", plot=tmp_path / "m.png"),
                        "tasks")

    good = _part(tmp_path, "good", [_hashed("full", 0), _hashed("snapkv@0.3", 0)])
    other = _part(tmp_path, "other", [_hashed("full", 1, sha="0" * 64)])  # another generator's seed 1
    with pytest.raises(SystemExit, match=r"other.json: full on multi-key seed 1 graded another case \(case_sha256 "
                                         r"000000000000\) than this code generates"):
        merge(good, other)
    old = _part(tmp_path, "old", [{k: v for k, v in _hashed("full", 2).items() if k != "case_sha256"}])
    m = merge(good, old)  # a run from before the hash: merged, named
    assert len(m["records"]) == 3 and m["config"]["unchecked_cases"] == [str(old)]
    assert "old.json recorded no case hashes" in capsys.readouterr().err
    assert "old.json recorded no case hashes" in bt.results_section(m, None)
    assert merge(good)["config"]["unchecked_cases"] == []

    partial = tmp_path / "run.partial.json"
    partial.write_text(other.read_text())
    cfg = json.loads(other.read_text())["config"]
    with pytest.raises(SystemExit, match="--resume: .*run.partial.json: full on multi-key seed 1 graded another"):
        bt.resume_payload(partial, cfg)
    partial.write_text(good.read_text())
    assert bt.resume_payload(partial, json.loads(good.read_text())["config"])["records"][0]["seed"] == 0
    # the same haystack names over another text (a package's licence upgraded since the run): refused as --merge
    # refuses it (review 92: the resumed run mixed prompts of two texts)
    moved = json.loads(good.read_text())["config"]
    moved["haystack_sources"] = {"pydoc": {"sha256": "f" * 64}}
    with pytest.raises(SystemExit, match=r"--resume: .*run.partial.json was run with another haystack text"):
        bt.resume_payload(partial, moved)
