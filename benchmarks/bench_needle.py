#!/usr/bin/env python
"""Needle in a haystack: a (context length x needle depth) grid per KV-cache policy and budget.

SmolLM2-135M (``hetero_jax.load("smollm2-135m")``), batch 1, greedy. For every
prompt length, needle depth and seed, one prompt is built with
``benchmarks/haystack.py``: real text from each haystack of ``--haystacks``
(``pydoc``: ``pydoc_data.topics``; ``stdlib-docs``: standard-library docstrings;
``licenses``: license texts of installed packages; see ``haystack.HAYSTACKS``),
one needle sentence at that depth of the haystack, then the question, in the
chat template, exactly N tokens. The default needle is "The special magic number is
K." / "What is the special magic number mentioned in the text?" with a 5-digit
K from the seed (``--needle`` picks another kind; see ``NEEDLE_KINDS``). The
seed also picks where in the corpus the haystack starts.

How one prompt is run: **one forward pass for every policy.** Prefill's forward
pass does not depend on the policy (each layer's full prompt KV exists before a
policy chooses what to keep) nor on the head layout (HeteroCache's permuted
heads compute the same function), so the layer-major prefill runs once and every
policy's ``build_layer`` hook sees that layer's KV: layout policies get the KV
heads and the layer's parameters in their own order (the hidden states are
shared; HeteroCache therefore differs from its own prefill only by float
rounding). Each policy then gets the cache and decode ``Engine`` that
``generate(model, ids, policy)`` builds, and decodes its answer greedily (up to
``--max-new-tokens`` or EOS). ``--prefill per-layout`` runs one forward pass per
head layout instead (``harness.prefill.make_engines``), ``--prefill separate``
one ``Engine`` per policy (exactly ``generate``); ``--check-generate`` re-runs
``generate`` per policy on the first prompt and compares the tokens.

Correctness: :func:`answer_correct` (numbers: the digits as one number; words:
the answer as whole word(s), case- and punctuation-insensitive, a plural
``s``/``es`` allowed). A cell's score is the fraction of its seeds answered;
with several haystacks a (length, depth) cell pools them, the comparison with
full KV is per (haystack, length, depth), and the tables give counts per
haystack and in total.

Outputs: ``--out`` JSON (full config, machine, commit, every cell: prompt
tokens, needle position, generated text, correct), a PNG heatmap per policy
like the HeteroCache paper's Figure 3 (x = context length, y = depth, colour =
score), a markdown table on stdout, and with ``--write-results`` the
``needle`` section of ``benchmarks/RESULTS.md``.

    .venv/bin/python benchmarks/bench_needle.py --preset cpu           # make bench (~3 min on 2 cores)
    .venv/bin/python benchmarks/bench_needle.py --preset issue15 --write-results   # 3 haystacks, rho 0.3 (~11 min)

``--help`` prints every preset's estimated run time on 2 CPU cores (:func:`estimate_minutes`).
    .venv/bin/python benchmarks/bench_needle.py --write-results        # the full grid
    .venv/bin/python benchmarks/bench_needle.py --lengths 512 --depths 0.5 --policies full snapkv  # smoke test
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
from harness.needles import (  # noqa: E402
    IDLE_CORES, LOAD_S, NEEDLE_KINDS, answer_correct, config_haystacks, haystack_lines, interp_cost, make_needle,
    record_haystack, saved_tokenizer, score_grid, shortest_prompt, summarize,
)
from harness.prefill import build_engines, greedy_answer  # noqa: E402  (the shared prefill)

SECTION = "needle"
MODEL = "smollm2-135m"

# --preset values; explicit arguments override them.
_ISSUE15 = {
    "lengths": [1000, 2000, 4000, 7000],
    "depths": [0.1, 0.5, 0.9],
    "policies": ["full", "snapkv", "heterocache"],
    "budgets": [0.3],
    "seeds": [0],
    "haystacks": list(haystack.HAYSTACKS),
}
PRESETS = {
    "full": {
        "lengths": [1000, 2000, 4000, 6000, 7900],  # the context is 8192 tokens: "8K" is 7900
        "depths": [0.0, 0.25, 0.5, 0.75, 1.0],
        "policies": ["full", "streamingllm", "snapkv", "pyramidkv", "h2o", "cake", "heterocache"],
        "budgets": [0.3],
        "seeds": [0],
        "haystacks": list(haystack.HAYSTACKS),
    },
    # the full grid's depths and policies at 1K-4K only (section needle-short), sized for 2 cores
    "short": {
        "lengths": [1000, 2000, 4000],
        "depths": [0.0, 0.25, 0.5, 0.75, 1.0],
        "policies": ["full", "streamingllm", "snapkv", "pyramidkv", "h2o", "cake", "heterocache"],
        "budgets": [0.3],
        "seeds": [0],
        "haystacks": list(haystack.HAYSTACKS),
    },
    "cpu": {  # make bench: about 9 minutes on a 2-core CPU
        "lengths": [1000, 2000, 4000],
        "depths": [0.1, 0.5, 0.9],
        "policies": ["full", "streamingllm", "snapkv", "heterocache"],
        "budgets": [0.3],
        "seeds": [0],
        "haystacks": ["pydoc"],  # the one haystack make bench has always used
    },
    # issue 15: is HeteroCache's needle score a property of the pydoc haystack? Every haystack, 1K-7K, rho 0.3
    "issue15": _ISSUE15,
    # issue 15, held out: the seeds on which defaults are chosen (tau_copy), never reported as the grid
    "issue15-heldout": {**_ISSUE15, "policies": ["full", "heterocache"], "seeds": [100, 101]},
    # issues 17 and 18 (common.ISSUE_COMPARISONS) on issue 15's haystacks, 1K-4K (7K costs as much again on 2 cores)
    **{name: {"lengths": [1000, 2000, 4000], "depths": [0.1, 0.5, 0.9], **comparison, "seeds": [0],
              "haystacks": list(haystack.HAYSTACKS)} for name, comparison in common.ISSUE_COMPARISONS.items()},
}

DESCRIPTION = ("Needle-in-a-haystack grid (context length x depth) per KV-cache policy and budget on SmolLM2-135M, "
               "real-text haystack, one needle per prompt.")
PRESETS_HELP = ("'cpu': the make-bench grid on pydoc; 'issue15': issue 15's grid (3 haystacks x 1K-7K x 3 depths, "
                "full/snapkv/heterocache at rho 0.3); 'full' (used when no preset is given): the complete grid on "
                "every haystack; 'short': its 1K-4K part.")

# Run-time model for the --preset help, in CPU seconds, from small measured runs (2-core Xeon, 2026-11-25,
# --haystacks pydoc/licenses/stdlib-docs at 1K-7K, full + snapkv + heterocache at rho 0.3; process_seconds of
# each prompt in the JSON): one prompt with those three combos after compilation, by length; the first prompt
# of each length also compiles (~40 s). Combos beyond three: ~1.5 s each for a cheap policy, ~4.2 s per 1K
# prompt tokens for one that scores every token (h2o, cake, pyramidkv: calibrated on the recorded needle-full
# run, 25 prompts x 7 policies in 32.7 min). Wall time on an idle 2-core machine ~ CPU seconds / 1.3 (the
# measured runs used about one core each); a machine shared with other jobs takes longer.
_PROMPT_CPU_S = {1000: 6.2, 2000: 10.0, 4000: 19.4, 7000: 42.0}
_COMPILE_CPU_S = 40.0
_SCORING_POLICIES = ("h2o", "cake", "pyramidkv")


def estimate_minutes(preset: dict) -> float:
    """Estimated wall minutes of a needle preset on an idle 2-core CPU (cold compilation cache)."""
    combos = common.make_combos(preset["policies"], preset["budgets"])
    extra = combos[3:] if len(combos) > 3 else []
    n = len(preset["depths"]) * len(preset["seeds"]) * len(preset["haystacks"])
    cpu = LOAD_S + _COMPILE_CPU_S * len(preset["lengths"])
    for L in preset["lengths"]:
        per_prompt = interp_cost(_PROMPT_CPU_S, L)
        per_prompt += sum(4.2e-3 * L if name in _SCORING_POLICIES else 1.5 for name, _ in extra)
        cpu += n * per_prompt
    return cpu / IDLE_CORES / 60


# ------------------------------------------------------------------- run
def run(args) -> dict:
    import jax
    from tqdm import tqdm

    from hetero_jax import runtime as G

    t_start = time.perf_counter()
    model, C, load_s = grid.load(args, args.lengths)
    # a (combo, length) whose budget cannot be met is left out and named in the report: its cells show "—"
    skipped = C.refused
    C = C.runnable_somewhere(args.lengths)
    cfg = model.config
    short_lengths_refused(model.tokenizer, args, sys.exit)  # where parse_args had no tokenizer to check them with
    for L in args.lengths:
        if L + args.max_new_tokens > cfg.max_position_embeddings:
            raise SystemExit(f"prompt {L} + {args.max_new_tokens} new tokens exceeds the model's context of "
                             f"{cfg.max_position_embeddings} tokens")
    eos = set(model.tokenizer.eos_token_ids) | set(cfg.eos_token_ids)
    tail_capacity = G.tail_capacity_for(args.max_new_tokens)

    config = {
        "model": args.model, "dtype": str(jax.tree.leaves(model.params)[0].dtype), "preset": args.preset,
        "lengths": args.lengths, "depths": args.depths, "seeds": args.seeds, "budgets": args.budgets,
        "policies": args.policies, "combos": C.labels, "policy_reprs": [repr(p) for p in C.policies],
        "needle_kind": args.needle, "needle_example": dataclasses.asdict(make_needle(args.needle, args.seeds[0])),
        "max_new_tokens": args.max_new_tokens, "prefill": args.prefill, "share_scores": not args.no_share_scores,
        "compile_cache": not args.no_compile_cache, "check_generate": args.check_generate,
        "instruction": args.instruction, "temperature": 0.0, "batch": 1, "chat_template": True,
        "haystacks": args.haystacks, "skipped": skipped,
        "haystack_sources": {h: haystack.haystack_info(h, model.tokenizer) for h in args.haystacks},
        "matching": "answer_correct: numbers as one number; words as whole words, case/punctuation-insensitive",
        "out": str(args.out), "plot": str(args.plot),
    }
    payload = grid.open_payload(SECTION, config, load_s, prompts=[], records=[], checks=[])
    records = payload["records"]

    def run_prompt(hay, L, d, seed, bar):
        needle = make_needle(args.needle, seed)
        p = haystack.build_needle_prompt(model.tokenizer, L, [(d, needle.sentence)], needle.question, needle.answer,
                                         seed=seed, instruction=args.instruction, haystack=hay)
        t_p = time.perf_counter()
        cpu_t_p = time.process_time()
        c0 = G.compile_seconds()
        active = C.active(L)
        engines, info = build_engines(model, p.ids, [C.policies[i] for i in active], tail_capacity,
                                      prefill=args.prefill, bar=bar, share_scores=not args.no_share_scores)
        prefill_s = time.perf_counter() - t_p
        row = []
        for i, j in enumerate(active):
            (name, rho), label = C.combos[j], C.labels[j]
            bar.set_postfix_str(f"decode {label}")
            t_d = time.perf_counter()
            out_ids, stop = greedy_answer(engines[i], args.max_new_tokens, eos)
            text = model.tokenizer.decode(out_ids)
            rec = {
                "haystack": hay, "length": L, "depth": d, "seed": seed, "label": label, "policy": name, "rho": rho,
                "prompt_tokens": p.n_tokens, "needle_token_start": p.needle_token_starts[0],
                "actual_depth": p.actual_depths[0], "answer": needle.answer, "generated_ids": out_ids,
                "text": text, "stop_reason": stop, "correct": answer_correct(text, needle.answer),
                "decode_wall_seconds": time.perf_counter() - t_d, **common.engine_kv_stats(engines[i]), **info[i],
            }
            engines[i] = None  # free this policy's cache before the next decodes
            records.append(rec)
            row.append(rec)
        payload["prompts"].append({
            "haystack": hay, "length": L, "depth": d, "seed": seed, "prompt_tokens": p.n_tokens, "exact": p.exact,
            "needle": dataclasses.asdict(needle), "needle_token_start": p.needle_token_starts[0],
            "actual_depth": p.actual_depths[0], "skipped_chars": p.skipped_chars,
            "prefill_wall_seconds": prefill_s, "seconds": time.perf_counter() - t_p,
            "process_seconds": time.process_time() - cpu_t_p,
            "compile_seconds": G.compile_seconds() - c0,
        })
        tqdm.write(f"[{hay} {L} tok d={d:g} seed {seed} answer {needle.answer}] prefill {prefill_s:.0f} s | full: "
                   f"{row[0]['text']!r} | " + " ".join(f"{r['label']}={'Y' if r['correct'] else 'n'}" for r in row))
        if args.check_generate and not payload["checks"]:
            payload["checks"].append(check_against_generate(model, p.ids, [C.combos[j] for j in active],
                                                            [C.policies[j] for j in active], row, args.max_new_tokens))
            c = payload["checks"][0]
            tqdm.write("check vs generate(): " + ("OK" if not c["problems"] else "; ".join(c["problems"])))

    grid.drive(grid.points(args.haystacks, args.lengths, args.depths, args.seeds), run_prompt, desc="needle",
               unit="prompt", describe=lambda hay, L, d, seed: f"{hay}, {L} tok, depth {d:g}, seed {seed}")
    payload["summary"] = summarize(records, C.combos, args.lengths)
    return grid.close_payload(payload, t_start)


def check_against_generate(model, ids, combos, policies, row, max_new) -> dict:
    """Re-run ``generate`` per policy on one prompt; the mismatches in tokens, prompt KV bytes and rho."""
    import hetero_jax

    problems = []
    for (name, rho), pol, r in zip(combos, policies, row):
        g = hetero_jax.generate(model, ids, pol, max_new_tokens=max_new, temperature=0.0)
        if g.token_ids != r["generated_ids"]:
            problems.append(f"{r['label']}: tokens {r['text']!r} (shared prefill) vs {g.text!r} (generate)")
        if g.stats.kv_bytes_prompt != r["kv_bytes_prompt"] or abs(g.stats.achieved_rho - r["achieved_rho"]) > 1e-9:
            problems.append(f"{r['label']}: prompt KV {r['kv_bytes_prompt']} B / rho {r['achieved_rho']:.4f} vs "
                            f"{g.stats.kv_bytes_prompt} B / {g.stats.achieved_rho:.4f}")
    return {"haystack": row[0]["haystack"], "length": row[0]["length"], "depth": row[0]["depth"],
            "seed": row[0]["seed"], "problems": problems}


# ------------------------------------------------------------------ report
def results_table(payload: dict) -> str:
    cfg = payload["config"]
    hays = config_haystacks(cfg)
    per_hay = hays if len(hays) > 1 else []
    headers = ["policy", "rho", "achieved rho", *[f"{L:,} tok" for L in cfg["lengths"]], *per_hay, "accuracy",
               "cells = full", "vs full"]
    rows = []
    for s in payload["summary"]:
        vs = s["vs_full"]
        if s["policy"] == "full":
            verdict = "(reference)"
        elif vs["equal"] == vs["cells"]:
            verdict = "equal in every cell"
        else:
            verdict = f"{vs['below']} cell(s) below, {vs['above']} above"
        rows.append([s["policy"], "—" if s["policy"] == "full" else f"{s['rho']:g}",
                     common.fmt_num(s["achieved_rho"], 3),
                     *[common.fraction_text(*s["per_length"][str(L)]) for L in cfg["lengths"]],
                     *[common.fraction_text(*s.get("per_haystack", {}).get(h, (0, 0))) for h in per_hay],
                     f"{common.fraction_text(s['correct'], s['total'])} ({100 * s['accuracy']:.0f} %)",
                     common.fraction_text(vs["equal"], vs["cells"]), verdict])
    return common.markdown_table(headers, rows, align="llr" + "r" * (len(cfg["lengths"]) + len(per_hay)) + "rrl")


def full_answers_table(payload: dict) -> str:
    """Full KV's answer in every cell (the reference)."""
    many = len(config_haystacks(payload["config"])) > 1
    rows = [[*([record_haystack(r)] if many else []), common.fmt_num(r["length"]), f"{r['depth']:g}", str(r["seed"]),
             f"{r['actual_depth']:.2f}", r["answer"], repr(r["text"]), "yes" if r["correct"] else "no"]
            for r in payload["records"] if r["policy"] == "full"]
    return common.markdown_table([*(["haystack"] if many else []), "prompt tok", "depth", "seed", "needle at", "answer",
                                  "full-KV answer", "correct"], rows, align=("l" if many else "") + "rrrrrlc")


