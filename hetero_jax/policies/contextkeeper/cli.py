"""``hetero-jax profile --method contextkeeper``: ContextKeeper's head ranking for a model (the flags are
``hetero-jax profile``'s; ``hetero_jax/cli.py`` sends this method here)."""

from __future__ import annotations

import sys


def run_profile(args) -> int:
    """Calibrate a ranking (the flags of ``hetero_jax.profile.cli.add_profile_parser``), write it to ``--out`` and
    print its summary; 2 after printing the error of bad flags, data or output."""
    import math

    import numpy as np

    from hetero_jax.errors import HeteroJaxError
    from hetero_jax.policies.contextkeeper.ranking import FORMAT_NAME, calibrate_ranking
    from hetero_jax.profile.cli import load_windows
    from hetero_jax.profile.schema import ProfileError

    def check(args):
        if args.sink < 0 or args.recent < 1 or args.ck_window < 1:
            raise ProfileError("--sink must be >= 0, --recent and --ck-window >= 1")
        if not (math.isfinite(args.top_p) and 0.0 < args.top_p <= 1.0):
            raise ProfileError(f"--top-p must be in (0, 1], got {args.top_p}")
        if args.ck_window > args.tokens:  # it was clipped to the window, and recorded as given
            raise ProfileError(f"--ck-window {args.ck_window} exceeds --tokens {args.tokens} (it scores the "
                               f"window's last queries); use --ck-window {args.tokens} or fewer")
        if args.tokens <= args.sink + args.recent:  # the score is the attention mass on [sink, tokens - recent)
            raise ProfileError(f"--tokens {args.tokens} leaves no middle to score between --sink {args.sink} and "
                               f"--recent {args.recent}; use --tokens above {args.sink + args.recent}, or lower "
                               "--sink or --recent")

    try:
        model, windows, source = load_windows(args, check=check, kind=FORMAT_NAME)
        ranking = calibrate_ranking(model, windows, window=args.ck_window, sink=args.sink, recent=args.recent,
                                    top_p=args.top_p, source=f"{source}; {args.samples} window(s) of "
                                    f"{args.tokens} tokens chosen with seed {args.seed}",
                                    progress=not args.no_progress)
        ranking.save(args.out)
    except HeteroJaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    values, counts = np.unique(ranking.votes, return_counts=True)
    print(f"ContextKeeper ranking of {model.name}: {ranking.shape[0]} layers x {ranking.shape[1]} KV heads, "
          f"{args.samples} x {args.tokens} tokens; heads per vote count: "
          + ", ".join(f"{int(v)}: {int(c)}" for v, c in zip(values, counts)))
    print(f"wrote {args.out}")
    return 0
