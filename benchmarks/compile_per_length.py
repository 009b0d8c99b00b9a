#!/usr/bin/env python
"""Compile seconds each new prompt length costs, per policy: ``hetero_jax.generate`` on random token ids of each
length in turn, in one process, and the increase of ``hetero_jax.runtime.compile_seconds()`` per call (every XLA
compile goes through ``runtime.compiled``). A length that shares its executables with an earlier one compiles
next to nothing; one that crosses a bucket (or a policy whose decode state follows the length) compiles again.

    .venv/bin/python benchmarks/compile_per_length.py --policies quest freekv --out /tmp/compile.json

Run it in a fresh process without a persistent compilation cache (the default here): executables of an earlier
run would otherwise be found on disk, not compiled.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.args import argument_parser, policy_spec  # noqa: E402
from harness.machine import machine_info, machine_summary  # noqa: E402
from harness.results import write_json  # noqa: E402


def main(argv=None) -> int:
    ap = argument_parser(__doc__.split("\n\n")[0])  # refuses an --out it cannot write (or the model's files)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--policies", nargs="+", type=policy_spec, default=["full", "quest", "freekv"])
    ap.add_argument("--budget", type=float, default=0.3, help="rho of every policy but full (default 0.3)")
    ap.add_argument("--lengths", nargs="+", type=int, default=[600, 601, 602, 603, 640, 700])
    ap.add_argument("--new-tokens", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True, help="JSON results")
    args = ap.parse_args(argv)
    if min(args.lengths) < 2 or args.new_tokens < 1:
        ap.error("--lengths must be >= 2 tokens and --new-tokens >= 1")
    if not 0.0 < args.budget <= 1.0:
        ap.error(f"--budget {args.budget} must lie in (0, 1]")
    import numpy as np

    import hetero_jax
    from hetero_jax.errors import HeteroJaxError
    from hetero_jax.policies import make_policy, registry_key
    from hetero_jax.runtime import compile_seconds

    # refused before loading
    policies = [make_policy(p, None if registry_key(p) == "full" else args.budget) for p in args.policies]
    model = hetero_jax.load(args.model)
    for name, pol in zip(args.policies, policies):  # a policy this model or a length cannot run: refused now
        try:
            bound = pol.bind(model)
            for n in (min(args.lengths), max(args.lengths)):
                bound.make_prefill(model.config, [n])
        except HeteroJaxError as e:
            ap.error(f"--policies {name}: {e}")
    rows = []
    for name, pol in zip(args.policies, policies):
        seconds = []
        for n in args.lengths:
            ids = np.random.default_rng(n).integers(100, model.config.vocab_size - 100, n).tolist()
            before = compile_seconds()
            hetero_jax.generate(model, ids, pol, max_new_tokens=args.new_tokens, chat=False)
            seconds.append(round(compile_seconds() - before, 2))
        rows.append({"policy": name, "policy_repr": repr(pol), "compile_seconds": seconds})
        print(f"{name:12s} " + ", ".join(f"{s:g}" for s in seconds), flush=True)
    info = machine_info()
    write_json(args.out, {"config": vars(args), "machine": info, "rows": rows})
    print(f"{machine_summary(info)}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