PREFILL_TEXT = {
    "shared": "One forward pass per prompt feeds every policy's selection (HeteroCache's permuted heads included)",
    "per-layout": "One forward pass per prompt and head layout feeds the policies' selections",
    "separate": "Every policy prefills the prompt itself (as `generate` does)",
}


def results_section(payload: dict, plot_rel: str | None) -> str:
    cfg = payload["config"]
    ex = cfg["needle_example"]
    hays = config_haystacks(cfg)
    many = len(hays) > 1
    diffs = [f"{s['label']}: " + ", ".join(f"{c['haystack'] + '/' if many else ''}{c['length']}/{c['depth']:g} "
                                          f"({c['full']:.2g}→{c['score']:.2g})" for c in s["vs_full"]["differ"])
             for s in payload["summary"] if s["policy"] != "full" and s["vs_full"]["differ"]]
    hay_text = (f"one of {len(hays)} real-text haystacks ({', '.join(f'`{h}`' for h in hays)}; below)" if many else
                f"a real-text haystack (`{hays[0]}`"
                + (": `pydoc_data.topics`" if hays[0] == "pydoc" else "") + ", `benchmarks/haystack.py`)")
    lines = [
        common.section_header(f"Needle in a haystack: {cfg['model']}, accuracy per policy (length x depth)", payload),
        "",
        f"One needle per prompt (kind `{cfg['needle_kind']}`, e.g. \"{ex['sentence']}\") at each depth of {hay_text}, "
        "then the question "
        f"(\"{ex['question']}\") in the chat template; every prompt is exactly its stated token count; "
        + (f"seeds {', '.join(map(str, cfg['seeds']))} pick" if len(cfg["seeds"]) > 1
           else f"seed {cfg['seeds'][0]} picks")
        + " the needle's value and where the haystack starts. Batch 1, greedy, "
        f"{cfg['dtype']}, up to {cfg['max_new_tokens']} new tokens. {PREFILL_TEXT[cfg['prefill']]}, giving each "
        "policy the cache `generate` would build. Correct iff the answer appears in the generated text (numbers "
        "as one number; words as whole words, case-insensitive). Columns per length"
        + (" and per haystack" if many else "") + ": prompts answered; "
        + ("'cells = full': (haystack, length, depth) cells" if many else "'cells = full': (length, depth) cells")
        + " whose score equals full KV's."
        + "".join(f" Not run: {lab} at {', '.join(errs)} tokens ({next(iter(errs.values()))})."
                  for lab, errs in cfg.get("skipped", {}).items()),
        "",
        *haystack_lines(cfg),
        *([""] if cfg.get("haystack_sources") else []),
        results_table(payload),
        "",
    ]
    lines += ([f"Cells that differ from full KV ({'haystack/' if many else ''}length/depth: full→policy):", ""]
              + [f"- {d}" for d in diffs] + [""]
              if diffs else ["Every policy scores the same as full KV in every cell.", ""])
    lines += ["Full-KV answers (the reference):", "", full_answers_table(payload), ""]
    if payload.get("checks"):
        c = payload["checks"][0]
        lines += [f"Check against `generate()` ({c.get('haystack', 'pydoc')}, {c['length']} tokens, depth "
                  f"{c['depth']:g}): "
                  + ("same tokens, prompt KV bytes and achieved rho for every policy." if not c["problems"]
                     else "MISMATCH: " + "; ".join(c["problems"])), ""]
    lines += common.closing_lines(payload, "needle grid", plot_rel)
    return "\n".join(lines)


