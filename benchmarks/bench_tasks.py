#!/usr/bin/env python
"""Generated tasks whose answers move through the context (RULER-like), graded automatically, per policy and budget.

SmolLM2-135M (``hetero_jax.load("smollm2-135m")``), batch 1, greedy. Every case
is generated from its seed (values, names, keys, sentences) and placed in a
real-text haystack of ``benchmarks/haystack.py`` (each of ``--haystacks``:
``pydoc``, ``stdlib-docs``, ``licenses``; the seed also picks where the haystack
starts), followed by the question in the chat template, exactly N tokens
(``haystack.build_needle_prompt``). The tasks (``harness/task_cases.py``: ``TASKS``; docs/tasks.md):

- ``multi-fact``: 4 ticket numbers of different things at depths 0.1 .. 0.9, one
  question naming the things in depth order; graded per thing: the value the reply
  states for it must be its own, in any order (``grade_pairs``);
- ``variable-tracking``: a chain of assignments ``VAR A = 4821`` ... ``VAR B = VAR A``
  ... spread over the context, interleaved with a second chain bound to another
  value; the answer names every variable bound to the asked value, and naming one of
  the other chain scores nothing (``grade_names``);
- ``multi-key``: 4 needles of one form under different names; one is asked for, and
  naming a distractor's value fails the case (``grade_key``);
- ``span-copy``: a generated sentence after a marker; the answer must repeat it word
  for word (``grade_span``);
- ``fidelity``: the multi-fact prompt with 3-5 facts, and a teacher-forced answer
  that quotes them in turn; per step, top-1 agreement and KL(full || policy) of the
  next-token distribution on the quoted value tokens (``bench_fidelity``'s
  ``next_token_metrics``). It needs no skill from the model: it measures whether a
  policy's cache gives the distribution full KV gives when attention moves.

The phrasing (answer prefixes, four-digit values, names as keys, seven-word
sentences) is the one full KV answered most often on trial cases; docs/tasks.md
says what was tried.

How one prompt is run: the shared prefill of ``harness.prefill.build_engines`` (one
forward pass; every policy's selection sees each layer's KV, HeteroCache's in its
own head order), then each policy decodes its answer greedily
(``harness.prefill.greedy_answer``), or, for ``fidelity``, is fed the forced answer one
decode step at a time (``bench_fidelity.step_logits``: the policy's decode hooks run,
so HeteroCache's drift checks and recalls happen). A combo whose budget a policy
cannot keep at a length is skipped there and named.

Reported per task, policy and rho: the mean graded score with counts and sample
sizes, and full KV's solve rate on the same cases beside it (cases full KV answers
completely; for ``fidelity``, quoted tokens whose true value is full KV's top-1), so a
task full KV fails is reported as such. Every record keeps the prompt's token count, the
SHA-256 of its token ids and of its case (``--merge`` and ``--resume`` refuse a case
the generator no longer makes).

Outputs: ``--out`` JSON (config, per-case records: task, haystack, seed, length,
policy, rho, score, answer text), a PNG beside it (accuracy against rho per method,
one panel per task), a markdown table on stdout, and with ``--write-results`` the
``tasks`` section of ``benchmarks/RESULTS.md``. While it runs, every finished case
is also in ``OUT.partial.json`` (rewritten atomically after each case, removed when
``--out`` is written): a run that is killed (a 7.9K grid takes hours) keeps its
cases there, ``--resume`` finishes it, and ``--merge`` reads it as it is.

    .venv/bin/python benchmarks/bench_tasks.py --preset cpu        # 2K + 4K, pydoc, 2 seeds (--help: its estimate)
    .venv/bin/python benchmarks/bench_tasks.py --write-results     # the full grid (2K, 4K, 7.9K, 3 haystacks, 3 seeds)
    .venv/bin/python benchmarks/bench_tasks.py --lengths 2000 --seeds 0 --haystacks pydoc \\
        --policies full snapkv --budgets 0.5                          # smoke test
    .venv/bin/python benchmarks/bench_tasks.py ... --resume           # finish a killed run (same flags)

``--help`` prints every preset's estimated run time on 2 CPU cores (:func:`estimate_minutes`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (benchmarks/common.py)
import haystack  # noqa: E402  (benchmarks/haystack.py)
from harness import grid  # noqa: E402  (benchmarks/harness/grid.py: the grid runner)
from harness.merging import figure_provenance  # noqa: E402  (a merge's figure names its runs' commits)
from harness.needles import IDLE_CORES, LOAD_S, haystack_lines, interp_cost  # noqa: E402
from harness.prefill import build_engines, greedy_answer  # noqa: E402  (the shared prefill, greedy decode)
from harness.task_report import (  # noqa: E402  (summary, tables, --merge)
    GRADING, MERGE_INPUTS, answers_table, case_problem, fidelity_table, haystack_hashes, merge, missing_text,
    results_table, summarize,
)
from harness.merging import merged_lines  # noqa: E402  (a merge's runs in its section)
from harness.task_cases import (  # noqa: E402  (cases, grading, prompts, teacher forcing)
    DIGITS, TASKS, build_case_prompt, case_sha256, forced_metrics, grade, make_case,
)

SECTION = "tasks"
MODEL = "smollm2-135m"


# ------------------------------------------------------------------ presets
_ISSUE38_POLICIES = ["full", "snapkv", "pyramidkv", "heterocache", "heterocache:tau_drift=-1", "quest", "freekv",
                     "synckv", "contextkeeper", "hcattention"]
PRESETS = {
    # issue 38's grid: every task at 2K, 4K and 7.9K (SmolLM2's context is 8192) on every haystack, 3 seeds
    "full": {"tasks": list(TASKS), "lengths": [2000, 4000, 7900], "seeds": [0, 1, 2],
             "haystacks": list(haystack.HAYSTACKS), "policies": _ISSUE38_POLICIES, "budgets": [0.5, 0.3, "min"]},
    # sized for 30 minutes on 2 shared cores: 2K and 4K (no 7.9K), one haystack, 2 seeds, full / SnapKV /
    # HeteroCache with the drift check on and off at rho 0.3
    "cpu": {"tasks": list(TASKS), "lengths": [2000, 4000], "seeds": [0, 1], "haystacks": ["pydoc"],
            "policies": ["full", "snapkv", "heterocache", "heterocache:tau_drift=-1"], "budgets": [0.3]},
}
DESCRIPTION = ("Generated tasks whose answers move through the context (multi-fact, variable tracking, multi-key, "
               "span copy, teacher-forced fidelity), graded automatically, per KV-cache policy and budget on "
               "SmolLM2-135M.")
PRESETS_HELP = ("'full' (used when no preset is given): issue 38's grid (every task, 2K / 4K / 7.9K, 3 haystacks, 3 "
                "seeds, every method at rho 0.5, 0.3 and its smallest budget at each length); 'cpu': 2K and 4K, "
                "pydoc, seeds 0 and 1, full / SnapKV / HeteroCache with the drift check on and off at rho 0.3 (fewer "
                "lengths, haystacks and seeds than the full grid).")

# Run-time model for the --preset help, in CPU seconds, from the smoke run (2-core Xeon shared with other jobs,
# 2026-11-27: pydoc, 2000 tokens, seed 0, every task, full + snapkv at rho 0.5, 44 s wall; process_seconds of each
# case in the JSON): a case's shared forward pass by length (beyond 2K scaled as bench_needle's prompt costs), each
# policy's selection hook in it, and each decoded or teacher-forced token per policy (at most max_new_tokens; the
# forced replies are 30-60 tokens). HeteroCache's hook and decode step (drift checks, recalls) are taken as
# bench_multiturn measured them, about three times a baseline's; they were not in the smoke run. The first case
# of a length compiles (cold XLA cache: ~40 s, and ~15 s per policy).
_PREFILL_CPU_S = {2000: 6.0, 4000: 12.0, 7900: 30.0}
_HOOK_CPU_S = {2000: 1.5, 4000: 3.0, 7900: 6.0}
_TOKEN_CPU_S = {2000: 0.06, 4000: 0.09, 7900: 0.15}
_HETERO_FACTOR = 3.0
_COMPILE_CPU_S, _COMPILE_PER_POLICY_CPU_S = 40.0, 15.0
_FORCED_TOKENS = 50  # a fidelity case's forced reply (its cases' max_new_tokens is 0)


def _tokens_per_case(task: str) -> int:
    """Decoded (at most ``max_new_tokens``) or teacher-forced tokens of one case of ``task``, per policy."""
    return make_case(task, 0).max_new_tokens or _FORCED_TOKENS


def estimate_minutes(preset: dict) -> float:
    """Estimated wall minutes of a preset on an idle 2-core CPU (cold compilation cache)."""
    from hetero_jax.policies import registry_key
    interp = interp_cost
    combos = common.make_combos(preset["policies"], preset["budgets"])
    weight = [1.0 if name == "full" else _HETERO_FACTOR if registry_key(name) == "heterocache" else 1.0
              for name, _ in combos]
    cpu = LOAD_S
    for L in preset["lengths"]:
        cpu += _COMPILE_CPU_S + _COMPILE_PER_POLICY_CPU_S * len(combos)
        hooks = interp(_HOOK_CPU_S, L) * sum(weight[1:])
        per_seed = sum(interp(_PREFILL_CPU_S, L) + hooks + _tokens_per_case(t) * interp(_TOKEN_CPU_S, L) * sum(weight)
                       for t in preset["tasks"])
        cpu += per_seed * len(preset["seeds"]) * len(preset["haystacks"])
    return cpu / IDLE_CORES / 60


# ---------------------------------------------------------------------- run
def run(args) -> dict:
    import jax
    from tqdm import tqdm

    from hetero_jax import runtime as G

    t_start = time.perf_counter()
    # a (combo, length) whose budget the policy cannot keep is left out there and named in the report
    model, C, load_s = grid.load(args, args.lengths)
    combos, labels, policies = C.combos, C.labels, C.policies
    cfg = model.config
    tok = model.tokenizer
    eos = set(tok.eos_token_ids) | set(cfg.eos_token_ids)
    config = {
        "model": args.model, "dtype": str(jax.tree.leaves(model.params)[0].dtype), "preset": args.preset,
        "tasks": args.tasks, "lengths": args.lengths, "seeds": args.seeds, "haystacks": args.haystacks,
        "budgets": args.budgets, "policies": args.policies, "combos": labels,
        "policy_reprs": [repr(p) for p in policies], "skipped": C.refused, "smallest_budgets": C.smallest,
        "digits": DIGITS,
        "task_examples": {t: dataclasses.asdict(make_case(t, args.seeds[0])) for t in args.tasks},
        "haystack_sources": {h: haystack.haystack_info(h, tok) for h in args.haystacks},
        "temperature": 0.0, "batch": 1, "chat_template": True, "prefill": "shared (bench_needle.build_engines)",
        "grading": GRADING, "compile_cache": not args.no_compile_cache, "out": str(args.out), "plot": str(args.plot),
    }
    partial = partial_path(args.out)
    prior = resume_payload(partial, config) if args.resume else None
    payload = grid.open_payload(SECTION, config, load_s, prompts=[], records=[])
    if prior is not None:
        payload["records"], payload["prompts"] = prior["records"], prior["prompts"]
        payload["resumed_from"] = prior.get("resumed_from", []) + [
            {"commit": prior["git"].get("commit"), "command": prior["command"], "cases": len(prior["prompts"]),
             "seconds": prior["total_seconds"]}]
    prior_seconds = 0.0 if prior is None else prior["total_seconds"]
    prior_peak = 0 if prior is None else prior.get("peak_rss_bytes", 0)  # the interrupted processes' peak
    records = payload["records"]
    done = {(q["task"], q["haystack"], q["length"], q["seed"]) for q in payload["prompts"]}

    def checkpoint():
        """Every finished case in ``partial`` (atomically), as a payload ``--merge`` and ``--resume`` read."""
        snap = grid.close_payload({**payload, "summary": summarize(records, labels, args.tasks)}, t_start)
        snap["total_seconds"] += prior_seconds
        snap["peak_rss_bytes"] = max(snap["peak_rss_bytes"], prior_peak)
        snap["interrupted"] = True
        common.write_json(partial, snap)

    def run_case(hay, L, seed, task, bar):
        if (task, hay, L, seed) in done:
            return
        case = make_case(task, seed)
        p = build_case_prompt(tok, case, L, hay)
        n_after = len(p.forced_ids) if case.forced is not None else case.max_new_tokens
        if p.n_tokens + n_after > cfg.max_position_embeddings:
            raise SystemExit(f"{task}: prompt {p.n_tokens} + {n_after} answer tokens exceed the model's context of "
                             f"{cfg.max_position_embeddings} tokens; use a shorter --lengths")
        t_p, cpu_p, c0 = time.perf_counter(), time.process_time(), G.compile_seconds()
        active = C.active(L)
        engines, info = build_engines(model, p.ids, [C.policy(i, L) for i in active], G.tail_capacity_for(n_after + 1),
                                      bar=bar)
        prefill_s = time.perf_counter() - t_p
        base = {"task": task, "haystack": hay, "length": L, "seed": seed, "prompt_tokens": p.n_tokens,
                "prompt_sha256": p.sha256, "case_sha256": case_sha256(case), "values": list(case.values),
                "distractors": list(case.distractors)}
        row = []
        if case.forced is not None:
            bar.set_postfix_str(f"teacher-forcing {len(p.forced_ids)} tokens x {len(active)} caches")
            t_d = time.perf_counter()
            fm = forced_metrics(engines, p.forced_ids, p.quoted)
            for k, j in enumerate(active):
                m = fm[k]
                n = len(m["agree"])
                # full KV's score: its top-1 is the true token (would it quote the value?); a policy's: its top-1
                # is full KV's
                hits = sum(m["true_top1"]) if combos[j][0] == "full" else sum(m["agree"])
                row.append({**base, "label": labels[j], "policy": combos[j][0], "rho": C.rho(j, L),
                            "score": hits / n, "found": hits, "n": n, "solved": hits == n,
                            "text": tok.decode(m.pop("top1")), "forced": case.forced,
                            "kl_mean": sum(m["kl"]) / n, "agreement": sum(m["agree"]) / n,
                            "true_top1_rate": sum(m["true_top1"]) / n, "steps": m,
                            "decode_wall_seconds": time.perf_counter() - t_d,
                            **common.engine_kv_stats(engines[k]), **info[k]})
        else:
            for k, j in enumerate(active):
                bar.set_postfix_str(f"decode {labels[j]}")
                t_d = time.perf_counter()
                out_ids, stop = greedy_answer(engines[k], case.max_new_tokens, eos)
                text = tok.decode(out_ids)
                g = grade(case, text)
                row.append({**base, "label": labels[j], "policy": combos[j][0], "rho": C.rho(j, L), **g,
                            "solved": g["score"] == 1.0, "answer_prefix": case.answer_prefix, "text": text,
                            "generated_ids": out_ids, "stop_reason": stop,
                            "decode_wall_seconds": time.perf_counter() - t_d,
                            **common.engine_kv_stats(engines[k]), **info[k]})
                engines[k] = None  # free this policy's cache before the next decodes
        del engines
        records.extend(row)
        payload["prompts"].append({
            **{k: base[k] for k in ("task", "haystack", "length", "seed", "prompt_tokens", "prompt_sha256")},
            "target_tokens": p.target_tokens, "exact": p.n_tokens == p.target_tokens,
            "case": dataclasses.asdict(case), "needle_token_starts": p.needle_token_starts,
            "actual_depths": p.actual_depths, "skipped_chars": p.skipped_chars, "forced_tokens": len(p.forced_ids),
            "prefill_wall_seconds": prefill_s, "seconds": time.perf_counter() - t_p,
            "process_seconds": time.process_time() - cpu_p, "compile_seconds": G.compile_seconds() - c0,
        })
        tqdm.write(f"[{task} {hay} {L} tok seed {seed}] full: {row[0]['text']!r} | "
                   + " ".join(f"{r['label']}={r['score']:.2f}" for r in row))
        checkpoint()

    grid.drive(grid.points(args.haystacks, args.lengths, args.seeds, args.tasks), run_case, desc="tasks", unit="case",
               describe=lambda hay, L, seed, task: f"{task}, {hay}, {L} tok, seed {seed}")
    payload["summary"] = summarize(records, labels, args.tasks)
    payload = grid.close_payload(payload, t_start)
    payload["total_seconds"] += prior_seconds
    payload["peak_rss_bytes"] = max(payload["peak_rss_bytes"], prior_peak)
    return payload


# ------------------------------------------------------- checkpoint / resume
# config keys a resumed run must share with the interrupted one (the rest, e.g. the command, may differ)
RESUME_KEYS = ("model", "dtype", "tasks", "lengths", "seeds", "haystacks", "combos", "policy_reprs", "digits",
               "grading", "chat_template")


def partial_path(out: Path) -> Path:
    """Where a run keeps its finished cases until ``out`` is written: OUT.partial.json beside it."""
    out = Path(out)
    return out.with_name(out.stem + ".partial.json")


def check_no_partial(out: Path) -> None:
    """Before a fresh run (no ``--resume``): refuse to overwrite another run's finished cases."""
    partial = partial_path(out)
    if partial.exists():
        raise SystemExit(f"{partial} exists: the finished cases of an interrupted run with this --out. Add --resume "
                         f"(and that run's flags) to finish it, pass it to --merge, or move it away to start afresh")


