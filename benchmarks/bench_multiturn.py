#!/usr/bin/env python
"""Multi-turn recall: unrelated facts far apart in one long context, asked one per turn of a ``Session``.

SmolLM2-135M, batch 1, greedy. For every context length and seed, ``--n-facts``
(default 3) unrelated facts (a ticket number, a person's favourite thing, the day
of an event, the city of an event; values and subjects from the seed, kinds
rotated by the seed so each kind visits each depth) are placed at depths
0.15 / 0.5 / 0.85 of a real-text haystack (each of ``--haystacks``:
``pydoc``, ``stdlib-docs``, ``licenses`` of ``benchmarks/haystack.py``; the
seed also picks where the haystack starts). The
context (no question) is prefilled once into a ``hetero_jax.Session`` per
policy; then one question per fact is asked, one per turn, in depth order, with
``--max-new-tokens`` (20) new tokens per answer. A turn is correct iff the
answer (a single word or number) appears in it (``bench_needle.answer_correct``:
case-insensitive, whole words; numbers as one number).

One forward pass per context serves every policy (``bench_needle.build_engines``:
each policy's selection hook sees every layer's KV, HeteroCache's in its own
head order), and each policy's ``Session`` is built around its engine: the
``Engine(...)`` call in ``Session.__init__`` is answered with the prebuilt
engine, so the session's own turn logic (chat template, tail, HeteroCache's drift
checks and recalls during the questions and answers) runs unchanged.
``--prefill separate`` builds every ``Session`` normally (one prefill each).

Reported per length and policy: accuracy per turn, facts recalled in total,
whether the policy is at most one fact below full KV in every context, whether
HeteroCache recalls more facts than SnapKV at the same budget, and HeteroCache's
recall statistics from the session's ``GenerationStats`` (drift checks, trigger
rate, satellite recalls, bytes recalled, host KV bytes); with several haystacks
the tables also give facts recalled per haystack and in total ("7/9").

    .venv/bin/python benchmarks/bench_multiturn.py --preset cpu      # make bench (~3 min on 2 cores)
    .venv/bin/python benchmarks/bench_multiturn.py --write-results   # 4000 and 7000 tokens, 3 seeds
    .venv/bin/python benchmarks/bench_multiturn.py --preset seeds --write-results   # 3 seeds at 4000 tokens
    .venv/bin/python benchmarks/bench_multiturn.py --preset issue15 --write-results # 3 haystacks x 3 seeds (~39 min)

``--help`` prints every preset's estimated run time on 2 CPU cores (:func:`estimate_minutes`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_needle  # noqa: E402  (benchmarks/bench_needle.py: answer matching, shared prefill)
import common  # noqa: E402  (benchmarks/common.py)
import haystack  # noqa: E402  (benchmarks/haystack.py)
from bench_needle import (  # noqa: E402
    answer_correct, config_haystacks, haystacks_of, record_haystack,
)

SECTION = "multiturn"
MODEL = "smollm2-135m"
MiB = 2**20

_ISSUE15 = {
    "lengths": [2000, 4000, 7000],
    "seeds": [0, 1, 2],
    "policies": ["full", "snapkv", "heterocache"],
    "budgets": [0.5, 0.3],
    "haystacks": list(haystack.HAYSTACKS),
}

PRESETS = {
    "full": {
        "lengths": [4000, 7000],
        "seeds": [0, 1, 2],
        "policies": ["full", "streamingllm", "snapkv", "heterocache"],
        "budgets": [0.3, 0.5],
        "haystacks": list(haystack.HAYSTACKS),
    },
    # more contexts at one length (section multiturn-seeds): three fact sets and haystack starts at 4K
    "seeds": {
        "lengths": [4000],
        "seeds": [0, 1, 2],
        "policies": ["full", "streamingllm", "snapkv", "heterocache"],
        "budgets": [0.3, 0.5],
        "haystacks": list(haystack.HAYSTACKS),
    },
    "cpu": {  # make bench: about 7 minutes on a 2-core CPU
        "lengths": [3000],
        "seeds": [0],
        "policies": ["full", "streamingllm", "snapkv", "heterocache"],
        "budgets": [0.3, 0.5],
        "haystacks": ["pydoc"],  # the one haystack make bench has always used
    },
    # issue 15: HeteroCache vs SnapKV vs full KV on every haystack, 3 fact sets each, 2K-7K
    "issue15": _ISSUE15,
    # issue 15 at 7K (its own RESULTS section, so the 2K/4K table keeps its run)
    "issue15-7k": {**_ISSUE15, "lengths": [7000]},
    # issue 15 ablation: the drift check switched off (tau_drift -100: the normalised overlap never falls
    # below it) beside the default, so the facts the within-turn recall adds on top of re-selection show
    "issue15-drift": {**_ISSUE15, "lengths": [2000, 4000], "budgets": [0.5, 0.3],
                      "policies": ["full", "heterocache", "heterocache:tau_drift=-100"]},
    # issues 17 and 18 (common.ISSUE_COMPARISONS) on issue 15's haystacks and fact sets, 2K contexts
    **{name: {"lengths": [2000], "seeds": [0, 1, 2], **comparison, "haystacks": list(haystack.HAYSTACKS)}
       for name, comparison in common.ISSUE_COMPARISONS.items()},
}


# Run-time model for the --preset help, in CPU seconds, from a small measured run (2-core Xeon, 2026-11-25:
# licenses and stdlib-docs at 2000 and 7000 tokens, seed 0, full + snapkv + heterocache at rho 0.5 and 0.3;
# process_seconds and compile_seconds of each context in the JSON): one context with those five combos after
# compilation, by length; the first context of a length compiles (~130 s), later ones still compile a little
# for new question shapes (~20 s). Each further combo: ~8 s a session (a baseline), ~25 s (HeteroCache).
# Wall time on an idle 2-core machine ~ CPU seconds / bench_needle.IDLE_CORES. The Session rework in progress
# (chunked turn prefill, HeteroCache re-selecting at each question) will change these; re-measure after it.
_CONTEXT_CPU_S = {2000: 56.0, 4000: 75.0, 7000: 105.0}
_FIRST_COMPILE_CPU_S, _MORE_COMPILE_CPU_S = 130.0, 20.0


def estimate_minutes(preset: dict) -> float:
    """Estimated wall minutes of a multi-turn preset on an idle 2-core CPU (cold compilation cache)."""
    combos = common.make_combos(preset["policies"], preset["budgets"])
    n_het = sum(name == "heterocache" for name, _ in combos)
    n_base = len(combos) - n_het
    n = len(preset["seeds"]) * len(preset["haystacks"])
    cpu = bench_needle.LOAD_S
    for L in preset["lengths"]:
        per_ctx = bench_needle.interp_cost(_CONTEXT_CPU_S, L) + 8.0 * (n_base - 3) + 25.0 * (n_het - 2)
        cpu += n * max(per_ctx, 10.0) + _FIRST_COMPILE_CPU_S + _MORE_COMPILE_CPU_S * (n - 1)
    return cpu / bench_needle.IDLE_CORES / 60


# -------------------------------------------------------------------- facts
@dataclasses.dataclass(frozen=True)
class Fact:
    """One fact: the sentence placed in the context, the question asked later, the one-word answer."""

    kind: str
    sentence: str
    question: str
    answer: str


_TICKETS = ["ferry", "museum", "night train", "cable car", "opera", "harbour tour"]
_NAMES = ["Tobias", "Ingrid", "Ravi", "Elena", "Kofi", "Hana", "Lucas", "Amara"]
_FAVOURITES = {
    "colour": ["purple", "turquoise", "crimson", "amber"],
    "animal": ["otter", "giraffe", "badger", "walrus"],
    "instrument": ["cello", "trumpet", "harp", "banjo"],
}
_DAY_EVENTS = ["piano recital", "team dinner", "boat trip", "book club"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Saturday", "Sunday"]
_CITY_EVENTS = ["chess final", "science fair", "jazz festival", "robot contest"]
_CITIES = ["Lisbon", "Oslo", "Nairobi", "Montevideo", "Reykjavik", "Kyoto", "Antwerp", "Cusco"]
FACT_KINDS = ("number", "favourite", "day", "city")


def _ticket_number(rng: random.Random, haystack_name: str = haystack.DEFAULT_HAYSTACK) -> str:
    """A 4-digit number that does not occur in the haystack's corpus."""
    return haystack.absent_number(rng, 1000, 9999, (haystack_name,))


