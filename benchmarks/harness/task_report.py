"""The task suite's records as tables (``bench_tasks.py``): the summary per task and combo, the accuracy table, the
moving-attention fidelity table, full KV's replies, and ``--merge``, which joins runs of slices of the grid."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

from harness.merging import merge_header, merged_preset, provenance, refuse_differences
from harness.results import fmt_num, fraction_text, markdown_table
from harness.task_cases import case_sha256, make_case


# what --merge reads of each file (a finished run's JSON or an interrupted run's OUT.partial.json):
# harness.args.read_json_inputs' arguments
MERGE_INPUTS = {
    "keys": ("config", "records", "prompts", "command", "git", "machine", "load_seconds", "total_seconds",
             "peak_rss_bytes"),
    "benchmark": "tasks", "config_keys": ("tasks", "lengths", "seeds", "haystacks", "combos"),
    "items": {"records": ("label", "task", "haystack", "length", "seed", "policy", "rho", "score", "n", "found",
                          "solved", "achieved_rho", "recall", "prompt_sha256"),
              "prompts": ("task", "haystack", "length", "seed")},
}
# what every merged run must share, besides each label's policy (policy_reprs) and each haystack's text (sha256)
SAME = ("model", "dtype", "digits", "grading", "temperature", "chat_template", "prefill", "batch")


def haystack_hashes(config: dict) -> dict:
    """{haystack: sha256 of its text} of a run's config: runs whose hashes differ built other prompts."""
    return {h: (v or {}).get("sha256") for h, v in config.get("haystack_sources", {}).items()}


def merge(args, section: str) -> dict:
    """One payload from runs of slices of the grid (``--merge A.json B.json ...``: other lengths, seeds, haystacks,
    tasks or budgets, each run when a session had the time): records and prompts joined, the summary made anew,
    the config the union of the runs' (policies, budgets, combos with their policy_reprs, haystacks, ...), each
    combo's cases missing from the union of lengths x seeds x haystacks x tasks named (``missing``), every run's
    commit, machine and command kept (``merged_from``), ``args.preset`` set to the runs' (their RESULTS section).
    Refused (SystemExit naming the two files): runs of another model, dtype, grading, decoding (temperature, chat
    template, prefill, batch), preset, haystack text (sha256) or policy configuration under one label
    (policy_reprs); a (combo, case) in two runs; full KV answering one case differently in two runs (the prompts or
    the model changed: the runs do not compare); a record whose case (``case_sha256``) is not the one this code
    generates for its task and seed (:func:`case_problem`). Runs that recorded no case hashes (older ones) are
    merged unchecked and named (``unchecked_cases``)."""
    files, parts = args.merge, [json.loads(Path(f).read_text()) for f in args.merge]
    for k in SAME:
        refuse_differences(files, parts, k, lambda p, k=k: {0: p["config"].get(k)})
    for f, p in zip(files, parts):
        if "policy_reprs" in p["config"] and len(p["config"]["policy_reprs"]) != len(p["config"]["combos"]):
            raise SystemExit(f"--merge: {f} has {len(p['config']['policy_reprs'])} policy_reprs for "
                             f"{len(p['config']['combos'])} combos: not a bench_tasks.py result as written")
    refuse_differences(files, parts, "policy configuration", lambda p: dict(zip(p["config"]["combos"],
                                                                                p["config"].get("policy_reprs", []))),
                       what=lambda label: label)
    refuse_differences(files, parts, "haystack text (sha256)", lambda p: haystack_hashes(p["config"]),
                       what=lambda h: f"haystack {h!r}")
    args.preset = merged_preset(files, parts, getattr(args, "preset", None))
    records, prompts, seen, unchecked = [], [], {}, []
    for f, p in zip(files, parts):
        for r in p["records"]:
            problem = case_problem(r)
            if problem:
                raise SystemExit(f"--merge: {f}: {problem}")
            if "case_sha256" not in r and f not in unchecked:
                unchecked.append(f)
            key = (r["label"], r["task"], *_case_key(r))
            if key in seen:
                first = seen[key]
                if r["label"] != "full":
                    raise SystemExit(f"--merge: {r['label']} on {r['task']} {key[2:]} is in {first[0]} and {f}")
                if (r["prompt_sha256"], r["score"], r.get("text")) != first[1]:
                    raise SystemExit(f"--merge: full KV answers {r['task']} {key[2:]} differently in {first[0]} "
                                     f"and {f}: the runs do not compare")
                continue
            seen[key] = (f, (r["prompt_sha256"], r["score"], r.get("text")))
            records.append(r)
        known = {(q["task"], q["haystack"], q["length"], q["seed"]) for q in prompts}
        prompts += [q for q in p["prompts"] if (q["task"], q["haystack"], q["length"], q["seed"]) not in known]
    cfg = dict(parts[0]["config"])
    for k in ("tasks", "lengths", "seeds", "haystacks", "combos", "policies", "budgets"):
        cfg[k] = list(dict.fromkeys(x for p in parts for x in p["config"].get(k, [])))
    cfg["lengths"], cfg["seeds"] = sorted(cfg["lengths"]), sorted(cfg["seeds"])
    reprs = {lab: r for p in parts for lab, r in zip(p["config"]["combos"], p["config"].get("policy_reprs", []))}
    cfg["policy_reprs"] = [reprs.get(lab) for lab in cfg["combos"]]
    for k in ("skipped", "smallest_budgets", "haystack_sources", "task_examples"):
        cfg[k] = {}
        for p in parts:
            for key, per in p["config"].get(k, {}).items():
                if k in ("skipped", "smallest_budgets"):
                    cfg[k].setdefault(key, {}).update(per)
                else:
                    cfg[k].setdefault(key, per)
    cfg["missing"] = missing_cases(records, cfg)
    cfg["unchecked_cases"] = [str(f) for f in unchecked]
    if unchecked:
        print(f"note: --merge: {', '.join(cfg['unchecked_cases'])} recorded no case hashes (run before they were "
              "kept): their cases are not checked against this code's generator", file=sys.stderr)
    cfg["merged_from"] = provenance(files, parts)
    cfg["out"], cfg["plot"] = str(args.out), str(args.plot)
    # the header is the merge's own (its command, commit, time); the section lists each run's commit, machine and
    # command (harness.merging)
    payload = {**merge_header(parts, cfg), "load_seconds": parts[0]["load_seconds"], "prompts": prompts,
               "records": records, "total_seconds": sum(p["total_seconds"] for p in parts),
               "peak_rss_bytes": max(p["peak_rss_bytes"] for p in parts)}
    payload["summary"] = summarize(records, cfg["combos"], cfg["tasks"])
    return payload


