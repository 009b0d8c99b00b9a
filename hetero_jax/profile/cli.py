"""``hetero-jax profile``: calibrate a HeteroCache head profile (or, ``--method synckv``, a SyncKV head grouping)
for a model; the flags of every method, and the checks they share.

``add_profile_parser(subparsers)`` adds the sub-command to the main CLI; ``run_profile(args)`` runs the two
methods calibrated here and returns the exit status. ``--method contextkeeper`` (a ContextKeeper head ranking)
and ``--method hcattention`` (an HCAttention key codebook) are calibrated beside their policies
(``policies/contextkeeper/cli.py``, ``policies/hcattention/cli.py``), which sit above this package:
``hetero_jax/cli.py`` sends each method to its handler.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from hetero_jax.io.own_outputs import FIGURE
from hetero_jax.profile.schema import FORMAT_NAME

DEFAULT_TOKENS = 1024
DEFAULT_SAMPLES = 4
DEFAULT_DECODE_STEPS = 50


def add_profile_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "profile",
        help="calibrate a HeteroCache head profile (roles, stability, similarity) for a model",
        description="Calibrate the offline HeteroCache head profile: prefill each calibration window, "
        "decode greedily, score every KV head's top-k attended tokens, then cluster heads into "
        "anchor / volatile / pivot / satellite roles. Writes the profile JSON (and optionally a figure).",
    )
    p.add_argument("--model", default="smollm2-135m",
                   help="known model name or converted checkpoint dir (default: smollm2-135m)")
    p.add_argument("--data", nargs="+", required=True, metavar="FILE",
                   help="UTF-8 text file(s), joined; 'pydoc' = Python's pydoc_data.topics texts")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                   help=f"tokens per calibration window (default {DEFAULT_TOKENS})")
    p.add_argument("--samples", type=int, default=DEFAULT_SAMPLES,
                   help=f"calibration windows, drawn from the data by --seed (default {DEFAULT_SAMPLES})")
    p.add_argument("--decode-steps", type=int, default=DEFAULT_DECODE_STEPS,
                   help=f"greedy decode steps per window (default {DEFAULT_DECODE_STEPS}; the paper uses 100)")
    p.add_argument("--top-k", type=int, default=None,
                   help="size of each top-k token set (default: 20%% of --tokens; synckv: 10%%)")
    p.add_argument("--tau-stable", type=float, default=0.5, help="stability threshold (default 0.5)")
    p.add_argument("--tau-sim", type=float, default=0.5, help="similarity threshold (default 0.5)")
    p.add_argument("--copy-steps", type=int, default=None,
                   help="teacher-forced steps of the copy phase, which re-feeds 4 runs of each window and "
                   "scores each head's argmax on the earlier occurrence of the token fed (default 48, or half of "
                   "--tokens if fewer; below --tokens; 0: no copy phase)")
    p.add_argument("--tau-copy", type=float, default=None,
                   help="copy score from which an anchor or satellite keeps its full KV (default 0.3)")
    p.add_argument("--seed", type=int, default=0, help="chooses the windows (default 0)")
    p.add_argument("--batch-size", type=int, default=4,
                   help="heterocache, synckv: windows run together (default 4)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="compute dtype (default: checkpoint's)")
    p.add_argument("--out", required=True, help="where to write the profile JSON")
    p.add_argument("--plot", default=None, help="also write the summary figure (PNG) here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--method", choices=["heterocache", "contextkeeper", "synckv", "hcattention"],
                   default="heterocache",
                   help="heterocache: role profile (default); contextkeeper: head ranking by the attention mass "
                   "on the prompt's middle (--sink, --recent, --ck-window, --top-p; the decode and clustering "
                   "options do not apply); synckv: R-heads by k-means over the heads' mean top-k overlaps at "
                   "every decode step (--n-r; --tau-stable and --tau-sim do not apply); hcattention: key "
                   "codebook, written as .npz (--sub-dim, --codebook-size, --kmeans-steps, --kmeans-batch)")
    p.add_argument("--n-r", type=int, default=None,
                   help="synckv: clusters (R-heads) per layer (default: a quarter of the KV heads, at least 1)")
    p.add_argument("--sink", type=int, default=128, help="contextkeeper: sink tokens left out (default 128)")
    p.add_argument("--recent", type=int, default=256, help="contextkeeper: recent tokens left out (default 256)")
    p.add_argument("--ck-window", type=int, default=32,
                   help="contextkeeper: last prompt queries scored (default 32)")
    p.add_argument("--top-p", type=float, default=0.65,
                   help="contextkeeper: share of a layer's heads voted for per sample (default 0.65)")
    p.add_argument("--sub-dim", type=int, default=4,
                   help="hcattention: dims per key sub-vector d; g = head_dim / d codes per key (default 4)")
    p.add_argument("--codebook-size", type=int, default=512,
                   help="hcattention: centroids per layer c, at most 32767 (default 512)")
    p.add_argument("--kmeans-steps", type=int, default=200, help="hcattention: mini-batch steps (default 200)")
    p.add_argument("--kmeans-batch", type=int, default=10000,
                   help="hcattention: sub-vectors per mini-batch (default 10000)")
    return p


# which methods read each method-specific flag: given to another method, it would change nothing
METHODS_OF_FLAG = {
    "decode_steps": ("heterocache", "synckv"), "top_k": ("heterocache", "synckv"),
    "tau_stable": ("heterocache",), "tau_sim": ("heterocache",), "copy_steps": ("heterocache",),
    "tau_copy": ("heterocache",), "n_r": ("synckv",), "batch_size": ("heterocache", "synckv"),
    # --plot: its own refusal, in check_profile_args
    "sink": ("contextkeeper",), "recent": ("contextkeeper",), "ck_window": ("contextkeeper",),
    "top_p": ("contextkeeper",), "sub_dim": ("hcattention",), "codebook_size": ("hcattention",),
    "kmeans_steps": ("hcattention",), "kmeans_batch": ("hcattention",),
}


@functools.cache
def _flag_defaults() -> dict:
    """The profile parser's defaults of those flags: a flag was given if its value differs."""
    p = add_profile_parser(argparse.ArgumentParser().add_subparsers())
    return {a.dest: a.default for a in p._actions if a.dest in METHODS_OF_FLAG}


