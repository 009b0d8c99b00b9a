#!/usr/bin/env python
"""Other orders of ContextKeeper's shipped SmolLM2 ranking, to trace whether the ranking is what loses facts
(RESULTS ``contextkeeper-layer-floor``): ``reversed`` (worst first), ``random`` (a seeded permutation) and
``copy`` (the HeteroCache profile's retrieval score, ``copy_score``, highest first). Each file holds the same
grid with scores that reproduce the order and no votes, so ``ContextKeeper(ranking=path)`` takes it as is.

    .venv/bin/python benchmarks/contextkeeper_rankings.py --out-dir /tmp/ck
    .venv/bin/python benchmarks/bench_multiturn.py ... --policies full contextkeeper:ranking=/tmp/ck/ck-copy.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hetero_jax  # noqa: E402
from harness.args import argument_parser  # noqa: E402
from hetero_jax.policies.contextkeeper.ranking import load_ranking  # noqa: E402

DATA = Path(hetero_jax.__file__).parent / "data"
VARIANTS = ("reversed", "random", "copy")


def with_order(base, order: np.ndarray, variant: str):
    """``base`` with scores falling along ``order`` [N, 2] and zero votes: its ``order()`` is ``order``."""
    n_l, n_h = base.shape
    scores = np.zeros((n_l, n_h))
    scores[order[:, 0], order[:, 1]] = np.arange(len(order), 0, -1, dtype=float)
    out = dataclasses.replace(base, scores=scores, votes=np.zeros((n_l, n_h), np.int64),
                              settings={**base.settings, "variant": variant})
    assert (out.order() == order).all()
    return out


def main(argv=None) -> int:
    # BenchParser: --out-dir (dest out_dir, an output folder) must be a directory it can create or write into
    p = argument_parser(__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, required=True, help="folder for ck-reversed/random/copy.json (created)")
    p.add_argument("--seed", type=int, default=0, help="the random order's seed")
    args = p.parse_args(argv)
    paths = {name: args.out_dir / f"ck-{name}.json" for name in VARIANTS}
    taken = [str(f) for f in paths.values() if f.exists()]
    if taken:  # before computing or writing any
        raise SystemExit(f"error: {', '.join(taken)} exist(s); choose another --out-dir (nothing is overwritten)")
    base = load_ranking(DATA / "smollm2-135m.contextkeeper.json")
    profile = json.loads((DATA / "smollm2-135m.profile.json").read_text())
    n_l, n_h = base.shape
    order = base.order()
    copy = np.asarray(profile["copy_score"], float).ravel()
    by_copy = np.lexsort((np.arange(n_l * n_h), -copy))  # highest first, ties to the lower (layer, head)
    variants = {"reversed": order[::-1].copy(),
                "random": order[np.random.default_rng(args.seed).permutation(len(order))],
                "copy": np.stack(np.divmod(by_copy, n_h), axis=1)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name in VARIANTS:
        with_order(base, variants[name], name).save(paths[name])
        print(f"wrote {paths[name]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