AXES = ("task", "haystack", "length", "seed")


def missing_cases(records: list[dict], cfg: dict) -> dict[str, list[str]]:
    """Per combo, the cases of the grid its row lacks, as few slices as name them ("seed 1", "4,000 tokens seed 1",
    or one case): the grid is every task x haystack x length x seed of ``cfg`` (what its section says was run),
    less the lengths the combo was refused at (``cfg["skipped"]``, named apart). Combos lacking nothing are left
    out."""
    import itertools

    values = [cfg["tasks"], cfg["haystacks"], cfg["lengths"], cfg["seeds"]]
    axes = [i for i, v in enumerate(values) if len(v) > 1]  # an axis of one value names nothing
    out = {}
    for label in cfg["combos"]:
        refused = set(cfg.get("skipped", {}).get(label, {}))
        have = {(r["task"], *_case_key(r)) for r in records if r["label"] == label}
        grid = [c for c in itertools.product(*values) if str(c[2]) not in refused]
        lack = [c for c in grid if c not in have]
        if not lack:
            continue
        if len(lack) == len(grid):
            out[label] = ["every case"]
            continue
        slices, covered = [], set()
        for k in range(1, len(axes) + 1):  # the fewest axes first: a whole seed before one seed's lengths
            for fixed in itertools.combinations(axes, k):
                for c in lack:
                    if c in covered:
                        continue
                    cases = [g for g in grid if all(g[i] == c[i] for i in fixed)]
                    if not any(g in have for g in cases):
                        slices.append(" ".join(_axis_text(i, c[i]) for i in fixed))
                        covered.update(cases)
        out[label] = slices
    return out


def _axis_text(axis: int, value) -> str:
    return (f"{value:,} tokens" if AXES[axis] == "length" else f"seed {value}" if AXES[axis] == "seed"
            else f"haystack {value}" if AXES[axis] == "haystack" else str(value))


def missing_text(cfg: dict) -> str:
    """The section's sentences naming each combo's missing cases (``cfg["missing"]`` of a merge) and the merged runs
    whose cases were not checked against the generator (``cfg["unchecked_cases"]``), or ''."""
    text = ""
    if cfg.get("missing"):
        text += (" Missing from the merged runs (not run, so not counted in the row): "
                 + "; ".join(f"{lab} lacks {', '.join(s)}" for lab, s in cfg["missing"].items()) + ".")
    if cfg.get("unchecked_cases"):
        text += (f" {', '.join(Path(f).name for f in cfg['unchecked_cases'])} recorded no case hashes (runs from "
                 "before they were kept): their cases were not checked against the generator.")
    return text


