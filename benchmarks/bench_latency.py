#!/usr/bin/env python
"""Latency per policy and context length: TTFT, decode ms/token percentiles, KV bytes, roofline ratio.

For each context length and each policy (default: full KV, StreamingLLM,
SnapKV and HeteroCache, each compressed one at rho 0.3 and 0.5), batch 1,
greedy, measured through ``generate``'s decode ``Engine``:

- **TTFT**: ``Engine.prefill_seconds`` (the prefill ``GenerationStats``
  reports: layer-major prefill with the policy's selection in every layer,
  HeteroCache's copy of the satellites' KV into the pinned-host reservoir,
  ``finish``; compile time excluded) plus sampling and reading back the first
  token. Every policy gets its own prefill; the prefills of one length run
  round-robin (order rotated per round). The first ``--ttft-warmup`` rounds
  are untimed (eager ops compile there; the jitted functions' compile time is
  excluded anyway); TTFT is the median of the next ``--ttft-repeats`` rounds.
  HeteroCache's permuted weights are made once before any timing (``generate``
  does that on its first call per model and layout).
- **Decode**: the caches of the last round decode in turn, ``--decode-block``
  consecutive steps per policy (order rotated every round) with
  ``Engine.step`` (HeteroCache's drift checks and recalls included). Each block
  ends with ``Engine.drain()``, whose wait counts in the block's last step, so
  a policy's times hold all its own asynchronous work and none of another's.
  Stepping the policies one step each in turn (as this script did before)
  timed one policy's background drift check as the next policy's step on a
  shared CPU. The first ``--warmup-steps`` steps per policy are untimed, the
  next ``--decode-steps`` are timed (wall time incl. reading the token back;
  compile time excluded). Mean / P50 / P95 / P99 ms per token; the ratio to
  full KV divides by full KV's value from the same interleaved blocks.
- **Roofline ratio**: (weight bytes + KV bytes one decode step reads with the
  policy) / (weight bytes + KV bytes with full KV). Weight bytes = every
  parameter once, except the embedding table, of which the token's gather
  reads one row; the lm_head is read in full (SmolLM2 ties it to the
  embedding table). KV bytes = what one step reads (``DecodeState.kv_bytes_read``,
  not the device KV column): the row pool as allocated (Quest: the rows it
  attends), the policy's index arrays, its host fetches per step counted twice.
  Printed beside each ratio with measured / roofline and whether that is within 10 %.
- **KV bytes** (device, host) and **recall trigger rate** (HeteroCache: drift
  checks that triggered / drift checks, over the timed steps) as
  ``Engine.stats_fields()`` reports them.

Weights: the real SmolLM2-135M (float32) for ``--real-lengths`` (default
1K, 2K, 4K and 7900 tokens: "8K" inside the 8192-token context; prompts are
the first N tokens of the pydoc corpus of ``benchmarks/haystack.py``, raw
text). ``--synthetic-lengths`` (default 16K, 32K) are beyond that context:
they use **synthetic** random weights with SmolLM2's exact shapes
(``hetero_jax.model.spec.init_params``, ``max_position_embeddings`` raised) and
random token ids, labelled "synthetic" in the JSON, table and plot; there
HeteroCache uses the shipped SmolLM2 profile's roles with its weights
fingerprint removed (roles calibrated on the real weights, applied to random
ones: the cost structure is right, what is kept is not meaningful).
``--synthetic-shape llama-3.1-8b`` gives the synthetic points Llama-3.1-8B's
shapes instead (32 layers, 32 query / 8 KV heads of 128, untied 128K vocab;
bfloat16 by default: 16 GB of weights, drawn on the device), with HeteroCache's
roles from the HeteroCache authors' published Llama-3.1-8B-Instruct profile
(``--synthetic-profile``, default ``../shared/reference``). That is for a GPU:
``--preset llama8b-gpu`` runs 16K to 128K with full KV, SnapKV and HeteroCache
at rho 0.3 (the ``latency-llama8b-gpu`` section). Not on a CPU: XLA's CPU backend
converts the bfloat16 weights to float32 for the decode step's matmuls, 30 GB.
``--synthetic-shape llama-3.1-8b-narrow`` keeps Llama-3.1-8B's attention heads and layers (and the authors'
roles) with a narrow MLP and vocabulary, float32: HeteroCache's per-head structure at a size a CPU runs
(``--preset llama8b-narrow-cpu``, 2K tokens, about 3 min).

Cost: prefill dominates long contexts (one per policy and round: 7 policies x
3 rounds (1 untimed) per length by default). On a 2-core CPU SmolLM2's full-KV prefill
takes about 90 s at 7900 tokens, 5.3 min at 16K and 22 min at 32K (measured,
synthetic weights), so the default grid's 16K and 32K points take hours there;
``--preset long`` (those two lengths, full KV, SnapKV and HeteroCache at rho 0.3,
one round) takes about 40 min; ``--preset long-copy-window`` the same with
HeteroCache's opt-in copy window. ``--preset cpu`` (real 1K and 2K,
synthetic 2K, rho 0.3 only, 32 timed steps) is the small configuration that
``make bench`` runs: 5 to 7 min on 2 shared cores (warm / cold XLA cache).

Outputs: ``--out`` JSON (full config, machine, commit, every sample; default: benchmarks/out/ and the name of
the preset's RESULTS section, e.g. latency.json for cpu), a PNG beside it, a markdown table on stdout, and with
``--write-results`` that section of ``benchmarks/RESULTS.md`` (with the HeteroCache rho 0.3 targets at the longest
context: MET / NOT MET).

    .venv/bin/python benchmarks/bench_latency.py --write-results          # full grid (long)
    .venv/bin/python benchmarks/bench_latency.py --preset cpu             # make bench
    .venv/bin/python benchmarks/bench_latency.py --real-lengths 512 --synthetic-lengths \\
        --policies full heterocache --budgets 0.3 --decode-steps 8        # smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (benchmarks/common.py)
import haystack  # noqa: E402  (benchmarks/haystack.py)
from harness import grid, roofline  # noqa: E402  (the grid runner; the latency measures)
from harness.latency_report import (  # noqa: E402  (tables, RESULTS section, figure, --merge)
    MERGE_INPUTS, length_report, make_plot, merge, results_section, results_table, targets_text,
)
from harness.roofline import (  # noqa: E402  (bytes per step, roofline, timing summaries, targets)
    add_fitted, add_ratios, model_weight_bytes, roofline_ratio, target_check, timing_summary, weight_bytes_per_token,
    within_tolerance,
)
from harness.synthetic import (  # noqa: E402  (random weights beyond the real context, their profile)
    MODEL, SYNTHETIC_DEFAULT_DTYPE, SYNTHETIC_SHAPES, make_policies, reference_dir, synthetic_config,
    synthetic_model, synthetic_profile,
)

# what other scripts and the tests import from here, their code now in harness/
__all__ = ["SYNTHETIC_SHAPES", "make_policies", "model_weight_bytes", "reference_dir", "roofline_ratio",
           "synthetic_config", "synthetic_model", "synthetic_profile", "target_check", "timing_summary",
           "weight_bytes_per_token", "within_tolerance"]

SECTION = "latency"
DEFAULT_REAL_LENGTHS = (1024, 2048, 4096, 7900)
DEFAULT_SYNTHETIC_LENGTHS = (16384, 32768)
DEFAULT_POLICIES = ("full", "streamingllm", "snapkv", "heterocache")
DEFAULT_BUDGETS = (0.3, 0.5)

# --preset NAME sets these defaults (explicit flags still win).
PRESETS = {
    # synthetic at 2048 too: beside the real 2048 row it shows that random weights time like real ones
    "cpu": dict(real_lengths=[1024, 2048], synthetic_lengths=[2048], budgets=[0.3], decode_steps=32,
                warmup_steps=6, ttft_warmup=1, ttft_repeats=1),
    # the synthetic long contexts alone (section latency-long), sized for a 2-core CPU: one 32K prefill takes
    # tens of minutes there, so one timed round and no untimed one (the jitted functions' compile is excluded
    # anyway; the eager ops' compile is seconds against minutes of prefill). 128 timed steps, the script's
    # default: over 64 the P99 is the slowest step interpolated with the next (one stray step decided it).
    # SnapKV reads HeteroCache's device bytes: what the roofline model misses on this machine (a step's cost
    # beside its bytes) shows in both, HeteroCache's own work only in the difference
    "long": dict(real_lengths=[], synthetic_lengths=[16384, 32768], policies=["full", "snapkv", "heterocache"],
                 budgets=[0.3],
                 decode_steps=128, warmup_steps=8, ttft_warmup=0, ttft_repeats=1),
    # the opt-in copy window at the same long contexts (section latency-long-copy-window)
    "long-copy-window": dict(real_lengths=[], synthetic_lengths=[16384, 32768],
                             policies=["full", "heterocache:copy_window=16"], budgets=[0.3], decode_steps=128,
                             warmup_steps=8, ttft_warmup=0, ttft_repeats=1),
    # issue 17: decode-time retrieval (Quest in-device and offloaded, FreeKV) beside full KV, SnapKV and
    # HeteroCache on the real model; the roofline counts the bytes a step reads, host fetches included
    "issue17": dict(real_lengths=[2048, 4096], synthetic_lengths=[],
                    policies=["full", "snapkv", "heterocache", "quest", "quest:offload=true", "freekv"],
                    budgets=[0.3], decode_steps=32, warmup_steps=6, ttft_warmup=1, ttft_repeats=1),
    # issue 36: decode-time retrieval without a host round trip in the step (FreeKV, offloaded Quest) and
    # HCAttention's host sums, beside in-device Quest and full KV; HCAttention runs at 0.5 only (its operating point)
    "issue36": dict(real_lengths=[2048, 4096], synthetic_lengths=[],
                    policies=["full", "quest", "quest:offload=true", "freekv", "hcattention"],
                    budgets=[0.3, 0.5], decode_steps=32, warmup_steps=6, ttft_warmup=1, ttft_repeats=1),
    # Llama-3.1-8B shapes to 128K, for one GPU (bfloat16: 16 GB of weights, 16 GB of full KV at 128K)
    "llama8b-gpu": dict(real_lengths=[], synthetic_lengths=[16384, 32768, 65536, 131072],
                        synthetic_shape="llama-3.1-8b",
                        policies=["full", "snapkv", "heterocache"], budgets=[0.3], decode_steps=64, warmup_steps=8,
                        ttft_warmup=1, ttft_repeats=1),
    # Llama-3.1-8B's heads and the authors' profile on a CPU (narrow MLP): HeteroCache's per-head structure
    "llama8b-narrow-cpu": dict(real_lengths=[], synthetic_lengths=[2048], synthetic_shape="llama-3.1-8b-narrow",
                               policies=["full", "snapkv", "heterocache"], budgets=[0.3], decode_steps=48,
                               warmup_steps=6, ttft_warmup=1, ttft_repeats=1),
    # issue 18: the three peers beside full KV and HeteroCache at rho 0.5 (the budget all of them reach on SmolLM2)
    "issue18-peers": dict(real_lengths=[2048, 4096], synthetic_lengths=[],
                          policies=["full", "heterocache", "contextkeeper", "synckv", "hcattention"],
                          budgets=[0.5], decode_steps=32, warmup_steps=6, ttft_warmup=1, ttft_repeats=1),
}


# ------------------------------------------------------------- one length


def measure_length(model, ids: list[int], combos, policies, args, bar=None, note=None) -> tuple[list[dict], dict]:
    """TTFT rounds, then interleaved decode, for every policy on one prompt. One dict per combo."""
    import gc

    from hetero_jax import runtime as G
    from hetero_jax.model import layout as LY

    cfg = model.config
    n = len(combos)
    steps_total = args.warmup_steps + args.decode_steps
    tail_capacity = G.tail_capacity_for(steps_total + 1)
    bound = [G.bind_policy(model, p) for p in policies]
    for p in bound:  # budget errors before any compute; HeteroCache's permuted weights made before timing
        p.make_prefill(cfg, [len(ids)])
        LY.params_for(model, p.layout(cfg))

    def status(text):
        if bar is not None:
            bar.set_postfix_str(f"{note}: {text}" if note else text)

    # --- TTFT: one prefill per policy per round, round-robin
    engines = [None] * n
    ttft = [[] for _ in range(n)]
    ttft_warm = [[] for _ in range(n)]
    prefill_s = [[] for _ in range(n)]
    compile_s = [0.0] * n
    rounds = args.ttft_warmup + args.ttft_repeats
    for rnd in range(rounds):
        for j in range(n):
            i = (rnd + j) % n
            status(f"prefill round {rnd + 1}/{rounds}, {common.combo_label(*combos[i])}")
            engines[i] = None  # free the previous round's cache first
            gc.collect()
            c0 = G.compile_seconds()
            e = G.Engine(model, [ids], bound[i], tail_capacity=tail_capacity)
            t0 = time.perf_counter()
            e.first_tokens(0.0, 1.0)
            first_s = time.perf_counter() - t0
            compile_s[i] += G.compile_seconds() - c0
            (ttft if rnd >= args.ttft_warmup else ttft_warm)[i].append(e.prefill_seconds + first_s)
            prefill_s[i].append(e.prefill_seconds)
            engines[i] = e
    after_prefill = [common.engine_kv_stats(e) for e in engines]

    # --- decode: blocks of consecutive steps per policy, order rotated every round. A block ends by
    # waiting for the policy's asynchronous work (HeteroCache's drift checks), counted in the block's last
    # step: a policy's times hold its own background work, as a user running it alone sees it, and none of
    # another policy's (which a step-by-step round-robin on shared cores would time as the next step's)
    toks = [int(e.first_tokens(0.0, 1.0)[0]) for e in engines]
    times: list[list[float]] = [[] for _ in range(n)]
    step_ids: list[list[int]] = [[] for _ in range(n)]  # each timed step's index (recall steps are told apart)
    recall_at_timing = [None] * n
    done = [0] * n
    c1 = G.compile_seconds()
    rnd = 0
    while min(done) < steps_total:
        for j in range(n):
            i = (rnd + j) % n
            for _ in range(min(args.decode_block, steps_total - done[i])):
                if done[i] == args.warmup_steps:
                    recall_at_timing[i] = common.engine_kv_stats(engines[i])["recall"]
                step_id = engines[i].steps
                nxt, seconds = engines[i].step([toks[i]], 0.0, 1.0)  # compile time excluded by Engine.step
                if done[i] >= args.warmup_steps:
                    times[i].append(seconds)
                    step_ids[i].append(step_id)
                toks[i] = int(nxt[0])
                done[i] += 1
            waited = engines[i].drain()
            if done[i] > args.warmup_steps:
                times[i][-1] += waited
        rnd += 1
        status(f"decode step {min(done)}/{steps_total} x {n} policies")
    decode_compile = G.compile_seconds() - c1
    final = [common.engine_kv_stats(e) for e in engines]
    recall_at = [set(getattr(e.state, "recall_steps", ())) for e in engines]  # steps that applied a recall
    del engines
    gc.collect()

    results = []
    for i, (name, rho) in enumerate(combos):
        r0, r1 = recall_at_timing[i] or {}, final[i]["recall"]
        checks = r1.get("drift_checks", 0) - r0.get("drift_checks", 0)
        trig = r1.get("drift_triggers", 0) - r0.get("drift_triggers", 0)
        results.append({
            "policy": name, "rho": rho, "label": common.combo_label(name, rho), "policy_repr": repr(bound[i]),
            **final[i],
            "kv_after_prefill": after_prefill[i],
            "ttft_seconds": ttft[i], "ttft_warmup_seconds": ttft_warm[i], "prefill_seconds": prefill_s[i],
            "ttft_median_seconds": statistics.median(ttft[i]),
            "compile_seconds_prefill": compile_s[i],
            "decode_seconds": times[i],
            "decode": timing_summary(times[i]),
            "decode_step_ids": step_ids[i],
            # HeteroCache: the steps that applied a recall and the others, apart
            "decode_plain": timing_summary([t for t, k in zip(times[i], step_ids[i]) if k not in recall_at[i]]),
            "decode_recall": timing_summary([t for t, k in zip(times[i], step_ids[i]) if k in recall_at[i]])
            if recall_at[i] & set(step_ids[i]) else None,
            "timed_drift_checks": checks, "timed_drift_triggers": trig,
            "timed_trigger_rate": trig / checks if checks else None,
            "timed_recalls": r1.get("recalls", 0) - r0.get("recalls", 0),
        })
    meta = {"tail_capacity": tail_capacity, "decode_compile_seconds": decode_compile,
            "prompt_tokens": len(ids)}
    return results, meta


# --------------------------------------------------------------------- run
def run(args) -> dict:
    from hetero_jax.policies import registry_key
    import numpy as np
    from tqdm import tqdm

    import hetero_jax

    if not args.no_compile_cache:
        from hetero_jax.cli import enable_compilation_cache

        enable_compilation_cache()
    combos = common.make_combos(args.policies, args.budgets)
    t_start = time.perf_counter()
    # Another shape's synthetic points alone need no real model (a GPU machine may not have the embedded GGUF)
    need_real = bool(args.real_lengths) or args.synthetic_shape == MODEL
    real = hetero_jax.load(args.model, dtype="float32", progress=False) if need_real else None
    load_s = time.perf_counter() - t_start
    steps_total = args.warmup_steps + args.decode_steps + 1
    synth_prof = None
    if args.synthetic_lengths and any(registry_key(n) == "heterocache" for n, _ in combos):  # a missing profile fails first
        synth_prof = synthetic_profile(args.synthetic_shape, args.synthetic_profile)
        synth_prof.check_compatible(synthetic_config(real.config if real is not None else None,
                                                     args.synthetic_shape, 0))
    ctx = real.config.max_position_embeddings if real is not None else None
    for L in args.real_lengths:
        if L + steps_total > ctx:
            raise SystemExit(f"real length {L} + {steps_total} decode tokens exceeds SmolLM2's {ctx}-token context; "
                             f"use at most {ctx - steps_total} (or --synthetic-lengths)")
    corpus = real.tokenizer.encode_prompt(haystack.pydoc_corpus(), chat=False) if args.real_lengths else []
    if args.real_lengths and max(args.real_lengths) > len(corpus):
        raise SystemExit(f"the pydoc corpus has {len(corpus)} tokens; --real-lengths must not exceed it")

    config = {
        "model": args.model, "dtype": "float32", "batch": 1, "temperature": 0.0,
        "synthetic_shape": args.synthetic_shape, "synthetic_dtype": args.synthetic_dtype,
        "synthetic_profile": synth_prof.model_name if synth_prof is not None else None,
        "real_lengths": args.real_lengths, "synthetic_lengths": args.synthetic_lengths,
        "policies": list(dict.fromkeys(n for n, _ in combos)), "budgets": args.budgets,
        "combos": [common.combo_label(n, r) for n, r in combos],
        "decode_steps": args.decode_steps, "warmup_steps": args.warmup_steps,
        "ttft_warmup": args.ttft_warmup, "ttft_repeats": args.ttft_repeats,
        "seed": args.seed, "preset": args.preset, "compile_cache": not args.no_compile_cache,
        "real_prompts": "first N tokens of benchmarks/haystack.py pydoc_corpus(), "
                        "tokenizer.encode_prompt(text, chat=False) (raw text)",
        "synthetic": f"random {args.synthetic_dtype} weights with {args.synthetic_shape}'s shapes (jax.random "
                     "per tensor from key(seed): N(0, 0.02^2), norms 1 + N(0, 0.1^2)), max_position_embeddings "
                     "raised; random token ids (numpy default_rng(seed)); HeteroCache: "
                     + ("the shipped SmolLM2 profile's" if args.synthetic_shape == MODEL else
                        "the HeteroCache authors' published profile's") + " roles, weights fingerprint removed",
        "ttft": "Engine.prefill_seconds (prefill + policy selection + HeteroCache reservoir copy + finish, "
                "compile excluded) + first-token sampling and read-back; one prefill per policy per round, "
                "round-robin; median of the timed rounds",
        "decode_timing": "blocks of decode_block consecutive steps per policy, order rotated per round, each "
                         "block ending with Engine.drain() counted in its last step; warm-up steps untimed; "
                         "wall time per Engine.step incl. token read-back, compile excluded",
        "decode_block": args.decode_block,
        "roofline": "(weight bytes + policy's KV bytes read per step) / (weight bytes + full KV's); bytes read = "
                    "device K/V + index arrays, for Quest the attended rows only, host fetches counted twice; "
                    "weight bytes = all params, embedding counted one row, lm_head (tied) in full; "
                    "device KV bytes = the row pool as allocated (kept prompt rows + each head's tail rows)",
        "roofline_tolerance": roofline.ROOFLINE_TOLERANCE,
        "out": str(args.out), "plot": str(args.plot),
    }
    # refused: label -> {length: the budget error}: a policy that cannot run a length is left out
    payload = grid.open_payload(SECTION, config, load_s, lengths=[], runs=[], refused={})
    runs = payload["runs"]
    held = {"real": real, "synth": None}

    def run_length(L, weights, bar):
        if weights == "real":
            model, ids = held["real"], corpus[:L]
        else:
            if held["synth"] is None:
                held["synth"] = synthetic_model(held["real"], max(args.synthetic_lengths) + steps_total, args.seed,
                                                args.synthetic_shape, args.synthetic_dtype)
                held["real"] = None  # free the real weights (the tokenizer lives on in synth)
            model = held["synth"]
            ids = np.random.default_rng(args.seed).integers(0, model.config.vocab_size, L).tolist()
        C = grid.refusals(model, combos, [common.combo_label(*c) for c in combos],
                          make_policies(combos, synth_prof if weights == "synthetic" else None), [L])
        for lab, errs in C.refused.items():
            payload["refused"].setdefault(lab, {}).update(errs)
        C = C.never_refused()
        wb = model_weight_bytes(model.params, model.config)
        t0 = time.perf_counter()
        res, meta = measure_length(model, ids, C.combos, C.policies, args, bar=bar, note=f"{L} {weights}")
        for r in res:
            r.update(length=L, weights=weights)
        add_ratios(res, wb)
        runs.extend(res)
        payload["lengths"].append({"length": L, "weights": weights, "weight_bytes_per_token": wb,
                                   "max_position_embeddings": model.config.max_position_embeddings,
                                   "seconds": time.perf_counter() - t0, **meta})
        tqdm.write(length_report(res, L, weights))

    del real  # held["real"] holds it until the synthetic weights replace it
    grid.drive(grid.points(args.real_lengths, ["real"]) + grid.points(args.synthetic_lengths, ["synthetic"]),
               run_length, desc="latency", unit="length", disable=args.no_progress,
               describe=lambda L, weights: f"{L} tok ({weights})")
    add_fitted(runs)
    payload["targets"] = target_check(runs)
    return grid.close_payload(payload, t_start, cpu=False)


# --------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = common.argument_parser("TTFT, decode ms/token (mean/P50/P95/P99), KV bytes and recall rate per KV-cache "
                               "policy and context length on SmolLM2-135M (synthetic random weights beyond its 8K "
                               "context), with each decode ratio to full KV beside its roofline ratio.")
    common.add_preset_argument(p, PRESETS)
    p.add_argument("--real-lengths", type=int, nargs="*", default=list(DEFAULT_REAL_LENGTHS),
                   help="prompt lengths on the real weights (context 8192: '8K' is 7900)")
    p.add_argument("--synthetic-lengths", type=int, nargs="*", default=list(DEFAULT_SYNTHETIC_LENGTHS),
                   help="prompt lengths on synthetic random weights with --synthetic-shape's shapes")
    p.add_argument("--synthetic-shape", choices=sorted(SYNTHETIC_SHAPES), default=MODEL,
                   help="shapes of the synthetic weights (llama-3.1-8b: 16 GB in bfloat16, for a GPU)")
    p.add_argument("--synthetic-dtype", choices=["float32", "bfloat16"], default=None,
                   help="dtype of the synthetic weights and KV (default: float32 for smollm2-135m, "
                        "bfloat16 for llama-3.1-8b)")
    p.add_argument("--synthetic-profile", type=Path, default=None,
                   help="head profile giving HeteroCache's roles on synthetic weights (default: the shipped one "
                        "for smollm2-135m; the authors' published one from ../shared/reference or "
                        "$HETERO_JAX_REFERENCE_DIR for llama-3.1-8b)")
    p.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), type=common.policy_spec,
                   help="registered policies, optionally with options (quest:offload=true; full KV always runs, as "
                        "the reference)")
    p.add_argument("--budgets", type=float, nargs="+", default=list(DEFAULT_BUDGETS),
                   help="budgets rho in (0, 1] for every compressed policy")
    p.add_argument("--decode-steps", type=int, default=128, help="timed decode steps per policy and length")
    p.add_argument("--decode-block", type=int, default=10,
                   help="consecutive decode steps per policy before the next policy's turn (a multiple of "
                        "HeteroCache's window, so every block holds the same drift checks)")
    p.add_argument("--warmup-steps", type=int, default=8,
                   help="untimed decode steps per policy first (>= HeteroCache's window, so its first drift "
                        "check is warm too)")
    p.add_argument("--ttft-warmup", type=int, default=1, help="untimed prefill rounds per length")
    p.add_argument("--ttft-repeats", type=int, default=2, help="timed prefill rounds per length (TTFT: median)")
    p.add_argument("--seed", type=int, default=0, help="synthetic weights and token ids")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="do not use the persistent XLA compilation cache (compile time is excluded from every "
                        "timing either way)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--model", default=MODEL, help=argparse.SUPPRESS)
    common.add_output_arguments(p, "latency", SECTION, named=True, out_per_preset=True, out_help="benchmarks/out/"
                                "SECTION[-merged].json: the preset's RESULTS section (cpu: latency), -merged for --merge")
    p.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                   help="no run: join the JSON of runs of one configuration at different lengths (each length "
                        "once) into one table (with --write-results, the section of their preset)")
    args = common.parse_with_preset(p, PRESETS, argv)
    args.synthetic_dtype = args.synthetic_dtype or SYNTHETIC_DEFAULT_DTYPE[args.synthetic_shape]
    args.budgets = common.checked_budgets(p, args.budgets)
    # counts, before the model loads (a --decode-block of 0 steps would never end its decode loop)
    if min(args.decode_steps, args.decode_block, args.ttft_repeats) < 1 or min(args.warmup_steps, args.ttft_warmup) < 0:
        p.error("--decode-steps, --decode-block and --ttft-repeats must be >= 1, --warmup-steps and --ttft-warmup >= 0")
    if not args.real_lengths and not args.synthetic_lengths:
        p.error("give at least one of --real-lengths / --synthetic-lengths")
    if any(n < 1 for n in args.real_lengths + args.synthetic_lengths):
        p.error("lengths must be positive")
    merged = args.merge and common.read_json_inputs(p, "--merge", args.merge, script="bench_latency.py", **MERGE_INPUTS)
    # each preset its own files (a section's plot is never another run's); a merge's never a run's it may read
    preset = args.preset or (merged[0]["config"].get("preset") if merged else None)
    common.fill_outputs(p, args, common.results_section_name(SECTION, preset) + ("-merged" if merged else ""))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    common.run_task(args, merge if args.merge else run, section=SECTION, make_plot=make_plot,
                    results_section=results_section,
                    tables=lambda payload: [results_table(payload["runs"]), targets_text(payload["targets"])],
                    plot_rows="runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
