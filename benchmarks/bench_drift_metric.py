#!/usr/bin/env python
"""Drift metric on the real SmolLM2-135M: raw vs chance-normalised pivot overlaps, with and without a question.

HeteroCache's drift check compares each pivot's K_t = top-L_base of its pooled
scores over the prompt with K_base (the prefill's) and fires when the median
over the W buffered steps of o_t = |K_t ∩ K_base| / L_base falls below
tau_drift (paper Eq. 9-10). Two random L_base-sets of an L-token prompt
overlap c = L_base / L on average, so o is read against that chance level:
normalised o' = (o - c) / (1 - c). This script records every pivot check of
real sessions (the shipped profile, drift never allowed to fire so that
K_base stays the prefill's and every check sees the same reference) and
reports the distribution of median_t(o) and median_t(o') per setting:

- ``continue``: the context as plain text, 40 greedy tokens continuing it
  (attention should stay where it was);
- ``question`` / ``answer``: a ``Session`` on the same context (chat
  template) asked three questions about facts at depths 0.15 / 0.5 / 0.85
  (``bench_multiturn``'s facts), 16 tokens per answer; ``question`` = checks
  dispatched while the question is appended, ``answer`` = while answering.

    .venv/bin/python benchmarks/bench_drift_metric.py --write-results
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (benchmarks/common.py)

SECTION = "drift-metric"
TAUS = (0.1, 0.2, 0.25, 0.3, 0.4)


class Recorder:
    """A HeteroCache decode state's check observer: records the raw o_t of every pivot check (see
    ``check_observers``: the state hands over o'_t = (o_t - c) / (1 - c), c = L_base / L, Eq. 9 normalised)."""

    def __init__(self):
        self.label, self.rows = "", []

    def __call__(self, layer, overlaps, lengths, l_base) -> None:
        import numpy as np

        o_norm = np.asarray(overlaps, np.float64)  # [B, Np, W]
        lengths = np.asarray(lengths)  # [B, Np]
        l_base = np.broadcast_to(np.asarray(l_base), lengths.shape[:1])  # [B]: each sequence's own L_base
        for b, p in np.ndindex(lengths.shape):
            lb = int(l_base[b])
            c = min(1.0, lb / max(int(lengths[b, p]), 1))
            o = o_norm[b, p] * (1.0 - c) + c if c < 1.0 else np.ones_like(o_norm[b, p])
            self.rows.append({"label": self.label, "o": o.tolist(), "L": int(lengths[b, p]), "l_base": lb})


def run(args) -> dict:
    import bench_multiturn as mt

    import hetero_jax
    from hetero_jax.policies import HeteroCache
    from hetero_jax.runtime import Engine, Session, tail_capacity_for
    from hetero_jax.runtime.engine import decode_loop

    model = hetero_jax.load(mt.MODEL, progress=False)
    facts = mt.make_facts(args.seed, 3)
    rows = []
    for n_tokens in args.lengths:
        ctx = mt.build_context(model.tokenizer, n_tokens, facts, mt.fact_depths(3), args.seed)
        for rho in args.budgets:
            policy = HeteroCache(budget=rho, tau_drift=-1.0)  # never fires: K_base stays the prefill's
            rec = Recorder()
            rec.label = "continue"  # greedy continuation of the plain-text context
            ids = model.tokenizer.encode_prompt(ctx.text, chat=False)
            eng = Engine(model, [ids], policy, tail_capacity=tail_capacity_for(args.continue_tokens))
            eng.state.check_observers.append(rec)
            # generate's own loop (stops at EOS), on an engine whose decode state the recorder can watch
            decode_loop(eng, eng.first_tokens(0.0, 1.0), args.continue_tokens, temperature=0.0, top_p=1.0,
                        stops=[], on_token=None)
            sess = Session(model, ctx.text, policy)
            sess.engine.state.check_observers.append(rec)
            # a turn's question is appended in chunks (no check runs there); every check of a turn
            # is on its answer's steps
            rec.label = "answer"
            for f in facts:
                sess.ask(f.question, max_new_tokens=args.answer_tokens)
            for r in rec.rows:
                r.update(n_tokens=n_tokens, rho=rho)
            rows += rec.rows
            print(f"{n_tokens} tokens, rho {rho}: {len(rec.rows)} pivot checks", flush=True)
    return {"config": vars(args), "rows": rows}


