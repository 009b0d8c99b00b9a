"""The latency script's report: its console lines per length, its RESULTS.md table and section, its figure, and
``--merge`` (runs of one configuration at different lengths joined into one payload).
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.merging import figure_provenance, merge_header, merged_lines, merged_preset, provenance
from harness.results import closing_lines, fmt_num, markdown_table, save_figure, section_header, subplots
from harness.roofline import MiB, TAIL_TARGET, TARGET_RHO, add_fitted, met, target_check
from harness.synthetic import MODEL

def model_label(cfg: dict) -> str:
    """The model a run timed: the real one, or '<shape> (synthetic)' when every point is another shape's."""
    shape = cfg.get("synthetic_shape", MODEL)
    if shape != MODEL and cfg.get("synthetic_lengths") and not cfg.get("real_lengths"):
        return f"{shape} (synthetic)"
    return cfg["model"]


def dtype_label(cfg: dict) -> str:
    dts = ([cfg["dtype"]] if cfg.get("real_lengths") else []) + \
          ([cfg.get("synthetic_dtype", "float32")] if cfg.get("synthetic_lengths") else [])
    return " / ".join(dict.fromkeys(dts)) or cfg["dtype"]


def ctx_label(length: int, weights: str) -> str:
    return f"{length:,}" + (" (synthetic)" if weights == "synthetic" else "")


def length_report(rows: list[dict], length: int, weights: str) -> str:
    """A few lines per length for the console: decode ratio beside its roofline."""
    lines = [f"[{ctx_label(length, weights)}]"]
    for r in rows:
        d = r["decode"]
        lines.append(
            f"  {r['label']:<16} TTFT {r['ttft_median_seconds']:7.2f} s ({r['ttft_ratio']:.2f}x) | decode P50 "
            f"{d['p50_ms']:6.1f} ms P99/P50 {d['p99_over_p50']:.2f} | ratio {r['decode_ratio_p50']:.2f} vs roofline "
            f"{r['roofline_ratio']:.2f} -> {r['measured_over_roofline']:.2f} "
            f"({'within' if r['within_10pct'] else 'outside'} 10 %)")
        if r.get("decode_recall"):
            lines.append(f"  {'':<16} plain steps P50 {r['decode_plain']['p50_ms']:.1f} ms ({r['decode_plain']['n']}), "
                         f"recall steps P50 {r['decode_recall']['p50_ms']:.1f} ms ({r['decode_recall']['n']}), "
                         f"{_trigger_text(r)}")
    return "\n".join(lines)


def _trigger_text(r: dict) -> str:
    if not r.get("timed_drift_checks"):
        return "—"
    return f"{r['timed_trigger_rate']:.0%} of {r['timed_drift_checks']} ({r['timed_recalls']} recalls)"


def results_table(runs: list[dict]) -> str:
    headers = ["context tok", "weights", "policy", "rho", "achieved rho", "TTFT s", "TTFT vs full",
               "decode ms mean", "P50", "P95", "P99", "P99/P50", "KV device MiB", "KV host MiB",
               "decode vs full (P50)", "roofline ratio", "measured / roofline", "within 10 %",
               "fitted ratio", "measured / fitted", "recall triggers"]
    rows = []
    for r in runs:
        d = r["decode"]
        rows.append([
            fmt_num(r["length"]), r["weights"], r["policy"], "—" if r["policy"] == "full" else f"{r['rho']:g}",
            fmt_num(r["achieved_rho"], 3), fmt_num(r["ttft_median_seconds"], 2),
            fmt_num(r["ttft_ratio"], 3), fmt_num(d["mean_ms"], 1), fmt_num(d["p50_ms"], 1),
            fmt_num(d["p95_ms"], 1), fmt_num(d["p99_ms"], 1), fmt_num(d["p99_over_p50"], 2),
            fmt_num(r["kv_bytes_device"] / MiB, 1), fmt_num(r["kv_bytes_host"] / MiB, 1),
            fmt_num(r["decode_ratio_p50"], 2), fmt_num(r["roofline_ratio"], 2),
            fmt_num(r["measured_over_roofline"], 2), "yes" if r["within_10pct"] else "no",
            fmt_num(r.get("fitted_ratio"), 2), fmt_num(r.get("measured_over_fitted"), 2),
            _trigger_text(r),
        ])
    return markdown_table(headers, rows, align="rllrrrrrrrrrrrrrrcrrl")


