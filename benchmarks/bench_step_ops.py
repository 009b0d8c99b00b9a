#!/usr/bin/env python
"""Kernels per decode step, per policy, in the executable XLA compiles for an H100, on a machine without a GPU.

Why: CPU timings hid a 5x GPU loss. HeteroCache's decode step launched one attention call per head group, and
on an H200 a Llama-3.1-8B step at 32K took 62.6 ms against full KV's 12.5 (RESULTS.md ``latency-llama8b-gpu``)
while the CPU showed a small gap. The number of kernels a step launches is visible without a GPU: jax with the
CUDA plugin compiles a jitted function for an H100 *topology* (``jax.experimental.topologies``; no device, no
driver) and the compiled executable's text lists every kernel (docs/architecture.md, "Compiling for a GPU
without one").

What is compiled, per policy: ONE decode step exactly as the engine jits it (``runtime.engine.decode_step_jit``:
``model.transformer.decode_step`` with the policy's ``attend`` in every layer, the cache donated, greedy
sampling), Llama-3.1-8B shapes (``bench_latency.SYNTHETIC_SHAPES["llama-3.1-8b"]``), bfloat16, batch 1, the
Pallas kernels (Triton lowering), for one H100 SXM (``H100_TARGET_CONFIG``). The 8B weights are
``jax.ShapeDtypeStruct``s: nothing is allocated.

Where the cache comes from (the "synthetic prefill", :func:`synthetic_prefill`): the decode step takes a
post-prefill cache whose structure depends on the policy's prefill. A real 32K prefill is far too slow on a
CPU, so for every layer the policy's prefill plan (``policy.make_prefill``) gets random inputs
(``build_layer(li, layer, x_in [B, T, hidden], k_buf [B, Hkv, T, D], v_buf, lens)``) with the layer params of a
NARROW twin of the model (``llama-3.1-8b-narrow``: the same layers, heads and head_dim, hidden 256, MLP 512,
vocab 1024, bfloat16), the layers are wrapped as ``model.transformer.prefill`` wraps them, ``plan.finish``
runs, and the finished cache becomes ShapeDtypeStruct leaves. Only the plan protocol is used
(``make_prefill`` / ``build_layer`` / ``finish``); ``tests/test_step_ops.py`` checks that the synthetic cache
has the same structure as a real prefill's, so a change of the cache layout shows there. Random weights and
inputs make *what* is kept meaningless; the *shapes* the step compiles for are the policy's own (budgets,
groups, pages, codes), except where a policy sizes its cache from the data (CAKE's layer budgets follow the
attention of the random inputs).

Peers that need a model-specific calibration file get a stand-in derived for Llama-3.1-8B (:func:`make_policy`):

- SyncKV: the HeteroCache authors' profile's clusters as SyncKV groups (each pivot an R-head with its
  satellites as NR-heads; volatile and anchor heads are clusters of one: SyncKV's "volatile", full KV);
- ContextKeeper: a fixed ranking: the authors' full-KV heads (pivots, volatiles) first, then the others by
  their allocation weight (the heads the authors give more context first);
- HCAttention: a random per-layer key codebook of the paper's g = 32 shape for 128-dim heads (d = 4, c = 512,
  the size this project ships; seed 0), besides its exact-keys point (rho 0.5) that needs no codebook.

Counting (:func:`count_step_ops`, on ``compiled.as_text()``): see ``COUNTING_RULE``. The compile does not run
the step: the counts are evidence about the GPU step's launches; times still need a GPU. Without a GPU XLA
cannot autotune, so the GEMM backend (cuBLAS or a Triton GEMM fusion) is XLA's untuned default; each GEMM is
one kernel either way.

Targets (the project's): HeteroCache at most 1.2x full KV's kernels per step; no compressed policy above 1.5x.

Environment: the CUDA plugin must not go into the project's .venv (it changes how jax starts). ``make step-ops``
builds ``.venv-gpucompile`` (or ``$GPUCOMPILE_VENV``) with ``pip install -e ".[gpu-compile]"`` and runs

    CUDA_VISIBLE_DEVICES=-1 JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 HETERO_JAX_KERNELS=pallas \\
        $VENV/bin/python benchmarks/bench_step_ops.py --lengths 32768 2048 --write-results

Output: ``--out`` JSON (config, commit, jax versions, target, per policy: fusions, custom calls by kind, copies,
kernels per step, ratios to full KV, compile seconds), a markdown table on stdout and, with
``--write-results``, the ``step-ops`` section of benchmarks/RESULTS.md. ``--target cpu`` compiles for this
machine's XLA:CPU instead (no plugin needed; what the tests use).

Code by concern, beside this script: ``step_ops_policies`` (specs and stand-ins), ``step_ops_compile`` (the target,
the synthetic prefill, the compiles), ``step_ops_hlo`` (the counting) and ``step_ops_report`` (ratios, targets,
tables, the RESULTS section); this script runs the grid and writes the JSON.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (benchmarks/common.py)
from step_ops_compile import (H100_DESCRIPTION, NARROW, TAIL_CAPACITY, abstract, abstract_params,  # noqa: E402
                              cache_summary, compile_check, compile_step, cpu_mesh, gpu_mesh, narrow_twin,
                              synthetic_prefill)
from step_ops_hlo import COUNTING_RULE, count_step_ops  # noqa: E402
from step_ops_policies import SHAPE, authors_profile, label, make_policy, parse_spec  # noqa: E402
from step_ops_report import (HETERO_TARGET, POLICY_TARGET, add_ratios, results_section,  # noqa: E402
                             sources_table, table, target_check, targets_text)

SECTION = "step-ops"
DEFAULT_LENGTHS = (32768,)
DEFAULT_RHO = 0.3
# Registry specs in table order; full KV first (the reference). HCAttention has byte-based operating points, not
# rho 0.3 (README): its exact-keys point (0.5) and the g = 32 codebook point (0.125 in bfloat16).
DEFAULT_POLICIES = ("full", "snapkv", "pyramidkv", "h2o", "streamingllm", "cake", "heterocache",
                    "synckv", "contextkeeper", "quest", "quest:offload=true", "freekv",
                    "hcattention@0.5", "hcattention@0.125")
# Policies whose prefill scoring is quadratic in the prompt (H2O: every prompt query's attention, 8.8 TFLOP
# per layer at 32K): above this length their synthetic prefill would take hours on a 2-core CPU, so they are
# measured at --fallback-length instead (marked in the table). --no-fallback runs them anyway.
QUADRATIC_MAX_LENGTH = {"h2o": 4096}


# ==================================================================== the run
# The first line of a --dump-hlo file, by which a later run knows it may replace it: hetero_jax.io.own_outputs'
# TEXT_MARK (not imported here: this module loads before JAX is configured) and what wrote it.
HLO_DUMP_MARK = "// written by hetero-jax bench_step_ops --dump-hlo"


def hlo_filename(policy_label: str, length: int) -> str:
    return f"{policy_label.replace(':', '_').replace('=', '-')}-{length}.hlo.txt"


def recount(payload: dict, hlo_dir: Path) -> int:
    """Count again, from the HLO texts a run dumped (--dump-hlo), every row whose text is in ``hlo_dir`` (the
    counting rule changed, not the compile); ratios and targets follow. Returns how many rows were recounted."""
    n = 0
    for r in payload["rows"]:
        f = hlo_dir / hlo_filename(r["policy"], r["length"])
        if f.is_file():
            r.update(count_step_ops(f.read_text().removeprefix(HLO_DUMP_MARK + "\n")))
            n += 1
    add_ratios(payload["rows"])
    payload["targets"] = target_check(payload["rows"])
    payload["config"]["counting_rule"] = COUNTING_RULE
    return n


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def measure(spec: str, rho: float, length: int, *, model, params_abs, cfg, mesh, kernels: str, profile,
            dump_dir: Path | None = None, seed: int = 0) -> dict:
    """Synthetic prefill, abstract cache, compile, count: one row."""
    policy, note = make_policy(spec, rho, profile, model.config)
    policy = policy.bind(model)
    t0 = time.perf_counter()
    last = [t0]

    def progress(li):
        now = time.perf_counter()
        if now - last[0] > 20 or li == model.config.num_layers - 1:
            log(f"  {label(spec, rho)} @ {length}: synthetic prefill layer {li + 1}/{model.config.num_layers} "
                f"({now - t0:.0f} s)")
            last[0] = now

    import pallas_kernels

    with pallas_kernels.use_kernels("reference"):  # the synthetic prefill runs here, on the CPU
        cache, state = synthetic_prefill(policy, model, length, seed=seed, progress=progress)
    prefill_s = time.perf_counter() - t0
    summary = cache_summary(cache, state, model.config)
    cache_abs = abstract(cache, mesh)
    check = compile_check(state, cache, mesh, kernels, model.config.group_size)
    if check is not None:  # work the decode state dispatches between steps: counted apart from the step's
        summary["check_kernels"] = count_step_ops(check[0].as_text())["kernels_per_step"]
        summary["check_every"] = check[1]
    del cache, state, check
    gc.collect()
    log(f"  {label(spec, rho)} @ {length}: compiling the step ({summary.get('head_groups', '?')} head groups)")
    exe, lower_s, compile_s = compile_step(params_abs, cache_abs, cfg, policy, mesh, kernels)
    text = exe.as_text()
    counts = count_step_ops(text)
    if dump_dir is not None:
        from hetero_jax.io.files import write_text

        dump_dir.mkdir(parents=True, exist_ok=True)
        write_text(dump_dir / hlo_filename(label(spec, rho), length), f"{HLO_DUMP_MARK}\n{text}", "--dump-hlo")
    row = {"policy": label(spec, rho), "spec": spec, "rho": None if spec == "full" else parse_spec(spec, rho)[1],
           "length": length, "policy_repr": repr(policy), "stand_in": note,
           "prefill_seconds": prefill_s, "lower_seconds": lower_s, "compile_seconds": compile_s, **summary, **counts}
    try:
        mem = exe.memory_analysis()
        row["temp_bytes"] = int(getattr(mem, "temp_size_in_bytes", 0))
    except Exception:  # noqa: BLE001 - informational
        pass
    del exe, text
    gc.collect()
    log(f"  {row['policy']} @ {length}: {row['kernels_per_step']} kernels/step, {row['fusions']} fusions, "
        f"{row['pallas_calls']} Pallas, {row['gemms']} GEMMs, {row['copies'] + row['async_copies']} copies "
        f"(prefill {prefill_s:.0f} s, compile {lower_s + compile_s:.0f} s)")
    return row


def run(args) -> dict:
    import jax
    import jaxlib

    import bench_latency

    t_start = time.perf_counter()
    if args.target == "h100":
        mesh = gpu_mesh()
        target = H100_DESCRIPTION
    else:
        mesh = cpu_mesh()
        target = f"XLA:CPU ({common.machine_info(with_jax=False)['cpu_model']})"
    cfg = bench_latency.synthetic_config(None, args.shape, max(args.lengths) + TAIL_CAPACITY)
    narrow_shape = args.narrow_shape
    model = narrow_twin(narrow_shape, args.dtype, args.seed, max(args.lengths) + TAIL_CAPACITY)
    ncfg = model.config
    same = (ncfg.num_layers, ncfg.num_heads, ncfg.num_kv_heads, ncfg.head_dim) == (
        cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    if not same:
        raise SystemExit(f"{narrow_shape} does not have {args.shape}'s layers / heads / head_dim")
    params_abs = abstract_params(cfg, args.dtype, mesh)
    profile = authors_profile(args.profile) if args.shape == SHAPE else None
    kernels = args.kernels or ("pallas" if args.target == "h100" else "reference")
    rows, errors = [], []
    jobs = []  # (spec, length run, [lengths it stands for])
    for spec in args.policies:
        base = parse_spec(spec, args.rho)[0].split(":")[0]
        runs: dict[int, list[int]] = {}
        for length in args.lengths:
            cap = QUADRATIC_MAX_LENGTH.get(base)
            if cap is not None and length > cap and not args.no_fallback:
                runs.setdefault(args.fallback_length, []).append(length)
            else:
                runs.setdefault(length, [])
        jobs += [(spec, length, instead) for length, instead in runs.items()]
    fallback_used = any(instead for _, _, instead in jobs)
    if fallback_used and ("full", args.fallback_length, []) not in jobs:  # the reference of the fallback rows
        jobs.insert(len(args.lengths), ("full", args.fallback_length, []))
    log(f"{len(jobs)} compiles for {target}; kernels: {kernels}; policies: {', '.join(args.policies)}")
    for i, (spec, length, instead_of) in enumerate(jobs):
        log(f"[{i + 1}/{len(jobs)}] {label(spec, args.rho)} at {length} tokens"
            + (f" (also for {', '.join(map(str, instead_of))}: its prefill scoring is quadratic)"
               if instead_of else ""))
        try:
            row = measure(spec, args.rho, length, model=model, params_abs=params_abs, cfg=cfg, mesh=mesh,
                          kernels=kernels, profile=profile, dump_dir=args.dump_hlo, seed=args.seed)
            row["instead_of"] = instead_of
            rows.append(row)
        except Exception as e:  # noqa: BLE001 - one policy's failure is recorded, the others still run
            import traceback

            traceback.print_exc()
            errors.append({"policy": label(spec, args.rho), "length": length, "error": f"{type(e).__name__}: {e}"})
            log(f"  FAILED: {type(e).__name__}: {str(e)[:300]}")
        gc.collect()
    add_ratios(rows)
    payload = common.report_header("bench_step_ops", {
        "shape": args.shape, "narrow_shape": narrow_shape, "dtype": args.dtype, "batch": 1,
        "lengths": list(args.lengths), "fallback_length": args.fallback_length, "rho": args.rho,
        "policies": list(args.policies), "target": args.target, "target_description": target,
        "kernels": kernels, "tail_capacity": TAIL_CAPACITY, "seed": args.seed,
        "jax": jax.__version__, "jaxlib": getattr(jaxlib, "__version__", None), "cuda_plugin": _plugin_versions(),
        "counting_rule": COUNTING_RULE, "targets": {"heterocache": HETERO_TARGET, "any_policy": POLICY_TARGET},
    }, machine=common.machine_info(with_jax=False))
    payload.update(rows=rows, errors=errors, targets=target_check(rows),
                   total_seconds=time.perf_counter() - t_start, peak_rss_bytes=common.peak_rss_bytes())
    return payload


def _plugin_versions() -> dict:
    from importlib import metadata

    out = {}
    for pkg in ("jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cuda-nvcc-cu12", "nvidia-cuda-runtime-cu12"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


RENDER_KEYS = ("config", "rows", "errors", "targets", "total_seconds")  # what main reads of a --render file
RENDER_ITEMS = {"rows": ("length", "policy", "shown_for", "kernels_per_step", "kernels_vs_full", "fusions",
                         "fusions_vs_full", "custom_calls_by_kind", "gemms", "gemm_fusions", "pallas_calls",
                         "host_callbacks", "copies", "async_copies", "other_ops", "while_loops", "loop_trips",
                         "unknown_trip_loops", "conditionals", "fusion_substrings", "lower_seconds", "compile_seconds",
                         "prefill_seconds"),
                "errors": ("policy", "length", "error")}
# and with --write-results, what its section reads (results_section)
SECTION_KEYS = ("command", "git", "machine", "peak_rss_bytes")
SECTION_CONFIG_KEYS = ("cuda_plugin", "target_description", "jax", "jaxlib", "shape", "dtype", "kernels", "rho",
                       "tail_capacity", "narrow_shape", "counting_rule")


def make_parser() -> common.BenchParser:
    p = common.argument_parser(__doc__.split("\n\n")[0])
    p.add_argument("--lengths", "--length", type=int, nargs="+", default=list(DEFAULT_LENGTHS),
                   help="prompt lengths (tokens) of the synthetic prefill")
    p.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES),
                   help="registry specs, optionally with options and @rho (hcattention@0.125); full KV always runs")
    p.add_argument("--rho", type=float, default=DEFAULT_RHO, help="budget of the compressed policies")
    p.add_argument("--fallback-length", type=int, default=2048,
                   help="length for policies whose prefill scoring is quadratic, above their limit "
                        f"({QUADRATIC_MAX_LENGTH})")
    p.add_argument("--no-fallback", action="store_true", help="run quadratic policies at every length anyway")
    p.add_argument("--target", choices=["h100", "cpu"], default="h100",
                   help="h100: the CUDA plugin's H100 topology (needs the gpu-compile venv); cpu: this machine")
    p.add_argument("--kernels", choices=["pallas", "reference"], default=None,
                   help="kernels traced into the step (default: pallas for h100, reference for cpu)")
    p.add_argument("--shape", default=SHAPE, help=argparse.SUPPRESS)
    p.add_argument("--narrow-shape", default=NARROW, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--profile", type=Path, default=None,
                   help="HeteroCache authors' profile JSON (default: ../shared/reference)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dump-hlo", type=Path, default=None, help="write each compiled HLO text into this folder")
    p.add_argument("--out", type=Path, default=common.OUT_DIR / "step-ops.json", help="JSON output")
    p.add_argument("--render", type=Path, default=None, metavar="JSON",
                   help="compile nothing: print (and with --write-results, write) the tables of a saved run's JSON")
    p.add_argument("--recount", type=Path, default=None, metavar="DIR",
                   help="with --render: count again from the HLO texts that run dumped into DIR (--dump-hlo)")
    common.add_results_arguments(p, SECTION, presets=False)
    p.not_written_with("out", "render")  # --render only reads its JSON
    return p


def parse_args(argv=None, parser: common.BenchParser | None = None):
    """The arguments (``parser``: :func:`make_parser`'s, made here when None); --render's file is read by
    :func:`load_render`, in main."""
    p = parser or make_parser()
    args = p.parse_args(argv)
    if args.recount is not None and args.render is None:
        p.error("--recount counts again the rows of a saved run: give it with --render JSON")
    if "full" not in args.policies:
        args.policies = ["full", *args.policies]
    args.lengths = list(dict.fromkeys(args.lengths))
    if args.dump_hlo is not None:  # before any compile: a dump may replace only an earlier run's dump
        from hetero_jax.errors import OutputError
        from hetero_jax.io.files import check_output_path

        for spec in args.policies:
            for length in [*args.lengths, args.fallback_length]:
                try:
                    check_output_path(args.dump_hlo / hlo_filename(label(spec, args.rho), length), "--dump-hlo",
                                      parents=True)
                except OutputError as e:
                    p.error(str(e))
    return args


def load_render(parser, args) -> dict:
    """The saved run of ``--render`` (and ``--recount``'s folder checked); ``parser.error`` (exit 2) naming the
    flag, the path and what is wrong otherwise."""
    if args.recount is not None and not args.recount.is_dir():
        parser.error(f"--recount {args.recount} is not a directory; give the folder a run's --dump-hlo wrote")
    section = bool(args.write_results)
    return common.read_json_inputs(parser, "--render", [args.render], RENDER_KEYS + SECTION_KEYS * section,
                                   "bench_step_ops.py", benchmark="bench_step_ops", items=RENDER_ITEMS,
                                   mappings={"targets": ("ratio", "limit", "met")},
                                   config_keys=SECTION_CONFIG_KEYS * section)[0]


def main(argv=None) -> int:
    p = make_parser()
    args = parse_args(argv, p)
    if args.render is not None:
        payload = load_render(p, args)
        if args.recount is not None:
            print(f"recounted {recount(payload, args.recount)} rows from {args.recount}")
    else:
        payload = run(args)
        out = common.write_json(args.out, payload)
        print(f"wrote {out}")
    print(table(payload["rows"]))
    print()
    print(sources_table(payload["rows"]))
    print()
    print(targets_text(payload))
    for e in payload["errors"]:
        print(f"not measured: {e['policy']} at {e['length']}: {e['error']}")
    print(f"total {payload['total_seconds'] / 60:.1f} min")
    if args.write_results:
        common.write_results_section(SECTION, lambda _plot: results_section(payload), None, args.results_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
