"""Pure parts of benchmarks/bench_tasks.py and benchmarks/harness/task_cases.py (the generated task suite): generators, prompts, graders, summaries.

No model weights: the prompt tests use SmolLM2's tokenizer alone (conftest's ``tokenizer`` fixture)."""

from __future__ import annotations

import hashlib
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_tasks as bt  # noqa: E402
from harness import task_cases as tc  # noqa: E402  (bench_tasks' cases, graders, prompts)
import haystack  # noqa: E402

SEEDS = [0, 1, 2, 7]


# ---------------------------------------------------------------- generators
@pytest.mark.parametrize("task", tc.TASKS)
def test_cases_are_deterministic_per_seed_and_differ_between_seeds(task):
    cases = [tc.make_case(task, s) for s in SEEDS]
    assert cases == [tc.make_case(task, s) for s in SEEDS]
    assert len({c.values for c in cases}) == len(SEEDS)
    for c in cases:
        assert c.task == task and c.needles == tuple(sorted(c.needles))
        assert all(0.0 <= d <= 1.0 for d, _ in c.needles)


def test_unknown_task_is_refused():
    with pytest.raises(ValueError, match="unknown task"):
        tc.make_case("summary", 0)


@pytest.mark.parametrize("seed", SEEDS)
def test_multi_fact_places_each_value_once_in_depth_order(seed):
    c = tc.make_case("multi-fact", seed)
    assert 3 <= len(c.values) <= 5 and len(set(c.values)) == len(c.values)
    assert [d for d, _ in c.needles] == tc.spread_depths(len(c.values))
    for (_, sentence), v in zip(c.needles, c.values):
        assert sentence.endswith(f" is {v}.")
        assert re.fullmatch(r"\d{%d}" % tc.DIGITS, v)
    # the question names the things in depth order; the reply prefix names the first
    things = [s.split("for the ")[1].split(" is ")[0] for _, s in c.needles]
    assert [c.question.index(t) for t in things] == sorted(c.question.index(t) for t in things)
    assert c.answer_prefix.endswith(f"for the {things[0]} is")


@pytest.mark.parametrize("seed", SEEDS)
def test_fidelity_quotes_3_to_5_facts_in_depth_order(seed):
    c = tc.make_case("fidelity", seed)
    assert 3 <= len(c.values) <= 5
    assert c.forced.startswith(c.answer_prefix)
    offsets = [c.forced.index(v) for v in c.values]
    assert offsets == sorted(offsets)
    assert {tc.make_fidelity(s).values.__len__() for s in range(3)} == {3, 4, 5}


@pytest.mark.parametrize("seed", SEEDS)
def test_variable_tracking_chains(seed):
    c = tc.make_case("variable-tracking", seed)
    value = re.search(r"value (\d+)", c.question).group(1)
    sentences = [s for _, s in c.needles]
    chain, wrong = list(c.values), list(c.distractors)
    assert wrong and not set(chain) & set(wrong)
    # the asked chain: its first name is bound to the value, each next one to the previous, in depth order
    at = [next(i for i, s in enumerate(sentences) if s.startswith(f"VAR {n} =")) for n in chain]
    assert at == sorted(at)
    assert sentences[at[0]] == f"VAR {chain[0]} = {value}."
    for a, b, i in zip(chain, chain[1:], at[1:]):
        assert sentences[i] == f"VAR {b} = VAR {a}."
    # the distractor chain starts from another number
    first = next(s for s in sentences if s.startswith(f"VAR {wrong[0]} ="))
    other = re.fullmatch(rf"VAR {wrong[0]} = (\d+)\.", first).group(1)
    assert other != value
    # no name is a word of any haystack, nor one of the worked example's
    for n in chain + wrong:
        assert n not in tc.VT_INSTRUCTION
        assert not any(re.search(rf"\b{n}\b", haystack.haystack_corpus(h), re.I) for h in haystack.HAYSTACKS)


@pytest.mark.parametrize("seed", SEEDS)
def test_multi_key_distractors_differ_from_the_asked_key(seed):
    c = tc.make_case("multi-key", seed)
    asked = re.search(r"number for (\w+)\?", c.question).group(1)
    keys = [re.search(r"number for (\w+) is", s).group(1) for _, s in c.needles]
    assert len(keys) == len(set(keys)) >= 3 and keys.count(asked) == 1
    asked_sentence = next(s for _, s in c.needles if f" for {asked} " in s)
    assert asked_sentence.endswith(f" is {c.values[0]}.")
    assert len(c.distractors) == len(keys) - 1 and c.values[0] not in c.distractors
    for _, s in c.needles:
        if s != asked_sentence:
            assert asked not in s and any(s.endswith(f" is {v}.") for v in c.distractors)
    assert set(keys) <= set(haystack.ANSWER_WORDS)  # no haystack contains a key