def summarize(rows):
    import numpy as np

    out = []
    keys = sorted({(r["n_tokens"], r["rho"]) for r in rows})
    for n_tokens, rho in keys:
        for label in ("continue", "question", "answer"):
            sel = [r for r in rows if (r["n_tokens"], r["rho"], r["label"]) == (n_tokens, rho, label)]
            if not sel:
                continue
            raw = np.array([np.median(r["o"]) for r in sel])
            c = np.array([min(1.0, r["l_base"] / r["L"]) for r in sel])
            norm = (raw - c) / (1 - c)
            q = lambda x: np.quantile(x, [0.1, 0.5, 0.9])  # noqa: E731
            out.append({"n_tokens": n_tokens, "rho": rho, "label": label, "checks": len(sel),
                        "L": int(np.median([r["L"] for r in sel])), "l_base": sel[0]["l_base"],
                        "chance": float(c.mean()), "raw_q": q(raw).tolist(), "norm_q": q(norm).tolist(),
                        "fire_raw_04": float((raw < 0.4).mean()),
                        "fire_norm": {t: float((norm < t).mean()) for t in TAUS}})
    return out


def render(summary, header: str) -> str:
    lines = [header, "",
             "Each row: the pivot checks of one setting (every pivot x check; drift never fires, so K_base is the "
             "prefill's). Statistic per check = median over its W = 5 steps; raw o = |K_t ∩ K_base| / L_base, "
             "chance c = L_base / L, normalised o' = (o - c) / (1 - c). q10/q50/q90 = quantiles over checks; "
             "'fires' = share of checks whose statistic is below the threshold (old rule: raw < 0.4; new rule: "
             "o' < tau).", "",
             "| prompt tok | rho | L_base | c | checks | phase | raw q10 / q50 / q90 | o' q10 / q50 / q90 | "
             "fires raw<0.4 | " + " | ".join(f"fires o'<{t}" for t in TAUS) + " |",
             "| ---: | ---: | ---: | ---: | ---: | :--- | :--- | :--- | ---: | " + " | ".join("---:" for _ in TAUS)
             + " |"]
    for s in summary:
        fmt = lambda v: " / ".join(f"{x:.2f}" for x in v)  # noqa: E731
        lines.append(f"| {s['n_tokens']:,} | {s['rho']} | {s['l_base']} | {s['chance']:.2f} | {s['checks']} | "
                     f"{s['label']} | {fmt(s['raw_q'])} | {fmt(s['norm_q'])} | {s['fire_raw_04']:.2f} | "
                     + " | ".join(f"{s['fire_norm'][t]:.2f}" for t in TAUS) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = common.argument_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2000, 4000], help="context tokens")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.3, 0.5], help="rho values")
    ap.add_argument("--seed", type=int, default=0, help="facts and haystack start (bench_multiturn)")
    ap.add_argument("--continue-tokens", type=int, default=40)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--write-results", action="store_true", help=f"rewrite the '{SECTION}' section of RESULTS.md")
    args = ap.parse_args(argv)
    payload = run(args)
    summary = summarize(payload["rows"])
    payload["summary"] = summary
    machine, git = common.machine_info(), common.git_info()
    out = common.write_json(common.REPO_ROOT / "benchmarks" / "out" / "drift_metric.json",
                            {**common.report_header(SECTION, vars(args), machine), **payload})
    header = common.results_header("Drift metric: raw vs chance-normalised pivot overlap (smollm2-135m)", machine,
                                   git, common.command_line(argv))
    text = render(summary, header)
    print(text)
    print(f"wrote {out}")
    if args.write_results:
        common.update_results_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