def make_plot(payload: dict, path: Path) -> Path | None:
    """One heatmap per combo (x = context length, y = needle depth, colour = score), like Fig. 3 of the paper."""
    import numpy as np

    cfg = payload["config"]
    labels, lengths, depths = cfg["combos"], cfg["lengths"], cfg["depths"]
    ncols = min(4, len(labels))
    nrows = -(-len(labels) // ncols)
    fig, axes = common.subplots(nrows, ncols, squeeze=False,
                                figsize=(3.6 * ncols + 1.2, 0.32 * len(depths) * nrows + 1.6 * nrows + 0.6))
    im = None
    for k, label in enumerate(labels):
        ax = axes[k // ncols][k % ncols]
        grid = np.array([[np.nan if v is None else v for v in row]
                         for row in score_grid(payload["records"], label, lengths, depths)], float)
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(lengths)))
        ax.set_xticklabels([f"{L / 1000:g}K" for L in lengths], fontsize=8)
        ax.set_yticks(range(len(depths)))
        ax.set_yticklabels([f"{100 * d:g}%" for d in depths], fontsize=8)
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if np.isfinite(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.2g}", ha="center", va="center", fontsize=7)
        s = next(s for s in payload["summary"] if s["label"] == label)
        ax.set_title(f"{label}: {100 * s['accuracy']:.0f} %", fontsize=9)
        if k % ncols == 0:
            ax.set_ylabel("needle depth")
        if k // ncols == nrows - 1:
            ax.set_xlabel("context length (tokens)")
    for k in range(len(labels), nrows * ncols):
        axes[k // ncols][k % ncols].axis("off")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="score (fraction of prompts correct: seeds x "
                 "haystacks)")
    return common.save_figure(fig, path, f"Needle in a haystack ({cfg['needle_kind']}) — {cfg['model']}, "
                                         f"{common.git_summary(payload['git'])}", crop=True, title_y=1.02)


