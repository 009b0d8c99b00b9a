#!/usr/bin/env python
"""Chunked session turns: the time to append a turn, per token, against prefill's and one decode step per token.

SmolLM2-135M, batch 1, float32. For each context length, the context (the first
tokens of the pydoc corpus) is prefilled into an ``Engine`` per policy; then a
turn of N tokens (the text that follows the context) is appended three ways:

- **chunked**: ``Engine.extend`` (bucketed chunks of at most 512 tokens over the
  cache as it is, then the policy's ``after_extend``: HeteroCache re-selects its
  compressed heads from the turn's queries; counted in the time);
- **per token**: one ``Engine.step`` per token (the path sessions used before;
  HeteroCache's decode hooks included), up to ``--max-step-tokens`` tokens;
- **prefill**: the context's own prefill, per token, as the yardstick.

Each measurement runs once untimed on a twin engine first, so compile time is
never counted; the timed run is the median of ``--repeats``. Reported: seconds
per appended token for each path, chunked / prefill and per-token / chunked.

    .venv/bin/python benchmarks/bench_extend.py --preset cpu --write-results
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (benchmarks/common.py)
import haystack  # noqa: E402  (benchmarks/haystack.py)

SECTION = "extend"
MODEL = "smollm2-135m"
PRESETS = {
    "cpu": dict(lengths=[2048], turn_tokens=[32, 256, 1024], policies=["full", "heterocache"], repeats=3,
                max_step_tokens=256),
    "full": dict(lengths=[2048, 4096], turn_tokens=[32, 256, 1024, 2048], policies=["full", "snapkv", "heterocache"],
                 repeats=3, max_step_tokens=256),
}


def _sync(engine) -> None:
    import jax

    jax.block_until_ready((engine.cache, engine.state.host_arrays()))


def _twin(engine):
    """An independent copy of a prefilled engine: its own cache buffers, and a fresh decode state from the
    same prefill (the state the engine had after prefill)."""
    import jax
    import jax.numpy as jnp

    twin = copy.copy(engine)
    twin.cache = jax.tree.map(jnp.copy, engine.cache)  # extend and step donate the cache they are given
    twin.state = engine.state.fresh()
    return twin



def time_chunked(engine, turn: list[int], repeats: int) -> float:
    _twin(engine).extend(turn)  # compile every chunk shape and the policy's re-selection
    times = []
    for _ in range(repeats):
        e = _twin(engine)
        t0 = time.perf_counter()
        e.extend(turn)
        _sync(e)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_per_token(engine, turn: list[int], repeats: int) -> float:
    import numpy as np

    warm = _twin(engine)
    warm.reserve(len(turn))
    for t in turn[:8]:  # compile the step (and HeteroCache's drift check, every 5 steps)
        warm.step(np.asarray([t], np.int32), 0.0, 1.0)
    times = []
    for _ in range(repeats):
        e = _twin(engine)
        e.reserve(len(turn))
        t0 = time.perf_counter()
        for t in turn:
            e.step(np.asarray([t], np.int32), 0.0, 1.0)
        _sync(e)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(args) -> dict:
    import hetero_jax
    from hetero_jax.runtime import Engine
    from hetero_jax.policies import make_policy

    t_start = time.perf_counter()
    model = hetero_jax.load(args.model)
    tok = model.tokenizer
    corpus = tok.encode(haystack.pydoc_corpus())
    rows = []
    for L in args.lengths:
        context = corpus[:L]
        for name in args.policies:
            policy = make_policy(name, None if name == "full" else args.budget)
            Engine(model, [context], policy, tail_capacity=max(args.turn_tokens) + 16)  # compile the prefill
            engine = Engine(model, [context], policy, tail_capacity=max(args.turn_tokens) + 16)
            prefill_per_tok = engine.prefill_seconds / L
            for n in args.turn_tokens:
                turn = corpus[L : L + n]
                chunked = time_chunked(engine, turn, args.repeats)
                stepped = time_per_token(engine, turn, args.repeats) if n <= args.max_step_tokens else None
                row = {"context_tokens": L, "policy": repr(policy), "name": name, "turn_tokens": n,
                       "prefill_s_per_token": prefill_per_tok, "chunked_s_per_token": chunked / n,
                       "per_token_s_per_token": None if stepped is None else stepped / n}
                rows.append(row)
                print(f"L={L} {name} n={n}: chunked {1e3 * chunked / n:.2f} ms/tok, prefill "
                      f"{1e3 * prefill_per_tok:.2f} ms/tok" + ("" if stepped is None else
                                                                f", per token {1e3 * stepped / n:.2f} ms/tok"),
                      flush=True)
    payload = common.report_header("bench_extend", {k: (str(v) if isinstance(v, Path) else v)
                                                    for k, v in vars(args).items()})
    payload.update(rows=rows, total_seconds=time.perf_counter() - t_start)
    return payload


def results_table(rows) -> str:
    out = []
    for r in rows:
        pt = r["per_token_s_per_token"]
        out.append([f"{r['context_tokens']:,}", r["name"], f"{r['turn_tokens']:,}",
                    f"{1e3 * r['prefill_s_per_token']:.2f}", f"{1e3 * r['chunked_s_per_token']:.2f}",
                    "—" if pt is None else f"{1e3 * pt:.2f}",
                    f"{r['chunked_s_per_token'] / r['prefill_s_per_token']:.2f}",
                    "—" if pt is None else f"{pt / r['chunked_s_per_token']:.1f}"])
    return common.markdown_table(["context tok", "policy", "turn tok", "prefill ms/tok", "chunked turn ms/tok",
                                  "per-token turn ms/tok", "chunked / prefill", "per-token / chunked"], out)


def results_section(payload: dict) -> str:
    cfg = payload["config"]
    return "\n".join([
        common.section_header(f"Session turns: chunked extension vs prefill, {cfg['model']}", payload),
        "",
        "Batch 1, float32. A context of the first N pydoc-corpus tokens is prefilled per policy (budget "
        f"{cfg['budget']} for compressed ones); a turn (the corpus text that follows) is appended with "
        "`Engine.extend` (chunks of at most 512 tokens over the cache as it is, plus HeteroCache's re-selection "
        "of its compressed heads from the turn's queries) or with one `Engine.step` per token (the earlier "
        "session path, drift checks included). Compile excluded (an untimed run on a twin engine first); median "
        f"of {cfg['repeats']} runs. 'prefill ms/tok': the context's prefill time per token.",
        "",
        results_table(payload["rows"]),
    ])


def parse_args(argv=None) -> argparse.Namespace:
    p = common.argument_parser(__doc__.splitlines()[1])
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="'cpu': 2K context, about 5 min on 2 cores; 'full' (used when none is given): 2K and 4K. "
                        "Explicit flags override it")
    p.add_argument("--lengths", type=int, nargs="+", help="context lengths (tokens)")
    p.add_argument("--turn-tokens", type=int, nargs="+", help="turn lengths (tokens)")
    common.add_compressed_policy_arguments(p)
    p.add_argument("--repeats", type=int, help="timed runs per measurement (median)")
    p.add_argument("--max-step-tokens", type=int, help="longest turn also timed one decode step per token")
    p.add_argument("--model", default=MODEL, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=common.OUT_DIR / "extend.json", help="JSON output")
    common.add_results_arguments(p, SECTION)
    args = common.parse_compressed_policy_args(p, PRESETS, argv)
    if min(args.lengths) < 16 or min(args.turn_tokens) < 1 or args.repeats < 1:
        p.error("--lengths must be >= 16, --turn-tokens and --repeats >= 1")
    return args


def main(argv=None) -> int:
    common.run_table_task(parse_args(argv), run, section=SECTION, results_section=results_section,
                          results_table=results_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
