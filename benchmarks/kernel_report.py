"""The markdown of ``bench_kernels.py``'s runs: the ``kernels`` (or ``kernels-gpu``) section of
benchmarks/RESULTS.md, the pool kernel's timing, the launch sweep and the drift-check timing."""

from __future__ import annotations

from typing import Any

import common  # benchmarks/common.py
from kernel_cases import (BLOCK_K, DRIFT_L_BASE, H100_NOMINAL_BW, KIB, LLAMA, LLAMA_LAYERS, POOL_COMPRESSED,
                          POOL_CONTEXTS, POOL_FULL_HEADS, SCORE_W, TRITON_CALL)


# ------------------------------------------------------------------ helpers
def _fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{n:,.0f} B"


def fmt_len(n: int) -> str:
    return f"{n // KIB}K" if n % KIB == 0 else str(n)


def _fmt_us(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e6:,.1f}"


def render_pool_timing(p: dict[str, Any] | None) -> list[str]:
    lines = ["### 5. pool_attention on a GPU (one launch per layer over a row pool)", ""]
    if p is None:
        return lines + ["**Not run: no GPU present.** With a GPU, this script times `pool_attention` (decode, bf16, "
                        f"B {LLAMA['B']}, Hkv {LLAMA['Hkv']}, G {LLAMA['G']}, D {LLAMA['D']}) over one row pool "
                        f"where KV heads {', '.join(map(str, POOL_FULL_HEADS))} keep the whole context and the others "
                        f"about {POOL_COMPRESSED:g}x of it, at contexts "
                        f"{', '.join(fmt_len(s) for s in POOL_CONTEXTS)}, and one `sparse_decode_attention` launch per "
                        "head group for the same lengths.", ""]
    lines += [f"Device: {p['device']}; copy bandwidth {p['copy']['bandwidth'] / 1e12:.2f} TB/s; heads "
              f"{', '.join(map(str, p['full_heads']))} full, the others about {p['compressed']:g}x the context, "
              f"{p['tail']} spare rows per region. Achieved = K+V bytes of the heads' lengths / kernel time. "
              "'per group' = one `sparse_decode_attention` per head group (full, compressed) on the same lengths; "
              "'paged': in-device Quest's read, every head attending its pages (`block_rows`) of a region that "
              "holds the whole context.",
              ""]
    rows = []
    for r in p["rows"]:
        row = [fmt_len(r["S"]), r.get("layout", "row pool"), f"{r['mean_rho']:.3f}", _fmt_bytes(r["kv_bytes"]),
               str(r["num_splits"])]
        if "kernel_s" in r:
            rows.append(row + [_fmt_us(r["kernel_s"]), f"{r['achieved_bandwidth'] / 1e12:.2f}",
                               f"{100 * r['fraction_of_copy_bandwidth']:.0f} %", _fmt_us(r.get("per_group_s")),
                               f"{r['max_abs_err_out']:.2e}", "yes" if r["ok"] else "NO"])
        else:
            rows.append(row + ["—", "—", "—", _fmt_us(r.get("per_group_s")), "—", f"NO: {r['error']}"])
    return lines + [common.markdown_table(["context", "layout", "mean rho", "K+V bytes", "num_splits", "kernel µs",
                                           "achieved TB/s", "of copy BW", "per group µs", "max abs err", "ok"],
                                          rows, "rlrrrrrrrrl"), ""]