def targets_text(t: dict) -> str:
    if not t.get("measured"):
        return f"Targets (HeteroCache rho {TARGET_RHO:g} at the longest context): **not measured** in this run."
    spec = f" (`{t['policy']}`)" if ":" in t.get("policy", "") else ""  # the options it ran with
    return "\n".join([
        f"Targets for HeteroCache{spec} rho {TARGET_RHO:g} at the longest context measured "
        f"({ctx_label(t['length'], t['weights'])} tokens):",
        "",
        f"- decode ratio to full KV within 10 % of the roofline ratio: measured {t['decode_ratio_p50']:.3f} vs "
        f"roofline {t['roofline_ratio']:.3f} (x{t['measured_over_roofline']:.3f}) — "
        f"**{met(t['decode_within_10pct_of_roofline'])}**",
        f"- TTFT at most 5 % above full KV: {t['ttft_ratio']:.3f}x full KV's — "
        f"**{met(t['ttft_at_most_5pct_above_full'])}**",
        f"- decode P99/P50 at most {TAIL_TARGET:g}: {t['p99_over_p50']:.2f} — "
        f"**{met(t['p99_over_p50_at_most_1_5'])}**",
    ] + ([
        "",
        f"Beside the roofline (not a target): the step model fitted to full KV in this run "
        f"(P50 = {t['fit']['fixed_ms']:.1f} ms + {t['fit']['ms_per_mib']:.4f} ms per MiB read, "
        f"{t['fit']['points']} lengths) gives HeteroCache's bytes a ratio of {t['fitted_ratio']:.3f}: "
        f"measured x{t['measured_over_fitted']:.3f} of it.",
    ] if t.get("fit") else []))


def warmup_text(cfg: dict) -> str:
    """The untimed TTFT rounds, per length (and weights) where merged runs differ."""
    per = cfg.get("ttft_warmup_per_length") or {}
    if len(set(per.values())) > 1:  # keys: ctx_label (a merge of an older merge may hold a bare length)
        return "untimed round(s) " + ", ".join(f"{k}: {v}" for k, v in per.items())
    return f"{cfg['ttft_warmup']} untimed round(s)"


def results_section(payload: dict, plot_rel: str | None) -> str:
    cfg = payload["config"]
    synth = [x for x in payload["lengths"] if x["weights"] == "synthetic"]
    real_ctx = next((x["max_position_embeddings"] for x in payload["lengths"] if x["weights"] == "real"), None)
    shape = cfg.get("synthetic_shape", MODEL)
    per_kind: dict[str, int] = {}
    for x in payload["lengths"]:
        per_kind.setdefault(x["weights"], x["weight_bytes_per_token"])
    weight_text = ", ".join(f"{v / MiB:,.1f} MiB per token with the {k} weights" for k, v in per_kind.items())
    synth_text = ""
    if synth:
        beyond = real_ctx is None or all(x["length"] > real_ctx for x in synth)
        roles = ("the shipped SmolLM2 profile's roles" if shape == MODEL else
                 f"the roles of the HeteroCache authors' published profile ({cfg.get('synthetic_profile')})")
        synth_text = (
            "**Synthetic** rows" + (" (beyond the real model's context)" if beyond else
                                     " (at lengths the real weights cover too, to compare their timings)")
            + f": random {cfg.get('synthetic_dtype', 'float32')} weights with {shape}'s exact shapes (seed "
            f"{cfg['seed']}; `max_position_embeddings` {synth[0]['max_position_embeddings']}) and random token "
            f"ids; HeteroCache there uses {roles} with the weights fingerprint removed, so its timings are "
            "meaningful and what it keeps is not. ")
    lines = [
        section_header(f"Latency: {model_label(cfg)} TTFT and decode per policy and context", payload),
        "",
        f"Batch 1, greedy, {dtype_label(cfg)}. Real weights: prompts are the first N tokens of the pydoc corpus "
        "(`benchmarks/haystack.py`, raw text). "
        + synth_text
        + f"TTFT = prefill as `GenerationStats` reports it (policy selection in every layer and HeteroCache's "
        f"pinned-host reservoir copy included, compile excluded) + sampling and reading back the first token; "
        f"each policy has its own prefill, round-robin, {warmup_text(cfg)} then the median of "
        f"{cfg['ttft_repeats']}. Decode: the policies' caches of one length take turns in blocks of "
        f"{cfg.get('decode_block', 1)} consecutive steps, order rotated every round, each block ending by waiting for "
        f"the policy's own asynchronous work (counted in its last step), {cfg['warmup_steps']} untimed then "
        f"{cfg['decode_steps']} timed steps each (`Engine.step`, HeteroCache's drift checks and recalls included; "
        f"wall time incl. token read-back). 'decode vs full' = P50 over full KV's P50 from the same rounds. "
        "Roofline ratio = (weight bytes + the KV bytes one decode step of the policy reads) / (weight bytes + full "
        f"KV's), weight bytes = all parameters with the embedding counted as one row and the lm_head in full "
        f"({weight_text}); KV bytes read (`kv_bytes_read_per_step` in the JSON, not the 'KV device MiB' column) = "
        f"the row pool as allocated (every head's kept prompt rows + its rows for added tokens, "
        f"{payload['lengths'][0]['tail_capacity']} per head) + the policy's index arrays + the rows it fetches from "
        "host memory per step, counted twice (read from the host, written into the pool); Quest counts only the "
        "prompt rows it attends, HCAttention the value rows it reads on the host (once). 'within 10 %': "
        f"measured / roofline in [0.9, 1.1]. Fitted ratio: the time the step model fitted to full KV's P50 at this "
        f"run's lengths (fixed ms + ms per MiB read) gives the policy's bytes, over full KV's P50; measured / fitted: "
        f"the policy's P50 over that time (see the note under the targets). Recall triggers: HeteroCache drift "
        f"checks that triggered during the timed steps.",
        "",
        *merged_lines(cfg),
        results_table(payload["runs"]),
        "",
        targets_text(payload["targets"]),
    ]
    apart = [r for r in payload["runs"] if r.get("decode_recall")]
    if apart:
        lines += ["", "Steps that applied a recall and the others, apart (P50, steps):", ""]
        lines += [f"- {ctx_label(r['length'], r['weights'])}, {r['label']}: plain {r['decode_plain']['p50_ms']:.1f} ms "
                  f"({r['decode_plain']['n']}), recall {r['decode_recall']['p50_ms']:.1f} ms "
                  f"({r['decode_recall']['n']}); drift checks {_trigger_text(r)}" for r in apart]
    if payload.get("refused"):
        lines += ["", "Refused (a budget the policy cannot keep, left out): " + "; ".join(
            f"{lab} at {', '.join(fmt_num(int(L)) for L in errs)} tokens" for lab, errs in payload["refused"].items())]
    if cfg.get("preset") == "cpu":
        lines += ["", "(`--preset cpu` is a small configuration: at these contexts the weights dominate "
                      "the bytes a decode step reads and one TTFT round per policy is noisy; the targets are meant "
                      "for the longest context of the full grid.)"]
    elif cfg.get("ttft_repeats") == 1:
        lines += ["", "(One timed TTFT round per policy: a single sample, with the noise of this machine in it.)"]
    lines += ["", *closing_lines(payload, "latency", plot_rel)]
    return "\n".join(lines)


