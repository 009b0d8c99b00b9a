"""``hetero-jax profile --method hcattention``: HCAttention's key codebook for a model (the flags are
``hetero-jax profile``'s; ``hetero_jax/cli.py`` sends this method here)."""

from __future__ import annotations

import sys


def run_profile(args) -> int:
    """Train a key codebook (the flags of ``hetero_jax.profile.cli.add_profile_parser``), write it to ``--out``
    (``.npz`` added as numpy does) and print its summary; 2 after printing the error of bad flags, data or
    output."""
    from hetero_jax.errors import HeteroJaxError
    from hetero_jax.policies.hcattention.codebook import npz_path, train_codebook
    from hetero_jax.profile.cli import load_windows
    from hetero_jax.profile.schema import ProfileError

    def check(args):
        for flag in ("sub_dim", "codebook_size", "kmeans_steps", "kmeans_batch"):
            if getattr(args, flag) < 1:
                raise ProfileError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")

    try:
        model, windows, source = load_windows(args, out=npz_path(args.out), check=check)
        cb = train_codebook(model, windows, sub_dim=args.sub_dim, size=args.codebook_size, batch=args.kmeans_batch,
                            steps=args.kmeans_steps, seed=args.seed, progress=not args.no_progress,
                            source=f"{source}; {args.samples} window(s) of {args.tokens} tokens chosen with seed "
                            f"{args.seed}")
        out = cb.save(args.out)
    except HeteroJaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    g = model.config.head_dim // cb.sub_dim
    print(f"HCAttention codebook of {model.name}: {cb.num_layers} layers x {cb.size} centroids of {cb.sub_dim} dims "
          f"(g={g} codes per key), {args.samples} x {args.tokens} tokens")
    print(f"wrote {out}")
    return 0