def render_sweep(sw: dict[str, Any]) -> str:
    lines = [f"Device {sw['device']}; copy bandwidth {sw['copy']['bandwidth'] / 1e12:.2f} TB/s; rho 1, bf16, B 1, "
             f"Hkv {LLAMA['Hkv']}, G {LLAMA['G']}, D {LLAMA['D']}; {sw['iters']} calls back to back per timing.", "",
             "| S | num_splits | block_k | num_warps | num_stages | µs | of copy BW | max abs err | ok |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for r in sorted(sw["rows"], key=lambda r: (r["S"], r.get("seconds", float("inf")))):
        if "seconds" in r:
            lines.append(f"| {fmt_len(r['S'])} | {r['num_splits']} | {r['block_k']} | {r['num_warps']} | "
                         f"{r['num_stages']} | {r['seconds'] * 1e6:,.1f} | "
                         f"{100 * r['fraction_of_copy_bandwidth']:.0f} % "
                         f"| {r['max_abs_err']:.2e} | {'yes' if r['ok'] else 'NO'} |")
        else:
            lines.append(f"| {fmt_len(r['S'])} | {r['num_splits']} | {r['block_k']} | {r['num_warps']} | "
                         f"{r['num_stages']} | — | — | — | NO: {r['error']} |")
    return "\n".join(lines)


def render_drift_timing(t: dict[str, Any]) -> str:
    lines = ["| prompt T | rho | L_base | before ms | old selection ms | new check ms | new / before | "
             "new / old selection | scores alone ms | selection alone, old: lax.top_k ms | selection alone, new: "
             "bisection ms | after a drift only: top-L_base of the latest step ms | same flags and overlaps |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for r in t["rows"]:
        s = r["seconds"]
        ms = lambda x: f"{x * 1e3:,.1f}"  # noqa: E731
        lines.append(f"| {fmt_len(r['T'])} | {r['rho']} | {r['l_base']:,} | {ms(s['before'])} | {ms(s['old'])} | "
                     f"{ms(s['new'])} | {s['new'] / s['before']:.2f} | {s['new'] / s['old']:.2f} | "
                     f"{ms(s['scores'])} | {ms(s['select_old'])} | "
                     f"{ms(s['select_new'])} | {ms(s['rank_latest'])} | {'yes' if r['agree'] else 'NO'} |")
    return "\n".join(lines)


def render_markdown(report: dict[str, Any]) -> str:
    has_gpu = report["gpu_present"]
    title = "Pallas kernels on a GPU (bench_kernels.py)" if has_gpu else "Pallas kernels (bench_kernels.py)"
    lines = [common.section_header(title, report), ""]
    if not has_gpu:
        lines += [
            "**No GPU was available for this run** (`jax.devices()`: "
            + ", ".join(report["machine"]["jax"]["devices"]) + "). The GPU targets — decode kernel bandwidth "
            ">= 70 % of copy bandwidth from S = 32K, and decode time falling with rho — are **NOT measured** here. "
            "The script's GPU timing path (kernel vs reference at the Llama-3.1-8B decode shapes, achieved "
            "bandwidth vs a measured `x + 0` copy bandwidth) exists but **was not run**. What follows is what can "
            "be checked without a GPU: CUDA lowering through Triton, interpret-mode numerics, and a computed "
            "bytes/bandwidth lower bound.",
            "",
        ]
    # 1. lowering
    low = report["lowering"]
    n_ok = sum(r["lowered"] and r["triton_call_present"] for r in low)
    lines += [
        "### 1. CUDA lowering through Triton (no GPU needed)",
        "",
        "`jax.jit(f).trace(*ShapeDtypeStructs).lower(lowering_platforms=(\"cuda\",))` of each public entry point "
        "at model shapes (B = 1); \"Triton call\" = the `" + TRITON_CALL + "` custom call in the StableHLO; "
        "\"verified\" = MLIR verifier passed on every Triton module built. Nothing is compiled to PTX or run. "
        f"Scoring kernels use W = {SCORE_W} query steps; drift_check uses L_base = {DRIFT_L_BASE}. "
        f"Lowering time is wall time from a cleared JAX cache. **{n_ok}/{len(low)} lowered with the Triton call.**",
        "",
    ]
    rows = []
    for r in low:
        ver = {True: "yes", False: "NO", None: "n/a"}[r["triton_modules_verified"]]
        rows.append([r["kernel"], r["model"], f"Hkv {r['Hkv']}, G {r['G']}, D {r['D']}",
                     ("S " if r["kernel"].startswith(("sparse_decode_attention", "pool_attention")) else "T ")
                     + fmt_len(r["S"]),
                     r["dtype"], "yes" if r["lowered"] else f"NO ({r['error']})",
                     f"yes ({r['triton_calls']})" if r["triton_call_present"] else "NO", ver,
                     f"{r['lower_seconds']:.2f}"])
    lines += [common.markdown_table(["kernel", "model", "heads", "length", "dtype", "lowered", "Triton call",
                                     "verified", "lower s"], rows, "lllrlllcr"), ""]
    # 2. numerics
    num = report["numerics"]
    n_ok = sum(r["ok"] for r in num)
    compiled = bool(num) and num[0].get("mode", "interpret") != "interpret"
    lines += [
        "### 2. Compiled (Triton) numerics on the GPU vs the plain-JAX reference" if compiled else
        "### 2. Interpret-mode numerics vs the plain-JAX reference (CPU)",
        "",
        ("The kernels compiled through Triton and run on the GPU (`interpret=False`; drift_check with backend "
         "'pallas'), at the interpret cases' small shapes and at Llama-3.1-8B sizes (32K / 8K keys), " if compiled
         else "Pallas interpreter (`interpret=True`) ")
        + "vs `*_reference` on the same inputs (the reference does float32 "
        "math). Lengths are ragged per head and include 1 and the full length; decode inputs hold NaN beyond each "
        "head's length (the kernel must never read them). Tolerances are those of tests/test_kernels.py. "
        f"**{n_ok}/{len(num)} within tolerance.**",
        "",
    ]
    rows = []
    for r in num:
        err = ", ".join(f"{k} {v:.2e}" for k, v in r["max_abs_err"].items())
        tol = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in r["tol"].items())
        extra = ""
        if "drift_flags_equal" in r:
            extra = f"; drift flags equal: {'yes' if r['drift_flags_equal'] else 'NO'}, " \
                    f"max overlap difference {r['max_abs_err']['overlap']:.3g}"
        if "invalid_filled" in r:
            extra = f"; t >= L = MASK_VALUE: {'yes' if r['invalid_filled'] else 'NO'}"
        lens = r["lengths"]
        lens_s = ", ".join(map(str, lens)) if len(lens) <= 6 else ", ".join(map(str, lens[:5])) + ", …"
        rows.append([r["kernel"], r["shape"], r["dtype"], r["params"], lens_s, err + extra, tol,
                     "yes" if r["ok"] else "NO"])
    lines += [common.markdown_table(["kernel", "shape", "dtype", "params", "lengths", "max abs error", "tolerance",
                                     "ok"], rows, "llllllll"), ""]
    if compiled:
        lines += ["(The drift check's scores are compared at valid positions; its flags must be equal.)", ""]
    # 3. bytes
    lines += [
        "### 3. Bytes read per decode kernel call at Llama-3.1-8B shapes — computed lower bound, NOT a measurement",
        "",
        f"One `sparse_decode_attention` call = one layer, B = 1, Hkv = {LLAMA['Hkv']}, D = {LLAMA['D']}, bf16; every "
        "KV head keeps L = rho * S slots (uniform across heads); K+V bytes = Hkv * 2 * L * D * 2 B, what any "
        "kernel must read (the kernel's block rounding to "
        f"{BLOCK_K} keys adds at most {BLOCK_K} rows per head). \"+ partials\" adds the float32 split partials "
        "(o, m, l) the kernel writes and the XLA combine reads back (independent of rho; q and the output are "
        f"negligible). Time = bytes / {H100_NOMINAL_BW / 1e12:.2f} TB/s, the nominal HBM3 bandwidth of an H100 SXM5: "
        "no kernel can be faster, a real one reaches a fraction of it (the GPU target is >= 70 % of *measured* "
        "copy bandwidth). The per-token column is the K+V bound times 32 layers (attention reads only). The dense "
        "reference reads at least all S slots of K and V whatever rho is.",
        "",
    ]
    rows = []
    for r in report["decode_bytes"]:
        rows.append([fmt_len(r["S"]), f"{r['rho']:g}", f"{r['L']:,}", f"{r['kv_bytes']:,}",
                     _fmt_bytes(r["kv_bytes"]), f"{r['num_splits']}: {_fmt_bytes(r['split_partial_bytes'])}",
                     _fmt_us(r["h100_lower_bound_s"]), _fmt_us(r["h100_lower_bound_s_with_partials"]),
                     _fmt_us(r["h100_lower_bound_s_32_layers"]), _fmt_bytes(r["dense_kv_bytes"])])
    lines += [common.markdown_table(["S", "rho", "L per head", "K+V bytes / call", "(binary units)",
                                     "splits: partials", "H100 bound µs (K+V)", "µs (+ partials)",
                                     f"µs / token, K+V x {LLAMA_LAYERS} layers", "dense reference reads"], rows,
                                    "rrrrrrrrrr"), ""]
    # 4. GPU timing
    lines += ["### 4. GPU timing (kernel vs reference, achieved vs copy bandwidth)", ""]
    g = report["gpu_timing"]
    if g is None:
        lines += ["**Not run: no GPU present.** With a GPU, this script times `sparse_decode_attention` and the "
                  "reference at the shapes of section 3 (median of N calls after warm-up), measures copy bandwidth "
                  "with a jitted `x + 0` over a 1 GiB bf16 array, and reports achieved bandwidth, its fraction of "
                  "copy bandwidth and both GPU targets. No number in this section exists for this run.", ""]
    else:
        c = g["copy"]
        lines += [f"Device: {g['device']}; {g['iters']} timed calls each (median); copy bandwidth "
                  f"(`x + 0`, {_fmt_bytes(c['array_bytes'])}): **{c['bandwidth'] / 1e12:.2f} TB/s**.", ""]
        rows = [[fmt_len(r["S"]), f"{r['rho']:g}", _fmt_us(r["kernel_s"]), _fmt_us(r["reference_s"]),
                 f"{r['speedup']:.2f}x", f"{r['achieved_bandwidth'] / 1e12:.2f}",
                 f"{100 * r['fraction_of_copy_bandwidth']:.0f} %", f"{r.get('max_abs_err_out', float('nan')):.2e}"]
                for r in g["rows"]]
        lines += [common.markdown_table(["S", "rho", "kernel µs", "reference µs", "speedup", "achieved TB/s",
                                         "of copy BW", "max abs err vs reference (out)"], rows, "rrrrrrrr"), ""]
        falls = ", ".join(f"{fmt_len(int(S))} {'yes' if ok else 'NO'}"
                          for S, ok in g["target_time_falls_with_rho"].items())
        met = {True: "met", False: "NOT met", None: "no shape >= 32K timed"}[
            g["target_bandwidth_fraction_ge_70pct_from_32k"]]
        lines += [f"- Target bandwidth >= 70 % of copy from S = 32K (rho 1): **{met}**",
                  f"- Target time falling with rho: {falls}", ""]
    lines += render_pool_timing(report.get("pool_timing"))
    lines.append(f"Wall time of the whole run: {report['wall_seconds']:.1f} s. JSON: `{report['json_path']}`.")
    return "\n".join(lines)