def resume_payload(partial: Path, config: dict) -> dict:
    """The interrupted run's payload in ``partial``; SystemExit when it is missing or was run with another grid."""
    if not partial.exists():
        raise SystemExit(f"--resume: {partial} does not exist (no interrupted run with this --out); drop --resume")
    try:
        prior = json.loads(partial.read_text())
        diff = [k for k in RESUME_KEYS if prior["config"].get(k) != config.get(k)]
        if haystack_hashes(prior["config"]) != haystack_hashes(config):  # the same names, another text
            diff.append("haystack text (sha256)")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise SystemExit(f"--resume: {partial} is not a bench_tasks checkpoint ({type(e).__name__}: {e})") from None
    if diff:
        raise SystemExit(f"--resume: {partial} was run with another {', '.join(diff)}; resume with that run's flags "
                         f"(its command: {prior.get('command')})")
    for r in prior["records"]:
        problem = case_problem(r)
        if problem:
            raise SystemExit(f"--resume: {partial}: {problem} (or move the file away to start afresh)")
    if any("case_sha256" not in r for r in prior["records"]):
        print(f"note: --resume: {partial} recorded no case hashes (run before they were kept): its cases are not "
              "checked against this code's generator", file=sys.stderr)
    return prior


def results_section(payload: dict, plot_rel: str | None) -> str:
    cfg = payload["config"]
    fid = fidelity_table(payload)
    lines = [
        common.section_header(f"Tasks with moving answers: {cfg['model']}, accuracy per task, policy and rho",
                              payload),
        "",
        f"Generated cases (docs/tasks.md) in real-text haystacks ({', '.join(cfg['haystacks'])}), "
        f"{', '.join(common.fmt_num(L) for L in cfg['lengths'])} tokens, seeds {', '.join(map(str, cfg['seeds']))}; "
        f"one shared prefill per case, greedy replies (batch 1, {cfg['dtype']}) after an answer prefix. Accuracy: "
        "the mean graded score; 'right': graded units (values stated for the right thing, chain names, cases, "
        "quoted tokens); 'cases below / above full': cases whose score is below / above full KV's (fidelity: whose "
        "quoted tokens the policy's top-1 predicts less / more often than full KV's); 'full KV solves (these "
        "cases)': of the row's cases, those full KV answers completely (fidelity: quoted tokens whose true value is "
        "full KV's top-1), so a task full KV fails shows as such. Grading: "
        + "; ".join(f"{t}: {g}" for t, g in cfg["grading"].items() if t in cfg["tasks"]) + "."
        + "".join(f" Not run: {lab} at {', '.join(errs)} tokens ({next(iter(errs.values()))})."
                  for lab, errs in cfg.get("skipped", {}).items()) + missing_text(cfg),
        "",
        *haystack_lines(cfg),
        "",
        *merged_lines(cfg),
        *([f"Resumed (`--resume`): the first {r['cases']} cases ran at {r['commit']} (`{r['command']}`)."
           for r in payload.get("resumed_from", [])] + [""] if payload.get("resumed_from") else []),
        results_table(payload),
        "",
    ]
    if fid:
        lines += ["Moving-attention fidelity on the quoted value tokens, by the value's place in the reply:", "",
                  fid, ""]
    lines += ["Full-KV replies (the reference):", "", answers_table(payload), "",
              *common.closing_lines(payload, "tasks", plot_rel)]
    return "\n".join(lines)


