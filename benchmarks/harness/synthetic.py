"""Synthetic weights for the latency points beyond a real model's context: a shape's exact config, random weights
drawn on the device, and the head profile that gives HeteroCache its roles there.

- :data:`SYNTHETIC_SHAPES`: the loaded SmolLM2's own shapes, Llama-3.1-8B's, or its attention with a narrow MLP.
- :func:`synthetic_config`, :func:`synthetic_model`: the config and random weights of a shape.
- :func:`reference_dir`, :func:`synthetic_profile`: the roles HeteroCache uses on synthetic weights.
- :func:`make_policies`: one policy per combo, HeteroCache's with that profile.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

MODEL = "smollm2-135m"

# ------------------------------------------------------------------- models
# Shapes the synthetic points can take: the loaded SmolLM2's own, or Llama-3.1-8B's (its published
# config.json fields that fix the cost of a step; meant for a GPU: 16 GB of weights in bfloat16).
SYNTHETIC_SHAPES = {
    MODEL: None,
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
    },
}
# Roles for HeteroCache on a synthetic shape: SmolLM2's shipped profile, or the HeteroCache authors'
# published Llama-3.1-8B-Instruct profile (read from --synthetic-profile or the reference folder).
# Llama-3.1-8B's attention (32 layers, 32 query / 8 KV heads of 128) with a narrow residual stream, MLP and
# vocabulary: what a CPU can run of the per-head structure (HeteroCache's head groups, the authors' roles) that
# sets the step's kernel count on a GPU; the weights' bytes are not Llama's, so the roofline is not either.
SYNTHETIC_SHAPES["llama-3.1-8b-narrow"] = dict(SYNTHETIC_SHAPES["llama-3.1-8b"], hidden_size=256,
                                               intermediate_size=512, vocab_size=1024)
OFFICIAL_PROFILES = {"llama-3.1-8b": "official_profile_llama-3.1-8b-instruct.json",
                     "llama-3.1-8b-narrow": "official_profile_llama-3.1-8b-instruct.json"}
SYNTHETIC_DEFAULT_DTYPE = {MODEL: "float32", "llama-3.1-8b": "bfloat16", "llama-3.1-8b-narrow": "float32"}


def synthetic_config(real_cfg, shape: str, max_positions: int):
    """ModelConfig of a synthetic shape with ``max_position_embeddings`` raised to ``max_positions``."""
    from hetero_jax.model.config import ModelConfig

    cfg = real_cfg if SYNTHETIC_SHAPES[shape] is None else ModelConfig.from_hf_dict(SYNTHETIC_SHAPES[shape])
    return dataclasses.replace(cfg, max_position_embeddings=max(max_positions, cfg.max_position_embeddings))


def synthetic_model(real_model, max_positions: int, seed: int, shape: str = MODEL, dtype: str = "float32"):
    """Random weights with a shape's exact config (``synthetic_config``), made on the default device.

    Each tensor is drawn with ``jax.random`` where it lives (an 8B model never passes through host
    memory): N(0, 0.02^2), norms 1 + N(0, 0.1^2), as ``spec.init_params`` draws them.
    """
    import jax
    import jax.numpy as jnp

    from hetero_jax.model import spec
    from hetero_jax.io.hub import Model

    cfg = synthetic_config(real_model.config if real_model is not None else None, shape, max_positions)
    dt = jnp.dtype(dtype)
    keys = iter(jax.random.split(jax.random.key(seed), 1 + 16 * (cfg.num_layers + 1)))

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def draw(key, shape_, norm):
        x = jax.random.normal(key, shape_, jnp.float32)
        return ((1.0 + 0.1 * x) if norm else 0.02 * x).astype(dt)

    make = lambda name, shp: draw(next(keys), tuple(shp), name.endswith("norm"))  # noqa: E731
    shapes = spec.param_shapes(cfg)
    params = {k: make(k, v) for k, v in shapes.items() if k != "layers"}
    params["layers"] = [{k: make(k, v) for k, v in layer.items()} for layer in shapes["layers"]]
    name = real_model.name if shape == MODEL else shape
    # no tokenizer for another shape's weights drawn without the real model (the timing feeds token ids)
    return Model(config=cfg, params=params, tokenizer=real_model.tokenizer if real_model is not None else None,
                 path="<synthetic>", name=f"{name}-synthetic")


def reference_dir() -> Path | None:
    """Folder with the HeteroCache authors' published profiles: $HETERO_JAX_REFERENCE_DIR, else shared/reference
    beside the repository or beside any folder above it (a git worktree sits deeper than the main checkout)."""
    root = Path(__file__).resolve().parents[2]  # the repository (this file: benchmarks/harness/)
    env = os.environ.get("HETERO_JAX_REFERENCE_DIR")
    for c in ([Path(env)] if env else []) + [d / "shared" / "reference" for d in root.parents]:
        if c.is_dir():
            return c
    return None


def synthetic_profile(shape: str = MODEL, path: Path | None = None):
    """Roles for HeteroCache on synthetic weights of ``shape``, with no weights fingerprint (they fit any weights).

    SmolLM2: the shipped profile. Llama-3.1-8B: the authors' published profile, from ``path`` or
    ``reference_dir()``.
    """
    from hetero_jax.profile import load_profile, shipped_profile_path

    if path is None:
        if shape == MODEL:
            path = Path(shipped_profile_path(MODEL))
        else:
            ref = reference_dir()
            path = ref / OFFICIAL_PROFILES[shape] if ref else None
            if path is None or not path.is_file():
                raise SystemExit(
                    f"HeteroCache on synthetic {shape} weights needs a head profile for that shape: "
                    f"{OFFICIAL_PROFILES[shape]} was not found (looked in $HETERO_JAX_REFERENCE_DIR and "
                    "../shared/reference); pass --synthetic-profile PATH or leave heterocache out of --policies")
    prof = load_profile(path)
    return dataclasses.replace(prof, weights_fingerprint=None)


def make_policies(combos, synthetic_prof=None):
    """One policy per combo; HeteroCache (and its variants) use ``synthetic_prof`` when given (synthetic weights)."""
    from hetero_jax.policies import make_policy, registry_key

    out = []
    for name, rho in combos:
        # the spec's options (``heterocache:copy_window=16``) are kept: they were once dropped here, so a
        # copy-window run timed the default policy under the variant's label
        het = registry_key(name) == "heterocache"
        extra = {"profile": synthetic_prof} if synthetic_prof is not None and het else {}
        out.append(make_policy(name, None if registry_key(name) == "full" else rho, **extra))
    return out


def add_step_arguments(ap, default_length: int = 32768) -> None:
    """The options of a script that decodes a few steps per policy on one synthetic prompt (profile_step.py,
    bench_pipeline.py): --shape, --dtype, --length, --policies, --rho, --seed, --no-compile-cache, --out."""
    from harness.args import policy_spec

    ap.add_argument("--shape", choices=sorted(SYNTHETIC_SHAPES), default=MODEL)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--length", type=int, default=default_length, help="prompt tokens (random ids)")
    ap.add_argument("--policies", nargs="+", default=["full", "heterocache"], type=policy_spec)
    ap.add_argument("--rho", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-compile-cache", action="store_true", help="no persistent XLA compilation cache")
    ap.add_argument("--out", type=Path, required=True, help="JSON written (temporary file, then renamed)")


def step_setup(args, extra_positions: int):
    """(model, HeteroCache's profile or None, prompt ids) for ``add_step_arguments``' options: random weights
    of ``--shape`` with room for ``--length`` + ``extra_positions`` tokens, random prompt ids; turns on the
    persistent compilation cache unless ``--no-compile-cache``."""
    from hetero_jax.policies import registry_key
    import numpy as np

    import hetero_jax

    if not args.no_compile_cache:
        from hetero_jax.cli import enable_compilation_cache

        enable_compilation_cache()
    real = hetero_jax.load(MODEL, dtype="float32", progress=False) if args.shape == MODEL else None
    model = synthetic_model(real, args.length + extra_positions, args.seed, args.shape, args.dtype)
    prof = synthetic_profile(args.shape) if any(registry_key(p) == "heterocache" for p in args.policies) else None
    ids = np.random.default_rng(args.seed).integers(0, model.config.vocab_size, args.length).tolist()
    return model, prof, ids


def run_per_policy(args, argv, name: str, title: str, measure, render, line) -> int:
    """Every ``--policies`` entry in turn: ``measure(policy name, rho)`` -> a row dict; after each, print
    ``line(row)`` and rewrite ``--out`` (JSON: the report header, the rows so far and their markdown under
    ``title`` from ``render(rows)``), so a run cut short keeps what it measured. Prints the markdown at the end."""
    from harness.machine import command_line, machine_info, report_header
    from harness.results import results_header, write_json

    header = report_header(name, vars(args), machine_info())
    rows, md = [], ""
    for p in args.policies:
        rows.append(measure(p, None if p == "full" else args.rho))
        print(line(rows[-1]), flush=True)
        md = "\n".join([results_header(title, header["machine"], header["git"], command_line(argv)), "",
                        render(rows)])
        write_json(args.out, {**header, "rows": rows, "markdown": md})
    print(md)
    return 0