@pytest.mark.parametrize("seed", SEEDS)
def test_span_copy_sentence_follows_the_marker(seed):
    c = tc.make_case("span-copy", seed)
    ((depth, sentence),) = c.needles
    assert sentence == f"{tc.SPAN_MARKER} {c.values[0]}" and tc.SPAN_MARKER in c.question
    assert c.answer_prefix == tc.SPAN_MARKER and 0.0 < depth < 1.0


def test_generated_numbers_are_absent_from_every_haystack():
    for task in tc.TASKS:
        for s in SEEDS:
            c = tc.make_case(task, s)
            for v in [*c.values, *c.distractors]:
                if v.isdigit():
                    assert not any(re.search(rf"(?<!\d){v}(?!\d)", haystack.haystack_corpus(h))
                                   for h in haystack.HAYSTACKS)


def test_spread_depths():
    assert tc.spread_depths(1) == [0.5]
    assert tc.spread_depths(3) == [0.1, 0.5, 0.9]
    with pytest.raises(ValueError):
        tc.spread_depths(0)


# ------------------------------------------------------------------ prompts
@pytest.mark.parametrize("task", tc.TASKS)
@pytest.mark.parametrize("hay", list(haystack.HAYSTACKS))
def test_prompt_has_the_length_and_the_needles_at_their_depths(tokenizer, task, hay):
    case = tc.make_case(task, 1)
    p = tc.build_case_prompt(tokenizer, case, 2000, hay)
    assert p.n_tokens == len(p.ids) == 2000
    assert p.sha256 == hashlib.sha256(",".join(map(str, p.ids)).encode()).hexdigest()
    prefix = tokenizer.encode(case.answer_prefix, add_special_tokens=False)
    assert p.ids[-len(prefix):] == prefix
    text = tokenizer.decode(p.ids)
    assert text.count(case.question) == 1
    # the haystack: from the end of the instruction (or the user turn's start) to the question
    hay_start = (text.index(case.instruction) + len(case.instruction) if case.instruction
                 else text.index("user\n", text.index("Hugging Face")) + len("user\n"))
    hay_end = text.index(case.question)
    for (depth, sentence), start, got in zip(case.needles, p.needle_token_starts, p.actual_depths):
        assert tokenizer.decode(p.ids[start:start + 40]).lstrip().startswith(sentence[:20])
        assert text.count(sentence) == 1
        assert abs((text.index(sentence) - hay_start) / (hay_end - hay_start) - depth) < 0.05
        if not case.instruction:  # the haystack is nearly the whole prompt: the token depth is close too
            assert abs(got - depth) < 0.05


def test_forced_reply_quotes_each_value_as_its_own_tokens(tokenizer):
    case = tc.make_case("fidelity", 2)
    p = tc.build_case_prompt(tokenizer, case, 2000, "pydoc")
    assert tokenizer.decode(p.ids[-8:] + p.forced_ids).endswith(case.forced)
    assert [i for i, _, _ in p.quoted] == list(range(len(case.values)))
    for i, s, e in p.quoted:
        assert s >= 1 and tokenizer.decode(p.forced_ids[s:e]).strip() == case.values[i]
    assert tc.make_case("multi-key", 2) != case  # other tasks have no forced reply
    assert tc.build_case_prompt(tokenizer, tc.make_case("multi-key", 2), 2000, "pydoc").forced_ids == []


# ------------------------------------------------------------------ graders
# multi-fact's pair grading: tests/test_task_grading.py
@pytest.mark.parametrize("text, score", [
    (" NTPXX, VAR VRFLF and VAR RQWWP.", 1.0),
    (" ntpxx, vrflf, rqwwp", 1.0),
    (" RQWWP, VRFLF and NTPXX", 1.0),  # order is not graded
    (" NTPXX and VAR VRFLF.", 2 / 3),
    (" NTPXX, VRFLF, RQWWP and CVWVW", 0.0),  # naming a distractor scores nothing
    (" NTPXX and CVWVW", 0.0),
    (" NTPXX, CVWVW, NKUFP", 0.0),
    (" NTPXXY", 0.0),
    (" QQQQQ, VAR RRRRR", 0.0),
])
def test_grade_names(text, score):
    assert tc.grade_names(text, ("NTPXX", "VRFLF", "RQWWP"), ("CVWVW", "NKUFP"))["score"] == pytest.approx(score)


