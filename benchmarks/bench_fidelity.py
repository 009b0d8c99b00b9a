#!/usr/bin/env python
"""Teacher-forced fidelity vs full KV: top-1 agreement and KL(full || policy) per policy and budget.

SmolLM2-135M (float32), batch 1. A real-text document (the pydoc corpus of
``benchmarks/haystack.py``, or ``--text FILE``) is tokenized as raw text; per
sample, its first ``--prompt-tokens`` P tokens are the prompt and the next
``--continuation-tokens`` N tokens the continuation:

1. The prompt is prefilled once per head layout for every policy (the shared
   prefill of ``bench_policies.make_engines``: each policy's selection hook
   runs on every layer's full KV, giving each the cache ``generate`` would
   build; HeteroCache, which permutes heads, gets its own prefill).
2. The continuation is teacher-forced: at step t every cache is fed the true
   token ``doc[P + t]`` with one decode step (``Engine.step``'s body, with the
   policy's ``before_step`` / ``after_step`` hooks, so HeteroCache's drift
   checks and recalls happen; :func:`step_logits` also returns the logits
   ``Engine.step`` samples from), and the policy's next-token distribution
   (predicting ``doc[P + t + 1]``) is compared with full KV's at the same step.
   The prediction made by prefill itself (of ``doc[P]``) is not counted: the
   prefill forward pass is the same for every policy, so it is identical by
   construction.
3. Per step, in float32: KL(full || policy) = sum_v p_full (log p_full -
   log p_policy), top-1 agreement (same argmax), and each one's negative
   log-likelihood of the true next token.

Per (policy, rho): mean (and median, P95) KL, the agreement rate, and the mean
NLL of the true tokens minus full KV's (nats/token), pooled over every step of
every sample; achieved rho and HeteroCache's drift-trigger rate.

Outputs: ``--out`` JSON (full config, machine, commit, per-step values), a PNG
beside it (KL and agreement vs budget per policy), a markdown table on
stdout, and with ``--write-results`` the ``fidelity`` section of
``benchmarks/RESULTS.md``. ``--preset cpu`` (P = 1024, N = 64, StreamingLLM,
SnapKV and HeteroCache at rho 0.3 and 0.5) is the small configuration that
``make bench`` runs: 1.5 to 3 min on 2 shared cores (warm / cold XLA cache).

    .venv/bin/python benchmarks/bench_fidelity.py --write-results
    .venv/bin/python benchmarks/bench_fidelity.py --preset cpu
    .venv/bin/python benchmarks/bench_fidelity.py --prompt-tokens 512 --continuation-tokens 16 \\
        --policies snapkv --budgets 0.3                                   # smoke test
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (benchmarks/common.py)
import haystack  # noqa: E402  (benchmarks/haystack.py)

SECTION = "fidelity"
MODEL = "smollm2-135m"
DEFAULT_PROMPT_TOKENS = 4096
DEFAULT_CONTINUATION_TOKENS = 256
DEFAULT_BUDGETS = (0.2, 0.3, 0.5)

# --preset NAME sets these defaults (explicit flags still win).
PRESETS = {
    "cpu": dict(prompt_tokens=1024, continuation_tokens=64, samples=1,
                policies=["streamingllm", "snapkv", "heterocache"], budgets=[0.3, 0.5]),
    # issue 18: next-token fidelity of the three peers beside HeteroCache (0.125: HCAttention's g=32 point only)
    "issue18-peers": dict(prompt_tokens=1024, continuation_tokens=64, samples=3,
                          policies=["heterocache", "contextkeeper", "synckv", "hcattention"], budgets=[0.125, 0.5]),
}


# ----------------------------------------------------------------- metrics
def log_softmax(logits):
    """[..., V] -> log-probabilities [..., V] in float32."""
    import numpy as np

    x = np.asarray(logits, np.float32)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True, dtype=np.float32))


def next_token_metrics(ref_logits, logits, targets=None) -> dict:
    """Compare next-token distributions, float32.

    ref_logits, logits: [..., V] (full KV's, the policy's); targets: [...] true
    next-token ids or None. Returns per position: ``kl`` = KL(ref || policy)
    [...], ``agree`` = same argmax [...] bool and, with targets, ``nll_ref`` and
    ``nll`` = -log p(target) [...].
    """
    import numpy as np

    lp_ref, lp = log_softmax(ref_logits), log_softmax(logits)
    p_ref = np.exp(lp_ref)
    out = {
        "kl": (p_ref * (lp_ref - lp)).sum(axis=-1, dtype=np.float32),
        "agree": np.argmax(ref_logits, axis=-1) == np.argmax(logits, axis=-1),
    }
    if targets is not None:
        t = np.asarray(targets)[..., None]
        out["nll_ref"] = -np.take_along_axis(lp_ref, t, axis=-1)[..., 0]
        out["nll"] = -np.take_along_axis(lp, t, axis=-1)[..., 0]
    return out


def summarize_steps(kl, agree, nll, nll_ref) -> dict:
    """Pooled per-step values -> mean/median/P95 KL, agreement rate, mean NLL delta (nats/token)."""
    import numpy as np

    kl = np.asarray(kl, np.float64)
    if kl.size == 0:
        nan = float("nan")
        return {"steps": 0, "kl_mean": nan, "kl_median": nan, "kl_p95": nan, "kl_max": nan, "agreement": nan,
                "nll_mean": nan, "nll_full_mean": nan, "nll_delta": nan}
    return {
        "steps": int(kl.size),
        "kl_mean": float(kl.mean()), "kl_median": float(np.median(kl)), "kl_p95": float(np.percentile(kl, 95)),
        "kl_max": float(kl.max()),
        "agreement": float(np.mean(agree)),
        "nll_mean": float(np.mean(nll)), "nll_full_mean": float(np.mean(nll_ref)),
        "nll_delta": float(np.mean(nll) - np.mean(nll_ref)),
    }


# ------------------------------------------------------------------ engine
def step_logits(engine, token: int):
    """One teacher-forced decode step of a one-sequence engine: append ``token``, return the logits [V] float32.

    ``Engine.step_with_logits``: the policy's decode hooks run as in ``Engine.step``
    (HeteroCache: pending recalls applied before, pivots' queries buffered and drift
    checks dispatched after); the logits are what ``Engine.step`` would sample from.
    """
    return engine.step_with_logits([token], 0.0, 1.0)[1][0]


def check_budgets(model, combos, prompt_len: int):
    """Split combos into (runnable [(name, rho, policy)], refused [{label, reason}]) for this prompt length."""
    from hetero_jax.policies import BudgetError, make_policy

    from hetero_jax import runtime as G
    ok, refused = [], []
    for name, rho in combos:
        pol = make_policy(name, None if name == "full" else rho)
        try:
            G.bind_policy(model, pol).make_prefill(model.config, [prompt_len])  # checks budgets, no compute
        except BudgetError as e:
            refused.append({"policy": name, "rho": rho, "label": common.combo_label(name, rho), "reason": str(e)})
            continue
        ok.append((name, rho, pol))
    return ok, refused


# ------------------------------------------------------------------ sample
def run_sample(model, doc: list[int], prompt_tokens: int, combos_ok, bar=None) -> list[dict]:
    """Prefill ``doc[:P]`` for every policy, teacher-force ``doc[P:]``. One dict per combo (full first)."""
    import numpy as np

    import bench_policies  # benchmarks/bench_policies.py: the shared prefill

    from hetero_jax import runtime as G
    n_steps = len(doc) - prompt_tokens - 1
    prompt, forced, targets = doc[:prompt_tokens], doc[prompt_tokens:-1], doc[prompt_tokens + 1:]
    assert len(forced) == len(targets) == n_steps
    tail_capacity = G.tail_capacity_for(n_steps + 1)
    t0 = time.perf_counter()
    engines, _ = bench_policies.make_engines(model, prompt, [p for _, _, p in combos_ok], tail_capacity, bar)
    prefill_s = time.perf_counter() - t0
    after_prefill = [common.engine_kv_stats(e) for e in engines]
    n = len(engines)
    kl = np.zeros((n, n_steps), np.float32)
    agree = np.zeros((n, n_steps), bool)
    nll = np.zeros((n, n_steps), np.float32)
    for t in range(n_steps):
        logits = [step_logits(e, forced[t]) for e in engines]
        for i in range(n):  # i = 0 is full KV: KL 0, agreement 1
            m = next_token_metrics(logits[0], logits[i], targets[t])
            kl[i, t], agree[i, t], nll[i, t] = m["kl"], m["agree"], m["nll"]
        if bar is not None:
            bar.set_postfix_str(f"teacher-forced step {t + 1}/{n_steps} x {n} caches")
    final = [common.engine_kv_stats(e) for e in engines]
    del engines
    out = []
    for i, (name, rho, pol) in enumerate(combos_ok):
        out.append({
            "policy": name, "rho": rho, "label": common.combo_label(name, rho), "policy_repr": repr(pol),
            "achieved_rho": after_prefill[i]["achieved_rho"],
            "kv_bytes_prompt": after_prefill[i]["kv_bytes_prompt"], "kv_bytes_host": after_prefill[i]["kv_bytes_host"],
            "recall": final[i]["recall"],
            "kl": kl[i].tolist(), "agree": agree[i].tolist(), "nll": nll[i].tolist(), "nll_full": nll[0].tolist(),
            "prefill_group_seconds": prefill_s,
        })
    return out


def summarize(runs: list[dict], combos) -> list[dict]:
    """One row per (policy, rho): every sample's steps pooled."""
    rows = []
    for name, rho in combos:
        rs = [r for r in runs if r["policy"] == name and r["rho"] == rho]
        if not rs:
            continue
        s = summarize_steps([v for r in rs for v in r["kl"]], [v for r in rs for v in r["agree"]],
                            [v for r in rs for v in r["nll"]], [v for r in rs for v in r["nll_full"]])
        checks = sum(r["recall"].get("drift_checks", 0) for r in rs)
        trig = sum(r["recall"].get("drift_triggers", 0) for r in rs)
        rows.append({
            "policy": name, "rho": rho, "label": common.combo_label(name, rho), "samples": len(rs),
            "achieved_rho": float(sum(r["achieved_rho"] for r in rs) / len(rs)), **s,
            "drift_checks": checks, "drift_triggers": trig, "trigger_rate": trig / checks if checks else None,
            "recalls": sum(r["recall"].get("recalls", 0) for r in rs),
        })
    return rows


