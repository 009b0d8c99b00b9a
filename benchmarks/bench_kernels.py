"""Benchmark: the Pallas kernels of pallas_kernels (decode attention, pooled scores, drift check).

What it measures depends on the machine:

- Always (no GPU needed):
  1. CUDA lowering through Triton of every kernel (sparse_decode_attention,
     pooled_scores gqa=max/mean, drift_check, pool_attention) at SmolLM2-135M shapes
     (Hkv 3, G 3, D 64, S 8192) and Llama-3.1-8B shapes (Hkv 8, G 4, D 128;
     S 8K/32K/128K for decode, T 8K/32K for scoring), bf16 and f32:
     lowered yes/no, Triton custom call present, Triton module verified,
     lowering wall time. This is `jax.jit(f).trace(*abstract_args)
     .lower(lowering_platforms=("cuda",))`; nothing is compiled or run.
  2. Interpret-mode numerics (Pallas interpreter on CPU) vs the plain-JAX
     references at small shapes with ragged lengths (1, 17, ..., full).
  3. The bytes each decode kernel call must read at Llama-3.1-8B shapes for
     S = 8K/32K/128K and rho = 1, 0.5, 0.3, and the time that takes at an
     H100's nominal HBM bandwidth: a computed lower bound, not a measurement.
- Only when jax sees a GPU: times the kernel vs the reference at the
  Llama-3.1-8B decode shapes and reports achieved bandwidth against a
  measured copy bandwidth (`x + 0` over a large array), and the two GPU
  targets (>= 70 % of copy bandwidth from S = 32K; time falling with rho).
  Then times `pool_attention` (one launch per layer over a row pool) at
  Llama-3.1-8B shapes, contexts 32K and 128K, two full KV heads and six at
  about 0.1x the context, against the bytes of the heads' lengths, the copy
  bandwidth and one `sparse_decode_attention` launch per head group.
  Without a GPU that path is skipped and the output says so.

Writes JSON (config, commit, machine, every row) to benchmarks/out/kernels.json
and prints the markdown; `--write-results` also rewrites the `kernels` section
of benchmarks/RESULTS.md (other sections untouched).

    python benchmarks/bench_kernels.py [--write-results] [--no-progress] [--out PATH]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

# The code by concern, beside this script: kernel_cases (shapes, lowering, numerics, bytes), kernel_timing (what
# runs only on a GPU) and kernel_report (the markdown); this script runs them and writes JSON and RESULTS.
import common  # noqa: E402  (benchmarks/common.py)
from kernel_cases import (BLOCK_K, DECODE_NUMERICS, DECODE_TOL, DRIFT_L_BASE, DRIFT_NUMERICS,  # noqa: E402
                          DRIFT_TAU, H100_NOMINAL_BW, LLAMA, MODELS, POOL_CONTEXTS, POOLED_NUMERICS, POOLED_RTOL,
                          POOLED_TOL, RHOS, SCORE_W, decode_bytes, gpu_present, lowering_jobs, numerics_jobs,
                          run_lowering, run_numerics)
from kernel_report import fmt_len, render_drift_timing, render_markdown, render_sweep  # noqa: E402
from kernel_timing import (DRIFT_TIMING_LAYERS, SWEEP, SWEEP_S, drift_timing, gpu_timing, pool_timing,  # noqa: E402
                           sweep_launch)

SECTION = "kernels"


# -------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = common.argument_parser(__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=common.OUT_DIR / "kernels.json", help="JSON output path "
                    "(default: benchmarks/out/kernels.json; checked before any work)")
    ap.add_argument("--write-results", action="store_true",
                    help=f"rewrite the '{SECTION}' section of benchmarks/RESULTS.md (created if missing)")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    ap.add_argument("--skip-lowering", action="store_true", help="skip the CUDA lowering checks")
    ap.add_argument("--skip-numerics", action="store_true", help="skip the interpret-mode numerics")
    ap.add_argument("--gpu-iters", type=int, default=50, help="timed calls per configuration on a GPU (default 50)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the numerics inputs (default 0)")
    ap.add_argument("--drift-timing", action="store_true",
                    help="only time the drift check, old (lax.top_k) vs new (bisection select), at SmolLM2 shapes; "
                         "--write-results rewrites the 'kernels-drift-check' section")
    ap.add_argument("--drift-iters", type=int, default=7, help="repeats of each drift-check timing (default 7)")
    ap.add_argument("--sweep", action="store_true",
                    help="only time the decode kernel over launch parameters (num_splits, block_k, num_warps, "
                         "num_stages) at Llama-3.1-8B shapes, 32K and 128K (needs a GPU); writes kernels-sweep.json "
                         "beside --out and, with --write-results, the 'kernels-gpu-sweep' section")
    args = ap.parse_args(argv)  # refuses an --out it cannot write (BenchParser.check_paths), before any work
    for flag, value in (("--gpu-iters", args.gpu_iters), ("--drift-iters", args.drift_iters)):
        if value < 1:
            ap.error(f"{flag} {value}: give at least 1 timed call (a median of none is no timing)")
    beside = "kernels-drift-check.json" if args.drift_timing else "kernels-sweep.json" if args.sweep else None
    if beside is not None:  # those write a file beside --out instead: check that one too
        from hetero_jax.errors import OutputError
        from hetero_jax.io.files import check_outputs

        try:
            check_outputs({"--out": args.out.with_name(beside)}, parents=True)
        except OutputError as e:
            ap.error(str(e))
    if args.drift_timing:
        return drift_timing_main(args, argv)
    if args.sweep:
        return sweep_main(args, argv)

    from tqdm import tqdm

    t_start = time.perf_counter()
    machine = common.machine_info()
    has_gpu = gpu_present()
    low_jobs = [] if args.skip_lowering else lowering_jobs()
    num_jobs = [] if args.skip_numerics else numerics_jobs(gpu=has_gpu)
    n_gpu = len(LLAMA["S"]) * len(RHOS) + len(POOL_CONTEXTS) if has_gpu else 0
    config = dict(models=MODELS, rhos=RHOS, score_W=SCORE_W, drift_L_base=DRIFT_L_BASE, drift_tau=DRIFT_TAU,
                  block_k=BLOCK_K, h100_nominal_bandwidth=H100_NOMINAL_BW, decode_numerics=DECODE_NUMERICS,
                  pooled_numerics=POOLED_NUMERICS, drift_numerics=DRIFT_NUMERICS, decode_tol=DECODE_TOL,
                  pooled_tol=POOLED_TOL, pooled_rtol=POOLED_RTOL, seed=args.seed, gpu_iters=args.gpu_iters,
                  skip_lowering=args.skip_lowering, skip_numerics=args.skip_numerics)

    lowering, numerics = [], []
    with tqdm(total=len(low_jobs) + len(num_jobs) + n_gpu, desc="kernels", unit="check",
              disable=args.no_progress, file=sys.stderr) as bar:
        for job in low_jobs:
            bar.set_postfix_str(f"lower {job['kernel']} {job['model']} {fmt_len(job['S'])} {job['dtype']}")
            lowering.append(run_lowering(job))
            bar.update(1)
        for i, (kind, case) in enumerate(num_jobs):
            bar.set_postfix_str(f"{'compiled' if has_gpu else 'interpret'} {kind} {case}")
            numerics.append(run_numerics(kind, case, args.seed * 1000 + i, compiled=has_gpu))
            bar.update(1)
        gpu = pool = None
        if has_gpu:
            bar.set_postfix_str("GPU timing")
            gpu = gpu_timing(iters=args.gpu_iters, progress=bar)
            bar.set_postfix_str("GPU timing: pool_attention")
            pool = pool_timing(iters=args.gpu_iters, copy=gpu["copy"], progress=bar)

    out = Path(args.out)
    report = common.report_header("kernels", config, machine)
    report.update(
        gpu_present=has_gpu,
        gpu_targets_measured=has_gpu,
        note=None if has_gpu else ("No GPU available for this run: the GPU targets (bandwidth fraction >= 70% "
                                   "from 32K, time falling with rho) were NOT measured; the GPU timing path "
                                   "was not run. decode_bytes is a computed lower bound, not a measurement."),
        lowering=lowering,
        numerics=numerics,
        decode_bytes=[decode_bytes(S, rho) for S in LLAMA["S"] for rho in RHOS],
        gpu_timing=gpu,
        gpu_timing_run=gpu is not None,
        pool_timing=pool,
        json_path=os.path.relpath(out.resolve(), REPO) if str(out.resolve()).startswith(str(REPO)) else str(out),
    )
    report["wall_seconds"] = time.perf_counter() - t_start
    md = render_markdown(report)
    report["markdown"] = md
    # a GPU run has its own section: make bench's CPU run (interpret numerics, no timing) keeps "kernels"
    publish(out, report, md, (SECTION + "-gpu" if has_gpu else SECTION) if args.write_results else None)
    failed = [r for r in lowering if not (r["lowered"] and r["triton_call_present"])] + \
             [r for r in numerics if not r["ok"]]
    return 1 if failed else 0


def sweep_main(args, argv) -> int:
    from tqdm import tqdm

    if not gpu_present():
        raise SystemExit("--sweep times compiled kernels: it needs a GPU (jax.devices() has none)")
    machine, git = common.machine_info(), common.git_info()
    n = len(SWEEP_S) * math.prod(len(v) for v in SWEEP.values())
    with tqdm(total=n, desc="sweep", disable=args.no_progress, file=sys.stderr) as bar:
        sw = sweep_launch(progress=bar)
    md = "\n".join([common.results_header("Decode kernel launch parameters on a GPU (bench_kernels.py --sweep)",
                                           machine, git, common.command_line(argv)), "", render_sweep(sw)])
    out = Path(args.out).with_name("kernels-sweep.json")
    publish(out, {**common.report_header("kernels-sweep", vars(args), machine), **sw, "markdown": md}, md,
            "kernels-gpu-sweep" if args.write_results else None)
    return 0


def drift_timing_main(args, argv) -> int:
    import jax

    machine, git = common.machine_info(), common.git_info()
    t = drift_timing(iters=args.drift_iters)
    md = "\n".join([
        common.results_header("Drift check: old (lax.top_k) vs new (bisection select), SmolLM2-135M shapes",
                              machine, git, common.command_line(argv)), "",
        f"One check step: {DRIFT_TIMING_LAYERS} layers x 1 pivot (B 1, W {SCORE_W} buffered steps, G 3, D 64, "
        f"float32, {t['rows'][0]['mode']} scores on {jax.default_backend()}), L_base of the shipped profile "
        f"({t['profile']}) at rho (Eq. 7). Wall ms of the {DRIFT_TIMING_LAYERS} dispatches until all are ready, "
        f"median of {t['iters']} repeats, all variants alternating (compile excluded). before = the check as "
        "of commit 69e668b (keys masked before the score dot, which kept XLA:CPU off its matmul, then lax.top_k of "
        "every buffered step + bitmap overlap); old selection = `drift_check_reference` (today's scores, then "
        "that lax.top_k selection); new = `drift_check` (L_base-th largest by a 32-pass bisection on the "
        "float32 bits, exact lax.top_k membership of K_base, no sort). 'scores alone' (today's "
        "`pooled_scores_reference` on CPU) is common to old selection and new; the selections are also timed "
        "alone on precomputed scores. "
        "The last timing column is the one top-k the new check still needs, on precomputed scores, only on a "
        "check where a pivot drifted (new K_base and recall rows; skipped by lax.cond otherwise).", "",
        render_drift_timing(t)])
    out = Path(args.out).with_name("kernels-drift-check.json")
    publish(out, {**common.report_header("kernels-drift-check", vars(args), machine), **t}, md,
            "kernels-drift-check" if args.write_results else None)
    return 0 if all(r["agree"] for r in t["rows"]) else 1


def publish(out: Path, payload: dict, md: str, section: str | None) -> None:
    """Write ``payload`` as JSON to ``out``, print ``md`` and, with a ``section``, rewrite that section of
    benchmarks/RESULTS.md with ``md``."""
    common.write_json(out, payload)
    print(md)
    print(f"\nwrote {out}")
    if section is not None:
        print(f"updated section '{section}' of {common.update_results_section(section, md)}")


if __name__ == "__main__":
    sys.exit(main())