@functools.lru_cache(maxsize=None)
def _generated_sha256(task: str, seed: int) -> str:
    """case_sha256 of the case this code generates for ``task`` and ``seed`` (computed once per pair)."""
    return case_sha256(make_case(task, seed))


def case_problem(record: dict) -> str | None:
    """Why ``record``'s case is not the one this code generates for its task and seed (its ``case_sha256``
    differs from :func:`case_sha256` of :func:`make_case`), or None (the same, or no hash recorded)."""
    got = record.get("case_sha256")
    if got is None:
        return None
    task, seed = record["task"], record["seed"]
    want = _generated_sha256(task, seed)
    if got == want:
        return None
    return (f"{record['label']} on {task} seed {seed} graded another case (case_sha256 {got[:12]}) than this "
            f"code generates ({want[:12]}): the case generator changed since that run; re-run its cases")


GRADING = {
    "multi-fact": "things whose stated value (the first number after each mention of the thing's name; before any, "
                  "the answer prefix's thing) is always its own / things asked; a value stated under another thing "
                  "earns nothing; order not graded",
    "variable-tracking": "chain names stated / chain names, 0 when any distractor-chain name is stated; order not "
                         "graded",
    "multi-key": "1 iff the asked key's number is stated and no distractor's",
    "span-copy": "1 iff the sentence is repeated word for word and ends there (case, punctuation between words, "
                 "spacing ignored; no word added after its last)",
    "fidelity": "quoted value tokens whose top-1 equals full KV's (full KV: equals the true token) / quoted tokens",
}


# ------------------------------------------------------------------ summary
def summarize(records: list[dict], labels, tasks) -> list[dict]:
    """One row per (task, combo): cases, mean score, graded units (values, names, tokens) right of all, cases
    solved, the comparison with full KV case by case, and full KV's solve rate on the row's own cases (a combo
    refused at a length, or lacking cases in a merge, is compared on the cases it ran)."""
    rows = []
    for task in tasks:
        ref = {_case_key(r): r for r in records if r["task"] == task and r["policy"] == "full"}
        for label in labels:
            rs = [r for r in records if r["task"] == task and r["label"] == label]
            if not rs:
                continue
            # full KV's solve rate on these cases: cases it answers completely; for fidelity, quoted tokens it
            # predicts (top-1 = true)
            shared = [ref[k] for k in dict.fromkeys(_case_key(r) for r in rs) if k in ref]
            full_solved = sum(r["found"] if task == "fidelity" else r["solved"] for r in shared)
            full_cases = sum(r["n"] for r in shared) if task == "fidelity" else len(shared)
            # fidelity: a case is below full KV when the policy's top-1 is the true token less often than full KV's
            key = "true_top1_rate" if task == "fidelity" else "score"
            cmp = [(r[key], ref[_case_key(r)][key]) for r in rs if _case_key(r) in ref]
            row = {
                # a 'min' combo's rho differs by length: the mean places it on the plot, the range in the table
                "task": task, "label": label, "policy": rs[0]["policy"], "smallest": label.endswith("@min"),
                "rho": sum(r["rho"] for r in rs) / len(rs), "rho_range": [min(r["rho"] for r in rs),
                                                                          max(r["rho"] for r in rs)],
                "cases": len(rs),
                "score_mean": sum(r["score"] for r in rs) / len(rs),
                "units_right": sum(r["found"] if task == "fidelity" else round(r["score"] * r["n"]) for r in rs),
                "units": sum(r["n"] for r in rs), "solved": sum(r["solved"] for r in rs),
                "below_full": sum(s < f for s, f in cmp), "above_full": sum(s > f for s, f in cmp),
                "full_solved": full_solved, "full_cases": full_cases,
                "achieved_rho": sum(r["achieved_rho"] for r in rs) / len(rs),
                "per_length": {str(L): [sum(r["score"] for r in rs if r["length"] == L),
                                        sum(r["length"] == L for r in rs)]
                               for L in sorted({r["length"] for r in rs})},
            }
            if task == "fidelity":
                kls = [k for r in rs for k in r["steps"]["kl"]]
                row.update(kl_mean=sum(kls) / len(kls), tokens=len(kls),
                           agreement=sum(a for r in rs for a in r["steps"]["agree"]) / len(kls),
                           true_top1_rate=sum(a for r in rs for a in r["steps"]["true_top1"]) / len(kls))
            checks = sum(r["recall"].get("drift_checks", 0) for r in rs)
            row.update(drift_checks=checks, drift_triggers=sum(r["recall"].get("drift_triggers", 0) for r in rs),
                       recalls=sum(r["recall"].get("recalls", 0) for r in rs))
            rows.append(row)
    return rows