# --------------------------------------------------------------------- run
def load_document(args, tokenizer) -> tuple[list[int], str]:
    """Raw-text token ids of the document and a description of where it came from."""
    if args.text:
        text = Path(args.text).read_text()
        where = f"{args.text} (raw text)"
    else:
        text = haystack.pydoc_corpus()
        where = "pydoc corpus of benchmarks/haystack.py (pydoc_data.topics, sorted keys; raw text)"
    return tokenizer.encode_prompt(text, chat=False), where


def run(args) -> dict:
    import jax
    from tqdm import tqdm

    import hetero_jax

    if not args.no_compile_cache:
        from hetero_jax.cli import enable_compilation_cache

        enable_compilation_cache()
    t_start = time.perf_counter()
    model = hetero_jax.load(args.model, dtype=args.dtype, progress=False)
    load_s = time.perf_counter() - t_start
    P, N = args.prompt_tokens, args.continuation_tokens
    ctx = model.config.max_position_embeddings
    if P + N + 1 > ctx:
        raise SystemExit(f"--prompt-tokens {P} + --continuation-tokens {N} + 1 exceeds the model's context of {ctx}")
    doc, where = load_document(args, model.tokenizer)
    stride = args.stride or (P + N + 1)
    starts = [args.start + s * stride for s in range(args.samples)]
    if starts[-1] + P + N + 1 > len(doc):
        raise SystemExit(f"the document has {len(doc)} tokens; {args.samples} sample(s) of {P} + {N} + 1 tokens "
                         f"from token {args.start} with stride {stride} need {starts[-1] + P + N + 1}")
    combos = common.make_combos(args.policies, args.budgets)
    combos_ok, refused = check_budgets(model, combos, P)
    for r in refused:
        print(f"skipped {r['label']}: {r['reason']}", file=sys.stderr)

    machine = common.machine_info()
    config = {
        "model": args.model, "dtype": str(jax.tree.leaves(model.params)[0].dtype), "batch": 1,
        "prompt_tokens": P, "continuation_tokens": N, "compared_steps_per_sample": N,
        "samples": args.samples, "start": args.start, "stride": stride, "sample_starts": starts,
        "document": where, "document_tokens": len(doc),
        "policies": list(dict.fromkeys(n for n, _ in combos)), "budgets": args.budgets,
        "combos": [common.combo_label(n, r) for n, r in combos], "preset": args.preset,
        "compile_cache": not args.no_compile_cache,
        "prefill": "one shared layer-major prefill per head layout (bench_policies.make_engines)",
        "teacher_forcing": "decode step per true token (Engine.step_with_logits: the policy's before_step / "
                           "after_step hooks); compared: the logits after feeding doc[P + t], predicting "
                           "doc[P + t + 1], t = 0 .. N-1 (prefill's own prediction of doc[P] is identical for every "
                           "policy and not counted)",
        "metrics": "float32: KL(full || policy) of the softmax distributions, top-1 (argmax) agreement, "
                   "NLL of the true next token",
        "out": str(args.out), "plot": str(args.plot),
    }
    payload = common.report_header(SECTION, config, machine)
    payload["load_seconds"] = load_s
    payload["refused"] = refused
    payload["runs"] = runs = []
    bar = tqdm(total=len(starts), desc="fidelity", unit="sample", dynamic_ncols=True, disable=args.no_progress)
    for s, start in enumerate(starts):
        bar.set_description(f"sample {s + 1}/{len(starts)} (token {start})")
        res = run_sample(model, doc[start:start + P + N + 1], P, combos_ok, bar)
        for r in res:
            r.update(sample=s, start=start)
        runs.extend(res)
        bar.update(1)
    bar.close()
    payload["summary"] = summarize(runs, combos)
    payload["total_seconds"] = time.perf_counter() - t_start
    payload["peak_rss_bytes"] = common.peak_rss_bytes()
    return payload