@pytest.mark.parametrize("text, score", [
    (" 4761.", 1.0), (" 4,761", 1.0), ("The number is 4761 for Ravi", 1.0),
    (" 4761 or 6456", 0.0),  # a distractor too
    (" 6456.", 0.0), (" 47610", 0.0), (" 476", 0.0), ("", 0.0),
])
def test_grade_key(text, score):
    assert tc.grade_key(text, "4761", ("6456", "4527", "9579"))["score"] == score


SPAN = "The golden gardener repaired the ancient lantern."


@pytest.mark.parametrize("text, score", [
    (" The golden gardener repaired the ancient lantern.\n\nThe golden", 1.0),
    ('\n\n"The golden gardener repaired the ancient lantern"', 1.0),
    ("\n\nthe  golden gardener\nrepaired the ancient lantern", 1.0),
    (" The golden gardener repaired the ancient lanterns.", 0.0),  # a changed word
    (" The golden gardener repaired the lantern.", 0.0),  # a dropped word
    (" The golden gardener repaired the very ancient lantern.", 0.0),  # an added word
    (" The gardener golden repaired the ancient lantern.", 0.0),  # order
    (" The golden gardener repaired the ancient", 0.0),  # cut short
    (" XThe golden gardener repaired the ancient lantern.", 0.0),
    # words added or changed after the last word (review 92: they passed)
    (" The golden gardener repaired the ancient lantern in the meadow.", 0.0),
    (" The golden gardener repaired the ancient lantern-keeper.", 0.0),
    (" The golden gardener repaired the ancient lantern's glass.", 0.0),
    (" The golden gardener repaired the ancient lantern, and slept.", 0.0),
    # the sentence ended by the reply's end, a closing quote or another end mark
    (" The golden gardener repaired the ancient lantern", 1.0),
    (" 'The golden gardener repaired the ancient lantern' is the sentence.", 1.0),
    (" The Golden Gardener, repaired the ancient lantern!", 1.0),
])
def test_grade_span(text, score):
    assert tc.grade_span(text, SPAN)["score"] == score


def test_grade_dispatches_per_task():
    c = tc.make_case("multi-key", 3)
    assert tc.grade(c, f" {c.values[0]}.")["score"] == 1.0
    assert tc.grade(c, f" {c.distractors[0]}.")["score"] == 0.0
    with pytest.raises(ValueError):
        tc.grade(tc.make_case("fidelity", 0), "anything")


# ----------------------------------------------------------- teacher forcing
class _FakeEngine:
    """step_with_logits returns fixed logits per step (what a policy would predict), recording the fed tokens."""

    def __init__(self, logits):
        self.logits, self.fed = logits, []

    def step_with_logits(self, tokens, temperature=0.0, top_p=1.0):
        lg = self.logits[len(self.fed)]
        self.fed.append(tokens[0])
        return np.array([int(np.argmax(lg))]), np.asarray(lg, np.float32)[None]


def test_forced_metrics_compare_only_quoted_tokens():
    V = 6
    forced = [5, 1, 2, 5, 3, 4]  # quoted: value 0 = tokens 1..2 (ids 1, 2), value 1 = token 4 (id 3)
    quoted = [(0, 1, 3), (1, 4, 5)]
    full = [np.eye(V)[forced[t + 1]] * 4.0 for t in range(len(forced) - 1)]
    other = [r.copy() for r in full]
    other[1] = np.eye(V)[0] * 4.0  # wrong top-1 at the step predicting token 2
    other[3] = full[3] * 0.5  # same top-1, flatter
    e0, e1 = _FakeEngine(full), _FakeEngine(other)
    m0, m1 = tc.forced_metrics([e0, e1], forced, quoted)
    assert e0.fed == e1.fed == forced[:-1]
    assert m1["value"] == [0, 0, 1] and m1["pos"] == [0, 1, 0]
    assert m1["agree"] == [True, False, True] and m1["true_top1"] == [True, False, True]
    assert m0["kl"] == [0.0, 0.0, 0.0] and m0["true_top1"] == [True, True, True]

    def kl(a, b):  # independent: KL(softmax a || softmax b)
        p, q = np.exp(a) / np.exp(a).sum(), np.exp(b) / np.exp(b).sum()
        return float((p * np.log(p / q)).sum())

    assert m1["kl"] == pytest.approx([0.0, kl(full[1], other[1]), kl(full[3], other[3])], rel=1e-5)
    assert len(m1["top1"]) == len(forced) - 1


