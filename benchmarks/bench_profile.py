"""Benchmark: HeteroCache profile calibration of the shipped SmolLM2-135M profile.

Re-runs the calibration at the shipped profile's recorded settings, reports
wall time (model load and calibration apart, compile time included in the
latter and also shown alone), peak RSS, role counts and whether the roles
match the shipped file; adds the role counts of the HeteroCache authors'
published profiles (../shared/reference). Writes JSON to benchmarks/out/ and
prints a markdown table.

    python benchmarks/bench_profile.py [--no-progress] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import platform
import resource
import subprocess
import sys
import time

from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _peak_rss_mib() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 1024  # bytes on macOS, KiB on Linux


def parse_args(argv=None):
    """The arguments and the parser (harness.args.BenchParser: --out must be a folder it can create or write into,
    refused with a usage error before any work)."""
    from harness.args import argument_parser

    ap = argument_parser(__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="known model with a shipped profile")
    ap.add_argument("--out", dest="out_dir", type=Path, default=Path(REPO, "benchmarks", "out"), metavar="DIR",
                    help="JSON output directory (created if missing; each run writes bench_profile-STAMP.json)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--write-results", action="store_true", help="rewrite the profile section of benchmarks/RESULTS.md")
    return ap.parse_args(argv), ap


def main(argv=None) -> int:
    args, ap = parse_args(argv)

    import jax
    import numpy as np

    import hetero_jax
    from hetero_jax.profile import load_profile
    from hetero_jax.profile.calibrate import calibrate_tokens, calibration_windows, pydoc_text
    from hetero_jax.profile import shipped_profile_path

    from hetero_jax.runtime import compile_seconds
    path = shipped_profile_path(args.model)
    if path is None:
        ap.error(f"no shipped profile for {args.model!r}")
    shipped = load_profile(path)
    s = shipped.settings
    batch = int(s.calibration_data.rsplit("batch_size ", 1)[1]) if "batch_size " in (s.calibration_data or "") else 4

    t0 = time.perf_counter()
    model = hetero_jax.load(args.model, progress=not args.no_progress)
    load_s = time.perf_counter() - t0
    windows = calibration_windows(model.tokenizer, pydoc_text(), s.tokens_per_sample, s.samples, seed=s.seed)
    compile0 = compile_seconds()
    t1 = time.perf_counter()
    prof = calibrate_tokens(model.config, model.params, windows, top_k=s.top_k, decode_steps=s.decode_steps,
                            tau_stable=s.tau_stable, tau_sim=s.tau_sim, seed=s.seed, tokens=s.tokens_per_sample,
                            progress=not args.no_progress, model_name=model.name, batch_size=batch)
    calib_s = time.perf_counter() - t1
    compile_s = compile_seconds() - compile0
    rss = _peak_rss_mib()
    reproduces = bool(np.array_equal(prof.roles, shipped.roles) and prof.clusters == shipped.clusters)

    ref_dir = os.path.normpath(os.path.join(REPO, "..", "shared", "reference"))
    refs = {}
    for f in sorted(glob.glob(os.path.join(ref_dir, "*.json"))):
        p = load_profile(f)
        refs[os.path.basename(f)] = {"shape": list(p.roles.shape), "roles": p.role_counts(),
                                     "full": p.n_full, "compressed": p.n_compressed}

    result = {
        "benchmark": "profile_calibration",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend(),
                    "devices": [str(d) for d in jax.devices()]},
        "config": {"model": args.model, "top_k": s.top_k, "decode_steps": s.decode_steps,
                   "tokens_per_sample": s.tokens_per_sample, "samples": s.samples, "seed": s.seed,
                   "tau_stable": s.tau_stable, "tau_sim": s.tau_sim, "batch_size": batch,
                   "data": s.calibration_data},
        "load_seconds": round(load_s, 2),
        "calibrate_seconds": round(calib_s, 2),
        "compile_seconds": round(compile_s, 2),
        "peak_rss_mib": round(rss, 1),
        "roles": prof.role_counts(),
        "full": prof.n_full,
        "compressed": prof.n_compressed,
        "reproduces_shipped_roles": reproduces,
        "reference_profiles": refs,
    }
    from harness.results import write_json

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = os.path.join(args.out_dir, f"bench_profile-{stamp}.json")
    write_json(out, result, "--out")  # whole or not at all (a temporary renamed into place)

    c = prof.role_counts()
    lines = [f"## Profile calibration: {args.model}", ""]
    if args.write_results:
        from common import command_line, git_info, git_summary, machine_info, machine_summary

        lines += [f"- Machine: {machine_summary(machine_info())}", f"- Commit: {git_summary(git_info())}",
                  f"- Date: {datetime.datetime.now().isoformat(timespec='seconds')}",
                  f"- Command: `{command_line(argv)}`", ""]
    lines += [f"Re-runs the shipped profile's calibration at its recorded settings ({s.samples} x "
              f"{s.tokens_per_sample} tokens of pydoc topics, {s.decode_steps} decode steps, top_k {s.top_k}, "
              f"tau_stable {s.tau_stable}, tau_sim {s.tau_sim}; {jax.default_backend()}, {os.cpu_count()} CPUs). "
              "Calibrate time includes compile; peak RSS is the process's (model load included).", "",
              "| load s | calibrate s | of which compile s | peak RSS MiB | reproduces shipped roles |",
              "|---:|---:|---:|---:|:---:|",
              f"| {load_s:.1f} | {calib_s:.1f} | {compile_s:.1f} | {rss:.0f} | {'yes' if reproduces else 'NO'} |",
              "", "| profile | layers x KV heads | anchor | volatile | pivot | satellite | full | compressed |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    rows = [(f"{args.model} (ours, re-run)", list(prof.roles.shape), c, prof.n_full, prof.n_compressed)]
    rows += [(name, r["shape"], r["roles"], r["full"], r["compressed"]) for name, r in refs.items()]
    for name, shape, rc, nf, nc in rows:
        lines.append(f"| {name} | {shape[0]} x {shape[1]} | {rc['anchor']} | {rc['volatile']} | {rc['pivot']} | "
                     f"{rc['satellite']} | {nf} | {nc} |")
    print("\n".join(lines))
    if args.write_results:
        from common import update_results_section

        update_results_section("profile", "\n".join(lines))
    print(f"\nwrote {out}")
    return 0 if reproduces else 1


if __name__ == "__main__":
    sys.exit(main())