# ------------------------------------------------------------------ report
def results_table(summary: list[dict]) -> str:
    headers = ["policy", "rho", "achieved rho", "top-1 agreement", "KL mean", "KL median", "KL P95",
               "NLL - full (nats/tok)", "steps", "recall triggers"]
    rows = []
    for s in summary:
        trig = ("—" if not s["drift_checks"]
                else f"{s['trigger_rate']:.0%} of {s['drift_checks']} ({s['recalls']} recalls)")
        rows.append([
            s["policy"], "—" if s["policy"] == "full" else f"{s['rho']:g}", common.fmt_num(s["achieved_rho"], 3),
            common.fmt_num(s["agreement"], 3), f"{s['kl_mean']:.4f}", f"{s['kl_median']:.4f}", f"{s['kl_p95']:.4f}",
            f"{s['nll_delta']:+.4f}", common.fmt_num(s["steps"]), trig,
        ])
    return common.markdown_table(headers, rows, align="lrrrrrrrrl")


def results_section(payload: dict, plot_rel: str | None) -> str:
    cfg = payload["config"]
    full = next((s for s in payload["summary"] if s["policy"] == "full"), None)
    lines = [
        common.section_header(f"Fidelity: {cfg['model']} next-token distributions vs full KV (teacher-forced)",
                              payload),
        "",
        f"Document: {cfg['document']}, {cfg['samples']} sample(s) starting at token(s) "
        f"{', '.join(map(str, cfg['sample_starts']))}. Each sample: the first {cfg['prompt_tokens']} tokens are the "
        f"prompt (prefilled once per head layout, every policy's selection on each layer's KV), then the next "
        f"{cfg['continuation_tokens']} real tokens are fed one decode step at a time (teacher forcing, the policy's "
        "decode hooks included: HeteroCache's drift checks and recalls happen), and after each step the policy's "
        "next-token distribution is compared with full KV's from the same step, in float32: top-1 agreement "
        "(same argmax), KL(full || policy) in nats, and the mean negative log-likelihood of the true next token "
        "minus full KV's. Prefill's own prediction (identical for every policy) is not counted. "
        f"{cfg['dtype']}, batch 1."
        + (f" Full KV's mean NLL: {full['nll_full_mean']:.3f} nats/token." if full else ""),
        "",
        results_table(payload["summary"]),
    ]
    if payload.get("refused"):
        lines += ["", "Refused (budget below the policy's minimum): "
                  + "; ".join(f"{r['label']}: {r['reason']}" for r in payload["refused"])]
    lines += ["", *common.closing_lines(payload, "fidelity", plot_rel)]
    return "\n".join(lines)


