"""Pure helpers of benchmarks/bench_needle.py and benchmarks/bench_multiturn.py (no model weights)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_multiturn as bm  # noqa: E402
import common  # noqa: E402
import bench_needle as bn  # noqa: E402
import haystack  # noqa: E402
from harness import facts as hf, grid, needles as hn  # noqa: E402  (the multi-turn facts; what the two scripts share)


# ---------------------------------------------------------- answer matching
@pytest.mark.parametrize("text, answer, want", [
    ("The special magic number mentioned in the text is 48213.", "48213", True),
    ('is:\n\n* "48213"', "48213", True),
    ("The number is 48,213.", "48213", True),
    ("The number is 48 213", "48213", True),
    ("The number is 482130.", "48213", False),
    ("The number is 48213 500", "48213", True),  # a 3-digit number after it is not a digit group of it
    ("ticket 1732 123", "1732", True),
    ("The number is 148213", "48213", False),
    ("The number is 4821", "48213", False),
    ("The robot contest will be held in LISBON, Portugal.", "Lisbon", True),
    ("held in Reykjavík.", "Reykjavik", True),
    ("Elena's favourite animal is the giraffes", "giraffe", True),
    ("It is on Sundays.", "Sunday", True),
    ("The jazz festival is in Lisbonne", "Lisbon", False),
    ("She likes the colour of amberjack fish", "amber", False),
    ("The dinner is on the 23rd of January.", "Sunday", False),
    ("Held in new   york!", "New York", True),
    ("", "Oslo", False),
])
def test_answer_correct(text, answer, want):
    assert bn.answer_correct(text, answer) is want


def test_answer_correct_refuses_an_empty_answer():
    with pytest.raises(ValueError):
        bn.answer_correct("anything", " .")


def test_normalize_text():
    assert hn.normalize_text("  Reykjavík,\n  LISBON!  ") == "reykjavik lisbon"


# --------------------------------------------------------- needle bookkeeping
def _rec(label, L, d, seed, correct):
    return {"label": label, "policy": label.split("@")[0], "length": L, "depth": d, "seed": seed,
            "correct": correct, "achieved_rho": 1.0 if label == "full" else 0.3,
            "kv_bytes_prompt": 100 if label == "full" else 30}


def _grid_records():
    # full: (1000, 0.5) 2/2, (1000, 0.9) 1/2, (2000, 0.5) 0/2, (2000, 0.9) 2/2
    full = {(1000, 0.5): (1, 1), (1000, 0.9): (1, 0), (2000, 0.5): (0, 0), (2000, 0.9): (1, 1)}
    # snapkv: (1000, 0.5) 2/2, (1000, 0.9) 0/2, (2000, 0.5) 1/2, (2000, 0.9) 2/2
    snap = {(1000, 0.5): (1, 1), (1000, 0.9): (0, 0), (2000, 0.5): (1, 0), (2000, 0.9): (1, 1)}
    recs = []
    for label, table in (("full", full), ("snapkv@0.3", snap)):
        for (L, d), per_seed in table.items():
            recs += [_rec(label, L, d, s, bool(c)) for s, c in enumerate(per_seed)]
    return recs


def test_cell_scores_and_grid_hand_computed():
    recs = _grid_records()
    assert hn.cell_scores(recs, "full") == {(1000, 0.5): 1.0, (1000, 0.9): 0.5, (2000, 0.5): 0.0, (2000, 0.9): 1.0}
    # rows = depths, columns = lengths; missing cells are None
    assert bn.score_grid(recs, "snapkv@0.3", [1000, 2000, 4000], [0.5, 0.9]) == [[1.0, 0.5, None], [0.0, 1.0, None]]


def test_compare_with_full_hand_computed():
    c = hn.compare_with_full(_grid_records(), "snapkv@0.3")
    assert (c["cells"], c["equal"], c["above"], c["below"]) == (4, 2, 1, 1)
    assert {(x["length"], x["depth"]) for x in c["differ"]} == {(1000, 0.9), (2000, 0.5)}
    same = hn.compare_with_full(_grid_records(), "full")
    assert same["equal"] == same["cells"] == 4 and not same["differ"]


def test_summarize_needle_hand_computed():
    rows = bn.summarize(_grid_records(), [("full", 1.0), ("snapkv", 0.3)], [1000, 2000])
    full, snap = rows
    assert (full["correct"], full["total"], full["accuracy"]) == (5, 8, 5 / 8)
    assert snap["per_length"] == {"1000": (2, 4), "2000": (3, 4)}
    assert snap["achieved_rho"] == pytest.approx(0.3) and snap["vs_full"]["equal"] == 2


def test_make_combos_puts_full_first_once():
    assert common.make_combos(["snapkv", "full", "heterocache"], [0.3, 0.5]) == [
        ("full", 1.0), ("snapkv", 0.3), ("snapkv", 0.5), ("heterocache", 0.3), ("heterocache", 0.5)]
    assert [common.combo_label(n, r) for n, r in common.make_combos(["full"], [0.3])] == ["full"]


def test_needles_are_deterministic_and_answer_free_questions():
    for kind in bn.NEEDLE_KINDS:
        a, b = bn.make_needle(kind, 3), bn.make_needle(kind, 3)
        assert a == b and a.answer in a.sentence and not bn.answer_correct(a.question, a.answer)


def test_presets_fill_only_missing_arguments():
    args = bn.parse_args(["--preset", "cpu", "--budgets", "0.5"])
    cpu = bn.PRESETS["cpu"]
    assert args.lengths == cpu["lengths"] and args.depths == cpu["depths"] and args.budgets == [0.5]
    assert args.out.name == "needle-cpu.json" and args.policies[0] == "full"
    default = bm.parse_args([])
    assert default.lengths == bm.PRESETS["full"]["lengths"] and default.out.name == "multiturn.json"
    assert max(bn.PRESETS["full"]["lengths"]) <= 8192 - 32



def test_grid_runner_combos_refusals_points_and_payload(monkeypatch):
    """harness/grid.py: which combos each length runs, the order of the points, what the progress bar is told, and
    the totals a payload closes with (hand-written expectations; no model)."""
    refused = {"snapkv@0.3": {"1000": "e1", "2000": "e2"}, "h2o@0.3": {"2000": "e3"}}
    C = grid.Combos([("full", 1.0), ("snapkv", 0.3), ("h2o", 0.3)], ["full", "snapkv@0.3", "h2o@0.3"],
                    ["P0", "P1", "P2"], refused)
    assert C.active(1000) == [0, 2] and C.active(2000) == [0] and C.active(4000) == [0, 1, 2]
    some = C.runnable_somewhere([1000, 2000])  # snapkv is refused at both lengths, h2o at one
    assert some.labels == ["full", "h2o@0.3"] and some.policies == ["P0", "P2"] and some.refused is refused
    assert C.never_refused().combos == [("full", 1.0)]
    assert grid.points([1, 2], "ab") == [(1, "a"), (1, "b"), (2, "a"), (2, "b")]
    seen = []

    class Bar:  # what drive tells the progress bar, in order
        def __init__(self, **kw):
            seen.append(("total", kw["total"]))

        def set_description(self, d):
            seen.append(d)

        def update(self, n):
            seen.append(n)

        def close(self):
            seen.append("closed")

    monkeypatch.setattr("tqdm.tqdm", Bar)
    grid.drive([(1, "a"), (2, "b")], lambda n, t, bar: seen.append((n, t)), desc="x", unit="u",
               describe=lambda n, t: f"{t}{n}")
    assert seen == [("total", 2), "a1", (1, "a"), 1, "b2", (2, "b"), 1, "closed"]
    payload = grid.close_payload({"records": []}, time.perf_counter() - 5.0, cpu=False)
    assert list(payload) == ["records", "total_seconds", "peak_rss_bytes"] and 5.0 <= payload["total_seconds"] < 60
    assert list(grid.close_payload({}, time.perf_counter())) == ["total_seconds", "total_process_seconds",
                                                                  "load_avg_end", "peak_rss_bytes"]

# ------------------------------------------------------- multi-turn helpers
def test_facts_are_deterministic_unrelated_and_single_word():
    corpus = haystack.pydoc_corpus().lower()
    for seed in range(6):
        facts = bm.make_facts(seed)
        assert facts == bm.make_facts(seed)
        assert len({f.kind for f in facts}) == 3
        assert len({f.answer.lower() for f in facts}) == 3
        for f in facts:
            assert re.fullmatch(r"[A-Za-z]+|\d+", f.answer)
            assert f.answer in f.sentence and not bm.answer_correct(f.question, f.answer)
            # the answer never occurs in the haystack corpus, so only the fact can supply it
            assert not re.search(rf"(?<![a-z0-9]){f.answer.lower()}(?![a-z0-9])", corpus)
    # kinds rotate with the seed, so every kind visits every depth over four seeds
    assert {bm.make_facts(s)[0].kind for s in range(4)} == set(hf.FACT_KINDS)
    assert bm.make_facts(0) != bm.make_facts(1)


def test_fact_depths():
    assert bm.fact_depths(3) == [0.15, 0.5, 0.85]
    assert bm.fact_depths(1) == [0.5]
    d = bm.fact_depths(5)
    assert d[0] == 0.15 and d[-1] == 0.85 and d == sorted(d)


def _turn(label, L, seed, turn, correct, recall=None, host=0):
    return {"label": label, "policy": label.split("@")[0], "rho": 1.0 if label == "full" else float(label[-3:]),
            "length": L, "seed": seed, "turn": turn, "correct": correct, "achieved_rho": 0.3,
            "recall": recall or {}, "kv_bytes_host": host, "kv_bytes_device": 10}


def _session_records():
    recs = []
    table = {  # (length, seed) -> turns correct
        "full": {(4000, 0): (1, 1, 1), (4000, 1): (1, 0, 1)},
        "snapkv@0.3": {(4000, 0): (1, 0, 0), (4000, 1): (1, 0, 1)},
        "heterocache@0.3": {(4000, 0): (1, 1, 0), (4000, 1): (1, 0, 1)},
    }
    for label, sessions in table.items():
        for (L, seed), turns in sessions.items():
            for t, c in enumerate(turns):
                recall = {"drift_checks": 10 * (t + 1), "drift_triggers": t, "recalls": 2 * t,
                          "bytes_recalled": 1000 * t} if label.startswith("hetero") else None
                recs.append(_turn(label, L, seed, t, bool(c), recall, 500 if label.startswith("hetero") else 0))
    return recs


def test_multiturn_summary_hand_computed():
    recs = _session_records()
    combos = [("full", 1.0), ("snapkv", 0.3), ("heterocache", 0.3)]
    rows = {r["label"]: r for r in bm.summarize(recs, combos, [4000], 3)}
    assert rows["full"]["turn_correct"] == [2, 1, 2] and rows["full"]["recalled"] == 5 and rows["full"]["facts"] == 6
    assert rows["snapkv@0.3"]["turn_accuracy"] == [1.0, 0.0, 0.5]
    h = rows["heterocache@0.3"]
    # recall stats are cumulative per session: the last turn's, summed over the two sessions
    assert (h["drift_checks"], h["drift_triggers"], h["recalls"], h["bytes_recalled"]) == (60, 4, 8, 4000)
    assert h["trigger_rate"] == pytest.approx(4 / 60) and h["kv_bytes_host"] == 500
    assert rows["full"]["trigger_rate"] is None


def test_within_one_of_full_and_hetero_vs_snapkv():
    recs = _session_records()
    snap = bm.within_one_of_full(recs, "snapkv@0.3")  # 3 -> 1 in seed 0: two below
    assert not snap["met"] and snap["max_shortfall"] == 2
    # records without a haystack are pydoc's (runs from before haystacks were recorded)
    assert snap["failing"] == [{"haystack": "pydoc", "length": 4000, "seed": 0, "full": 3, "recalled": 1}]
    assert bm.within_one_of_full(recs, "heterocache@0.3")["met"]
    assert bm.hetero_vs_snapkv(recs, [0.3, 0.5]) == [
        {"rho": 0.3, "heterocache": 4, "snapkv": 3, "met": True, "per_haystack": {"pydoc": [4, 3]}}]
    tie = [r for r in recs if r["label"] != "heterocache@0.3"] + [
        dict(r, label="heterocache@0.3") for r in recs if r["label"] == "snapkv@0.3"]
    assert bm.hetero_vs_snapkv(tie, [0.3])[0]["met"] is False


def test_multiturn_policies_and_results_sections():
    args = bm.parse_args(["--policies", "snapkv", "heterocache", "--budgets", "0.5", "--lengths", "900"])
    assert args.policies == ["full", "snapkv", "heterocache"] and args.preset is None
    assert common.make_combos(args.policies, args.budgets)[-1] == ("heterocache", 0.5)
    # the benchmark-only recall='own' variant is gone: only registered policies
    assert not hasattr(bm, "VARIANTS") and not hasattr(bm, "build_policy")
    with pytest.raises(SystemExit):
        bm.parse_args(["--policies", "heterocache-own"])
    assert all("heterocache-own" not in p["policies"] for p in bm.PRESETS.values())


    # make bench (--preset cpu) and the full grids write different RESULTS.md sections
    assert common.results_section_name("needle", "cpu") == "needle"
    assert common.results_section_name("needle", None) == "needle-full"
    assert common.results_section_name("latency", "full") == "latency-full"
    assert common.results_section_name("latency", "long") == "latency-long"


# ------------------------------------------------ prompts with the real tokenizer
@pytest.mark.parametrize("n_tokens, depth", [(1000, 0.0), (2000, 0.5), (4000, 0.9)])
def test_needle_prompt_has_the_token_count_and_the_needle_at_its_depth(tokenizer, n_tokens, depth):
    needle = bn.make_needle("magic-number", 1)
    p = haystack.build_needle_prompt(tokenizer, n_tokens, [(depth, needle.sentence)], needle.question,
                                     needle.answer, seed=1)
    assert p.n_tokens == n_tokens
    assert needle.sentence in p.text and p.text.rstrip().endswith(needle.question)
    assert abs(p.actual_depths[0] - depth) < 0.05


@pytest.mark.parametrize("n_tokens, seed, hay", [(1500, 0, "pydoc"), (4000, 2, "pydoc"), (2000, 0, "licenses")])
def test_multiturn_context_places_every_fact_near_its_depth(tokenizer, n_tokens, seed, hay):
    facts = bm.make_facts(seed, 3, hay)
    ctx = bm.build_context(tokenizer, n_tokens, facts, bm.fact_depths(3), seed, hay)
    # the session prefills exactly the stated length (it fell 2-3 tokens short), as Session itself tokenizes it
    assert len(ctx.ids) == n_tokens and hf.session_context_ids(tokenizer, ctx.text)[0] == ctx.ids
    for f, want, got, start in zip(facts, ctx.depths, ctx.actual_depths, ctx.fact_token_starts):
        assert f.sentence in ctx.text and f.question not in ctx.text
        assert abs(got - want) < 0.05
        # the fact's tokens are where the context says they are
        assert tokenizer.decode(ctx.ids[start : start + 12]).strip().startswith(f.sentence[:12])
    starts = [ctx.text.index(f.sentence) for f in facts]
    assert starts == sorted(starts)


def test_session_context_ids_are_the_chat_prefix(tokenizer):
    ids, tail = hf.session_context_ids(tokenizer, "Some context.")
    full = tokenizer.encode_prompt("Some context.", chat=True)
    assert ids == full[: len(ids)] and len(full) > len(ids) and tail > 0


# ---------------------------------------------------------------- haystacks
HAYSTACKS = list(haystack.HAYSTACKS)


def test_haystack_names_and_presets():
    assert HAYSTACKS[0] == "pydoc" and {"stdlib-docs", "licenses"} <= set(HAYSTACKS)
    # make bench (--preset cpu) keeps its one haystack; no preset (the full grids) runs every haystack
    for mod in (bn, bm):
        assert mod.parse_args(["--preset", "cpu"]).haystacks == ["pydoc"]
        assert mod.parse_args([]).haystacks == HAYSTACKS
        assert mod.parse_args(["--preset", "issue15"]).haystacks == HAYSTACKS
        assert mod.parse_args(["--preset", "cpu", "--haystacks", "licenses", "licenses"]).haystacks == ["licenses"]
        with pytest.raises(SystemExit):
            mod.parse_args(["--haystacks", "no-such-haystack"])
    needle, multi = bn.PRESETS["issue15"], bm.PRESETS["issue15"]
    assert needle["budgets"] == [0.3] and set(needle["policies"]) == {"full", "snapkv", "heterocache"}
    assert len(multi["seeds"]) >= 3 and {2000, 4000} <= set(multi["lengths"]) and max(multi["lengths"]) <= 7000
    assert sorted(multi["budgets"]) == [0.3, 0.5] and set(multi["policies"]) == {"full", "snapkv", "heterocache"}
    # every preset's run time is estimated in --preset help, issue 15's within an afternoon on 2 cores
    for mod in (bn, bm):
        minutes = {k: mod.estimate_minutes(v) for k, v in mod.PRESETS.items()}
        assert all(0 < m < 240 for m in minutes.values()) and minutes["cpu"] < minutes["issue15"] < 60
        assert f"issue15 ~{minutes['issue15']:.0f} min" in common.preset_minutes_help(mod.PRESETS, mod.estimate_minutes)
    assert bn.interp_cost({1000: 1.0, 2000: 3.0}, 1500) == 2.0 and bn.interp_cost({1000: 1.0, 2000: 3.0}, 3000) == 5.0


@pytest.mark.parametrize("name", HAYSTACKS)
def test_haystack_is_deterministic_prose_without_answers(name):
    text = haystack.haystack_corpus(name)
    getattr(haystack, {"pydoc": "pydoc_corpus", "stdlib-docs": "stdlib_docs_corpus",
                       "licenses": "licenses_corpus"}[name]).cache_clear()
    assert haystack.haystack_corpus(name) == text  # rebuilt from scratch: the same text
    info = haystack.haystack_info(name)
    assert info["chars"] == len(text) and len(info["sha256"]) == 64 and info["python"]
    if name == "licenses":
        assert set(info["distributions"]) == set(haystack.LICENSE_DISTRIBUTIONS)
        assert all(d["files"] >= 1 and d["version"] for d in info["distributions"].values())
    low = text.lower()
    # no answer a benchmark can expect: needle cities, multi-turn values, passkeys of the seeds presets use
    words = {*hn._CITIES, *hf._NAMES, *hf._DAYS, *hf._CITIES, *(v for vs in hf._FAVOURITES.values() for v in vs)}
    assert words <= set(haystack.ANSWER_WORDS)
    for w in (haystack.ANSWER_WORDS if name != "pydoc" else words):
        assert not re.search(rf"(?<![a-z0-9]){w.lower()}(?:e?s)?(?![a-z0-9])", low), w
    for seed in range(10):
        assert not re.search(rf"(?<!\d){haystack.make_passkey(seed)}(?!\d)", text)
        for f in bm.make_facts(seed, 3, name):
            assert not re.search(rf"(?<![a-z0-9]){f.answer.lower()}(?![a-z0-9])", low)
    if name != "pydoc":  # prose: every paragraph passes the filter, none is code or a doctest
        paras = text.split("\n\n")
        assert len(paras) > 100 and all(haystack.is_prose(p) for p in paras[:: max(1, len(paras) // 200)])
        assert ">>>" not in text and "def " not in text.replace("undef ", "")


def test_is_prose():
    assert haystack.is_prose("Return a new object replacing specified fields with new values, as the docs say.")
    assert not haystack.is_prose(">>> x = [1, 2, 3]; print(x) and then some words here.")
    assert not haystack.is_prose("Copyright (c) 2015 the respective contributors and all of them, too.")
    assert not haystack.is_prose("The festival is held in Lisbon every year, so the text would give it away.")
    assert not haystack.is_prose("The special magic number is 48213 and it would give the needle away.")
    assert not haystack.is_prose("Too short.")


@pytest.mark.parametrize("name", HAYSTACKS)
def test_haystack_is_long_enough_for_8k_and_seeds_differ(tokenizer, name):
    assert haystack.haystack_info(name, tokenizer)["tokens"] >= 20000  # > 8K tokens without repeating
    needle = bn.make_needle("magic-number", 1)
    p = haystack.build_needle_prompt(tokenizer, 8000, [(0.5, needle.sentence)], needle.question, needle.answer,
                                     seed=1, haystack=name)
    assert p.n_tokens == 8000 and p.haystack == name and needle.sentence in p.text
    again = haystack.build_needle_prompt(tokenizer, 8000, [(0.5, needle.sentence)], needle.question, needle.answer,
                                         seed=1, haystack=name)
    assert again.ids == p.ids
    other = haystack.build_needle_prompt(tokenizer, 1000, [(0.5, needle.sentence)], needle.question,
                                         needle.answer, seed=2, haystack=name)
    assert other.text[:200] != p.text[:200]  # the seed moves the haystack's start
    # the 8,000 tokens fit in the corpus once: the haystack does not wrap around
    assert p.haystack_chars + p.skipped_chars < len(haystack.haystack_corpus(name))


def test_needle_records_and_tables_carry_the_haystack():
    recs = [dict(r, haystack="pydoc") for r in _grid_records()]
    recs += [dict(r, haystack="licenses", correct=True) for r in _grid_records()]
    combos = [("full", 1.0), ("snapkv", 0.3)]
    full, snap = bn.summarize(recs, combos, [1000, 2000])
    assert full["per_haystack"] == {"pydoc": (5, 8), "licenses": (8, 8)} and (full["correct"], full["total"]) == (13, 16)
    assert snap["per_haystack"] == {"pydoc": (5, 8), "licenses": (8, 8)}
    # comparison per (haystack, length, depth): pydoc's 2 differing cells, licenses' none
    assert (snap["vs_full"]["cells"], snap["vs_full"]["equal"]) == (8, 6)
    assert {c["haystack"] for c in snap["vs_full"]["differ"]} == {"pydoc"}
    payload = {"config": {"lengths": [1000, 2000], "haystacks": ["pydoc", "licenses"]},
               "summary": [full, snap], "records": [dict(r, actual_depth=r["depth"], answer="1", text="1")
                                                    for r in recs]}
    table = bn.results_table(payload)
    assert "| pydoc | licenses |" in table and "| 5/8 | 8/8 | 13/16 (81 %) |" in table
    assert "| 6/8 |" in table  # cells = full
    assert "| licenses |" in bn.full_answers_table(payload)
    one = {"config": {"lengths": [1000, 2000]}, "summary": bn.summarize(_grid_records(), combos, [1000, 2000])}
    assert "pydoc" not in bn.results_table(one)  # one haystack (or an old run): no per-haystack columns


def test_multiturn_records_and_tables_carry_the_haystack():
    recs = [dict(r, haystack="pydoc") for r in _session_records()]
    recs += [dict(r, haystack="stdlib-docs", correct=r["label"] != "snapkv@0.3") for r in _session_records()]
    combos = [("full", 1.0), ("snapkv", 0.3), ("heterocache", 0.3)]
    rows = {r["label"]: r for r in bm.summarize(recs, combos, [4000], 3)}
    # two haystacks x two seeds: four sessions, 12 facts per policy
    assert rows["full"]["sessions"] == 4 and rows["full"]["facts"] == 12
    assert rows["snapkv@0.3"]["per_haystack"] == {"pydoc": (3, 6), "stdlib-docs": (0, 6)}
    h = rows["heterocache@0.3"]
    assert h["per_haystack"] == {"pydoc": (4, 6), "stdlib-docs": (6, 6)} and h["recalled"] == 10
    assert (h["drift_checks"], h["recalls"]) == (120, 16)  # the last turn's stats of each of the 4 sessions
    w = bm.within_one_of_full(recs, "snapkv@0.3")
    assert w["contexts"] == 4 and {f["haystack"] for f in w["failing"]} == {"pydoc", "stdlib-docs"}
    assert bm.hetero_vs_snapkv(recs, [0.3]) == [{"rho": 0.3, "heterocache": 10, "snapkv": 3, "met": True,
                                                 "per_haystack": {"pydoc": [4, 3], "stdlib-docs": [6, 0]}}]
    payload = {"config": {"fact_depths": [0.15, 0.5, 0.85], "haystacks": ["pydoc", "stdlib-docs"],
                          "combos": ["full", "snapkv@0.3", "heterocache@0.3"]},
               "summary": list(rows.values()), "within_one_of_full": {"snapkv@0.3": w}, "records": recs,
               "contexts": [{"facts": [1, 2, 3]}] * 4, "heterocache_vs_snapkv": bm.hetero_vs_snapkv(recs, [0.3])}
    assert "| pydoc | stdlib-docs |" in bm.results_table(payload)
    totals = bm.totals_table(payload)
    assert "| snapkv@0.3 | 3/6 | 0/6 | 3/12 (25 %) |" in totals and "| heterocache@0.3 | 4/6 | 6/6 | 10/12" in totals
    assert "pydoc 4 vs 3, stdlib-docs 6 vs 0" in "\n".join(bm.criteria_lines(payload))


# --------------------------------------------------- shared prefills
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "per-layout"])
def test_shared_prefills_build_the_engines_generate_builds(mode):
    """One forward pass for every policy (``bench_needle.build_engines``: a PoolBuilder per plan, fed by an
    observe hook; per layout for ``per-layout``): each engine decodes the tokens and logits of an ``Engine`` of
    its own, for policies in model order and in their own head layouts, a plan whose counts are decided at
    the end (CAKE) and one with host copies and anticipations (SyncKV)."""
    import numpy as np

    from hetero_jax.policies import CAKE, FullKV, SnapKV, SyncKV
    from hetero_jax.runtime import Engine
    from test_contextkeeper import ck
    from test_synckv import PROFILE
    from tiny_model import tiny_model

    model = tiny_model()
    ids = np.random.default_rng(0).integers(3, 100, 150).tolist()
    policies = [FullKV(), SnapKV(budget=0.5), CAKE(budget=0.5), SyncKV(profile=PROFILE, budget=0.6, m=2), ck(0.5)]

    def greedy(eng, n=5):
        tok, toks, logits = eng.first_tokens(0.0, 1.0), [], []
        for _ in range(n):
            tok, lg = eng.step_with_logits(tok)
            toks.append(int(tok[0]))
            logits.append(lg)
        return toks, np.stack(logits)

    engines, info = bn.build_engines(model, ids, policies, 8, prefill=mode)
    assert [i["prefill"] for i in info] == [mode] * len(policies)
    for p, eng in zip(policies, engines):
        want_toks, want_logits = greedy(Engine(model, [ids], p, tail_capacity=8))
        toks, logits = greedy(eng)
        assert toks == want_toks, p
        np.testing.assert_allclose(logits, want_logits, atol=1e-4, rtol=0)
    assert engines[3].state.stats()["anticipations"] == 2  # the shared SyncKV engine recalled from its host copy


@pytest.mark.parametrize("mode", ["shared", "per-layout"])
def test_shared_prefills_leave_no_cycle_that_holds_a_host_store(mode):
    """With the collector off, dropping the engines of a shared prefill frees every host store: no reference
    cycle (a plan's compile_fn closure pointing back at the prefill that holds the plans) keeps hundreds of
    MiB per policy alive until a full collection (a 7.9K task grid grew by gigabytes a case from it)."""
    import gc
    import weakref

    import numpy as np

    from hetero_jax.model.host_store import HostKVStore
    from hetero_jax.policies import FreeKV, Quest, SnapKV
    from tiny_model import tiny_model

    model = tiny_model()
    ids = np.random.default_rng(1).integers(3, 100, 200).tolist()
    gc.collect()
    gc.disable()
    try:
        engines, _ = bn.build_engines(model, ids, [SnapKV(budget=0.5), FreeKV(budget=0.6, page_size=8),
                                                   Quest(budget=0.8, page_size=8, offload=True)], 8, prefill=mode)
        stores = [weakref.ref(o) for o in gc.get_objects() if isinstance(o, HostKVStore)]
        assert len(stores) == 2
        del engines
        assert [r() is None for r in stores] == [True, True]
    finally:
        gc.enable()


# --------------------------------------------------- tiny end-to-end runs
@pytest.mark.slow
@pytest.mark.real_model
def test_needle_and_multiturn_run_end_to_end_on_two_haystacks(smollm2_dir, tmp_path):
    """Both scripts on the real model, two haystacks, tiny prompts: every record, context and table names them."""
    import json

    hays = ["stdlib-docs", "licenses"]
    out = tmp_path / "needle.json"
    assert bn.main(["--lengths", "300", "--depths", "0.5", "--policies", "full", "snapkv", "--haystacks", *hays,
                    "--max-new-tokens", "2", "--model", smollm2_dir, "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["config"]["haystacks"] == hays and set(d["config"]["haystack_sources"]) == set(hays)
    assert [p["haystack"] for p in d["prompts"]] == hays and {r["haystack"] for r in d["records"]} == set(hays)
    assert all(s["per_haystack"] == {h: [s["per_haystack"][h][0], 1] for h in hays} for s in d["summary"])
    assert "| stdlib-docs | licenses |" in bn.results_table(d) and "Haystack `licenses`" in bn.results_section(d, None)

    out = tmp_path / "multiturn.json"
    assert bm.main(["--lengths", "400", "--seeds", "0", "--policies", "full", "--haystacks", *hays, "--n-facts", "1",
                    "--max-new-tokens", "2", "--model", smollm2_dir, "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert [c["haystack"] for c in d["contexts"]] == hays and [r["haystack"] for r in d["records"]] == hays
    assert d["summary"][0]["facts"] == 2 and set(d["summary"][0]["per_haystack"]) == set(hays)
    assert "| stdlib-docs | licenses |" in bm.totals_table(d)
