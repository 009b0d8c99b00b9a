"""Calibrate ContextKeeper's head ranking for a model on local text and write it as JSON.

    python benchmarks/calibrate_contextkeeper.py --model smollm2-135m --data pydoc \
        --tokens 1536 --samples 8 --out hetero_jax/data/smollm2-135m.contextkeeper.json

The shipped SmolLM2 ranking was made with exactly this command (defaults: window 32, sink 128,
recent 256, top_p 0.65; seed 0 picks the windows). See hetero_jax/profile/contextkeeper.py.
"""

from __future__ import annotations

import argparse
import time

import hetero_jax
from hetero_jax.profile.calibrate import calibration_windows, read_texts
from hetero_jax.profile.contextkeeper import (DEFAULT_RECENT, DEFAULT_SINK, DEFAULT_TOP_P, DEFAULT_WINDOW,
                                              calibrate_ranking)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", nargs="+", default=["pydoc"], help="text files, or 'pydoc'")
    p.add_argument("--tokens", type=int, default=1536, help="tokens per window")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    p.add_argument("--sink", type=int, default=DEFAULT_SINK)
    p.add_argument("--recent", type=int, default=DEFAULT_RECENT)
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    model = hetero_jax.load(a.model, dtype="float32")
    text, source = read_texts(a.data)
    samples = calibration_windows(model.tokenizer, text, a.tokens, a.samples, a.seed)
    t0 = time.perf_counter()
    r = calibrate_ranking(model, samples, window=a.window, sink=a.sink, recent=a.recent, top_p=a.top_p,
                          source=f"{source}; {a.samples} windows of {a.tokens} tokens, seed {a.seed}")
    r.save(a.out)
    print(f"{a.out}: {r.shape[0]} layers x {r.shape[1]} KV heads in {time.perf_counter() - t0:.1f} s; "
          f"votes histogram {dict(zip(*[x.tolist() for x in __import__('numpy').unique(r.votes, return_counts=True)]))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
