"""Where a decode step's device time goes, per policy: a profiler trace of consecutive ``Engine.step`` calls.

For the GPU: the step of HeteroCache against full KV's at Llama-3.1-8B shapes (synthetic weights, the
authors' profile), kernel by kernel. Every device kernel the trace holds is summed by name and by kind
(attention kernels from Pallas/Triton, matrix products, XLA fusions, copies), per step, with the number of
kernels per step and the device-busy time against the wall time of a step. Policies run one after the
other (one engine alive at a time); each gets ``--warmup`` untimed steps first, then ``--steps`` traced.

    python benchmarks/profile_step.py --shape llama-3.1-8b --dtype bfloat16 --length 32768 \\
        --policies full heterocache heterocache:tau_drift=-1 --out /tmp/profile.json
    python benchmarks/profile_step.py --length 1024 --steps 6      # SmolLM2 shapes, a CPU smoke run

On a CPU the trace holds XLA's host ops instead of kernels (for testing the script, not for numbers).
"""
from __future__ import annotations

import collections
import gc
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_latency as BL  # noqa: E402
import common  # noqa: E402
from harness.synthetic import add_step_arguments, run_per_policy, step_setup  # noqa: E402

KINDS = (  # (kind, substrings of a kernel name), first match wins
    ("attention (Pallas/Triton)", ("pool_attention", "sparse_decode", "drift_check", "pooled_scores", "triton")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "dot", "matmul")),
    ("copy", ("memcpy", "memset", "copy", "dynamic-update-slice", "dynamic_update_slice")),
    ("reduction/sort", ("reduce", "sort", "top_k", "topk", "scan")),
    ("fusion", ("fusion", "loop_", "input_", "wrapped_")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def device_events(trace_dir: Path):
    """({line: [(event name, duration ns)]} of the kernel lines, {line: same} of the XLA-op lines, plane names).

    GPU planes are '/device:GPU:N': kernels are on its 'Stream #...' lines, the same time once more by HLO
    op on 'XLA Ops'. Without one (a CPU run) XLA's host ops on the client threads are taken as kernels."""
    from jax.profiler import ProfileData

    files = sorted(trace_dir.rglob("*.xplane.pb"))
    if not files:
        raise SystemExit(f"no *.xplane.pb under {trace_dir}: the profiler wrote no trace")
    data = ProfileData.from_file(str(files[-1]))
    planes = list(data.planes)
    gpu = [p for p in planes if p.name.startswith("/device:GPU")]
    kernels, ops = {}, {}
    for p in gpu:
        for line in p.lines:
            evs = [(e.name, e.duration_ns) for e in line.events]
            if "stream" in line.name.lower():
                kernels[f"{p.name} {line.name}"] = evs
            elif "xla ops" in line.name.lower():
                ops[f"{p.name} {line.name}"] = evs
        if not kernels:  # another profiler version's line names: every line but the per-module/op/step ones
            kernels = {f"{p.name} {ln.name}": [(e.name, e.duration_ns) for e in ln.events] for ln in p.lines
                       if not any(w in ln.name.lower() for w in ("xla modules", "xla ops", "steps"))}
    if not gpu:
        for p in planes:
            if p.name.startswith("/host:CPU"):
                for line in p.lines:
                    if line.name.startswith("tf_XLAPjRtCpuClient"):
                        kernels[line.name] = [(e.name, e.duration_ns) for e in line.events
                                              if not e.name.startswith(("ThreadpoolListener", "end: "))]
    names = [p.name for p in planes] + [f"{p.name} {ln.name}" for p in gpu for ln in p.lines]
    host = {}  # the host's events (Python functions, JAX dispatch, PJRT) on a GPU run, where kernels run apart
    if gpu:
        for p in planes:
            if p.name.startswith("/host:CPU"):
                for line in p.lines:
                    host[f"{p.name} {line.name}"] = [(e.name, e.duration_ns) for e in line.events]
    return kernels, ops, names, host


def summarise(lines: dict, n_steps: int, top: int) -> dict:
    """Per-step counts and times of the events of ``lines``, by name and by kind."""
    by_name: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for evs in lines.values():
        for n, dur in evs:
            by_name[n][0] += 1
            by_name[n][1] += dur
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for n, (cnt, dur) in by_name.items():
        by_kind[kind_of(n)][0] += cnt
        by_kind[kind_of(n)][1] += dur
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "busy_ms_per_step": sum(d for _c, d in by_name.values()) / 1e6 / n_steps,
        "events_per_step": sum(c for c, _d in by_name.values()) / n_steps,
        "by_kind": {k: {"kernels_per_step": c / n_steps, "ms_per_step": d / 1e6 / n_steps}
                    for k, (c, d) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])},
        "top": [{"name": n[:160], "kind": kind_of(n), "calls_per_step": c / n_steps,
                 "ms_per_step": d / 1e6 / n_steps, "us_per_call": d / 1e3 / c} for n, (c, d) in ranked],
        "lines": {k: len(v) for k, v in lines.items()},
    }