def _make_fact(kind: str, rng: random.Random, used: set, haystack_name: str = haystack.DEFAULT_HAYSTACK) -> Fact:
    def pick(pool):
        left = [x for x in pool if x not in used] or list(pool)
        x = rng.choice(left)
        used.add(x)
        return x

    if kind == "number":  # not "code": next to Python's documentation the model starts writing code
        thing = pick(_TICKETS)
        n = _ticket_number(rng, haystack_name)
        return Fact(kind, f"The ticket number for the {thing} is {n}.", f"What is the ticket number for the {thing}?",
                    n)
    if kind == "favourite":
        name, cat = pick(_NAMES), pick(sorted(_FAVOURITES))
        v = pick(_FAVOURITES[cat])
        return Fact(kind, f"{name}'s favourite {cat} is the {v}." if cat != "colour"
                    else f"{name}'s favourite colour is {v}.", f"What is {name}'s favourite {cat}?", v)
    if kind == "day":
        event, day = pick(_DAY_EVENTS), pick(_DAYS)
        return Fact(kind, f"The {event} is on {day}.", f"On which day is the {event}?", day)
    if kind == "city":
        event, city = pick(_CITY_EVENTS), pick(_CITIES)
        return Fact(kind, f"The {event} will be held in {city}.", f"In which city will the {event} be held?", city)
    raise ValueError(f"unknown fact kind {kind!r}; known: {', '.join(FACT_KINDS)}")


