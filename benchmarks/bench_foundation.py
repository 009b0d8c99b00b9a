#!/usr/bin/env python
"""Foundation benchmark: SmolLM2-135M full-KV prefill and decode on this machine.

For each (prompt length, dtype) configuration, in a fresh subprocess:

1. load SmolLM2-135M (``hetero_jax.load("smollm2-135m", dtype=...)``);
2. build the prompt from real text: Python's ``pydoc_data.topics.topics``
   joined in sorted key order, tokenized with the model's tokenizer (raw
   text, no chat template), first N tokens, passed as token ids (chat=False);
3. one warm-up ``generate`` of the same shape (compiles, warms caches and the
   allocator), then ``--repeats`` timed ``generate`` calls with greedy
   decoding and ``max_new_tokens = decode_steps + 1`` (``generate`` times a
   decode step for every new token after the first, which prefill yields);
4. report prefill tokens/s, decode ms/token (mean, P50, P90 over the steps),
   compile time (from the warm-up, kept out of the timings by ``generate``)
   and the child's peak RSS (``ru_maxrss``).

Running every configuration in its own process makes the peak RSS that of
that configuration alone. The parent collects one JSON line per child, writes
``--out`` (JSON with the full config, machine and commit), a PNG plot beside
it, and with ``--write-results`` rewrites the ``foundation`` section of
``benchmarks/RESULTS.md``.

The model's context is 8192 tokens and a prompt needs room for the generated
tokens, so the "8K" point is 8000 prompt tokens by default
(8000 + decode_steps + 1 <= 8192).

    .venv/bin/python benchmarks/bench_foundation.py --write-results
    .venv/bin/python benchmarks/bench_foundation.py --lengths 256 512 --decode-steps 8   # smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (benchmarks/common.py)

SECTION = "foundation"
MODEL = "smollm2-135m"
DEFAULT_LENGTHS = (1024, 4096, 8000)
DEFAULT_DTYPES = ("float32", "bfloat16")


# -------------------------------------------------------------------- child
def corpus_token_ids(tokenizer) -> list[int]:
    """The benchmark's real-text corpus: pydoc topics in sorted key order, raw-text token ids."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return tokenizer.encode_prompt(text, chat=False)


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def run_one(length: int, dtype: str, decode_steps: int, repeats: int, model_name: str) -> dict:
    """Measure one configuration in this process; returns the JSON-able result."""
    t_start = time.perf_counter()
    import jax
    import numpy as np

    import hetero_jax

    t0 = time.perf_counter()
    model = hetero_jax.load(model_name, dtype=dtype, progress=False)
    load_s = time.perf_counter() - t0
    got = {str(x.dtype) for x in jax.tree.leaves(model.params)}
    if got != {dtype}:
        raise RuntimeError(f"asked for {dtype} params, got {sorted(got)}")
    ctx = model.config.max_position_embeddings
    max_new = decode_steps + 1
    if length + max_new > ctx:
        raise ValueError(
            f"prompt {length} + {max_new} new tokens exceeds the model's context of {ctx} tokens; "
            f"use a prompt of at most {ctx - max_new} tokens for --decode-steps {decode_steps}")
    rss_after_load = common.current_rss_bytes()
    peak_after_load = common.peak_rss_bytes()

    ids = corpus_token_ids(model.tokenizer)
    if len(ids) < length:
        raise ValueError(f"the corpus has only {len(ids)} tokens; asked for {length}")
    prompt = ids[:length]

    def gen():
        return hetero_jax.generate(model, prompt, max_new_tokens=max_new, temperature=0.0, chat=False)

    warm = gen()
    ws = warm.stats
    runs = [gen() for _ in range(repeats)]

    prefill_s = [r.stats.prefill_seconds for r in runs]
    decode_s = [s for r in runs for s in r.stats.decode_seconds]
    decode_ms = [1e3 * s for s in decode_s]
    last = runs[-1].stats
    recompiled = sum(r.stats.compile_seconds for r in runs)
    prefill_med = statistics.median(prefill_s)
    result = {
        "length": length,
        "dtype": dtype,
        "model": model_name,
        "prompt_tokens": last.prompt_tokens,
        "decode_steps_requested": decode_steps,
        "decode_steps_timed": len(decode_s),
        "repeats": repeats,
        "stop_reason": last.stop_reason,
        "generated_text_head": runs[-1].text[:80],
        # prefill: median over repeats
        "prefill_seconds": prefill_med,
        "prefill_seconds_all": prefill_s,
        "prefill_tokens_per_second": length / prefill_med if prefill_med > 0 else float("nan"),
        # decode: every timed step of every repeat
        "decode_ms_mean": float(np.mean(decode_ms)) if decode_ms else float("nan"),
        "decode_ms_p50": percentile(decode_ms, 50),
        "decode_ms_p90": percentile(decode_ms, 90),
        "decode_ms_min": min(decode_ms) if decode_ms else float("nan"),
        "decode_ms_max": max(decode_ms) if decode_ms else float("nan"),
        "decode_ms_all": decode_ms,
        "decode_tokens_per_second": 1e3 / float(np.mean(decode_ms)) if decode_ms else float("nan"),
        # warm-up (first call of this shape in the process)
        "warmup_compile_seconds": ws.compile_seconds,
        "warmup_prefill_seconds": ws.prefill_seconds,
        "warmup_decode_ms_mean": ws.decode_ms_per_token,
        "timed_compile_seconds": recompiled,  # should be 0: every shape was compiled in the warm-up
        "kv_bytes_device": last.kv_bytes_device,
        "kv_bytes_used": last.kv_bytes_used,
        # memory
        "load_seconds": load_s,
        "rss_after_load_bytes": rss_after_load,
        "peak_rss_after_load_bytes": peak_after_load,
        "rss_end_bytes": common.current_rss_bytes(),
        "peak_rss_bytes": common.peak_rss_bytes(),
        "child_seconds": time.perf_counter() - t_start,
        "jax_backend": jax.default_backend(),
    }
    return result