def _rho_text(s: dict) -> str:
    """The table's rho: the combo's budget, or 'min' with the smallest budgets the lengths took."""
    if not s.get("smallest"):
        return f"{s['rho']:g}"
    lo, hi = s["rho_range"]
    return f"min ({lo:.3g})" if lo == hi else f"min ({lo:.3g}-{hi:.3g})"


def _case_key(r: dict) -> tuple:
    return r["haystack"], r["length"], r["seed"]


# ------------------------------------------------------------------ report
UNITS = {"multi-fact": "values", "variable-tracking": "names", "multi-key": "cases", "span-copy": "cases",
         "fidelity": "tokens"}


def results_table(payload: dict) -> str:
    """Accuracy per task x policy x rho: mean score, units right, cases solved, cases below / above full KV, and
    full KV's solve rate on the row's cases beside."""
    rows = []
    for s in payload["summary"]:
        full = s["policy"] == "full"
        rows.append([
            s["task"], s["policy"], "—" if full else _rho_text(s), fmt_num(s["achieved_rho"], 3),
            f"{100 * s['score_mean']:.0f} %", f"{s['units_right']}/{s['units']} {UNITS[s['task']]}",
            fraction_text(s["solved"], s["cases"]),
            "(reference)" if full else f"{s['below_full']} / {s['above_full']}",
            f"{fraction_text(s['full_solved'], s['full_cases'])}"
            + (f" ({100 * s['full_solved'] / s['full_cases']:.0f} %)" if s["full_cases"] else ""),
            f"{s['drift_triggers']}/{s['drift_checks']} ({s['recalls']})" if s["drift_checks"] else "—",
        ])
    return markdown_table(
        ["task", "policy", "rho", "achieved rho", "accuracy", "right", "cases solved", "cases below / above full",
         "full KV solves (these cases)", "drift triggers / checks (recalls)"], rows, align="lllrrrrcrr")


def fidelity_table(payload: dict) -> str | None:
    """Moving-attention fidelity: per combo, top-1 agreement with full KV and KL on the quoted tokens, by the
    quoted value's place in the reply (first, second, ...)."""
    recs = [r for r in payload["records"] if r["task"] == "fidelity" and r["policy"] != "full"]
    if not recs:
        return None
    n_vals = max(v for r in recs for v in r["steps"]["value"]) + 1
    rows = []
    for label in payload["config"]["combos"]:
        rs = [r for r in recs if r["label"] == label]
        if not rs:
            continue
        cells = []
        for i in range(n_vals):
            a = [x for r in rs for x, v in zip(r["steps"]["agree"], r["steps"]["value"]) if v == i]
            k = [x for r in rs for x, v in zip(r["steps"]["kl"], r["steps"]["value"]) if v == i]
            cells.append(f"{sum(a)}/{len(a)}, KL {sum(k) / len(k):.3f}" if a else "—")
        a = [x for r in rs for x in r["steps"]["agree"]]
        k = [x for r in rs for x in r["steps"]["kl"]]
        rows.append([label, *cells, f"{sum(a)}/{len(a)} ({100 * sum(a) / len(a):.0f} %)", f"{sum(k) / len(k):.4f}"])
    return markdown_table(["policy", *[f"value {i + 1}: top-1 = full, KL" for i in range(n_vals)],
                                  "all quoted tokens", "KL mean"], rows, align="l" + "r" * (n_vals + 2))


def answers_table(payload: dict, label: str = "full") -> str:
    """Each case's reply by ``label`` (full KV, the reference), graded."""
    rows = [[r["task"], r["haystack"], fmt_num(r["length"]), str(r["seed"]), " ".join(r["values"]),
             repr(r["text"][:120]), f"{r['score']:.2f}"]
            for r in payload["records"] if r["label"] == label]
    return markdown_table(["task", "haystack", "tokens", "seed", "expected", f"{label} reply", "score"], rows,
                                 align="llrrllr")