def make_facts(seed: int, n: int = 3, haystack_name: str = haystack.DEFAULT_HAYSTACK) -> list[Fact]:
    """``n`` unrelated facts for ``seed``: kinds rotated by the seed, subjects and values drawn from it.

    The ticket number is one that ``haystack_name``'s corpus does not contain (so, rarely, the facts of a seed
    differ between haystacks); no other answer word occurs in any haystack (``haystack.ANSWER_WORDS``)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(f"multiturn-facts-{seed}")
    kinds = [FACT_KINDS[(seed + i) % len(FACT_KINDS)] for i in range(n)]
    used: set = set()
    return [_make_fact(k, rng, used, haystack_name) for k in kinds]


def fact_depths(n: int) -> list[float]:
    """Depths of ``n`` facts: evenly from 0.15 to 0.85 (0.15 / 0.5 / 0.85 for three; 0.5 for one)."""
    if n == 1:
        return [0.5]
    return [round(0.15 + 0.7 * i / (n - 1), 4) for i in range(n)]


@dataclasses.dataclass
class Context:
    """A fitted multi-fact context and where its facts landed, in the session's tokens."""

    text: str  # the context (user message without a question)
    ids: list[int]  # what Session(model, text) prefills
    tail_capacity: int  # the tail Session reserves
    facts: list[Fact]
    depths: list[float]  # requested
    fact_token_starts: list[int]  # index of each fact's first token in ``ids``
    actual_depths: list[float]


def build_context(tokenizer, n_tokens: int, facts: list[Fact], depths: list[float], seed: int,
                  haystack_name: str = haystack.DEFAULT_HAYSTACK) -> Context:
    """The context with ``facts`` at ``depths`` whose session prefill is about ``n_tokens`` tokens.

    ``haystack.build_needle_prompt`` counts the chat template's generation
    suffix, which a ``Session`` context does not prefill, so the target is
    raised by the suffix's length.
    """
    if len(facts) != len(depths):
        raise ValueError(f"{len(facts)} facts but {len(depths)} depths")
    suffix = haystack.suffix_len(tokenizer, True)
    p = haystack.build_needle_prompt(tokenizer, n_tokens + suffix, list(zip(depths, [f.sentence for f in facts])),
                                     None, "", seed=seed, haystack=haystack_name)
    ids, tail = session_context_ids(tokenizer, p.text)
    # needle_token_starts index the chat prompt; its prefix is the session's ids
    return Context(text=p.text, ids=ids, tail_capacity=tail, facts=list(facts), depths=list(depths),
                   fact_token_starts=list(p.needle_token_starts),
                   actual_depths=[t / len(ids) for t in p.needle_token_starts])


# ------------------------------------------------- sessions around engines
def _session_cls():
    from hetero_jax.runtime import Session

    return Session


@contextlib.contextmanager
def session_engine(factory):
    """While active, the ``Engine(...)`` call in ``Session.__init__`` is answered by ``factory``."""
    mod = sys.modules[_session_cls().__module__]
    original = mod.Engine
    mod.Engine = factory
    try:
        yield
    finally:
        mod.Engine = original


class _Probe(Exception):
    pass


def session_context_ids(tokenizer, context: str) -> tuple[list[int], int]:
    """(token ids, tail capacity) that ``Session(model, context)`` would prefill; no model or compute needed."""
    got: dict = {}

    def probe(model, batch, policy, *, tail_capacity, **_):
        got.update(ids=[int(t) for t in batch[0]], tail_capacity=tail_capacity)
        raise _Probe

    with session_engine(probe):
        try:
            _session_cls()(_TokenizerOnly(tokenizer), context)
        except _Probe:
            return got["ids"], got["tail_capacity"]
    raise RuntimeError("Session(...) built no Engine; the shared prefill cannot be used (try --prefill separate)")


@dataclasses.dataclass(frozen=True)
class _TokenizerOnly:
    tokenizer: object


def session_around(model, context: str, engine, ids: list[int]):
    """``Session(model, context, policy)`` whose prefilled engine is ``engine`` (built for ``ids``)."""

    def reuse(model_, batch, policy, **_):
        if [int(t) for t in batch[0]] != ids:
            raise RuntimeError("the session's context tokens differ from the prefilled ones")
        return engine

    with session_engine(reuse):
        return _session_cls()(model, context, engine.policy)


# ------------------------------------------------------------ aggregation
def _session_key(r: dict) -> tuple[str, int]:
    return record_haystack(r), r["seed"]