def make_plot(payload: dict, path: Path) -> Path | None:
    runs = payload["runs"]

    labels = list(dict.fromkeys(r["label"] for r in runs))
    fig, axes = subplots(1, 3, figsize=(17, 5))
    panels = [
        (axes[0], lambda r: r["decode"]["p50_ms"], "decode ms/token (P50)", "Decode time per token"),
        (axes[1], None, "decode time / full KV's (P50)", "Measured ratio (solid) vs roofline (dotted)"),
        (axes[2], lambda r: r["ttft_median_seconds"], "time to first token (s)", "TTFT"),
    ]
    for ax, get, ylab, title in panels:
        for ci, lab in enumerate(labels):
            rs = sorted((r for r in runs if r["label"] == lab), key=lambda r: r["length"])
            color = f"C{ci}"
            for weights, mfc, ls in (("real", color, "-"), ("synthetic", "white", "--")):
                part = [r for r in rs if r["weights"] == weights]
                if not part:
                    continue
                xs = [r["length"] for r in part]
                name = lab + (" (synthetic)" if weights == "synthetic" else "")
                if get is None:
                    if lab == "full":
                        continue
                    ax.plot(xs, [r["decode_ratio_p50"] for r in part], marker="o", color=color, mfc=mfc, ls=ls,
                            label=name)
                    ax.plot(xs, [r["roofline_ratio"] for r in part], marker="x", color=color, ls=":", lw=1)
                else:
                    ax.plot(xs, [get(r) for r in part], marker="o", color=color, mfc=mfc, ls=ls, label=name)
        synth = [r["length"] for r in runs if r["weights"] == "synthetic"]
        real = [r["length"] for r in runs if r["weights"] == "real"]
        if synth and (not real or min(synth) > max(real)):  # shade only a range that is synthetic alone
            ax.axvspan(min(synth) / 1.15, max(synth) * 1.15, color="0.9", zorder=0)
            ax.text(min(synth) / 1.1, ax.get_ylim()[1], "synthetic weights", va="top", fontsize=8, color="0.35")
        if get is None:
            ax.axhline(1.0, color="k", lw=0.8, alpha=0.5)
            ax.plot([], [], marker="x", color="0.3", ls=":", lw=1, label="roofline ratio (policy's colour)")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["length"] for r in runs})
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t / 1024:g}K" if t % 1024 == 0 else f"{t:,}" for t in ticks], fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("context (prompt tokens)")
        ax.set_ylabel(ylab)
        ax.set_title(title)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=7)
    sub = f"{model_label(payload['config'])} {dtype_label(payload['config'])}, {figure_provenance(payload)}"
    synth = " (hollow markers, dashed: synthetic random weights)" if any(r["weights"] == "synthetic" for r in runs) \
        else ""
    return save_figure(fig, path, f"Latency per policy{synth} — {sub}")


