"""The policies script's report: its summary per (length, combo), its tables, RESULTS.md section and figure."""

from __future__ import annotations

import statistics
from pathlib import Path

import haystack
from harness.grid import combo_label
from harness.machine import git_summary
from harness.results import (
    fmt_num, markdown_table, plot_markdown, save_figure, section_header, subplots, wall_and_memory_line,
)

MiB = 2**20


def summarize(runs: list[dict], combos, lengths) -> list[dict]:
    """One row per (length, combo): KV, rho, pooled decode timings, ratio to full, accuracy."""
    import numpy as np

    rows = []
    for L in lengths:
        full_ms = [1e3 * s for r in runs if r["length"] == L and r["policy"] == "full" for s in r["decode_seconds"]]
        full_p50 = statistics.median(full_ms) if full_ms else float("nan")
        full_mean = float(np.mean(full_ms)) if full_ms else float("nan")
        for name, rho in combos:
            rs = [r for r in runs if r["length"] == L and r["policy"] == name and r["rho"] == rho]
            if not rs:
                continue
            ms = [1e3 * s for r in rs for s in r["decode_seconds"]]
            p50 = statistics.median(ms) if ms else float("nan")
            mean = float(np.mean(ms)) if ms else float("nan")
            rows.append({
                "length": L, "policy": name, "rho": rho, "label": combo_label(name, rho),
                "achieved_rho": float(np.mean([r["achieved_rho"] for r in rs])),
                "achieved_rho_all": [r["achieved_rho"] for r in rs],
                "kv_bytes_prompt": int(np.mean([r["kv_bytes_prompt"] for r in rs])),
                "kv_bytes_tail": int(np.mean([r["kv_bytes_tail"] for r in rs])),
                "kv_bytes_device": int(np.mean([r["kv_bytes_device"] for r in rs])),
                "kv_bytes_host": int(np.mean([r["kv_bytes_host"] for r in rs])),
                "recalls": int(sum(r["recall_after_timing"].get("recalls", 0) for r in rs)),
                "drift_checks": int(sum(r["recall_after_timing"].get("drift_checks", 0) for r in rs)),
                "decode_ms_p50": p50, "decode_ms_mean": mean, "decode_steps_timed": len(ms),
                "decode_ratio_p50": p50 / full_p50 if full_ms and ms else float("nan"),
                "decode_ratio_mean": mean / full_mean if full_ms and ms else float("nan"),
                "correct": {f"{r['depth']:g}": r["correct"] for r in rs},
                "accuracy": float(np.mean([r["correct"] for r in rs])),
                "answers": {f"{r['depth']:g}": r["text"] for r in rs},
            })
    return rows


# ------------------------------------------------------------------ report
def results_table(summary: list[dict], depths) -> str:
    headers = ["prompt tok", "policy", "rho", "achieved rho", "KV prompt MiB", "KV tail MiB", "KV device MiB",
               "KV host MiB", "decode ms/tok (P50)", "vs full (P50)", "vs full (mean)", "recalls"]
    headers += [f"passkey d={d:g}" for d in depths] + ["accuracy"]
    rows = []
    for s in summary:
        rows.append([
            fmt_num(s["length"]), s["policy"], "—" if s["policy"] == "full" else f"{s['rho']:g}",
            fmt_num(s["achieved_rho"], 3),
            fmt_num(s["kv_bytes_prompt"] / MiB, 1), fmt_num(s["kv_bytes_tail"] / MiB, 1),
            fmt_num(s["kv_bytes_device"] / MiB, 1), fmt_num(s["kv_bytes_host"] / MiB, 1),
            fmt_num(s["decode_ms_p50"], 1), fmt_num(s["decode_ratio_p50"], 2),
            fmt_num(s["decode_ratio_mean"], 2),
            f"{s['recalls']} / {s['drift_checks']} checks" if s["drift_checks"] else "—",
            *[("yes" if s["correct"][f"{d:g}"] else "no") if f"{d:g}" in s["correct"] else "—" for d in depths],
            f"{sum(s['correct'].values())}/{len(s['correct'])}",
        ])
    return markdown_table(headers, rows, align="rllrrrrrrrrr" + "c" * len(depths) + "r")


def answers_table(payload: dict) -> str:
    """What full KV answered per prompt (the reference; shows what the model does with the whole prompt)."""
    rows = []
    for r in payload["runs"]:
        if r["policy"] == "full":
            rows.append([fmt_num(r["length"]), f"{r['depth']:g}", r["passkey"], repr(r["text"]),
                         "yes" if r["correct"] else "no"])
    return markdown_table(["prompt tok", "depth", "passkey", "full-KV answer", "correct"], rows, align="rrrlc")