def check_profile_args(args, out: str | None = None, kind: str = FORMAT_NAME) -> None:
    """Before any work: ProfileError for a bad number, a ``--plot`` that draws nothing or a flag that would
    change nothing; OutputError for an ``--out`` / ``--plot`` inside the installed package (its shipped data) or
    that would overwrite an input (``--data``, ``--model``) or each other, or that cannot
    be written (``hetero_jax.io.files.check_outputs``: an existing ``--out`` must be an earlier output of this
    ``kind``, the method's file format; ``--plot`` an earlier figure). ``out``: the file ``--out`` names, when
    the writer changes it (the codebook's ``.npz``); None: ``args.out``."""
    import math

    from hetero_jax.io.files import check_outputs
    from hetero_jax.io.hub import checkpoint_dir
    from hetero_jax.profile.schema import ProfileError

    method = getattr(args, "method", "heterocache")
    if args.plot is not None and method != "heterocache":
        raise ProfileError(f"--plot draws the HeteroCache role figure; --method {method} draws nothing. Drop "
                           "--plot (it would write no file)")
    defaults = _flag_defaults()
    for dest, methods in METHODS_OF_FLAG.items():
        if method not in methods and getattr(args, dest, defaults[dest]) != defaults[dest]:
            flag = "--" + dest.replace("_", "-")
            raise ProfileError(f"{flag} applies to --method {' and '.join(methods)}, not {method}: drop it (it "
                               "would change nothing)")

    if getattr(args, "n_r", None) is not None and args.n_r < 1:
        raise ProfileError(f"--n-r must be >= 1, got {args.n_r}")
    for flag in ("tokens", "samples", "decode_steps", "batch_size"):
        v, least = getattr(args, flag), 2 if flag == "tokens" else 1  # a window needs a prompt and its last query
        if v < least:
            raise ProfileError(f"--{flag.replace('_', '-')} must be >= {least}, got {v}")
    if getattr(args, "copy_steps", None) is not None and args.copy_steps < 0:
        raise ProfileError(f"--copy-steps must be >= 0, got {args.copy_steps}")
    tau_copy = getattr(args, "tau_copy", None)
    if tau_copy is not None and getattr(args, "copy_steps", None) == 0:
        raise ProfileError(f"--tau-copy {tau_copy} sets the copy rule of the copy phase, which --copy-steps 0 "
                           "turns off: drop --tau-copy (it would change nothing) or give --copy-steps N > 0")
    if tau_copy is not None and not (math.isfinite(tau_copy) and 0.0 <= tau_copy <= 1.0):
        raise ProfileError(f"--tau-copy must be in [0, 1], got {tau_copy}")
    if args.top_k is not None and not 1 <= args.top_k < args.tokens:
        raise ProfileError(f"--top-k must be >= 1 and below --tokens {args.tokens} (a top-k set of every token "
                           f"tells nothing), got {args.top_k}")
    for flag in ("tau_stable", "tau_sim"):
        v = getattr(args, flag)
        if not (math.isfinite(v) and 0.0 <= v <= 1.0):
            raise ProfileError(f"--{flag.replace('_', '-')} must be in [0, 1], got {v}")
    from hetero_jax.errors import OutputError
    from hetero_jax.io.files import path_inside

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # hetero_jax/, this file's package's
    for flag, path in (("--out", args.out if out is None else out), ("--plot", args.plot)):
        if path is not None and path_inside(path, package):
            raise OutputError(f"{flag} {path} lies inside the installed hetero_jax package ({package}): writing "
                              "there would replace data shipped with the library (hetero_jax/data/*.profile.json "
                              "are the default profiles every run of their model loads). Write it elsewhere and "
                              "pass that path to the policy (for HeteroCache: --profile PATH)")
    check_outputs({"--out": args.out if out is None else out, "--plot": args.plot},
                  {"--data": [d for d in args.data if d != "pydoc"], "--model": checkpoint_dir(args.model)},
                  kinds={"--out": kind, "--plot": FIGURE})
    if args.plot is not None:
        from hetero_jax.profile.plot import plot_format

        plot_format(args.plot, "--plot")