# ------------------------------------------------------------------ summary
def _rec(task, label, seed, score, n=3, **kw):
    policy, _, rho = label.partition("@")
    return {"task": task, "label": label, "policy": policy, "rho": 0.2 if rho == "min" else float(rho or 1),
            "haystack": "pydoc",
            "length": 2000, "seed": seed, "score": score, "n": n, "found": round(score * n),
            "solved": score == 1.0, "achieved_rho": 1.0 if policy == "full" else 0.3, "recall": {}, **kw}


def test_summarize_hand_computed():
    recs = [_rec("multi-fact", "full", 0, 1.0), _rec("multi-fact", "full", 1, 1 / 3),
            _rec("multi-fact", "snapkv@0.3", 0, 2 / 3), _rec("multi-fact", "snapkv@0.3", 1, 2 / 3)]
    rows = bt.summarize(recs, ["full", "snapkv@0.3"], ["multi-fact"])
    full, snap = rows
    assert (full["cases"], full["solved"], full["units_right"], full["units"]) == (2, 1, 4, 6)
    assert full["score_mean"] == pytest.approx(2 / 3)
    assert (snap["solved"], snap["units_right"], snap["below_full"], snap["above_full"]) == (0, 4, 1, 1)
    assert (snap["full_solved"], snap["full_cases"]) == (1, 2)


def test_presets():
    full = bt.parse_args([])
    assert full.lengths == [2000, 4000, 7900] and len(full.seeds) >= 3
    assert full.haystacks == list(haystack.HAYSTACKS) and full.tasks == list(tc.TASKS)
    assert {"heterocache", "heterocache:tau_drift=-1", "snapkv"} <= set(full.policies)
    assert full.policies[0] == "full" and full.out.name == "tasks.json"
    cpu = bt.parse_args(["--preset", "cpu"])
    assert cpu.out.name == "tasks-cpu.json" and len(cpu.lengths) < len(full.lengths)
    assert bt.estimate_minutes(bt.PRESETS["cpu"]) <= 30
    assert bt.parse_args(["--preset", "cpu", "--lengths", "4000"]).lengths == [4000]
    with pytest.raises(SystemExit):
        bt.parse_args(["--tasks", "summary"])
    with pytest.raises(SystemExit):
        bt.parse_args(["--budgets", "0"])


def test_results_table_and_section_render_from_records():
    recs = [_rec("multi-key", "full", 0, 1.0, n=1, text=" 4761."), _rec("multi-key", "snapkv@0.3", 0, 0.0, n=1,
                                                                          text=" 6456.")]
    for r in recs:
        r["values"] = ["4761"]
    payload = {"records": recs, "summary": bt.summarize(recs, ["full", "snapkv@0.3"], ["multi-key"]),
               "config": {"combos": ["full", "snapkv@0.3"]}}
    table = bt.results_table(payload)
    assert "| multi-key | snapkv | 0.3 |" in table and "| 1/1 (100 %) |" in table
    assert bt.fidelity_table(payload) is None
    assert math.isclose(payload["summary"][1]["score_mean"], 0.0)


def test_fidelity_summary_counts_tokens():
    def fid(label, seed, agree, true_top1, kl):
        r = _rec("fidelity", label, seed, 0.0, n=len(agree))
        hits = sum(true_top1) if label == "full" else sum(agree)
        r.update(score=hits / len(agree), found=hits, solved=hits == len(agree),
                 true_top1_rate=sum(true_top1) / len(agree),
                 steps={"agree": agree, "true_top1": true_top1, "kl": kl, "value": [0] * len(agree)})
        return r

    recs = [fid("full", 0, [True] * 4, [True, True, False, True], [0.0] * 4),
            fid("full", 1, [True] * 2, [True, True], [0.0] * 2),
            fid("snapkv@0.3", 0, [True, False, True, True], [True, False, False, True], [0.0, 1.0, 0.5, 0.5]),
            fid("snapkv@0.3", 1, [True, True], [True, True], [0.0, 0.0])]
    full, snap = bt.summarize(recs, ["full", "snapkv@0.3"], ["fidelity"])
    assert (full["full_solved"], full["full_cases"]) == (5, 6)  # quoted tokens full KV predicts / quoted tokens
    assert (snap["units_right"], snap["units"], snap["tokens"]) == (5, 6, 6)
    assert snap["agreement"] == pytest.approx(5 / 6) and snap["kl_mean"] == pytest.approx(2.0 / 6)
    # per case, true-token rates: seed 0 2/4 vs full KV's 3/4 (below), seed 1 2/2 vs 2/2
    assert (snap["below_full"], snap["above_full"]) == (1, 0)