def make_plot(payload: dict, path: Path) -> Path | None:
    """Accuracy against rho, one panel per task, one line per method; full KV as a dashed line."""
    summary = payload["summary"]
    tasks = list(dict.fromkeys(s["task"] for s in summary))
    fig, axes = common.subplots(1, len(tasks), squeeze=False, figsize=(3.4 * len(tasks) + 1.5, 3.6))
    methods = list(dict.fromkeys(s["policy"] for s in summary if s["policy"] != "full"))
    for ax, task in zip(axes[0], tasks):
        ss = [s for s in summary if s["task"] == task]
        for s in ss:
            if s["policy"] == "full":
                ax.axhline(s["score_mean"], color="k", ls="--", lw=1,
                           label="full KV" + (" (fidelity: top-1 = true token)" if task == "fidelity" else ""))
        for mi, m in enumerate(methods):
            pts = sorted((s["rho"], s["score_mean"]) for s in ss if s["policy"] == m)
            if pts:
                ax.plot(*zip(*pts), marker="o", color=f"C{mi}", label=m)
        ax.set_title(task + (" (top-1 = full KV)" if task == "fidelity" else ""), fontsize=9)
        ax.set_xlabel("budget rho")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("accuracy (mean graded score)")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    cfg = payload["config"]
    return common.save_figure(fig, path, f"Tasks with moving answers — {cfg['model']}, "
                                         f"{len(cfg['seeds'])} seed(s) x {len(cfg['haystacks'])} haystack(s), "
                                         f"{figure_provenance(payload)}", crop=True)