def check_model_args(args, config) -> None:
    """ProfileError, right after the model is loaded and before any window is cut or calibrated, for a
    ``--tokens`` (plus the decode steps of the methods that decode) past the model's context, or an ``--n-r``
    larger than its KV heads."""
    from hetero_jax.profile.schema import ProfileError

    method = getattr(args, "method", "heterocache")
    context = config.max_position_embeddings
    steps = args.decode_steps if method in ("heterocache", "synckv") else 0
    if steps > context - 2:
        raise ProfileError(f"--decode-steps {steps} leaves no room in the model's context of {context} tokens for "
                           f"a window of --tokens; use --decode-steps {context - 2} or fewer")
    if args.tokens + steps > context:
        plus = f" plus --decode-steps {steps}" if steps else ""
        raise ProfileError(f"--tokens {args.tokens}{plus} exceeds the model's context of {context} tokens; use "
                           f"--tokens {context - steps} or fewer")
    n_r, heads = getattr(args, "n_r", None), config.num_kv_heads
    if method == "synckv" and n_r is not None and n_r > heads:
        raise ProfileError(f"--n-r {n_r} exceeds the model's {heads} KV heads per layer (SyncKV groups a layer's "
                           f"KV heads into R-head clusters); use --n-r {heads} or fewer")