def summarize(records: list[dict], combos, lengths, n_facts: int) -> list[dict]:
    """One row per (length, combo), every haystack pooled: per-turn accuracy, facts recalled (in total and per
    haystack), recall stats."""
    rows = []
    for L in lengths:
        for name, rho in combos:
            label = common.combo_label(name, rho)
            rs = [r for r in records if r["length"] == L and r["label"] == label]
            if not rs:
                continue
            sessions = sorted({_session_key(r) for r in rs})
            per_turn = [[r["correct"] for r in rs if r["turn"] == t] for t in range(n_facts)]
            last = {s: max((r for r in rs if _session_key(r) == s), key=lambda r: r["turn"]) for s in sessions}
            per_hay = {}
            for h in haystacks_of(rs):
                c = [r["correct"] for r in rs if record_haystack(r) == h]
                per_hay[h] = (sum(c), len(c))
            recall = [last[s]["recall"] for s in sessions]
            checks = sum(x.get("drift_checks", 0) for x in recall)
            triggers = sum(x.get("drift_triggers", 0) for x in recall)
            rows.append({
                "length": L, "label": label, "policy": name, "rho": rho, "sessions": len(sessions),
                "turn_correct": [sum(c) for c in per_turn], "turn_total": [len(c) for c in per_turn],
                "turn_accuracy": [sum(c) / len(c) if c else None for c in per_turn],
                "recalled": sum(r["correct"] for r in rs), "facts": len(rs), "per_haystack": per_hay,
                "achieved_rho": sum(r["achieved_rho"] for r in rs) / len(rs),
                "drift_checks": checks, "drift_triggers": triggers,
                "trigger_rate": triggers / checks if checks else None,
                "recalls": sum(x.get("recalls", 0) for x in recall),
                "bytes_recalled": sum(x.get("bytes_recalled", 0) for x in recall),
                "kv_bytes_host": max(last[s]["kv_bytes_host"] for s in sessions),
                "kv_bytes_device": max(last[s]["kv_bytes_device"] for s in sessions),
            })
    return rows


def recalled_per_session(records: list[dict], label: str) -> dict[tuple[str, int, int], int]:
    """{(haystack, length, seed): facts recalled} of one combo."""
    out: dict[tuple[str, int, int], int] = {}
    for r in records:
        if r["label"] == label:
            k = (record_haystack(r), r["length"], r["seed"])
            out[k] = out.get(k, 0) + int(r["correct"])
    return out


def within_one_of_full(records: list[dict], label: str) -> dict:
    """Whether ``label`` recalls at most one fact fewer than full KV in every context (haystack, length, seed)."""
    ref, mine = recalled_per_session(records, "full"), recalled_per_session(records, label)
    keys = sorted(set(ref) & set(mine))
    worst = [k for k in keys if mine[k] < ref[k] - 1]
    return {"met": bool(keys) and not worst, "contexts": len(keys),
            "failing": [{"haystack": h, "length": L, "seed": s, "full": ref[(h, L, s)], "recalled": mine[(h, L, s)]}
                        for h, L, s in worst],
            "max_shortfall": max((ref[k] - mine[k] for k in keys), default=0)}


def hetero_vs_snapkv(records: list[dict], budgets) -> list[dict]:
    """Per budget: facts recalled by HeteroCache and by SnapKV over every context, in total and per haystack;
    met iff HeteroCache's total is higher."""
    out = []
    for b in budgets:
        labels = [common.combo_label(n, b) for n in ("heterocache", "snapkv")]
        if not all(any(r["label"] == lab for r in records) for lab in labels):
            continue
        counts = [recalled_per_session(records, lab) for lab in labels]
        h, s = (sum(c.values()) for c in counts)
        per_hay = {hay: [sum(v for k, v in c.items() if k[0] == hay) for c in counts] for hay in haystacks_of(records)}
        out.append({"rho": b, "heterocache": h, "snapkv": s, "met": h > s, "per_haystack": per_hay})
    return out