def make_plot(payload: dict, path: Path) -> Path | None:
    summary = [s for s in payload["summary"] if s["policy"] != "full"]
    if not summary:  # full KV alone: nothing to compare
        return None

    cfg = payload["config"]
    fig, axes = common.subplots(1, 2, figsize=(12, 4.6))
    pols = list(dict.fromkeys(s["policy"] for s in summary))
    for ax, key, ylab, title in ((axes[0], "kl_mean", "mean KL(full || policy), nats", "KL vs full KV"),
                                 (axes[1], "agreement", "top-1 agreement with full KV", "Top-1 agreement")):
        for pi, pol in enumerate(pols):
            ss = sorted((s for s in summary if s["policy"] == pol), key=lambda s: s["rho"])
            ax.plot([s["rho"] for s in ss], [s[key] for s in ss], marker="o", color=f"C{pi}", label=pol)
        ax.set_xlabel("budget rho")
        ax.set_ylabel(ylab)
        ax.set_title(title)
        if key == "kl_mean":
            ax.set_yscale("log")
        else:
            ax.axhline(1.0, color="k", lw=0.8, alpha=0.5)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=8)
    sub = (f"{cfg['model']} {cfg['dtype']}, prompt {cfg['prompt_tokens']} + {cfg['continuation_tokens']} "
           f"teacher-forced tokens x {cfg['samples']} sample(s), {common.git_summary(payload['git'])}")
    return common.save_figure(fig, path, f"Fidelity vs full KV — {sub}")


