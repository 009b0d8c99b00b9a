#!/usr/bin/env python
"""Beyond one device: per-device KV bytes on a ("data", "model") mesh, and where role-balanced placement helps.

Two parts:

1. **Placement, computed from profiles** (no model run): the authors' published HeteroCache profiles
   (Llama-3.1-8B-Instruct, Qwen2.5-14B-Instruct, ``../shared/reference``) give every head's device tokens
   at a budget rho and prompt length L (Eq. 7-8). For tp in 2/4/8 the table shows the bytes the largest
   shard keeps, max/mean, and what an SPMD cache (per-layer head groups split evenly over the shards)
   allocates per device, for the contiguous split of the checkpoint order, of the role-grouped layout, and
   for ``hetero_jax.policies.placement.balanced_placement``.
2. **A sharded run on simulated CPU devices** (SmolLM2-135M, 3 KV heads): tp in {1, 3} x dp in {1, 2},
   full KV / SnapKV / HeteroCache, a batch of two prompts: per-device device and host bytes measured from
   the arrays' shards, and the decode step time. A correctness and scaling-shape run: on a CPU the largest
   mesh's count of simulated "devices" share this machine's cores, so the times say nothing about speed on
   real devices. Every mesh is checked (format, device count, KV heads) before any work.

    .venv/bin/python benchmarks/bench_mesh.py --write-results

3. **Bytes per process** (``--per-process``, its own section ``mesh-processes``; no model run, no weights):
   HeteroCache at rho on the authors' Llama-3.1-8B-Instruct profile beside full KV, tensor parallel over P
   processes of one device each, at each prompt length: the device and host bytes each process holds, from
   the layout the runtime builds (``HeteroCache.bind``'s role-balanced rows, ``cache.pool_offsets``' pool
   rows, the host copy's heads).

    .venv/bin/python benchmarks/bench_mesh.py --per-process --write-results

The planned GPU run (8 devices, Llama-3.1-8B shapes) is named in the section it writes.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (benchmarks/common.py)
import haystack  # noqa: E402  (benchmarks/haystack.py)

SECTION = "mesh"
PROCESS_SECTION = "mesh-processes"
REFERENCE = common.REPO_ROOT.parent / "shared" / "reference"
PROFILES = {"Llama-3.1-8B-Instruct": "official_profile_llama-3.1-8b-instruct.json",
            "Qwen2.5-14B-Instruct": "official_profile_qwen2.5-14b-instruct.json"}
GPU_COMMAND = ("python benchmarks/bench_mesh.py --model <converted Llama-3.1-8B dir> --meshes 1x1,8x1,4x2 "
               "--prompt-tokens 32768 --write-results  # on 8 GPUs")


def placement_rows(rhos, lengths, tps, itemsize: int = 2) -> list[dict]:
    from hetero_jax.policies.placement import placement_report
    from hetero_jax.profile import load_profile

    rows = []
    for model_name, fname in PROFILES.items():
        path = REFERENCE / fname
        if not path.exists():
            print(f"skipping {model_name}: {path} not found")
            continue
        profile = load_profile(str(path))
        bytes_per_token = 2 * profile.head_dim * itemsize
        for rho in rhos:
            for L in lengths:
                budgets = profile.budgets(rho, L)
                for tp in tps:
                    if profile.num_kv_heads % tp:
                        continue
                    for r in placement_report(budgets, tp, bytes_per_token):
                        rows.append(dict(model=model_name, rho=rho, prompt_tokens=L, **r,
                                         full_per_shard=profile.num_layers * profile.num_kv_heads // tp * L
                                         * bytes_per_token))
    return rows


def layout_bytes(policy, cfg, tp: int, prompt_len: int, tail: int, itemsize: int = 2) -> dict:
    """Bytes one device holds for one sequence of ``prompt_len`` tokens on a tp x 1 mesh, from the layout of
    ``policy`` (a HeteroCache bound for tp shards) and ``cache.pool_offsets``, beside full KV's:

    - ``*_pool``: the row pool [S, P, D] K and V plus its positions [S, P] int32, P the largest shard's kept
      rows plus ``tail`` rows per head (rounded to the pool quantum);
    - ``small``: each layer's offsets and lengths [H] int32 (split over "model");
    - ``k_base``: HeteroCache's K_base [pivots, its bucketed width ``base_width``] int32 per pivot layer (its
      "pivots" axis is not split, so every device holds all of it);
    - ``host``: HeteroCache's pinned prompt copy: on one device the compressed heads of each layer, under
      tensor parallelism every head of each layer that has a compressed head, split over "model" as the
      heads are (``heterocache.prefill``)."""
    import numpy as np

    from hetero_jax.model.cache import pool_offsets
    from hetero_jax.policies.heterocache.step import base_width

    D, H, L = cfg.head_dim, cfg.num_kv_heads, prompt_len
    layout, roles = policy.layout(cfg), policy.layer_roles(cfg)
    grid, l_base = policy.budget_grid(L)
    counts = np.stack([grid[li, np.asarray(perm)] for li, perm in enumerate(layout.perms)])[:, None, :]  # [L, 1, H]
    row = 2 * D * itemsize + 4
    out = {"small": cfg.num_layers * 2 * (H // tp) * 4}
    for name, c in (("full", np.full_like(counts, L)), ("heterocache", counts)):
        _, rows = pool_offsets(c, tail, tp)
        out[f"{name}_pool_rows"], out[f"{name}_pool"] = rows, rows * row
    out["k_base"] = sum(len(r.pivot_slots()) for r in roles if r.pivot_slots()) * base_width([l_base]) * 4
    heads = [(H // tp if tp > 1 else len(r.comp_slots)) for r in roles if r.comp_slots]
    out["host"] = sum(heads) * L * 2 * D * itemsize
    return out


def process_rows(rho: float, lengths, processes, new_tokens: int, itemsize: int = 2,
                 reference: Path = REFERENCE) -> list[dict]:
    """Bytes per process of full KV and HeteroCache(rho) on Llama-3.1-8B (the authors' profile), tensor parallel
    over each count of ``processes`` (one device each, batch 1, a tail for ``new_tokens``): ``layout_bytes``
    of the layout ``HeteroCache.bind`` builds for that mesh (bind reads the config and the mesh's shape only:
    no weights)."""
    from types import SimpleNamespace

    from bench_latency import SYNTHETIC_SHAPES
    from hetero_jax.model.config import ModelConfig
    from hetero_jax.policies import HeteroCache
    from hetero_jax.profile import load_profile
    from hetero_jax.runtime.compile_cache import tail_capacity_for

    cfg = ModelConfig.from_hf_dict(SYNTHETIC_SHAPES["llama-3.1-8b"])
    profile = load_profile(str(Path(reference) / PROFILES["Llama-3.1-8B-Instruct"]))
    tail = tail_capacity_for(new_tokens)
    rows = []
    for n in processes:
        mesh = SimpleNamespace(size=n, shape={"model": n, "data": 1})
        policy = HeteroCache(budget=rho, profile=profile).bind(
            SimpleNamespace(config=cfg, params=None, mesh=mesh, name="llama-3.1-8b"))
        for L in lengths:
            b = layout_bytes(policy, cfg, n, L, tail, itemsize)
            rows.append(dict(processes=n, prompt_tokens=L, rho=rho, tail_rows=tail, **b,
                             full_device=b["full_pool"] + b["small"], full_host=0,
                             heterocache_device=b["heterocache_pool"] + b["small"] + b["k_base"],
                             heterocache_host=b["host"]))
    return rows


def render_processes(payload: dict) -> str:
    mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
    cfg = payload["config"]
    out = [common.section_header("Mesh across processes: device and host bytes per process, Llama-3.1-8B", payload),
           "",
           f"Computed from the layout, not measured: no weights are loaded and nothing runs. HeteroCache at rho "
           f"{cfg['rho']} on the authors' Llama-3.1-8B-Instruct profile (`{Path(cfg['reference']).name}/"
           f"{PROFILES['Llama-3.1-8B-Instruct']}`) beside full KV, "
           "tensor parallel over P processes of one device each (the usual one GPU per process), one sequence, "
           f"bf16 K and V, a tail for {cfg['new_tokens']} new tokens. *device*: the row pool of the process's "
           "heads (K, V, positions; rows from `cache.pool_offsets` over `HeteroCache.bind`'s role-balanced "
           "layout), every layer's offsets and lengths, and K_base (not split: every process holds all pivots'). "
           "*host*: HeteroCache's pinned prompt copy of the process's heads (every head of a layer with a "
           "compressed head under tensor parallelism). HeteroCache runs across processes: the host column is what "
           "each process's own host holds, its heads' rows (docs/devices.md, *Host copies per process*). With K "
           "devices per process, multiply by K (tp = P x K).", ""]
    rows = [[r["prompt_tokens"], r["processes"], mib(r["full_device"]), mib(r["heterocache_device"]),
             f"{r['heterocache_device'] / r['full_device']:.3f}", mib(r["heterocache_host"]),
             mib(r["heterocache_device"] + r["heterocache_host"])] for r in payload["processes"]]
    out.append(common.markdown_table(["L", "processes", "full KV device MiB", "HeteroCache device MiB",
                                      "device ratio", "HeteroCache host MiB", "HeteroCache device + host MiB"],
                                     rows, align="rrrrrrr"))
    out.append("")
    return "\n".join(out)


def simulate_devices(meshes) -> None:
    """On a CPU, as many simulated devices as the largest mesh needs (before JAX starts; no effect on GPU
    devices, nor once JAX started or the flag is set)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        n = max(tp * dp for tp, dp in meshes)
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def mesh_problem(meshes, num_kv_heads: int, devices: int, cpu: bool = True) -> str | None:
    """Why the first of ``meshes`` that cannot run here cannot (its tp must divide the KV heads, its devices be
    visible: ``devices``, simulated ones on a ``cpu``), or None."""
    flag = re.search(r"--xla_force_host_platform_device_count=\S*", os.environ.get("XLA_FLAGS", ""))
    from hetero_jax.model.sharding import tp_problem

    for tp, dp in meshes:
        problem = tp_problem(tp, num_kv_heads)
        if problem:
            return f"--meshes {tp}x{dp}: {problem}"
        if tp * dp > devices:
            return (f"--meshes {tp}x{dp}: needs {tp * dp} devices but {devices} are visible" + (
                f"; XLA_FLAGS sets {flag.group(0)}: raise it, or unset it to simulate the largest mesh's count"
                if cpu and flag else ""))
    return None


def sharded_runs(base, meshes, policies, prompt_tokens: int, steps: int) -> list[dict]:
    """Each policy on each of ``meshes`` (tp, dp) with ``base`` (a loaded model) placed on it."""
    import jax
    import numpy as np

    import hetero_jax
    from hetero_jax.runtime import Engine
    from hetero_jax.policies import make_policy
    from hetero_jax.model.sharding import imbalance, make_mesh

    tok = base.tokenizer
    ids = tok.encode(haystack.pydoc_corpus(), add_special_tokens=False)
    prompts = [ids[:prompt_tokens], ids[prompt_tokens: 2 * prompt_tokens - prompt_tokens // 4]]
    rows = []
    for tp, dp in meshes:
        model = hetero_jax.place(base, make_mesh(tp, dp)) if tp * dp > 1 else base
        for spec in policies:
            name, _, budget = spec.partition("@")
            policy = make_policy(name, float(budget) if budget else None)
            eng = Engine(model, prompts, policy, tail_capacity=steps + 2, is_batch=True)
            t = eng.first_tokens(0.0, 1.0)
            for _ in range(2):  # compile + warm
                t, _ = eng.step(t, 0.0, 1.0)
            times = []
            for _ in range(steps - 2):
                t, s = eng.step(t, 0.0, 1.0)
                times.append(s)
            f = eng.stats_fields()
            dev = f["kv_bytes_per_device"] or {"cpu:0": f["kv_bytes_device"]}
            host = f["host_bytes_per_device"] or ({"cpu:0": f["kv_bytes_host"]} if f["kv_bytes_host"] else {})
            rows.append(dict(tp=tp, dp=dp, policy=spec, devices=len(jax.devices()[: tp * dp]),
                             kv_total=f["kv_bytes_device"], kv_max=max(dev.values()),
                             kv_mean=float(np.mean(list(dev.values()))), kv_imbalance=imbalance(dev),
                             host_max=max(host.values()) if host else 0, decode_ms=1e3 * statistics.median(times),
                             rho=float(np.mean(eng.achieved_rho))))
            print(rows[-1], flush=True)
    return rows


def render(payload: dict) -> str:
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    cfg = payload["config"]
    out = [common.section_header("Mesh: per-device KV bytes and role-balanced placement", payload), ""]
    out += ["### Placement computed from the authors' profiles",
            "",
            "Device tokens per head from Eq. 7-8 at rho and L, bf16 K+V (2 x head_dim x 2 bytes per token). "
            "*kept*: bytes of the tokens a shard's heads keep, over all layers; *SPMD alloc*: bytes per device "
            "when each layer's cache is head groups split evenly over the shards (one shape on every device; a "
            "group's capacity is its largest head); *pool alloc*: bytes per device of HeteroCache's runtime under "
            "tensor parallelism, where each shard's kept rows of all layers share one pool (the largest shard's "
            "total; the tail rows, equal on every shard, come on top). *full*: full KV per shard.", ""]
    rows = [[r["model"], r["rho"], r["prompt_tokens"], r["tp"], r["placement"], mib(r["kept_max"]),
             mib(r["kept_mean"]), f"{r['imbalance']:.2f}", mib(r["padded"]),
             mib(r["pooled"]) if r.get("pooled") is not None else "—", mib(r["full_per_shard"])]
            for r in payload["placement"]]
    out.append(common.markdown_table(["model", "rho", "L", "tp", "placement", "kept max MiB", "kept mean MiB",
                                      "max/mean", "SPMD alloc MiB", "pool alloc MiB", "full MiB"], rows))
    devices, platform = cfg.get("devices", 6), cfg.get("platform", "cpu")  # runs before both were recorded: 6 CPU
    cpu = platform == "cpu"
    out += ["", f"### Sharded runs on {'simulated CPU' if cpu else platform.upper()} devices (correctness and "
            f"scaling shape{', not speed' if cpu else ''})", "",
            f"{cfg['model']}, a batch of two pydoc prompts ({cfg['prompt_tokens']} and "
            f"{cfg['prompt_tokens'] - cfg['prompt_tokens'] // 4} tokens), median of {cfg['steps'] - 2} decode "
            "steps after 2 warm ones. Bytes measured from each array's shards (a replicated group counts on "
            "every device). " + (f"The {devices} simulated devices share this machine's cores." if cpu else
                                 f"{devices} {platform} devices."), ""]
    rows = [[r["policy"], r["tp"], r["dp"], f"{r['rho']:.3f}", mib(r["kv_total"]), mib(r["kv_max"]),
             f"{r['kv_imbalance']:.2f}", mib(r["host_max"]), f"{r['decode_ms']:.1f}"] for r in payload["runs"]]
    out.append(common.markdown_table(["policy", "tp", "dp", "rho", "KV total MiB (logical)", "KV max MiB/device",
                                      "max/mean", "host max MiB/device", "decode ms/step"], rows))
    out += ["", f"Planned GPU run: `{GPU_COMMAND}`", ""]
    return "\n".join(out)


def parse_args(argv=None):
    p = common.argument_parser(__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--meshes", default="1x1,3x1,1x2,3x2",
                   help="comma-separated TPxDP (on a CPU, as many simulated devices as the largest needs)")
    p.add_argument("--policies", default="full,snapkv@0.5,heterocache@0.5", help="NAME@RHO, comma-separated")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rhos", default="0.3,0.5")
    p.add_argument("--lengths", default="32768")
    p.add_argument("--tps", default="2,4,8")
    p.add_argument("--skip-runs", action="store_true", help="only the placement tables")
    p.add_argument("--per-process", action="store_true",
                   help=f"only the bytes per process (section {PROCESS_SECTION}): --rhos' first, --lengths, "
                        "--processes")
    p.add_argument("--processes", default="2,4,8", help="process counts for --per-process")
    p.add_argument("--new-tokens", type=int, default=256, help="--per-process: tokens the tail holds")
    p.add_argument("--reference", type=Path, default=REFERENCE,
                   help=f"--per-process: the folder of the authors' profiles (default {REFERENCE})")
    p.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "out" / "mesh.json")
    common.add_results_arguments(p, SECTION, presets=False)
    args = p.parse_args(argv)
    # every mesh before any work: a bad one would otherwise end the run after the meshes before it, unwritten
    bad = [m for m in args.meshes.split(",") if not re.fullmatch(r"[1-9][0-9]*x[1-9][0-9]*", m.strip())]
    if bad:
        p.error(f"--meshes {bad[0]!r} is not TPxDP (two positive integers, e.g. 3x2)")
    args.mesh_list = [tuple(int(x) for x in m.strip().split("x")) for m in args.meshes.split(",")]
    args.usage_error = p.error  # main's checks of the meshes against the model and the devices
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.per_process:
        return main_processes(args)
    meshes = args.mesh_list
    config = dict(model=args.model, meshes=meshes, policies=args.policies.split(","),
                  prompt_tokens=args.prompt_tokens, steps=args.steps, rhos=[float(x) for x in args.rhos.split(",")],
                  lengths=[int(x) for x in args.lengths.split(",")], tps=[int(x) for x in args.tps.split(",")])
    base = None
    if not args.skip_runs:
        simulate_devices(meshes)
        import jax

        import hetero_jax

        base = hetero_jax.load(args.model, progress=False)
        problem = mesh_problem(meshes, base.config.num_kv_heads, jax.device_count(),
                               cpu=jax.devices()[0].platform == "cpu")
        if problem:
            args.usage_error(problem)
        config.update(devices=jax.device_count(), platform=jax.devices()[0].platform)
    payload = common.report_header(SECTION, config)
    payload["placement"] = placement_rows(config["rhos"], config["lengths"], config["tps"])
    payload["runs"] = [] if base is None else sharded_runs(base, meshes, config["policies"], args.prompt_tokens,
                                                           args.steps)
    common.write_json(args.json, payload, "--json")
    print(render(payload))
    if args.write_results:
        common.write_results_section(SECTION, lambda _plot: render(payload), None, args.results_file)
    return 0


def main_processes(args) -> int:
    config = dict(rho=float(args.rhos.split(",")[0]), lengths=[int(x) for x in args.lengths.split(",")],
                  processes=[int(x) for x in args.processes.split(",")], new_tokens=args.new_tokens,
                  reference=str(args.reference))
    payload = common.report_header(PROCESS_SECTION, config)
    payload["processes"] = process_rows(config["rho"], config["lengths"], config["processes"], args.new_tokens,
                                        reference=args.reference)
    common.write_json(args.json.with_name("mesh-processes.json"), payload, "--json")
    print(render_processes(payload))
    if args.write_results:
        common.write_results_section(PROCESS_SECTION, lambda _plot: render_processes(payload), None,
                                     args.results_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