# ------------------------------------------------------------------- run
def run(args) -> dict:
    import jax
    from tqdm import tqdm

    from hetero_jax import runtime as G

    depths = args.fact_depths or fact_depths(args.n_facts)
    t_start = time.perf_counter()
    model, combos, labels, policies, load_s = common.load_grid(args)
    # a combo whose budget its profile cannot meet at some length is left out and named in the report
    skipped = {lab: "; ".join(errs.values())
               for lab, errs in common.refused_by_length(model, labels, policies, args.lengths).items()}
    keep = [i for i, lab in enumerate(labels) if lab not in skipped]
    combos, labels, policies = [combos[i] for i in keep], [labels[i] for i in keep], [policies[i] for i in keep]
    config = {
        "model": args.model, "dtype": str(jax.tree.leaves(model.params)[0].dtype), "preset": args.preset,
        "lengths": args.lengths, "seeds": args.seeds, "budgets": args.budgets, "policies": args.policies,
        "combos": labels, "policy_reprs": [repr(p) for p in policies], "n_facts": args.n_facts,
        "fact_depths": depths, "max_new_tokens": args.max_new_tokens, "prefill": args.prefill,
        "compile_cache": not args.no_compile_cache, "temperature": 0.0, "batch": 1, "chat_template": True,
        "haystacks": args.haystacks,
        "haystack_sources": {h: haystack.haystack_info(h, model.tokenizer) for h in args.haystacks},
        "matching": "bench_needle.answer_correct: case-insensitive whole words; numbers as one number",
        "out": str(args.out), "plot": str(args.plot), "skipped": skipped,
    }
    payload = common.report_header(SECTION, config, common.machine_info())
    payload.update(load_seconds=load_s, contexts=[], records=[])
    records = payload["records"]

    grid = [(h, L, s) for h in args.haystacks for L in args.lengths for s in args.seeds]
    bar = tqdm(total=len(grid) * len(combos), desc="multiturn", unit="session", dynamic_ncols=True)
    for hay, L, seed in grid:
        facts = make_facts(seed, args.n_facts, hay)
        ctx = build_context(model.tokenizer, L, facts, depths, seed, hay)
        turns_room = model.config.max_position_embeddings - len(ctx.ids)
        t_c = time.perf_counter()
        cpu_t_c = time.process_time()
        c0 = G.compile_seconds()
        bar.set_description(f"{hay}, {L} tok, seed {seed}")
        if args.prefill == "shared":
            engines, info = bench_needle.build_engines(model, ctx.ids, policies, ctx.tail_capacity, bar=bar)
        else:
            engines, info = [None] * len(policies), [{"prefill": "separate"}] * len(policies)
        prefill_s = time.perf_counter() - t_c
        for i, ((name, rho), label) in enumerate(zip(combos, labels)):
            bar.set_postfix_str(f"{label}")
            t_s = time.perf_counter()
            if engines[i] is None:
                sess = G.Session(model, ctx.text, policies[i])
            else:
                sess = session_around(model, ctx.text, engines[i], ctx.ids)
            engines[i] = None
            if sess.context_tokens != len(ctx.ids):
                raise RuntimeError(f"session context {sess.context_tokens} tokens, expected {len(ctx.ids)}")
            for t, fact in enumerate(facts):
                res = sess.ask(fact.question, max_new_tokens=args.max_new_tokens)
                st = res.stats
                records.append({
                    "haystack": hay, "length": L, "seed": seed, "label": label, "policy": name, "rho": rho, "turn": t,
                    "kind": fact.kind, "depth": depths[t], "actual_depth": ctx.actual_depths[t],
                    "question": fact.question, "answer": fact.answer, "text": res.text,
                    "generated_ids": res.token_ids, "stop_reason": st.stop_reason,
                    "correct": answer_correct(res.text, fact.answer),
                    "context_tokens": sess.context_tokens, "achieved_rho": st.achieved_rho,
                    "kv_bytes_device": st.kv_bytes_device, "kv_bytes_prompt": st.kv_bytes_prompt,
                    "kv_bytes_tail": st.kv_bytes_tail, "kv_bytes_host": st.kv_bytes_host,
                    "kv_bytes_index": st.kv_bytes_index, "kv_bytes_read_per_step": st.kv_bytes_read_per_step,
                    "recall": dict(st.policy_stats), "extend_seconds": st.extend_seconds,
                    "decode_seconds_total": sum(st.decode_seconds), "prefill_seconds": st.prefill_seconds,
                    **info[i],
                })
            del sess
            row = [r for r in records if r["haystack"] == hay and r["length"] == L and r["seed"] == seed
                   and r["label"] == label]
            tqdm.write(f"[{hay} {L} tok seed {seed}] {label}: " + " | ".join(
                f"{'Y' if r['correct'] else 'n'} {r['text']!r}" for r in row)
                + f"  ({time.perf_counter() - t_s:.0f} s)")
            bar.update(1)
        payload["contexts"].append({
            "haystack": hay, "length": L, "seed": seed, "context_tokens": len(ctx.ids), "room_after_context": turns_room,
            "facts": [dataclasses.asdict(f) for f in facts], "depths": depths,
            "fact_token_starts": ctx.fact_token_starts, "actual_depths": ctx.actual_depths,
            "prefill_wall_seconds": prefill_s, "seconds": time.perf_counter() - t_c,
            "process_seconds": time.process_time() - cpu_t_c,
            "compile_seconds": G.compile_seconds() - c0,
        })
    bar.close()
    payload["summary"] = summarize(records, combos, args.lengths, args.n_facts)
    payload["within_one_of_full"] = {lab: within_one_of_full(records, lab) for lab in labels if lab != "full"}
    payload["heterocache_vs_snapkv"] = hetero_vs_snapkv(records, args.budgets)
    payload["total_seconds"] = time.perf_counter() - t_start
    payload["total_process_seconds"] = time.process_time()  # CPU seconds of every thread, since start
    payload["load_avg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    payload["peak_rss_bytes"] = common.peak_rss_bytes()
    return payload


# ------------------------------------------------------------------ report
def results_table(payload: dict) -> str:
    cfg = payload["config"]
    depths = cfg["fact_depths"]
    hays = config_haystacks(cfg)
    per_hay = hays if len(hays) > 1 else []
    headers = ["context tok", "policy", "rho", "achieved rho",
               *[f"turn {t + 1} (d={d:g})" for t, d in enumerate(depths)], *per_hay, "facts recalled",
               "≤ 1 below full",
               "drift checks", "trigger rate", "recalls", "KiB recalled", "host KV MiB"]
    rows = []
    for s in payload["summary"]:
        w = payload["within_one_of_full"].get(s["label"])
        hetero = bool(s["drift_checks"]) or s["kv_bytes_host"]
        rows.append([
            common.fmt_num(s["length"]), s["policy"], "—" if s["policy"] == "full" else f"{s['rho']:g}",
            common.fmt_num(s["achieved_rho"], 3),
            *[f"{c}/{n}" for c, n in zip(s["turn_correct"], s["turn_total"])],
            *[common.fraction_text(*s.get("per_haystack", {}).get(h, (0, 0))) for h in per_hay],
            f"{s['recalled']}/{s['facts']}", "(reference)" if w is None else ("yes" if w["met"] else "no"),
            common.fmt_num(s["drift_checks"]) if hetero else "—",
            f"{100 * s['trigger_rate']:.0f} %" if s["trigger_rate"] is not None else "—",
            common.fmt_num(s["recalls"]) if hetero else "—",
            common.fmt_num(s["bytes_recalled"] / 1024, 0) if hetero else "—",
            common.fmt_num(s["kv_bytes_host"] / MiB, 1) if hetero else "—",
        ])
    return common.markdown_table(headers, rows, align="rllr" + "r" * (len(depths) + len(per_hay)) + "rcrrrrr")


def totals_table(payload: dict) -> str:
    """Facts recalled per policy over every context length: per haystack and in total ("7/9")."""
    hays = config_haystacks(payload["config"])
    rows = []
    for label in payload["config"]["combos"]:
        rs = [s for s in payload["summary"] if s["label"] == label]
        if not rs:
            continue
        per = [[sum(s.get("per_haystack", {}).get(h, (0, 0))[i] for s in rs) for i in (0, 1)] for h in hays]
        rec, tot = sum(s["recalled"] for s in rs), sum(s["facts"] for s in rs)
        rows.append([label, *[common.fraction_text(*p) for p in per], f"{common.fraction_text(rec, tot)} ({100 * rec / tot:.0f} %)"])
    return common.markdown_table(["policy", *hays, "total"], rows, align="l" + "r" * (len(hays) + 1))


def retrieval_table(payload: dict) -> str | None:
    """Decode-time retrieval policies (Quest, FreeKV): per combo and context length, the means over contexts of
    the last turn's session totals; None when no such policy ran."""
    rows = []
    for label in payload["config"]["combos"]:
        for L in payload["config"]["lengths"]:
            rs = [r for r in payload["records"] if r["label"] == label and r["length"] == L]
            last = {}
            for r in rs:  # the last turn of each context holds the session's totals
                k = (record_haystack(r), r["seed"])
                if k not in last or r["turn"] > last[k]["turn"]:
                    last[k] = r
            st = [r["recall"] for r in last.values()]
            if not st or "attended_fraction" not in st[0]:
                continue
            mean = lambda key: sum(x.get(key, 0) for x in st) / len(st)  # noqa: E731
            rmean = lambda key: sum(r.get(key, 0) for r in last.values()) / len(last)  # noqa: E731
            rows.append([
                label, common.fmt_num(L), f"{mean('attended_fraction'):.2f}",
                common.fmt_num(mean("recalled_pages_per_step"), 1) if "recalled_pages_per_step" in st[0] else "—",
                common.fmt_num(rmean("kv_bytes_prompt") / MiB, 1), common.fmt_num(rmean("kv_bytes_index") / MiB, 2),
                common.fmt_num(rmean("kv_bytes_host") / MiB, 1),
                common.fmt_num(rmean("kv_bytes_read_per_step") / MiB, 1),
            ])
    if not rows:
        return None
    return common.markdown_table(
        ["policy", "context tok", "attended fraction", "pages recalled / step",
         "prompt KV on device MiB", "index MiB (summaries, page ids)", "host KV MiB", "KV read / step MiB"],
        rows, align="lr" + "r" * 6)


def criteria_lines(payload: dict) -> list[str]:
    """The two questions, answered MET / NOT MET from the records."""
    w = payload["within_one_of_full"]
    n_ctx = len(payload["contexts"])
    n_facts = sum(len(c["facts"]) for c in payload["contexts"])
    close = [lab for lab, v in w.items() if v["met"]]
    far = [f"{lab} (up to {v['max_shortfall']} below)" for lab, v in w.items() if not v["met"]]
    lines = [f"- Over {n_ctx} context(s) ({', '.join(config_haystacks(payload['config']))}), {n_facts} facts per "
             "policy.",
             f"- At most one fact below full KV in every context: {', '.join(close) or 'none'}"
             + (f"; not: {', '.join(far)}." if far else ".")]
    for c in payload["heterocache_vs_snapkv"]:
        per = c.get("per_haystack") or {}
        lines.append(f"- HeteroCache above SnapKV at rho {c['rho']:g}: **{'MET' if c['met'] else 'NOT MET'}** "
                     f"({c['heterocache']} vs {c['snapkv']} facts recalled"
                     + (": " + ", ".join(f"{h} {a} vs {b}" for h, (a, b) in per.items()) if len(per) > 1 else "")
                     + ").")
    return lines


def answers_table(payload: dict, label: str = "full") -> str:
    many = len(config_haystacks(payload["config"])) > 1
    rows = [[*([record_haystack(r)] if many else []), common.fmt_num(r["length"]), str(r["seed"]), str(r["turn"] + 1),
             f"{r['actual_depth']:.2f}", r["question"], r["answer"], repr(r["text"]), "yes" if r["correct"] else "no"]
            for r in payload["records"] if r["label"] == label]
    return common.markdown_table([*(["haystack"] if many else []), "context tok", "seed", "turn", "fact at", "question",
                                  "answer", f"{label} answer", "correct"], rows,
                                 align=("l" if many else "") + "rrrrlllc")


def results_section(payload: dict, plot_rel: str | None) -> str:
    cfg = payload["config"]
    ctxs = payload["contexts"]
    tok = ", ".join(f"{n:,}" for n in sorted({c["context_tokens"] for c in ctxs}))
    hays = config_haystacks(cfg)
    hay_text = (f"each of {len(hays)} real-text haystacks ({', '.join(f'`{h}`' for h in hays)}; below)"
                if len(hays) > 1 else f"a real-text haystack (`{hays[0]}`"
                + (": `pydoc_data.topics`" if hays[0] == "pydoc" else "") + ")")
    lines = [
        common.section_header(f"Multi-turn recall: {cfg['model']}, {cfg['n_facts']} facts, one question per turn",
                              payload),
        "",
        f"{cfg['n_facts']} unrelated facts (a ticket number, a person's favourite thing, the day or the city of an "
        "event; "
        f"values from seed{'s' if len(cfg['seeds']) > 1 else ''} {', '.join(map(str, cfg['seeds']))}) at depths "
        f"{' / '.join(f'{d:g}' for d in cfg['fact_depths'])} of {hay_text}; the "
        f"context ({tok} tokens) is prefilled once into a `Session` per policy ("
        f"{'one forward pass shared by every policy' if cfg['prefill'] == 'shared' else 'one prefill each'}), then one "
        f"question per fact is asked per turn in depth order, up to {cfg['max_new_tokens']} new tokens each, greedy, "
        f"{cfg['dtype']}. Correct iff the one-word answer appears in the reply (case-insensitive whole word; numbers "
        "as one number). 'turn k': contexts whose k-th question was answered; '≤ 1 below full': the policy "
        "recalled at most one fact fewer than full KV in every context. HeteroCache columns are the session's "
        "`GenerationStats` after the last turn (drift checks per pivot, triggered fraction, satellite recalls, "
        "bytes recalled to the device; summed over contexts) and the satellites' KV in pinned host memory "
        "(the largest context's)."
        + "".join(f" Not run: {lab} ({err})." for lab, err in cfg.get("skipped", {}).items()),
        "",
        *bench_needle.haystack_lines(cfg),
        *([""] if cfg.get("haystack_sources") else []),
        results_table(payload),
        "",
        *(["Facts recalled per haystack, every context length:", "", totals_table(payload), ""]
          if len(hays) > 1 else []),
        *criteria_lines(payload),
        "",
        *(["Decode-time retrieval (means over contexts of each session's totals after its last turn; 'KV read / "
           "step' counts host fetches twice, as the latency roofline does):", "", retrieval_table(payload), ""]
          if retrieval_table(payload) else []),
        "Full-KV answers (the reference):",
        "",
        answers_table(payload),
        "",
        *common.closing_lines(payload, "multi-turn recall", plot_rel),
    ]
    return "\n".join(lines)


def make_plot(payload: dict, path: Path) -> Path | None:
    """Grouped bars: accuracy per turn (x) for every policy (bars), one panel per context length."""
    summary = payload["summary"]
    import numpy as np

    cfg = payload["config"]
    lengths, labels, depths = cfg["lengths"], cfg["combos"], cfg["fact_depths"]
    fig, axes = common.subplots(1, len(lengths), squeeze=False,
                                figsize=(1.2 + 0.45 * len(labels) * len(depths) * len(lengths) + 1.5, 4.2))
    width = 0.8 / len(labels)
    x = np.arange(len(depths))
    names = list(dict.fromkeys(lab.split("@")[0] for lab in labels))
    budgets = sorted({float(lab.split("@")[1]) for lab in labels if "@" in lab})
    for ax, L in zip(axes[0], lengths):
        for k, label in enumerate(labels):
            s = next((s for s in summary if s["length"] == L and s["label"] == label), None)
            if s is None:
                continue
            acc = [a if a is not None else np.nan for a in s["turn_accuracy"]]
            # one colour per policy, hatching per budget; zero-height bars still show as a baseline tick
            hatch = "" if s["policy"] == "full" or budgets.index(s["rho"]) == len(budgets) - 1 else "//"
            xs = x - 0.4 + (k + 0.5) * width
            ax.bar(xs, acc, width, label=f"{label} ({s['recalled']}/{s['facts']})", hatch=hatch, edgecolor="white",
                   color="k" if s["policy"] == "full" else f"C{names.index(s['policy'])}")
            ax.plot(xs, np.zeros_like(xs), "|", ms=6, color="k" if s["policy"] == "full" else
                    f"C{names.index(s['policy'])}")
        ax.set_xticks(x)
        ax.set_xticklabels([f"turn {t + 1}\nfact at {d:g}" for t, d in enumerate(depths)], fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("accuracy (fraction of contexts)")
        ax.set_title(f"{L:,}-token context", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return common.save_figure(fig, path, f"Multi-turn recall — {cfg['model']}, {common.git_summary(payload['git'])}",
                              crop=True)


# --------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    ph = lambda key: common.preset_help(PRESETS, key)  # noqa: E731
    S = argparse.SUPPRESS  # preset arguments: absent unless given, then filled from the preset
    p = common.argument_parser("Multi-turn recall on SmolLM2-135M: facts far apart in one long real-text context, "
                               "prefilled once into a Session, asked one per turn; accuracy per turn per policy and "
                               "budget.")
    common.add_grid_preset_argument(
        p, PRESETS, estimate_minutes, "'cpu': the make-bench configuration on pydoc; 'issue15': issue 15's evaluation "
        "(3 haystacks x 3 seeds x 2K/4K/7K, full/snapkv/heterocache at rho 0.5 and 0.3); 'full' (used when no preset "
        "is given): the complete one on every haystack; 'seeds': 3 seeds at 4K on every haystack.")
    p.add_argument("--lengths", type=int, nargs="+", default=S,
                   help="context lengths in tokens (the context is 8192)" + ph("lengths"))
    p.add_argument("--seeds", type=int, nargs="+", default=S, help="one context (fact set) per seed" + ph("seeds"))
    common.add_policy_arguments(p, PRESETS)
    common.add_haystacks_argument(p, PRESETS, "every (length, seed) context is built on each")
    p.add_argument("--n-facts", type=int, default=3, help="facts per context (= turns)")
    p.add_argument("--fact-depths", type=float, nargs="+", default=None,
                   help="depth of each fact (default: evenly from 0.15 to 0.85)")
    p.add_argument("--max-new-tokens", type=int, default=20,
                   help="answer tokens per turn (the model restates the question before the answer)")
    p.add_argument("--prefill", default="shared", choices=["shared", "separate"],
                   help="shared: one forward pass per context for every policy's Session; separate: a plain "
                        "Session per policy")
    common.add_model_arguments(p, MODEL)
    common.add_output_arguments(p, SECTION, SECTION, out_per_preset=True)
    args = common.parse_grid_args(p, PRESETS, SECTION, argv)
    if args.n_facts < 1 or args.max_new_tokens < 1 or any(n < 1 for n in args.lengths):
        p.error("--n-facts, --max-new-tokens and --lengths must be positive")
    if args.fact_depths is not None:
        if len(args.fact_depths) != args.n_facts:
            p.error(f"--fact-depths needs one depth per fact ({args.n_facts})")
        if any(not 0.0 <= d <= 1.0 for d in args.fact_depths) or sorted(args.fact_depths) != args.fact_depths:
            p.error("--fact-depths must be increasing, in [0, 1] (facts are asked in depth order)")
    return args


def report_tables(payload: dict) -> list[str]:
    """What the run prints: the results table, facts recalled per haystack (several haystacks), the criteria."""
    many = len(payload["config"]["haystacks"]) > 1
    return [results_table(payload), *([totals_table(payload)] if many else []), "\n".join(criteria_lines(payload))]


def main(argv=None) -> int:
    common.run_task(parse_args(argv), run, section=SECTION, make_plot=make_plot, results_section=results_section,
                    tables=report_tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