def results_section(payload: dict, plot_rel: str | None) -> str:
    cfg = payload["config"]
    td = cfg.get("timing_depth", "all")
    timing_where = "every" if td == "all" else f"depth-{td:g}"
    lines = [
        section_header(f"Policies: {cfg['model']} KV, decode vs full KV, passkey accuracy", payload),
        "",
        f"Passkey prompts from `benchmarks/haystack.py` (real text: `pydoc_data.topics`; the needle "
        f"\"{haystack.PASSKEY_NEEDLE.format(key='K')}\" at each depth, then \"{haystack.PASSKEY_QUESTION}\" "
        "in the chat template; every prompt exactly its stated token count; passkey and haystack from "
        f"seed {cfg['seed']}). Batch 1, greedy, {cfg['dtype']}. Each prompt is prefilled once and every "
        "policy's selection hook runs on each layer's KV (prefill's forward pass does not depend on the "
        "policy; a policy's token scores, which never read the budget, are computed once for both budgets), "
        "giving each policy the cache `generate` would build (HeteroCache, which permutes heads, gets its "
        "own prefill). Then greedy decode steps run round-robin over all the policies' caches (order "
        "rotated each step) through `generate`'s decode engine (HeteroCache's drift checks and recalls "
        f"included): on the {timing_where} prompt of each length the first {cfg['warmup_steps']} step(s) "
        f"per cache are untimed warm-up and the next {cfg['decode_steps']} are timed (wall time incl. "
        "reading the token back; compile time excluded); the other prompts only decode their answers. "
        "'vs full' is the policy's median (mean) ms/token over full KV's median (mean) from the same "
        "interleaved steps. Correct iff the first "
        f"{cfg['max_new_tokens']} generated tokens contain the passkey. KV MiB: device arrays when the "
        "answer is complete, as `generate` reports them (prompt = the kept prompt rows of the row pool; tail = the "
        "rest of it, each head's rows for new tokens, "
        f"{payload['prompts'][0]['tail_capacity'] if payload['prompts'] else '?'} slots); achieved rho = "
        "prompt KV kept / full prompt KV. KV host: HeteroCache's satellites' full KV in pinned host memory; "
        "recalls: HeteroCache's drift-triggered recalls over all decode steps (timed ones included) / drift checks.",
        "",
        results_table(payload["summary"], cfg["depths"]),
        "",
        "Full-KV answers (the reference):",
        "",
        answers_table(payload),
        "",
        wall_and_memory_line(payload),
    ]
    if payload.get("checks"):
        c = payload["checks"][0]
        lines += ["", f"Check against `generate()` ({c['length']} tokens, depth {c['depth']:g}): "
                      + ("tokens, prompt KV bytes and achieved rho agree for every policy." if not c["problems"]
                         else "MISMATCH: " + "; ".join(c["problems"]))]
    lines += ["", plot_markdown("policies", plot_rel, cfg["plot"])]
    return "\n".join(lines)


def make_plot(payload: dict, path: Path) -> Path | None:
    summary = payload["summary"]
    import numpy as np

    cfg = payload["config"]
    lengths, depths, labels = cfg["lengths"], cfg["depths"], cfg["combos"]
    fig, axes = subplots(1, 3, figsize=(16, 0.42 * len(labels) + 2.6),
                                gridspec_kw={"width_ratios": [1.1, 1, 1]})
    # (a) accuracy grid: combos x (length, depth)
    ax = axes[0]
    cols = [(L, d) for L in lengths for d in depths]
    grid = np.full((len(labels), len(cols)), np.nan)
    for r in payload["runs"]:
        grid[labels.index(r["label"]), cols.index((r["length"], r["depth"]))] = float(r["correct"])
    ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels([f"{L}\nd={d:g}" for L, d in cols], fontsize=8)
    for i in range(len(labels)):
        for j in range(len(cols)):
            if np.isfinite(grid[i, j]):
                ax.text(j, i, "✓" if grid[i, j] else "✗", ha="center", va="center", fontsize=9)
    ax.set_title("Passkey correct (prompt tokens, needle depth)")
    # (b) decode ratio vs rho, (c) device KV MiB vs rho
    markers = ["o", "s", "^", "D"]
    pols = list(dict.fromkeys(s["policy"] for s in summary if s["policy"] != "full"))
    for k, (ax, key, ylab, title) in enumerate([
        (axes[1], "decode_ratio_p50", "decode ms/token / full KV's (median)", "Decode time vs full KV (same run)"),
        (axes[2], "kv_bytes_prompt", "prompt KV on device (MiB)", "Prompt KV on the device"),
    ]):
        for pi, pol in enumerate(pols):
            for li, L in enumerate(lengths):
                ss = sorted((s for s in summary if s["policy"] == pol and s["length"] == L), key=lambda s: s["rho"])
                if not ss:
                    continue
                ys = [s[key] / (MiB if key.startswith("kv") else 1) for s in ss]
                ax.plot([s["rho"] for s in ss], ys, marker=markers[li % 4], color=f"C{pi}",
                        ls="-" if li == 0 else "--", label=f"{pol} {L}" if k == 0 or li == 0 else None)
        for li, L in enumerate(lengths):
            f = [s for s in summary if s["policy"] == "full" and s["length"] == L]
            if f:
                y = f[0][key] / (MiB if key.startswith("kv") else 1)
                ax.plot([1.0], [y], marker=markers[li % 4], color="k", label=f"full {L}")
        if key == "decode_ratio_p50":
            ax.axhline(1.0, color="k", lw=0.8, alpha=0.5)
        ax.set_xlabel("budget rho")
        ax.set_ylabel(ylab)
        ax.set_title(title)
        ys_all = [y for line in ax.get_lines() for y in line.get_ydata() if np.isfinite(y)]
        ax.set_ylim(0, 1.18 * max(ys_all + [1.0]))
        ax.set_xlim(0, 1.05)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    sub = f"{cfg['model']}, {git_summary(payload['git'])}, {payload['machine'].get('cpu_model', '?')}"
    return save_figure(fig, path, f"KV-cache policies — {sub}")