# ------------------------------------------------------------------- report
MiB = 2**20


def _ok(results: list[dict]) -> list[dict]:
    return [r for r in results if "error" not in r]


def results_table(results: list[dict]) -> str:
    headers = ["prompt tokens", "dtype", "prefill tok/s", "prefill s", "decode ms/tok (mean)",
               "decode ms/tok (P50)", "decode ms/tok (P90)", "decode steps", "compile s (warm-up)",
               "KV MiB", "peak RSS MiB", "of which load MiB"]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([common.fmt_num(r["length"]), r["dtype"], f"failed: {r['error']}"] + ["—"] * (len(headers) - 3))
            continue
        steps = f"{r['decode_steps_timed']}"
        if r["decode_steps_timed"] < r["decode_steps_requested"] * r["repeats"]:
            steps += f" (stopped: {r['stop_reason']})"
        rows.append([
            common.fmt_num(r["length"]), r["dtype"],
            common.fmt_num(r["prefill_tokens_per_second"], 0), common.fmt_num(r["prefill_seconds"], 2),
            common.fmt_num(r["decode_ms_mean"], 1), common.fmt_num(r["decode_ms_p50"], 1),
            common.fmt_num(r["decode_ms_p90"], 1), steps,
            common.fmt_num(r["warmup_compile_seconds"], 1),
            common.fmt_num(r["kv_bytes_device"] / MiB, 1),
            common.fmt_num(r["peak_rss_bytes"] / MiB, 0),
            common.fmt_num(r["peak_rss_after_load_bytes"] / MiB, 0),
        ])
    return common.markdown_table(headers, rows, align="rlrrrrrrrrrr")


def results_section(payload: dict, plot_rel: str | None) -> str:
    cfg = payload["config"]
    lines = [
        common.section_header(f"Foundation: {MODEL} full-KV prefill and decode", payload),
        "",
        "Prompts are the first N tokens of Python's `pydoc_data.topics.topics` (joined in sorted key "
        "order, raw text, no chat template), passed as token ids. Greedy decoding, batch 1, full KV. "
        f"Each configuration runs in a fresh process: one warm-up `generate` of the same shape, then "
        f"{cfg['repeats']} timed call(s) with {cfg['decode_steps']} decode steps each. Prefill tok/s = "
        "prompt tokens / prefill wall time (median over the timed calls; prefill pads the prompt to a "
        "multiple of its chunk, 512 tokens at these lengths, and the padding is computed but not counted). "
        "Decode ms/token is the wall time of one decode step including reading the token back, over every "
        "timed step. Compile time (warm-up call) is kept out of both. Peak RSS is `ru_maxrss` of the "
        "configuration's process (model load included); 'of which load' is the peak reached by the end of "
        "`hetero_jax.load` (the checkpoint is read in float32 and cast), so peak RSS above it is inference's.",
    ]
    if any(r.get("length") == 8000 for r in payload["results"]):
        lines += ["", "The model's context is 8192 tokens, so the \"8K\" point is 8000 prompt tokens "
                      f"(room for the {cfg['decode_steps'] + 1} new tokens)."]
    lines += ["", results_table(payload["results"])]
    lines += ["", common.plot_markdown("foundation", plot_rel, cfg["plot"])]
    return "\n".join(lines)


def make_plot(results: list[dict], path: Path, subtitle: str) -> Path | None:
    ok = _ok(results)
    if not ok:
        return None

    dtypes = list(dict.fromkeys(r["dtype"] for r in ok))  # in run order
    fig, (ax1, ax2) = common.subplots(1, 2, figsize=(11, 4.2))
    for i, dt in enumerate(dtypes):
        rs = sorted((r for r in ok if r["dtype"] == dt), key=lambda r: r["length"])
        xs = [r["length"] for r in rs]
        color = f"C{i}"
        ax1.plot(xs, [r["prefill_tokens_per_second"] for r in rs], "o-", color=color, label=dt)
        ax2.plot(xs, [r["decode_ms_mean"] for r in rs], "o-", color=color, label=f"{dt} mean")
        ax2.plot(xs, [r["decode_ms_p50"] for r in rs], "s--", color=color, alpha=0.6, label=f"{dt} P50")
    for ax in (ax1, ax2):
        ax.set_xlabel("prompt tokens")
        ax.set_xscale("log", base=2)
        lengths = sorted({r["length"] for r in ok})
        ax.set_xticks(lengths)
        ax.set_xticklabels([str(x) for x in lengths])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    ax1.set_ylabel("prefill tokens / s (higher is better)")
    ax1.set_title("Prefill throughput")
    ax2.set_ylabel("decode ms / token (lower is better)")
    ax2.set_title("Decode latency")
    return common.save_figure(fig, path, f"{MODEL}, full KV, batch 1 — {subtitle}", dpi=120)