# --------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    from hetero_jax.policies import REGISTRY

    names = list(REGISTRY)
    p = common.argument_parser("Teacher-forced fidelity of each KV-cache policy vs full KV on SmolLM2-135M: top-1 "
                               "agreement and KL(full || policy) of the next-token distributions over a real-text "
                               "continuation.")
    common.add_preset_argument(p, PRESETS)
    p.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS, help="P: prompt tokens per sample")
    p.add_argument("--continuation-tokens", type=int, default=DEFAULT_CONTINUATION_TOKENS,
                   help="N: teacher-forced tokens per sample (compared steps)")
    p.add_argument("--samples", type=int, default=1, help="windows of P + N + 1 tokens from the document")
    p.add_argument("--start", type=int, default=0, help="token offset of the first sample in the document")
    p.add_argument("--stride", type=int, default=None, help="tokens between sample starts (default: P + N + 1)")
    p.add_argument("--text", type=Path, default=None, help="a text file to use instead of the pydoc corpus")
    p.add_argument("--policies", nargs="+", default=[n for n in names if n != "full"], type=common.policy_spec,
                   help="registered policies, optionally with options (quest:offload=true; full KV always runs, as the reference)")
    p.add_argument("--budgets", type=float, nargs="+", default=list(DEFAULT_BUDGETS), help="budgets rho in (0, 1]")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="model dtype (default: the loader's)")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="do not use the persistent XLA compilation cache (only makes reruns start faster)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--model", default=MODEL, help=argparse.SUPPRESS)
    common.add_output_arguments(p, "fidelity", SECTION)
    args = common.parse_with_preset(p, PRESETS, argv)
    args.plot = args.plot or args.out.with_suffix(".png")
    args.budgets = common.checked_budgets(p, args.budgets)
    if args.prompt_tokens < 1 or args.continuation_tokens < 1 or args.samples < 1 or args.start < 0:
        p.error("--prompt-tokens, --continuation-tokens and --samples must be >= 1, --start >= 0")
    if args.stride is not None and args.stride < 1:
        p.error("--stride must be >= 1")
    return args


def main(argv=None) -> int:
    common.run_task(parse_args(argv), run, section=SECTION, make_plot=make_plot, results_section=results_section,
                    tables=lambda payload: [results_table(payload["summary"])])
    return 0


if __name__ == "__main__":
    sys.exit(main())
