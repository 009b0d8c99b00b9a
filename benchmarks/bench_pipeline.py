"""Decode steps one at a time against pipelined (the next step dispatched before a step's token is read back).

``Engine.step`` dispatches a step and waits for its token; ``generate`` dispatches each step before reading
back the previous one (``decode_loop(pipelined=True)``), so the host's work for a step (the policy's hooks,
the dispatch, a GPU's launch and graph update) overlaps the device's work for the step before. On an H200
the host side of a full-KV step at 32K was as long as its kernels (section `profile-step-gpu-recall`): this
script measures what the overlap gives, per policy, both ways in one run: blocks of ``--block`` steps, one
at a time then pipelined, alternating for ``--rounds`` rounds after ``--warmup`` untimed steps of each.
A step's time is the wall time until its tokens are on the host (a pipelined block's first step includes
the dispatch of the one after it); a block ends by waiting for the policy's asynchronous work, counted in
its last step. One engine alive at a time.

    python benchmarks/bench_pipeline.py --shape llama-3.1-8b --dtype bfloat16 --length 32768 \\
        --policies full heterocache:tau_drift=-1 heterocache --out /tmp/pipeline.json
    python benchmarks/bench_pipeline.py --length 512 --rounds 2     # SmolLM2 shapes on a CPU (the plumbing)
"""
from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_latency as BL  # noqa: E402
import common  # noqa: E402
from harness.roofline import timing_summary  # noqa: E402
from harness.synthetic import add_step_arguments, run_per_policy, step_setup  # noqa: E402

MODES = ("one at a time", "pipelined")


def sync_block(e, tok: int, n: int) -> tuple[int, list[float]]:
    """``n`` steps of ``Engine.step`` (dispatch, then wait for the token): (last token, seconds per step)."""
    times = []
    for _ in range(n):
        nxt, s = e.step([tok], 0.0, 1.0)
        times.append(s)
        tok = int(nxt[0])
    return tok, times


def pipelined_block(e, tok: int, n: int) -> tuple[int, list[float]]:
    """``n`` steps, each dispatched on the device tokens of the one before, before those are read back."""
    from hetero_jax.model.sharding import to_host

    times = []
    t = time.perf_counter()
    this = e.dispatch([tok], 0.0, 1.0)
    for k in range(n):
        ahead = e.dispatch(this, 0.0, 1.0) if k + 1 < n else None
        tok = int(to_host(this)[0])
        now = time.perf_counter()
        times.append(now - t)
        t, this = now, ahead
    return tok, times


def measure_policy(model, ids, name, rho, prof, args) -> dict:
    from hetero_jax import runtime as G

    policy = BL.make_policies([(name, rho)], prof)[0]
    steps = args.warmup * 2 + args.rounds * 2 * args.block + 2
    e = G.Engine(model, [ids], G.bind_policy(model, policy), tail_capacity=G.tail_capacity_for(steps))
    tok = int(e.first_tokens(0.0, 1.0)[0])
    for block in (sync_block, pipelined_block):  # compiles, and the first steps' allocations
        tok, _ = block(e, tok, args.warmup)
    e.drain()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode, block in zip(MODES, (sync_block, pipelined_block)):
            tok, t = block(e, tok, args.block)
            t[-1] += e.drain()
            times[mode] += t
    recall = common.engine_kv_stats(e).get("recall")
    del e
    gc.collect()
    return {"policy": name, "rho": rho, "label": common.combo_label(name, rho), "seconds": times,
            "summary": {m: timing_summary(times[m]) for m in MODES}, "recall": recall}


def summary_line(r: dict) -> str:
    a, b = (r["summary"][m]["p50_ms"] for m in MODES)
    return f"{r['label']}: one at a time P50 {a:.2f} ms, pipelined {b:.2f} ms ({b / a:.2f}x)"


def render(rows: list[dict]) -> str:
    full = next((r for r in rows if r["policy"] == "full"), None)
    out = ["| policy | one at a time P50 ms | pipelined P50 ms | pipelined / one at a time | one at a time vs full "
           "KV | pipelined vs full KV | P99/P50 one at a time | P99/P50 pipelined | steps per mode |",
           "| :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        a, b = (r["summary"][m] for m in MODES)
        vs = ["—", "—"] if full is None else [f"{s['p50_ms'] / full['summary'][m]['p50_ms']:.2f}"
                                                for s, m in ((a, MODES[0]), (b, MODES[1]))]
        out.append(f"| {r['label']} | {a['p50_ms']:.2f} | {b['p50_ms']:.2f} | {b['p50_ms'] / a['p50_ms']:.2f} | "
                   f"{vs[0]} | {vs[1]} | {a['p99_over_p50']:.2f} | {b['p99_over_p50']:.2f} | {a['n']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = common.argument_parser(__doc__.split("\n\n")[0])  # refuses an --out it cannot write, before any work
    add_step_arguments(ap)
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps of each mode first (compiles)")
    ap.add_argument("--block", type=int, default=10, help="consecutive steps of one mode")
    ap.add_argument("--rounds", type=int, default=4, help="blocks of each mode, alternating")
    args = ap.parse_args(argv)
    for flag in ("warmup", "block", "rounds"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    model, prof, ids = step_setup(args, 2 * args.warmup + 2 * args.rounds * args.block + 8)
    return run_per_policy(
        args, argv, "pipeline",
        f"Decode steps one at a time and pipelined: {args.shape} at {args.length:,} tokens (bench_pipeline.py)",
        lambda p, rho: measure_policy(model, ids, p, rho, prof, args), render,
        summary_line)


if __name__ == "__main__":
    raise SystemExit(main())