# what --merge reads of each file: harness.args.read_json_inputs' arguments
MERGE_INPUTS = {
    "keys": ("config", "lengths", "runs", "total_seconds", "command", "git", "machine", "peak_rss_bytes"),
    "benchmark": "latency",
    "config_keys": ("synthetic_lengths", "real_lengths", "ttft_warmup", "ttft_repeats", "decode_steps", "warmup_steps",
                    "model", "dtype", "seed"),
    "items": {"lengths": ("length", "weights", "max_position_embeddings", "weight_bytes_per_token", "tail_capacity"),
              "runs": ("length", "weights", "label", "policy", "rho", "achieved_rho", "decode", "ttft_median_seconds",
                       "ttft_ratio", "kv_bytes_device", "kv_bytes_host", "kv_bytes_read_per_step", "decode_ratio_p50",
                       "roofline_ratio", "measured_over_roofline", "within_10pct")},
}


def merge(args) -> dict:
    """One payload from runs of the same configuration at different lengths (``--merge A.json B.json ...``).

    A device call that may be cut off runs each length as its own process with its own JSON; this joins
    the lengths that finished into one table and target check. The header is the merge's own (command, commit,
    time); ``config["merged_from"]`` keeps every run's commit, machine and command, and the section lists them
    (``harness.merging``). ``args.preset`` becomes the runs' (their RESULTS section). Refused (SystemExit naming
    the two files): another configuration, or a length (with its weights) in two runs.
    """
    parts = [json.loads(Path(f).read_text()) for f in args.merge]
    keep = ("synthetic_lengths", "real_lengths", "out", "plot", "ttft_warmup", "merged_from", "ttft_warmup_per_length")
    base = {k: v for k, v in parts[0]["config"].items() if k not in keep}
    for f, p in zip(args.merge[1:], parts[1:]):
        other = {k: v for k, v in p["config"].items() if k not in keep}
        if other != base:
            diff = sorted(k for k in set(base) | set(other) if base.get(k) != other.get(k))
            raise SystemExit(f"--merge: {f} was run with another configuration than {args.merge[0]} "
                             f"({', '.join(diff)} differ): the runs do not compare")
    args.preset = merged_preset(args.merge, parts, getattr(args, "preset", None))
    seen: dict[tuple, object] = {}
    for f, p in zip(args.merge, parts):
        for x in p["lengths"]:
            key = (x["weights"], x["length"])
            if key in seen:
                raise SystemExit(f"--merge: {ctx_label(x['length'], x['weights'])} tokens ({x['weights']} weights) "
                                 f"are in {seen[key]} and {f}: merge each length once (leave one of the two out)")
            seen[key] = f
    order = sorted(range(len(parts)), key=lambda i: min(x["length"] for x in parts[i]["lengths"]))
    cfg = dict(parts[0]["config"])
    for k in ("synthetic_lengths", "real_lengths"):
        cfg[k] = sorted({L for p in parts for L in p["config"][k]})
    cfg["ttft_warmup"] = min(p["config"]["ttft_warmup"] for p in parts)
    # a merged run's own per row kind: a length with its weights, as rows are told apart (real and synthetic rows
    # of one length come from different runs); a merged merge's own entry first (an older one's by length alone)
    cfg["ttft_warmup_per_length"] = {ctx_label(x["length"], x["weights"]): _warmup_of(parts[i]["config"], x)
                                     for i in order for x in parts[i]["lengths"]}
    cfg["merged_from"] = provenance(args.merge, parts)
    cfg["out"], cfg["plot"] = str(args.out), str(args.plot)
    payload = {**merge_header(parts, cfg), "load_seconds": parts[0].get("load_seconds"),
               "lengths": [x for i in order for x in parts[i]["lengths"]],
               "runs": [r for i in order for r in parts[i]["runs"]], "refused": {}}
    for p in parts:
        for lab, errs in p.get("refused", {}).items():
            payload["refused"].setdefault(lab, {}).update(errs)
    add_fitted(payload["runs"])
    payload["targets"] = target_check(payload["runs"])
    payload["total_seconds"] = sum(p["total_seconds"] for p in parts)
    payload["peak_rss_bytes"] = max(p["peak_rss_bytes"] for p in parts)
    return payload


def _warmup_of(cfg: dict, x: dict) -> int:
    """The untimed TTFT rounds of length entry ``x`` of a run with config ``cfg`` (itself a merge or not)."""
    per = cfg.get("ttft_warmup_per_length") or {}
    return per.get(ctx_label(x["length"], x["weights"]), per.get(str(x["length"]), cfg["ttft_warmup"]))
