#!/usr/bin/env python
"""Policy sweep: device KV, achieved rho, decode ms/token vs full KV, and passkey accuracy.

SmolLM2-135M (``hetero_jax.load("smollm2-135m")``), batch 1, greedy. For each
prompt length (default 4000 and 7900 tokens: "4K" and "8K" with room for the
new tokens inside the 8192-token context) and each needle depth (default 0.1,
0.5, 0.9), one passkey prompt is built with ``benchmarks/haystack.py`` (real
text from ``pydoc_data.topics``, "The pass key is K. Remember it. K is the
pass key." at that depth, then "What is the pass key?" in the chat template,
exactly N tokens). Every registered policy runs on it at every budget rho
(default 0.3 and 0.5; full KV once as the reference).

How one prompt is run (all policies in one process, side by side):

1. **One shared prefill per head layout** (``harness.prefill.make_engines``). Prefill's forward pass does not
   depend on the policy (each layer's full prompt KV is built first; a policy
   only chooses what of it to keep), so the layer-major prefill runs once and
   every policy's ``build_layer`` hook runs on each layer's KV in turn
   (HeteroCache permutes the KV heads, so it gets its own prefill). Each policy
   gets the cache ``generate(model, ids, policy)`` would build (``finish``
   applied) and ``generate``'s decode ``Engine`` around it. The baselines'
   token scores never read the budget, so within a layer they are computed once
   per policy and shared by its budgets (``--no-share-scores`` turns this off).
   ``--check-generate`` re-runs ``generate`` for every policy on the first
   prompt and checks the tokens, KV bytes and achieved rho agree.
2. **Interleaved decode.** Greedy decode steps run round-robin over all the
   policies' engines (the order rotates every step) with ``Engine.step``, the
   step ``generate`` runs (HeteroCache's drift checks and recalls included).
   On the ``--timing-depth`` prompt of each length, the first
   ``--warmup-steps`` steps per engine are untimed and the next
   ``--decode-steps`` are timed (wall time including reading the token back;
   compile time excluded, as in ``generate``); decode continues past EOS for
   timing only. The other prompts decode just their answers.
3. **Accuracy.** The first ``--max-new-tokens`` generated tokens (up to EOS)
   are the answer; correct iff they contain the passkey as a number.

KV bytes and achieved rho are ``Engine.stats_fields()`` (what
``GenerationStats`` reports) when the answer is complete. A policy's decode
ms/token is the median over its timed steps; its ratio to full KV divides by
full KV's median from the same interleaved steps (means in the JSON too).

Cost on a 2-core CPU: compile dominates small runs (every policy's cache shape
compiles its own decode step; CAKE's data-dependent per-layer budgets recompile
selection and decode for every prompt). The persistent XLA cache
(``hetero_jax.cli.enable_compilation_cache``) makes reruns start faster.

Outputs: ``--out`` JSON (full config, machine, commit, every sample), a PNG
beside it, a markdown table on stdout, and with ``--write-results`` the
``policies`` section of ``benchmarks/RESULTS.md``.

    .venv/bin/python benchmarks/bench_policies.py --write-results
    .venv/bin/python benchmarks/bench_policies.py --lengths 1024 --depths 0.5 --budgets 0.5 \\
        --policies full snapkv --decode-steps 8                          # smoke test
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (benchmarks/common.py)
import haystack  # noqa: E402  (benchmarks/haystack.py)
from harness import grid  # noqa: E402  (benchmarks/harness/grid.py: the grid runner)
from harness.policies_report import (  # noqa: E402  (summary, tables, RESULTS section, figure)
    answers_table, make_plot, results_section, results_table, summarize,
)
from harness.prefill import make_engines  # noqa: E402  (the shared prefill; bench_fidelity uses it from here)

SECTION = "policies"
MODEL = "smollm2-135m"
DEFAULT_LENGTHS = (4000, 7900)
DEFAULT_BUDGETS = (0.3, 0.5)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)


# ------------------------------------------------------------------ combos
def policy_names() -> list[str]:
    from hetero_jax.policies import REGISTRY

    return list(REGISTRY)


# ------------------------------------------------------------- one prompt
def run_prompt(model, ids: list[int], combos, policies, *, max_new: int, warmup: int, steps: int, timed: bool,
               share_scores: bool = True, bar=None):
    """Prefill once per layout for every policy, then decode all engines round-robin. One dict per combo.

    ``timed``: decode ``warmup + steps`` steps per engine and time the last ``steps``; otherwise stop each
    engine when its answer is complete (EOS or ``max_new`` tokens).
    """
    from hetero_jax import runtime as G
    cfg = model.config
    eos = set(model.tokenizer.eos_token_ids) | set(cfg.eos_token_ids)
    # tokens generated per cache (the first comes from prefill); the tail is sized as for a timed prompt
    # either way, so every prompt of a length shares the compiled decode steps
    total_timed = max(max_new, warmup + steps + 1)
    total = total_timed if timed else max_new
    tail_capacity = G.tail_capacity_for(total_timed)

    c0 = G.compile_seconds()
    t0 = time.perf_counter()
    engines, info = make_engines(model, ids, policies, tail_capacity, bar, share_scores)
    prefill_wall = time.perf_counter() - t0
    prefill_compile = G.compile_seconds() - c0
    after_prefill = [common.engine_kv_stats(e) for e in engines]

    n = len(combos)
    out_ids: list[list[int]] = [[] for _ in range(n)]
    done = [False] * n
    stop = ["max_new_tokens"] * n
    answer_stats: list[dict | None] = [None] * n

    def accept(i, t):
        if done[i]:
            return
        if t in eos:
            done[i], stop[i] = True, "eos"
        else:
            out_ids[i].append(t)
            done[i] = len(out_ids[i]) >= max_new
        if done[i]:  # the answer is complete: KV as generate(max_new_tokens) would report it
            answer_stats[i] = common.engine_kv_stats(engines[i])

    toks = [int(e.first_tokens(0.0, 1.0)[0]) for e in engines]
    for i in range(n):
        accept(i, toks[i])
    times: list[list[float]] = [[] for _ in range(n)]
    c1 = G.compile_seconds()
    for step in range(total - 1):
        if not timed and all(done):
            break
        order = [(step + j) % n for j in range(n)]  # rotate: no policy always runs right after another
        for i in order:
            if not timed and done[i]:
                continue
            nxt, seconds = engines[i].step([toks[i]], 0.0, 1.0)  # compile time is excluded by Engine.step
            if timed and step >= warmup and len(times[i]) < steps:
                times[i].append(seconds)
            toks[i] = int(nxt[0])
            accept(i, toks[i])
        if bar is not None:
            bar.set_postfix_str(f"decode step {step + 1}/{total - 1} x {n} policies")
    decode_compile = G.compile_seconds() - c1
    final = [common.engine_kv_stats(e) for e in engines]
    engines.clear()  # free the caches now (the list, not the name: accept() above closes over it)

    results = []
    for i, (name, rho) in enumerate(combos):
        st = answer_stats[i] or final[i]
        results.append({
            "policy": name, "rho": rho, "label": common.combo_label(name, rho), "policy_repr": repr(policies[i]),
            **st,
            "kv_after_prefill": after_prefill[i],
            "recall_after_timing": final[i]["recall"],
            "generated_ids": out_ids[i],
            "text": model.tokenizer.decode(out_ids[i]),
            "stop_reason": stop[i],
            "decode_seconds": times[i],
            **info[i],
        })
    meta = {"prefill_wall_seconds": prefill_wall, "prefill_compile_seconds": prefill_compile,
            "decode_compile_seconds": decode_compile, "tail_capacity": tail_capacity, "timed": timed}
    return results, meta


def check_against_generate(model, ids, combos, policies, results, max_new, tail_capacity) -> list[str]:
    """Re-run ``generate`` per policy; return the mismatches (empty when everything agrees)."""
    import hetero_jax
    from hetero_jax import runtime as G

    same_tail = G.tail_capacity_for(max_new) == tail_capacity  # else the tails differ by design
    problems = []
    for (name, rho), pol, r in zip(combos, policies, results):
        g = hetero_jax.generate(model, ids, pol, max_new_tokens=max_new, temperature=0.0)
        s = g.stats
        want = {"generated_ids": g.token_ids, "kv_bytes_prompt": s.kv_bytes_prompt, "achieved_rho": s.achieved_rho,
                "kv_bytes_host": s.kv_bytes_host}
        if same_tail:
            want["kv_bytes_tail"] = s.kv_bytes_tail
        for k, v in want.items():
            got = r[k]
            if (abs(got - v) > 1e-9) if isinstance(v, float) else (got != v):
                problems.append(f"{common.combo_label(name, rho)}: {k} shared-prefill {got!r} vs generate {v!r}")
    return problems


# ------------------------------------------------------------------- main run
def run(args) -> dict:
    import jax
    from tqdm import tqdm

    t0 = time.perf_counter()
    model, C, load_s = grid.load(args)
    combos, policies = C.combos, C.policies
    cfg = model.config
    ctx = cfg.max_position_embeddings
    total_new = max(args.max_new_tokens, args.warmup_steps + args.decode_steps + 1)
    for L in args.lengths:
        if L + total_new > ctx:
            raise SystemExit(f"prompt {L} + {total_new} new tokens exceeds the model's context of {ctx} tokens; "
                             f"use --lengths of at most {ctx - total_new}")

    config = {
        "model": args.model, "dtype": str(jax.tree.leaves(model.params)[0].dtype),
        "lengths": args.lengths, "depths": args.depths, "budgets": args.budgets,
        "policies": [n for n, _ in combos[:1]] + list(dict.fromkeys(n for n, _ in combos[1:])),
        "combos": C.labels, "policy_reprs": [repr(p) for p in policies],
        "max_new_tokens": args.max_new_tokens, "warmup_steps": args.warmup_steps,
        "decode_steps": args.decode_steps, "timing_depth": args.timing_depth or "all",
        "share_scores": not args.no_share_scores, "compile_cache": not args.no_compile_cache,
        "seed": args.seed, "instruction": args.instruction,
        "temperature": 0.0, "batch": 1,
        "needle": haystack.PASSKEY_NEEDLE, "question": haystack.PASSKEY_QUESTION,
        "haystack": "pydoc_data.topics.topics, sorted keys joined by blank lines (benchmarks/haystack.py)",
        "chat_template": True, "check_generate": args.check_generate,
        "out": str(args.out), "plot": str(args.plot),
        "prefill": "one shared layer-major prefill per prompt; every policy's build_layer hook on each layer",
        "decode_timing": "round-robin over all policies' caches, order rotated per step; "
                         "warm-up steps untimed; wall time per step incl. token read-back",
    }
    payload = grid.open_payload(SECTION, config, load_s, prompts=[], runs=[], checks=[])
    runs = payload["runs"]

    def run_one(L, d, bar):
        p = haystack.build_passkey(model.tokenizer, L, d, seed=args.seed, instruction=args.instruction)
        if not p.exact:
            tqdm.write(f"note: the {L}-token prompt at depth {d:g} has {p.n_tokens} tokens")
        t_p = time.perf_counter()
        res, meta = run_prompt(model, p.ids, combos, policies, max_new=args.max_new_tokens,
                               warmup=args.warmup_steps, steps=args.decode_steps,
                               timed=args.timing_depth is None or d == args.timing_depth,
                               share_scores=not args.no_share_scores, bar=bar)
        prompt_rec = {
            "length": L, "depth": d, "prompt_tokens": p.n_tokens, "passkey": p.answer,
            "needle_token_start": p.needle_token_starts[0], "actual_depth": p.actual_depths[0],
            "seconds": time.perf_counter() - t_p, **meta,
        }
        payload["prompts"].append(prompt_rec)
        for r in res:
            r.update(length=L, depth=d, prompt_tokens=p.n_tokens, passkey=p.answer,
                     correct=haystack.passkey_correct(r["text"], p.answer))
            runs.append(r)
        full = res[0]
        tqdm.write(
            f"[{L} tok d={d:g} key {p.answer}] prefill {meta['prefill_wall_seconds']:.0f} s "
            f"(compile {meta['prefill_compile_seconds']:.0f} s) | full: {full['text']!r} | correct: "
            + " ".join(f"{r['label']}={'Y' if r['correct'] else 'n'}" for r in res))
        if args.check_generate and not payload["checks"]:
            problems = check_against_generate(model, p.ids, combos, policies, res, args.max_new_tokens,
                                              meta["tail_capacity"])
            payload["checks"].append({"length": L, "depth": d, "problems": problems})
            tqdm.write("check vs generate(): " + ("OK" if not problems else "; ".join(problems)))

    grid.drive(grid.points(args.lengths, args.depths), run_one, desc="policies", unit="prompt",
               describe=lambda L, d: f"{L} tok, depth {d:g}")
    payload["summary"] = summarize(runs, combos, args.lengths)
    return grid.close_payload(payload, t0, cpu=False)


# --------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    names = policy_names()
    p = common.argument_parser("Every KV-cache policy at each budget vs full KV on SmolLM2-135M: device KV bytes, "
                               "achieved rho, decode ms/token side by side with full KV, and passkey accuracy.")
    p.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS),
                   help="prompt lengths in tokens (the context is 8192: '8K' is 7900)")
    p.add_argument("--policies", nargs="+", default=names, type=common.policy_spec,
                   help="registered policies, optionally with options (quest:offload=true; full KV always runs once, "
                        "as the reference)")
    p.add_argument("--budgets", type=float, nargs="+", default=list(DEFAULT_BUDGETS), help="budgets rho in (0, 1]")
    p.add_argument("--depths", type=float, nargs="+", default=list(DEFAULT_DEPTHS),
                   help="needle depths (fraction of the haystack)")
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per policy (timed prompts)")
    p.add_argument("--timing-depth", default="0.5",
                   help="decode is timed on the prompt with this needle depth (one per length; the other "
                        "prompts only decode their answers); 'all' times every prompt. Default: 0.5, or the "
                        "first of --depths when 0.5 is not among them")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed decode steps per policy and prompt first")
    p.add_argument("--max-new-tokens", type=int, default=12, help="answer tokens checked for the passkey")
    p.add_argument("--seed", type=int, default=0, help="passkey and haystack start")
    p.add_argument("--instruction", default=None,
                   help="optional text before the haystack (e.g. 'There is an important info hidden inside "
                        "a lot of irrelevant text. Find it and memorize it.'); default: none")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="model dtype (default: the loader's)")
    p.add_argument("--no-share-scores", action="store_true",
                   help="compute each policy's token scores once per budget instead of once per policy")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="do not use the persistent XLA compilation cache (compile time is excluded from "
                        "every timing either way; the cache only makes reruns start faster)")
    p.add_argument("--check-generate", action="store_true",
                   help="re-run generate() per policy on the first prompt and compare (costs one prefill each)")
    p.add_argument("--model", default=MODEL, help=argparse.SUPPRESS)
    common.add_output_arguments(p, "policies", SECTION, presets=False)
    args = p.parse_args(argv)
    args.plot = args.plot or args.out.with_suffix(".png")
    args.budgets = common.checked_budgets(p, args.budgets)
    if any(not 0.0 <= d <= 1.0 for d in args.depths):
        p.error("--depths must be in [0, 1]")
    if args.decode_steps < 1 or args.warmup_steps < 0 or args.max_new_tokens < 1:
        p.error("--decode-steps and --max-new-tokens must be >= 1, --warmup-steps >= 0")
    if any(n < 1 for n in args.lengths):
        p.error("--lengths must be positive")
    if args.timing_depth == "all":
        args.timing_depth = None
    else:
        try:
            td = float(args.timing_depth)
        except ValueError:
            p.error("--timing-depth: a depth or 'all'")
        args.timing_depth = td if td in args.depths else args.depths[0]
    return args


def main(argv=None) -> int:
    payload = common.run_task(parse_args(argv), run, section=SECTION, make_plot=make_plot,
                              results_section=results_section,
                              tables=lambda payload: [results_table(payload["summary"], payload["config"]["depths"]),
                                                      answers_table(payload)])
    return 1 if any(c["problems"] for c in payload["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