# --------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    p = grid.parser(DESCRIPTION, PRESETS, estimate_minutes, PRESETS_HELP)
    grid.add_preset_list(p, PRESETS, "--tasks", f"tasks ({', '.join(TASKS)})", choices=list(TASKS),
                             metavar="TASK")
    grid.add_preset_list(p, PRESETS, "--lengths", "prompt lengths in tokens (the context is 8192)", type=int)
    grid.add_preset_list(p, PRESETS, "--seeds", "one case per task and seed", type=int)
    common.add_policy_arguments(p, PRESETS, smallest=True)
    common.add_haystacks_argument(p, PRESETS, "every case runs on each")
    common.add_model_arguments(p, MODEL)
    common.add_output_arguments(p, SECTION, SECTION, out_per_preset=True, named=True)
    p.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                   help="join the JSON of runs of slices of the grid (other lengths, seeds, haystacks, tasks or "
                        "budgets) into one table instead of running (with --write-results, the section of their "
                        "preset); refused when the model, dtype, grading, decoding, preset, a haystack's text or a "
                        "label's policy configuration differ, a combo's case is in two runs, or full KV answers a "
                        "case differently")
    p.add_argument("--resume", action="store_true",
                   help="finish the run whose finished cases are in OUT.partial.json (same grid flags): its cases "
                        "are kept, the others run")
    args = common.parse_grid_args(p, PRESETS, SECTION, argv)
    if args.resume and args.merge:
        p.error("--resume finishes a run; --merge joins finished ones: give one of them")
    if any(n < 1 for n in args.lengths):
        p.error("--lengths must be positive")
    if any(s < 0 for s in args.seeds):
        p.error("--seeds must be >= 0")
    if args.merge:  # each a result file of this script, before any work (merge reads them again)
        common.read_json_inputs(p, "--merge", args.merge, script="bench_tasks.py", **MERGE_INPUTS)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.merge and not args.resume:
        check_no_partial(args.out)
    common.run_task(args, (lambda a: merge(a, SECTION)) if args.merge else run, section=SECTION, make_plot=make_plot,
                    results_section=results_section,
                    tables=lambda payload: [t for t in (results_table(payload), fidelity_table(payload)) if t])
    if not args.merge:
        partial_path(args.out).unlink(missing_ok=True)  # its cases are in --out now
    return 0


if __name__ == "__main__":
    sys.exit(main())
