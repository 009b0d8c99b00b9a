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
answer (a single word or number) appears in it (``harness.needles.answer_correct``:
case-insensitive, whole words; numbers as one number).

One forward pass per context serves every policy (``harness.prefill.build_engines``:
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
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (benchmarks/common.py)
import haystack  # noqa: E402  (benchmarks/haystack.py)
from harness import grid  # noqa: E402  (benchmarks/harness/grid.py: the grid runner)
from harness.facts import (  # noqa: E402  (facts, contexts, sessions around engines, aggregation)
    build_context, fact_depths, hetero_vs_snapkv, make_facts, retrieval_table, session_around, summarize,
    within_one_of_full,
)
from harness.needles import (  # noqa: E402
    IDLE_CORES, LOAD_S, answer_correct, config_haystacks, haystack_lines, interp_cost, record_haystack,
)
from harness.prefill import build_engines  # noqa: E402  (the shared prefill)

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

DESCRIPTION = ("Multi-turn recall on SmolLM2-135M: facts far apart in one long real-text context, prefilled once "
               "into a Session, asked one per turn; accuracy per turn per policy and budget.")
PRESETS_HELP = ("'cpu': the make-bench configuration on pydoc; 'issue15': issue 15's evaluation (3 haystacks x 3 "
                "seeds x 2K/4K/7K, full/snapkv/heterocache at rho 0.5 and 0.3); 'full' (used when no preset is "
                "given): the complete one on every haystack; 'seeds': 3 seeds at 4K on every haystack.")

# Run-time model for the --preset help, in CPU seconds, from a small measured run (2-core Xeon, 2026-11-25:
# licenses and stdlib-docs at 2000 and 7000 tokens, seed 0, full + snapkv + heterocache at rho 0.5 and 0.3;
# process_seconds and compile_seconds of each context in the JSON): one context with those five combos after
# compilation, by length; the first context of a length compiles (~130 s), later ones still compile a little
# for new question shapes (~20 s). Each further combo: ~8 s a session (a baseline), ~25 s (HeteroCache).
# Wall time on an idle 2-core machine ~ CPU seconds / IDLE_CORES. The Session rework in progress
# (chunked turn prefill, HeteroCache re-selecting at each question) will change these; re-measure after it.
_CONTEXT_CPU_S = {2000: 56.0, 4000: 75.0, 7000: 105.0}
_FIRST_COMPILE_CPU_S, _MORE_COMPILE_CPU_S = 130.0, 20.0


def estimate_minutes(preset: dict) -> float:
    """Estimated wall minutes of a multi-turn preset on an idle 2-core CPU (cold compilation cache)."""
    from hetero_jax.policies import registry_key

    combos = common.make_combos(preset["policies"], preset["budgets"])
    n_het = sum(registry_key(name) == "heterocache" for name, _ in combos)
    n_base = len(combos) - n_het
    n = len(preset["seeds"]) * len(preset["haystacks"])
    cpu = LOAD_S
    for L in preset["lengths"]:
        per_ctx = interp_cost(_CONTEXT_CPU_S, L) + 8.0 * (n_base - 3) + 25.0 * (n_het - 2)
        cpu += n * max(per_ctx, 10.0) + _FIRST_COMPILE_CPU_S + _MORE_COMPILE_CPU_S * (n - 1)
    return cpu / IDLE_CORES / 60


# ------------------------------------------------------------------- run
def run(args) -> dict:
    import jax
    from tqdm import tqdm

    from hetero_jax import runtime as G

    depths = args.fact_depths or fact_depths(args.n_facts)
    t_start = time.perf_counter()
    model, C, load_s = grid.load(args, args.lengths)
    # a combo whose budget its profile cannot meet at some length is left out and named in the report
    skipped = {lab: "; ".join(errs.values()) for lab, errs in C.refused.items()}
    C = C.never_refused()
    combos, labels, policies = C.combos, C.labels, C.policies
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
    payload = grid.open_payload(SECTION, config, load_s, contexts=[], records=[])
    records = payload["records"]

    def run_context(hay, L, seed, bar):
        facts = make_facts(seed, args.n_facts, hay)
        ctx = build_context(model.tokenizer, L, facts, depths, seed, hay)
        turns_room = model.config.max_position_embeddings - len(ctx.ids)
        t_c = time.perf_counter()
        cpu_t_c = time.process_time()
        c0 = G.compile_seconds()
        if args.prefill == "shared":
            engines, info = build_engines(model, ctx.ids, policies, ctx.tail_capacity, bar=bar)
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
            row = []
            for t, fact in enumerate(facts):
                res = sess.ask(fact.question, max_new_tokens=args.max_new_tokens)
                st = res.stats
                row.append({
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
            records.extend(row)
            tqdm.write(f"[{hay} {L} tok seed {seed}] {label}: " + " | ".join(
                f"{'Y' if r['correct'] else 'n'} {r['text']!r}" for r in row)
                + f"  ({time.perf_counter() - t_s:.0f} s)")
            bar.update(1)
        payload["contexts"].append({
            "haystack": hay, "length": L, "seed": seed, "context_tokens": len(ctx.ids),
            "room_after_context": turns_room,
            "facts": [dataclasses.asdict(f) for f in facts], "depths": depths,
            "fact_token_starts": ctx.fact_token_starts, "actual_depths": ctx.actual_depths,
            "prefill_wall_seconds": prefill_s, "seconds": time.perf_counter() - t_c,
            "process_seconds": time.process_time() - cpu_t_c,
            "compile_seconds": G.compile_seconds() - c0,
        })

    contexts = grid.points(args.haystacks, args.lengths, args.seeds)
    grid.drive(contexts, run_context, desc="multiturn", unit="session", total=len(contexts) * len(combos),
               update=False, describe=lambda hay, L, seed: f"{hay}, {L} tok, seed {seed}")
    payload["summary"] = summarize(records, combos, args.lengths, args.n_facts)
    payload["within_one_of_full"] = {lab: within_one_of_full(records, lab) for lab in labels if lab != "full"}
    payload["heterocache_vs_snapkv"] = hetero_vs_snapkv(records, args.budgets)
    return grid.close_payload(payload, t_start)


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
        rows.append([label, *[common.fraction_text(*p) for p in per],
                     f"{common.fraction_text(rec, tot)} ({100 * rec / tot:.0f} %)"])
    return common.markdown_table(["policy", *hays, "total"], rows, align="l" + "r" * (len(hays) + 1))


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
        *haystack_lines(cfg),
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
    p = grid.parser(DESCRIPTION, PRESETS, estimate_minutes, PRESETS_HELP)
    grid.add_preset_list(p, PRESETS, "--lengths", "context lengths in tokens (the context is 8192)", type=int)
    grid.add_preset_list(p, PRESETS, "--seeds", "one context (fact set) per seed", type=int)
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