# --------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = grid.parser(DESCRIPTION, PRESETS, estimate_minutes, PRESETS_HELP)
    grid.add_preset_list(p, PRESETS, "--lengths", "prompt lengths in tokens (the context is 8192)", type=int)
    grid.add_preset_list(p, PRESETS, "--depths", "needle depths (fraction of the haystack)", type=float)
    common.add_policy_arguments(p, PRESETS)
    grid.add_preset_list(p, PRESETS, "--seeds", "one prompt per seed and cell; a cell's score is the fraction "
                             "answered", type=int)
    common.add_haystacks_argument(p, PRESETS, "every cell runs on each")
    p.add_argument("--needle", default="magic-number", choices=sorted(NEEDLE_KINDS), help="needle kind")
    p.add_argument("--max-new-tokens", type=int, default=24,
                   help="answer tokens checked (the model often restates the question first: 16 cut 5-digit answers)")
    p.add_argument("--instruction", default=None, help="optional text before the haystack")
    p.add_argument("--prefill", default="shared", choices=["shared", "per-layout", "separate"],
                   help="shared: one forward pass per prompt for every policy; per-layout: one per head layout; "
                        "separate: one Engine per policy (what generate() does)")
    p.add_argument("--check-generate", action="store_true",
                   help="re-run generate() per policy on the first prompt and compare (one prefill each)")
    p.add_argument("--no-share-scores", action="store_true",
                   help="compute each baseline's token scores once per budget instead of once per policy")
    common.add_model_arguments(p, MODEL)
    common.add_output_arguments(p, SECTION, SECTION, "PNG heatmaps", out_per_preset=True)
    args = common.parse_grid_args(p, PRESETS, SECTION, argv)
    if any(not 0.0 <= d <= 1.0 for d in args.depths):
        p.error("--depths must be in [0, 1]")
    if any(n < 1 for n in args.lengths) or args.max_new_tokens < 1:
        p.error("--lengths and --max-new-tokens must be positive")
    tokenizer = saved_tokenizer(args.model)  # a length too short for the prompt is refused before the model loads
    if tokenizer is not None:
        short_lengths_refused(tokenizer, args, p.error)
    return args


def short_lengths_refused(tokenizer, args, fail) -> None:
    """``fail(message)`` when a --lengths value is below the fewest tokens the needle prompt takes."""
    least = shortest_prompt(tokenizer, args.needle, args.seeds, args.instruction)
    short = [n for n in args.lengths if n < least]
    if short:
        what = "--instruction, needle and question" if args.instruction else "needle and question"
        fail(f"--lengths {' '.join(map(str, short))}: a {args.needle} needle prompt ({what} in the chat template) "
             f"takes {least} tokens before any haystack; give lengths of at least {least}")


def main(argv=None) -> int:
    payload = common.run_task(parse_args(argv), run, section=SECTION, make_plot=make_plot,
                              results_section=results_section, tables=lambda payload: [results_table(payload)],
                              plot_rows="records")
    return 1 if any(c["problems"] for c in payload["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