# --------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = common.argument_parser("SmolLM2-135M full-KV prefill tokens/s, decode ms/token and peak RSS per "
                               "(prompt length, dtype); every configuration runs in a fresh subprocess.")
    p.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS),
                   help="prompt lengths in tokens (the model's context is 8192, so '8K' is 8000)")
    p.add_argument("--dtypes", nargs="+", default=list(DEFAULT_DTYPES), choices=["float32", "bfloat16"],
                   help="parameter / KV dtypes")
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per generate call")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed generate calls per configuration after the warm-up (prefill: median; "
                        "decode: all steps pooled)")
    p.add_argument("--model", default=MODEL, help=argparse.SUPPRESS)
    common.add_output_arguments(p, "foundation", SECTION, presets=False)
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per configuration")
    p.add_argument("--one", nargs=2, metavar=("LEN", "DTYPE"), help=argparse.SUPPRESS)  # child mode
    args = p.parse_args(argv)
    if args.decode_steps < 1:
        p.error("--decode-steps must be >= 1")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if any(n < 1 for n in args.lengths):
        p.error("--lengths must be positive")
    return args


def child_main(args: argparse.Namespace) -> int:
    length, dtype = int(args.one[0]), args.one[1]
    common.emit_child_result(run_one(length, dtype, args.decode_steps, args.repeats, args.model))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one:
        return child_main(args)

    from tqdm import tqdm

    plot_path = args.plot or args.out.with_suffix(".png")
    config = {
        "model": args.model,
        "lengths": args.lengths,
        "dtypes": args.dtypes,
        "decode_steps": args.decode_steps,
        "max_new_tokens": args.decode_steps + 1,
        "repeats": args.repeats,
        "warmup_runs": 1,
        "temperature": 0.0,
        "batch": 1,
        "policy": "full KV",
        "prompt_source": "pydoc_data.topics.topics, sorted keys joined by blank lines, "
                         "tokenizer.encode_prompt(text, chat=False)[:N]",
        "timeout_per_config_s": args.timeout,
        "out": str(args.out),
        "plot": str(plot_path),
    }
    payload = common.report_header(SECTION, config)
    payload["results"] = results = []

    configs = [(n, dt) for n in args.lengths for dt in args.dtypes]
    t0 = time.perf_counter()
    bar = tqdm(configs, desc="foundation", unit="config", dynamic_ncols=True)
    for n, dt in bar:
        bar.set_postfix_str(f"{n} tok {dt}")
        child_args = [Path(__file__).resolve(), "--one", n, dt, "--decode-steps", args.decode_steps,
                      "--repeats", args.repeats, "--model", args.model]
        r = common.run_child(child_args, timeout=args.timeout)
        r.setdefault("length", n)
        r.setdefault("dtype", dt)
        results.append(r)
        if "error" in r:
            tqdm.write(f"[{n} tok {dt}] FAILED: {r['error']}\n{r.get('stderr_tail', '')[-2000:]}")
        else:
            warn = ""
            if r["decode_steps_timed"] < args.decode_steps * args.repeats:
                warn += f"  [only {r['decode_steps_timed']} decode steps: {r['stop_reason']}]"
            if r["timed_compile_seconds"] > 0:
                warn += f"  [recompiled {r['timed_compile_seconds']:.1f} s in timed calls]"
            tqdm.write(
                f"[{n:>5} tok {dt:>8}] prefill {r['prefill_tokens_per_second']:8.0f} tok/s "
                f"({r['prefill_seconds']:.2f} s) | decode mean {r['decode_ms_mean']:.1f} "
                f"P50 {r['decode_ms_p50']:.1f} ms/tok | compile {r['warmup_compile_seconds']:.1f} s | "
                f"peak RSS {r['peak_rss_bytes'] / MiB:.0f} MiB | {r['child_wall_seconds']:.0f} s{warn}")
    bar.close()
    payload["total_seconds"] = time.perf_counter() - t0

    out = common.write_json(args.out, payload)
    subtitle = f"{common.git_summary(payload['git'])}, {payload['machine'].get('cpu_model', '?')}"
    png = make_plot(results, plot_path, subtitle)
    print(f"wrote {out}" + (f" and {png}" if png else ""))
    print(results_table(results))
    if args.write_results:
        common.write_results_section(SECTION, lambda plot_rel: results_section(payload, plot_rel), png,
                                     args.results_file)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