def load_windows(args, out: str | None = None, check=None, check_model=None, kind: str = FORMAT_NAME):
    """What every method does before calibrating, in this order: the flags (``check_profile_args`` with
    ``out``, then ``check(args)``, the method's own), the data, the model (``io.hub.load``), the flags against
    the model (``check_model_args``, then ``check_model(args, config)``, the method's own), the calibration
    windows (``--samples`` of ``--tokens`` tokens each). ``kind``: the method's file format (``--out``).
    Returns (model, windows, the data's source)."""
    from hetero_jax.io.hub import load
    from hetero_jax.profile.calibrate import calibration_windows, read_texts

    check_profile_args(args, out, kind)  # before reading data, loading the model or calibrating
    if check is not None:
        check(args)
    text, source = read_texts(args.data)
    model = load(args.model, dtype=args.dtype, progress=not args.no_progress)
    check_model_args(args, model.config)
    if check_model is not None:
        check_model(args, model.config)
    return model, calibration_windows(model.tokenizer, text, args.tokens, args.samples, seed=args.seed), source


def run_profile(args) -> int:
    """``--method heterocache`` or ``synckv``: calibrate, write the profile (and ``--plot``'s figure) and print
    its summary; 2 after printing the error of bad flags, data or output."""
    from hetero_jax.errors import HeteroJaxError
    from hetero_jax.profile.calibrate import DEFAULT_TAU_COPY, calibrate_tokens
    from hetero_jax.profile.schema import ProfileError

    method = getattr(args, "method", "heterocache")
    if method not in ("heterocache", "synckv"):  # a programming error: hetero_jax/cli.py routes the others
        raise ProfileError(f"--method {method} is calibrated beside its policy "
                           f"(hetero_jax/policies/{method}/cli.py), not by hetero_jax.profile.cli.run_profile")
    try:
        model, windows, source = load_windows(args)
        desc = (f"{source}: {args.samples} window(s) of {args.tokens} tokens chosen with seed {args.seed} "
                f"among consecutive non-overlapping windows; batch_size {args.batch_size}")
        profile = calibrate_tokens(
            model.config, model.params, windows, top_k=args.top_k, decode_steps=args.decode_steps,
            tau_stable=args.tau_stable, tau_sim=args.tau_sim, seed=args.seed, tokens=args.tokens,
            progress=not args.no_progress, model_name=model.name, data_description=desc,
            batch_size=args.batch_size, scoring=method, n_r=getattr(args, "n_r", None),
            copy_steps=args.copy_steps, tau_copy=DEFAULT_TAU_COPY if args.tau_copy is None else args.tau_copy,
        )
        profile.to_json(args.out)
    except HeteroJaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    counts = profile.role_counts()
    total = sum(counts.values())
    if method == "synckv":
        print(f"SyncKV grouping of {model.name}: {profile.num_layers} layers x {profile.num_kv_heads} KV heads, "
              f"{profile.settings.n_clusters} cluster(s) per layer (top_k {profile.settings.top_k}, "
              f"{args.decode_steps} decode steps, {args.samples} x {args.tokens} tokens)")
        print(f"R-heads {counts['pivot']}, NR-heads {counts['satellite']}, singletons (full) {counts['volatile']}")
        print(f"wrote {args.out}")
        return 0
    print(f"profile of {model.name}: {profile.num_layers} layers x {profile.num_kv_heads} KV heads = {total} heads "
          f"(top_k {profile.settings.top_k}, {args.decode_steps} decode steps, {args.samples} x {args.tokens} tokens)")
    print("roles: " + ", ".join(f"{k} {v}" for k, v in counts.items())
          + f" | full {profile.n_full}, compressed {profile.n_compressed}")
    s = profile.settings
    if s.copy_steps:
        import numpy as np

        kept = ", ".join(f"layer {l} head {h} ({profile.copy_score[l, h]:.2f})"
                         for l, h in zip(*np.nonzero(profile.copy_heads())))
        print(f"copy phase: {s.copy_steps} steps; heads with copy score >= {s.tau_copy} (kept whole): "
              + (kept or "none"))
    print(f"wrote {args.out}")
    if args.plot:
        from hetero_jax.profile import plot_profile

        try:
            plot_profile(profile, args.plot)
        except HeteroJaxError as e:  # e.g. its directory removed while calibrating; the profile is written
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}")
    return 0
