"""What ``bench_step_ops.py`` makes of its rows: ratios to full KV, the project's targets, the markdown tables on
stdout and the ``step-ops`` section of benchmarks/RESULTS.md."""

from __future__ import annotations

import common  # benchmarks/common.py

HETERO_TARGET = 1.2  # HeteroCache kernels per step / full KV's, at most
POLICY_TARGET = 1.5  # any compressed policy's, at most


# ==================================================================== ratios and targets
def add_ratios(rows: list[dict]) -> None:
    """Each row's kernels / fusions over full KV's at the same length (None where full KV is missing)."""
    full = {r["length"]: r for r in rows if r["policy"] == "full"}
    for r in rows:
        f = full.get(r["length"])
        r["kernels_vs_full"] = r["kernels_per_step"] / f["kernels_per_step"] if f else None
        r["fusions_vs_full"] = r["fusions"] / f["fusions"] if f and f["fusions"] else None


def target_check(rows: list[dict]) -> dict:
    """HeteroCache <= 1.2x full KV's kernels per step and every compressed policy <= 1.5x, at each length."""
    from hetero_jax.policies import registry_key
    out = {}
    for r in rows:
        if r["policy"] == "full" or r["kernels_vs_full"] is None:
            continue
        key = f"{r['policy']}@{r['length']}"
        limit = HETERO_TARGET if registry_key(r["policy"]) == "heterocache" else POLICY_TARGET
        out[key] = {"ratio": r["kernels_vs_full"], "limit": limit, "met": r["kernels_vs_full"] <= limit}
    return out


# ==================================================================== report
def fmt_int(x) -> str:
    return "—" if x is None else f"{int(x):,}"


def _other_kernels(r: dict) -> int:
    return int(sum(r["other_ops"].values()))


def table_rows(rows: list[dict], lengths=None) -> list[dict]:
    """Rows in table order: per context (``lengths``, default every row's), full KV first, then the policies in run
    order; a row measured at a fallback length also stands in the blocks of the lengths it was run for."""
    lengths = sorted({r["length"] for r in rows} if lengths is None else set(lengths), reverse=True)
    out = []
    for length in lengths:
        block = [r for r in rows if r["length"] == length or length in (r.get("instead_of") or [])]
        block.sort(key=lambda r: 0 if r["policy"] == "full" else 1)
        out += [dict(r, shown_for=length) for r in block]
    return out


def _context(r: dict) -> str:
    """A table row's context: its length, and the length it stands for when measured at a fallback length."""
    return f"{r['length']:,}" if r["shown_for"] == r["length"] else f"{r['length']:,} (for {r['shown_for']:,})"


def table(rows: list[dict], lengths=None) -> str:
    headers = ["context", "policy", "kernels / step", "vs full", "fusions", "vs full", "GEMMs (cuBLAS + Triton)",
               "Pallas (Triton) calls", "other custom calls", "host callbacks", "copies (+ async)", "other ops",
               "while loops (trips) / conditionals", "head groups", "`fusion(` in text", "compile s",
               "synthetic prefill s", "between steps: kernels (every n steps)"]
    out = []
    for r in table_rows(rows, lengths):
        kinds = r["custom_calls_by_kind"]
        other_cc = sum(n for k, n in kinds.items() if k not in ("cublas", "pallas_triton", "host_callback"))
        out.append([
            _context(r), r["policy"], fmt_int(r["kernels_per_step"]),
            common.fmt_num(r["kernels_vs_full"], 2) if r["kernels_vs_full"] is not None else "—",
            fmt_int(r["fusions"]),
            common.fmt_num(r["fusions_vs_full"], 2) if r["fusions_vs_full"] is not None else "—",
            f"{r['gemms']:,} ({kinds.get('cublas', 0)} + {r['gemm_fusions']})", fmt_int(r["pallas_calls"]),
            fmt_int(other_cc), fmt_int(r["host_callbacks"]), f"{r['copies']:,} (+{r['async_copies']})",
            fmt_int(_other_kernels(r)),
            f"{r['while_loops']} ({r['loop_trips']:,}"
            + (f", {r['unknown_trip_loops']} unknown" if r["unknown_trip_loops"] else "") + f") / {r['conditionals']}",
            fmt_int(r.get("head_groups")), fmt_int(r["fusion_substrings"]),
            f"{r['lower_seconds'] + r['compile_seconds']:.0f}", f"{r['prefill_seconds']:.0f}",
            f"{r['check_kernels']:,} ({r['check_every']})" if r.get("check_kernels") is not None else "—",
        ])
    return common.markdown_table(headers, out, align="rl" + "r" * (len(headers) - 2))


def extra_sources(row: dict, full: dict | None, top: int = 4) -> str:
    """The sources (``op_source``) of the launches a policy adds over full KV at the same length, largest first."""
    if full is None or "kernels_by_source" not in row:
        return "—"
    base = full.get("kernels_by_source", {})
    diff = {k: v - base.get(k, 0) for k, v in row["kernels_by_source"].items()}
    diff.update({k: -v for k, v in base.items() if k not in diff})
    parts = [f"`{k}` {v:+,}" for k, v in sorted(diff.items(), key=lambda kv: -kv[1])[:top] if v > 0]
    return ", ".join(parts) or "none"