def test_smallest_budget_combos_resolve_per_length():
    """--budgets min: each policy's smallest budget at each length (Policy.smallest_budget, hand-computed here),
    refused where none fits; other scripts do not take it."""
    from harness import grid
    from hetero_jax.policies import make_policy
    from tiny_model import tiny_model
    import bench_needle as bn

    args = bt.parse_args(["--budgets", "0.5", "min", "--policies", "snapkv", "freekv:page_size=64"])
    assert args.budgets == [0.5, "min"]
    for bad in (["--budgets", "minimum"], ["--budgets", "0"]):
        with pytest.raises(SystemExit):
            bt.parse_args(bad)
    with pytest.raises(SystemExit):
        bn.parse_args(["--budgets", "min"])
    combos = grid.make_combos(args.policies, args.budgets)
    labels = [grid.combo_label(*c) for c in combos]
    assert labels == ["full", "snapkv@0.5", "snapkv@min", "freekv:page_size=64@0.5", "freekv:page_size=64@min"]
    policies = [make_policy(n, None if n == "full" or r == "min" else r) for n, r in combos]
    C = grid.refusals(tiny_model(256), combos, labels, policies, [100, 200])
    # SnapKV keeps its 32-query window: round(rho * L) >= 32 from rho 0.315 at 100 tokens, 0.1575 at 200
    assert C.smallest["snapkv@min"] == {"100": 0.315, "200": 0.1575}
    assert C.rho(2, 200) == 0.1575 and C.policy(2, 200).budget == 0.1575 and C.policy(1, 200) is policies[1]
    # FreeKV's 64-token page beside its sinks and window fits no budget at 100 tokens
    assert "no budget up to rho=1" in C.refused["freekv:page_size=64@min"]["100"]
    assert C.active(100) == [0, 1, 2] and C.active(200) == [0, 1, 2, 4]
    recs = [_rec("multi-key", "full", 0, 1.0, n=1, length=100), _rec("multi-key", "full", 1, 1.0, n=1, length=200),
            _rec("multi-key", "snapkv@0.315", 0, 0.0, n=1, length=100),
            _rec("multi-key", "snapkv@0.1575", 1, 1.0, n=1, length=200)]
    recs[2]["label"] = recs[3]["label"] = "snapkv@min"
    s = bt.summarize(recs, ["full", "snapkv@min"], ["multi-key"])[1]
    assert s["smallest"] and s["rho"] == pytest.approx((0.315 + 0.1575) / 2)
    assert "| multi-key | snapkv | min (0.158-0.315) |" in bt.results_table({"summary": [s]})


def _part(tmp_path, name, recs, **cfg):
    import json

    config = {"model": "smollm2-135m", "dtype": "float32", "digits": 4, "grading": bt.GRADING, "tasks": ["multi-key"],
              "lengths": sorted({r["length"] for r in recs}), "seeds": sorted({r["seed"] for r in recs}),
              "haystacks": ["pydoc"], "combos": list(dict.fromkeys(r["label"] for r in recs)), "skipped": {},
              "smallest_budgets": {}, **cfg}
    prompts = [{"task": r["task"], "haystack": r["haystack"], "length": r["length"], "seed": r["seed"]}
               for r in recs if r["label"] == "full"]
    payload = {"config": config, "records": recs, "prompts": prompts, "git": {"commit": name}, "command": f"run {name}",
               "timestamp": "t", "load_seconds": 1.0, "machine": {"cpu": "x"}, "total_seconds": 60.0,
               "peak_rss_bytes": 1}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(payload))
    return path