def profile_policy(model, ids, name, rho, prof, args) -> dict:
    import jax

    from hetero_jax import runtime as G

    policy = BL.make_policies([(name, rho)], prof)[0]
    bound = G.bind_policy(model, policy)
    e = G.Engine(model, [ids], bound, tail_capacity=G.tail_capacity_for(args.warmup + args.steps + 2))
    tok = int(e.first_tokens(0.0, 1.0)[0])
    for _ in range(args.warmup):
        nxt, _s = e.step([tok], 0.0, 1.0)
        tok = int(nxt[0])
    e.drain()
    wall = []
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            nxt, s = e.step([tok], 0.0, 1.0)
            wall.append(s)
            tok = int(nxt[0])
        wall[-1] += e.drain()
        total_wall = time.perf_counter() - t0
        jax.profiler.stop_trace()
        kernel_lines, op_lines, plane_names, host_lines = device_events(Path(d))
    stats = common.engine_kv_stats(e)
    del e
    gc.collect()
    k = summarise(kernel_lines, args.steps, args.top)
    return {
        "policy": name, "rho": rho, "label": common.combo_label(name, rho), "steps": args.steps,
        "step_wall_ms": [1e3 * s for s in wall], "wall_ms_per_step": 1e3 * total_wall / args.steps,
        "device_busy_ms_per_step": k["busy_ms_per_step"], "kernels_per_step": k["events_per_step"],
        "by_kind": k["by_kind"], "top": k["top"], "kernel_lines": k["lines"],
        "xla_ops": summarise(op_lines, args.steps, args.top) if op_lines else None,
        # nested events (a Python function and what it calls) each count their whole time
        "host": summarise(host_lines, args.steps, args.top) if host_lines else None,
        "planes": plane_names, "recall": stats.get("recall"), "kv_bytes_device": stats.get("kv_bytes_device"),
    }


def render(rows: list[dict]) -> str:
    out = ["| policy | wall ms/step | device busy ms/step | kernels/step | " +
           " | ".join(k for k, _ in KINDS) + " | other |", "| :--- | ---: | ---: | ---: |" + " ---: |" * (len(KINDS) + 1)]
    for r in rows:
        cells = []
        for k in [k for k, _ in KINDS] + ["other"]:
            v = r["by_kind"].get(k)
            cells.append(f"{v['ms_per_step']:.2f} ({v['kernels_per_step']:.0f})" if v else "—")
        out.append(f"| {r['label']} | {r['wall_ms_per_step']:.2f} | {r['device_busy_ms_per_step']:.2f} | "
                   f"{r['kernels_per_step']:.0f} | " + " | ".join(cells) + " |")
    out.append("")
    out.append("Cells: device ms per step (kernels per step).")
    for r in rows:
        out += ["", f"Top kernels, {r['label']}:", "", "| kernel | kind | calls/step | ms/step | µs/call |",
                "| :--- | :--- | ---: | ---: | ---: |"]
        out += [f"| `{t['name'][:90]}` | {t['kind']} | {t['calls_per_step']:.1f} | {t['ms_per_step']:.3f} | "
                f"{t['us_per_call']:.1f} |" for t in r["top"]]
        if r.get("host"):
            out += ["", f"Host events, {r['label']} (nested events each count their whole time):", "",
                    "| event | calls/step | ms/step | µs/call |", "| :--- | ---: | ---: | ---: |"]
            out += [f"| `{t['name'][:90]}` | {t['calls_per_step']:.1f} | {t['ms_per_step']:.3f} | "
                    f"{t['us_per_call']:.1f} |" for t in r["host"]["top"]]
    return "\n".join(out)


def main(argv=None) -> int:
    import jax

    ap = common.argument_parser(__doc__.split("\n\n")[0])  # refuses an --out it cannot write, before any work
    add_step_arguments(ap)
    ap.add_argument("--warmup", type=int, default=6, help="untimed steps before the trace (compiles)")
    ap.add_argument("--steps", type=int, default=10, help="traced steps per policy")
    ap.add_argument("--top", type=int, default=25, help="kernels listed per policy")
    args = ap.parse_args(argv)
    for flag, value, least in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0), ("--top", args.top, 1)):
        if value < least:
            ap.error(f"{flag} {value} must be >= {least}")
    model, prof, ids = step_setup(args, args.warmup + args.steps + 8)
    # A process's first trace carries a hundred times more Python events than the next ones (on this CPU:
    # 20,577 against 187 for the same work), and on the H200 the first policy's trace came back without
    # any: a throwaway trace first, so every policy's is a later one
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        jax.profiler.stop_trace()
    return run_per_policy(
        args, argv, "profile-step",
        f"Decode step kernel by kernel: {args.shape} at {args.length:,} tokens (profile_step.py)",
        lambda p, rho: profile_policy(model, ids, p, rho, prof, args), render,
        lambda r: f"{r['label']}: wall {r['wall_ms_per_step']:.2f} ms/step, device busy "
                  f"{r['device_busy_ms_per_step']:.2f} ms/step, {r['kernels_per_step']:.0f} kernels/step")


if __name__ == "__main__":
    raise SystemExit(main())
