"""``hetero-jax profile --method hcattention``: HCAttention's key codebook for a model (the flags are
``hetero-jax profile``'s; ``hetero_jax/cli.py`` sends this method here)."""

from __future__ import annotations

import sys


def run_profile(args) -> int:
    """Train a key codebook (the flags of ``hetero_jax.profile.cli.add_profile_parser``), write it to ``--out``
    (``.npz`` added as numpy does) and print its summary; 2 after printing the error of bad flags, data or
    output."""
    from hetero_jax.errors import HeteroJaxError
    from hetero_jax.policies.hcattention.codebook import FORMAT_NAME, MAX_CODES, npz_path, train_codebook
    from hetero_jax.profile.cli import load_windows
    from hetero_jax.profile.schema import ProfileError

    def check(args):
        for flag in ("sub_dim", "codebook_size", "kmeans_steps", "kmeans_batch"):
            if getattr(args, flag) < 1:
                raise ProfileError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
        if args.codebook_size > MAX_CODES:
            raise ProfileError(f"--codebook-size {args.codebook_size} does not fit the int16 codes; use "
                               f"--codebook-size {MAX_CODES} or fewer")

    def check_model(args, config):
        head_dim = config.head_dim
        if head_dim % args.sub_dim:
            divisors = [d for d in range(1, head_dim + 1) if head_dim % d == 0]
            raise ProfileError(f"--sub-dim {args.sub_dim} does not divide the model's head_dim {head_dim} (each key "
                               f"is cut into head_dim / d sub-vectors); use one of {', '.join(map(str, divisors))}")
        per_layer = args.samples * args.tokens * config.num_kv_heads * (head_dim // args.sub_dim)
        if args.codebook_size > per_layer:  # k-means needs a sub-vector per centroid
            raise ProfileError(f"--codebook-size {args.codebook_size} exceeds the {per_layer} key sub-vectors per "
                               f"layer that {args.samples} window(s) of {args.tokens} tokens give; use "
                               f"--codebook-size {per_layer} or fewer, or more --samples or --tokens")

    try:
        model, windows, source = load_windows(args, out=npz_path(args.out), check=check, check_model=check_model,
                                              kind=FORMAT_NAME)
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