def test_merge_joins_slices_and_refuses_runs_that_do_not_compare(tmp_path):
    import argparse

    def rec(label, seed, score, text=" 4761."):
        return _rec("multi-key", label, seed, score, n=1, text=text, prompt_sha256=f"sha{seed}", values=["4761"])

    a = _part(tmp_path, "a", [rec("full", 0, 1.0), rec("snapkv@0.3", 0, 0.0)])
    b = _part(tmp_path, "b", [rec("full", 0, 1.0), rec("full", 1, 1.0), rec("snapkv@0.3", 1, 1.0),
                              rec("snapkv@min", 1, 0.0)])
    args = argparse.Namespace(merge=[a, b], out=tmp_path / "m.json", plot=tmp_path / "m.png")
    m = bt.merge(args, "tasks")
    assert len(m["records"]) == 5 and m["config"]["seeds"] == [0, 1]  # full at seed 0 once
    assert m["config"]["combos"] == ["full", "snapkv@0.3", "snapkv@min"]
    snap = next(s for s in m["summary"] if s["label"] == "snapkv@0.3")
    assert (snap["cases"], snap["solved"], snap["below_full"]) == (2, 1, 1)
    assert [x["commit"] for x in m["config"]["merged_from"]] == ["a", "b"] and m["total_seconds"] == 120.0
    assert "Merged (`--merge`) from 2 runs" in bt.results_section(m, None)
    for bad, needle in [
        (_part(tmp_path, "c", [rec("full", 0, 0.0, text=" 1.")]), "full KV answers multi-key .* differently"),
        (_part(tmp_path, "d", [rec("full", 0, 1.0), rec("snapkv@0.3", 0, 1.0)]), "snapkv@0.3 on multi-key .* is in"),
        (_part(tmp_path, "e", [rec("full", 5, 1.0)], model="other"), "another model"),
    ]:
        with pytest.raises(SystemExit, match=needle):
            bt.merge(argparse.Namespace(merge=[a, bad], out=tmp_path / "m.json", plot=tmp_path / "m.png"), "tasks")


@pytest.mark.slow
@pytest.mark.real_model
def test_a_killed_run_keeps_its_cases_and_resume_finishes_it(smollm2_dir, tmp_path, monkeypatch):
    """Each finished case is checkpointed in OUT.partial.json; a fresh run refuses to overwrite it; --resume runs
    only the missing cases (one prefill here), writes --out with every case and removes the checkpoint."""
    import json

    out = tmp_path / "tasks.json"
    flags = ["--tasks", "span-copy", "multi-key", "--lengths", "400", "--seeds", "0", "--haystacks", "pydoc",
             "--policies", "full", "--model", smollm2_dir, "--out", str(out)]
    real_build, calls = bt.build_engines, []

    def dies_on_second_case(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("killed")
        return real_build(*a, **k)

    monkeypatch.setattr(bt, "build_engines", dies_on_second_case)
    with pytest.raises(RuntimeError, match="killed"):
        bt.main(flags)
    partial = bt.partial_path(out)
    assert partial == tmp_path / "tasks.partial.json" and not out.exists()
    kept = json.loads(partial.read_text())
    assert kept["interrupted"] and [p["task"] for p in kept["prompts"]] == ["span-copy"]
    assert [r["task"] for r in kept["records"]] == ["span-copy"] and kept["summary"][0]["cases"] == 1

    with pytest.raises(SystemExit, match="tasks.partial.json exists.*--resume"):
        bt.main(flags)
    with pytest.raises(SystemExit, match="another seeds"):
        bt.main([*flags[:6], "1", *flags[7:], "--resume"])
    assert json.loads(partial.read_text()) == kept  # refusals leave it as it was

    calls.clear()
    assert bt.main([*flags, "--resume"]) == 0
    assert len(calls) == 1 and not partial.exists()
    d = json.loads(out.read_text())
    assert [p["task"] for p in d["prompts"]] == ["span-copy", "multi-key"]
    assert [r["task"] for r in d["records"]] == ["span-copy", "multi-key"]
    assert d["records"][0] == kept["records"][0] and d["resumed_from"][0]["cases"] == 1
    assert {s["task"]: s["cases"] for s in d["summary"]} == {"span-copy": 1, "multi-key": 1}
    assert d["total_seconds"] > kept["total_seconds"]
    assert "Resumed (`--resume`): the first 1 cases ran at" in bt.results_section(d, None)
    with pytest.raises(SystemExit, match="does not exist"):
        bt.main([*flags, "--resume"])