def sources_table(rows: list[dict], lengths=None) -> str:
    """Per policy: launches inside loops and the sources of its launches beyond full KV's."""
    full = {r["length"]: r for r in rows if r["policy"] == "full"}
    out = []
    for r in table_rows(rows, lengths):
        if r["policy"] == "full":
            continue
        out.append([_context(r), r["policy"], fmt_int(r["kernels_per_step"]), fmt_int(r.get("kernels_in_loops")),
                    extra_sources(r, full.get(r["length"]))])
    return common.markdown_table(["context", "policy", "kernels / step", "in while loops",
                                  "largest additions over full KV, by source (op_name)"], out, align="rlrrl")


def targets_text(payload: dict) -> str:
    """One line per policy: its ratio at each length measured, its limit, MET only when met at every length."""
    by_policy: dict[str, list] = {}
    for key, t in payload["targets"].items():
        policy, _, length = key.rpartition("@")
        by_policy.setdefault(policy, []).append((int(length), t))
    lines = []
    for policy, items in by_policy.items():
        items.sort(key=lambda it: -it[0])
        ratios = ", ".join(f"{t['ratio']:.2f}x at {length:,}" for length, t in items)
        met = all(t["met"] for _, t in items)
        lines.append(f"- {policy}: {ratios} (at most {items[0][1]['limit']:g}x) — "
                     + ("**MET**" if met else "**NOT MET**"))
    return "\n".join(lines) or "- (no compressed policy measured beside full KV)"


def results_section(payload: dict) -> str:
    cfg = payload["config"]
    rows = payload["rows"]
    plugin = ", ".join(f"{k} {v}" for k, v in cfg["cuda_plugin"].items()) or "none"
    notes = [r for r in rows if r.get("stand_in")]
    seen = set()
    stand_ins = []
    for r in notes:
        if r["policy"] not in seen:
            seen.add(r["policy"])
            stand_ins.append(f"- {r['policy']}: {r['stand_in']}")
    errors = "\n".join(f"- {e['policy']} at {e['length']:,}: {e['error']}" for e in payload["errors"])
    parts = [
        common.section_header("Decode-step kernels per policy (compiled for an H100, no GPU)", payload),
        "- Reproduce: `make step-ops` (its own venv with the `gpu-compile` extra; `CUDA_VISIBLE_DEVICES=-1 "
        "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 HETERO_JAX_KERNELS=pallas`)",
        "",
        f"Target: {cfg['target_description']}. jax {cfg['jax']}, jaxlib {cfg['jaxlib']}; {plugin}. "
        f"One decode step as the engine jits it (`engine.decode_step_jit`: `decode_step` with the policy's `attend`, "
        f"cache donated, greedy), {cfg['shape']} shapes, {cfg['dtype']}, batch 1, kernels: {cfg['kernels']}, "
        f"rho {cfg['rho']:g} (HCAttention at its own byte-based points), tail {cfg['tail_capacity']} slots. "
        f"Weights are ShapeDtypeStructs; the cache is the policy's own post-prefill structure from a synthetic "
        f"prefill (random layer inputs through the policy's `build_layer`, layer params of `{cfg['narrow_shape']}`, "
        f"then `finish`). Compiled, not run: launches, not times. Without a GPU XLA does not autotune, so its GEMMs "
        f"are its untuned choice (a Triton GEMM fusion or a cuBLAS call: one kernel each).",
        "",
        table(rows),
        "",
    ]
    fallback = sorted({(r["policy"], r["length"]) for r in rows if r.get("instead_of")})
    if fallback:
        parts += ["Rows marked '(for N)': " + "; ".join(f"{p} measured at {n:,} tokens" for p, n in fallback)
                  + ": its prefill scores every prompt query (quadratic), hours per policy at 32K on this CPU; "
                  "full KV's own count moves 4 % from 2K to 32K.", ""]
    parts += [
        "Where the launches go: the step's kernels inside `while` loops (per trip) and the sources of the "
        "launches each policy adds over full KV (the innermost function jitted inside the step, else the jax "
        "primitive, from the HLO's `op_name`; negative changes not shown):",
        "",
        sources_table(rows),
        "",
        "Targets (kernels per step, ratio to full KV at the same context; the project's: HeteroCache at most "
        f"{HETERO_TARGET:g}x, every compressed policy at most {POLICY_TARGET:g}x):",
        "",
        targets_text(payload),
        "",
        "Stand-ins for calibration files this shape has none of:",
        "",
        "\n".join(stand_ins) or "- none",
        "",
        f"Counting rule: {cfg['counting_rule']}",
    ]
    if errors:
        parts += ["", "Not measured:", "", errors]
    parts += ["", common.wall_and_memory_line(payload)]
    return "\n".join(parts)

