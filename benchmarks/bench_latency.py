#!/usr/bin/env python
"""Latency per policy and context length: TTFT, decode ms/token percentiles, KV bytes, roofline ratio.

For each context length and each policy (default: full KV, StreamingLLM,
SnapKV and HeteroCache, each compressed one at rho 0.3 and 0.5), batch 1,
greedy, measured through ``generate``'s decode ``Engine``:

- **TTFT**: ``Engine.prefill_seconds`` (the prefill ``GenerationStats``
  reports: layer-major prefill with the policy's selection in every layer,
  HeteroCache's copy of the satellites' KV into the pinned-host reservoir,
  ``finish``; compile time excluded) plus sampling and reading back the first
  token. Every policy gets its own prefill; the prefills of one length run
  round-robin (order rotated per round). The first ``--ttft-warmup`` rounds
  are untimed (eager ops compile there; the jitted functions' compile time is
  excluded anyway); TTFT is the median of the next ``--ttft-repeats`` rounds.
  HeteroCache's permuted weights are made once before any timing (``generate``
  does that on its first call per model and layout).
- **Decode**: the caches of the last round decode in turn, ``--decode-block``
  consecutive steps per policy (order rotated every round) with
  ``Engine.step`` (HeteroCache's drift checks and recalls included). Each block
  ends with ``Engine.drain()``, whose wait counts in the block's last step, so
  a policy's times hold all its own asynchronous work and none of another's.
  Stepping the policies one step each in turn (as this script did before)
  timed one policy's background drift check as the next policy's step on a
  shared CPU. The first ``--warmup-steps`` steps per policy are untimed, the
  next ``--decode-steps`` are timed (wall time incl. reading the token back;
  compile time excluded). Mean / P50 / P95 / P99 ms per token; the ratio to
  full KV divides by full KV's value from the same interleaved blocks.
- **Roofline ratio**: (weight bytes + KV bytes one decode step reads with the
  policy) / (weight bytes + KV bytes with full KV). Weight bytes = every
  parameter once, except the embedding table, of which the token's gather
  reads one row; the lm_head is read in full (SmolLM2 ties it to the
  embedding table). KV bytes = the device KV the step attends: the row pool as
  allocated (every head's kept prompt rows plus its rows for added tokens).
  Printed beside each measured ratio with measured / roofline and whether that
  is within 10 %.
- **KV bytes** (device, host) and **recall trigger rate** (HeteroCache: drift
  checks that triggered / drift checks, over the timed steps) as
  ``Engine.stats_fields()`` reports them.

Weights: the real SmolLM2-135M (float32) for ``--real-lengths`` (default
1K, 2K, 4K and 7900 tokens: "8K" inside the 8192-token context; prompts are
the first N tokens of the pydoc corpus of ``benchmarks/haystack.py``, raw
text). ``--synthetic-lengths`` (default 16K, 32K) are beyond that context:
they use **synthetic** random weights with SmolLM2's exact shapes
(``hetero_jax.model.spec.init_params``, ``max_position_embeddings`` raised) and
random token ids, labelled "synthetic" in the JSON, table and plot; there
HeteroCache uses the shipped SmolLM2 profile's roles with its weights
fingerprint removed (roles calibrated on the real weights, applied to random
ones: the cost structure is right, what is kept is not meaningful).
``--synthetic-shape llama-3.1-8b`` gives the synthetic points Llama-3.1-8B's
shapes instead (32 layers, 32 query / 8 KV heads of 128, untied 128K vocab;
bfloat16 by default: 16 GB of weights, drawn on the device), with HeteroCache's
roles from the HeteroCache authors' published Llama-3.1-8B-Instruct profile
(``--synthetic-profile``, default ``../shared/reference``). That is for a GPU:
``--preset llama8b-gpu`` runs 16K to 128K with full KV, SnapKV and HeteroCache
at rho 0.3 (the ``latency-llama8b-gpu`` section). Not on a CPU: XLA's CPU backend
converts the bfloat16 weights to float32 for the decode step's matmuls, 30 GB.
``--synthetic-shape llama-3.1-8b-narrow`` keeps Llama-3.1-8B's attention heads and layers (and the authors'
roles) with a narrow MLP and vocabulary, float32: HeteroCache's per-head structure at a size a CPU runs
(``--preset llama8b-narrow-cpu``, 2K tokens, about 3 min).

Cost: prefill dominates long contexts (one per policy and round: 7 policies x
3 rounds (1 untimed) per length by default). On a 2-core CPU SmolLM2's full-KV prefill
takes about 90 s at 7900 tokens, 5.3 min at 16K and 22 min at 32K (measured,
synthetic weights), so the default grid's 16K and 32K points take hours there;
``--preset long`` (those two lengths, full KV and HeteroCache at rho 0.3, one
round) takes about 15 min (4fb7e81); ``--preset long-copy-window`` the same with
HeteroCache's opt-in copy window. ``--preset cpu`` (real 1K and 2K,
synthetic 2K, rho 0.3 only, 32 timed steps) is the small configuration that
``make bench`` runs: 5 to 7 min on 2 shared cores (warm / cold XLA cache).

Outputs: ``--out`` JSON (full config, machine, commit, every sample), a PNG
beside it, a markdown table on stdout, and with ``--write-results`` the
``latency`` section of ``benchmarks/RESULTS.md`` (with the HeteroCache rho 0.3
targets at the longest context: MET / NOT MET).

    .venv/bin/python benchmarks/bench_latency.py --write-results          # full grid (long)
    .venv/bin/python benchmarks/bench_latency.py --preset cpu             # make bench
    .venv/bin/python benchmarks/bench_latency.py --real-lengths 512 --synthetic-lengths \\
        --policies full heterocache --budgets 0.3 --decode-steps 8        # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (benchmarks/common.py)
import haystack  # noqa: E402  (benchmarks/haystack.py)

SECTION = "latency"
MODEL = "smollm2-135m"
DEFAULT_REAL_LENGTHS = (1024, 2048, 4096, 7900)
DEFAULT_SYNTHETIC_LENGTHS = (16384, 32768)
DEFAULT_POLICIES = ("full", "streamingllm", "snapkv", "heterocache")
DEFAULT_BUDGETS = (0.3, 0.5)
ROOFLINE_TOLERANCE = 0.10  # measured / roofline decode ratio within 10 %
TTFT_TARGET = 1.05  # HeteroCache rho 0.3 TTFT at most 5 % above full KV's
TAIL_TARGET = 1.5  # HeteroCache rho 0.3 decode P99 / P50
TARGET_POLICY, TARGET_RHO = "heterocache", 0.3
MiB = 2**20

# --preset NAME sets these defaults (explicit flags still win).
PRESETS = {
    # synthetic at 2048 too: beside the real 2048 row it shows that random weights time like real ones
    "cpu": dict(real_lengths=[1024, 2048], synthetic_lengths=[2048], budgets=[0.3], decode_steps=32,
                warmup_steps=6, ttft_warmup=1, ttft_repeats=1),
    # the synthetic long contexts alone (section latency-long), sized for a 2-core CPU: one 32K prefill takes
    # tens of minutes there, so one timed round and no untimed one (the jitted functions' compile is excluded
    # anyway; the eager ops' compile is seconds against minutes of prefill). 128 timed steps, the script's
    # default: over 64 the P99 is the slowest step interpolated with the next (one stray step decided it)
    "long": dict(real_lengths=[], synthetic_lengths=[16384, 32768], policies=["full", "heterocache"], budgets=[0.3],
                 decode_steps=128, warmup_steps=8, ttft_warmup=0, ttft_repeats=1),
    # the opt-in copy window at the same long contexts (section latency-long-copy-window)
    "long-copy-window": dict(real_lengths=[], synthetic_lengths=[16384, 32768],
                             policies=["full", "heterocache:copy_window=16"], budgets=[0.3], decode_steps=128,
                             warmup_steps=8, ttft_warmup=0, ttft_repeats=1),
    # issue 17: decode-time retrieval (Quest in-device and offloaded, FreeKV) beside full KV, SnapKV and
    # HeteroCache on the real model; the roofline counts the bytes a step reads, host fetches included
    "issue17": dict(real_lengths=[2048, 4096], synthetic_lengths=[],
                    policies=["full", "snapkv", "heterocache", "quest", "quest:offload=true", "freekv"],
                    budgets=[0.3], decode_steps=32, warmup_steps=6, ttft_warmup=1, ttft_repeats=1),
    # issue 36: decode-time retrieval without a host round trip in the step (FreeKV, offloaded Quest) and
    # HCAttention's host sums, beside in-device Quest and full KV; HCAttention runs at 0.5 only (its operating point)
    "issue36": dict(real_lengths=[2048, 4096], synthetic_lengths=[],
                    policies=["full", "quest", "quest:offload=true", "freekv", "hcattention"],
                    budgets=[0.3, 0.5], decode_steps=32, warmup_steps=6, ttft_warmup=1, ttft_repeats=1),
    # Llama-3.1-8B shapes to 128K, for one GPU (bfloat16: 16 GB of weights, 16 GB of full KV at 128K)
    "llama8b-gpu": dict(real_lengths=[], synthetic_lengths=[16384, 32768, 65536, 131072], synthetic_shape="llama-3.1-8b",
                        policies=["full", "snapkv", "heterocache"], budgets=[0.3], decode_steps=64, warmup_steps=8,
                        ttft_warmup=1, ttft_repeats=1),
    # Llama-3.1-8B's heads and the authors' profile on a CPU (narrow MLP): HeteroCache's per-head structure
    "llama8b-narrow-cpu": dict(real_lengths=[], synthetic_lengths=[2048], synthetic_shape="llama-3.1-8b-narrow",
                               policies=["full", "snapkv", "heterocache"], budgets=[0.3], decode_steps=48,
                               warmup_steps=6, ttft_warmup=1, ttft_repeats=1),
    # issue 18: the three peers beside full KV and HeteroCache at rho 0.5 (the budget all of them reach on SmolLM2)
    "issue18-peers": dict(real_lengths=[2048, 4096], synthetic_lengths=[],
                          policies=["full", "heterocache", "contextkeeper", "synckv", "hcattention"],
                          budgets=[0.5], decode_steps=32, warmup_steps=6, ttft_warmup=1, ttft_repeats=1),
}


# ----------------------------------------------------------------- metrics
def weight_bytes_per_token(param_bytes: int, embed_bytes: int, vocab_size: int, tied_embeddings: bool) -> int:
    """Weight bytes one decode token reads.

    Every parameter once, except the embedding table [V, H], of which the
    token's gather reads one row; the lm_head is read in full (with tied
    embeddings that is the embedding table again; an untied lm_head is
    already inside ``param_bytes``).
    """
    row = embed_bytes // vocab_size
    lm_head = embed_bytes if tied_embeddings else 0
    return param_bytes - embed_bytes + row + lm_head


def model_weight_bytes(params, cfg) -> int:
    """:func:`weight_bytes_per_token` of a params pytree (spec.py layout)."""
    import jax

    total = int(sum(x.nbytes for x in jax.tree.leaves(params)))
    return weight_bytes_per_token(total, int(params["embed"].nbytes), cfg.vocab_size, cfg.tie_word_embeddings)


def roofline_ratio(weight_bytes: float, kv_bytes_policy: float, kv_bytes_full: float) -> float:
    """Bandwidth-bound decode time of a policy over full KV's: (W + KV_policy) / (W + KV_full)."""
    return (weight_bytes + kv_bytes_policy) / (weight_bytes + kv_bytes_full)


def within_tolerance(measured_ratio: float, roofline: float, tol: float = ROOFLINE_TOLERANCE) -> bool:
    """True when measured / roofline is within ``tol`` of 1 (False for NaN)."""
    r = measured_ratio / roofline
    return bool(math.isfinite(r) and abs(r - 1.0) <= tol)


def timing_summary(seconds) -> dict:
    """Per-step wall times (s) -> mean / P50 / P95 / P99 in ms (numpy's linear percentiles), P99/P50, n."""
    import numpy as np

    ms = 1e3 * np.asarray(seconds, np.float64)
    if ms.size == 0:
        nan = float("nan")
        return {"mean_ms": nan, "p50_ms": nan, "p95_ms": nan, "p99_ms": nan, "p99_over_p50": nan, "n": 0}
    p50, p95, p99 = (float(v) for v in np.percentile(ms, [50, 95, 99]))
    return {"mean_ms": float(ms.mean()), "p50_ms": p50, "p95_ms": p95, "p99_ms": p99,
            "p99_over_p50": p99 / p50 if p50 > 0 else float("nan"), "n": int(ms.size)}


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
    """Folder with the HeteroCache authors' published profiles: $HETERO_JAX_REFERENCE_DIR or ../shared/reference."""
    root = Path(__file__).resolve().parents[1]
    for c in (os.environ.get("HETERO_JAX_REFERENCE_DIR"), root.parent / "shared" / "reference"):
        if c and Path(c).is_dir():
            return Path(c)
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
    from hetero_jax.policies import make_policy

    out = []
    for name, rho in combos:
        # the spec's options (``heterocache:copy_window=16``) are kept: they were once dropped here, so a
        # copy-window run timed the default policy under the variant's label
        extra = {"profile": synthetic_prof} if synthetic_prof is not None and name.startswith("heterocache") else {}
        out.append(make_policy(name, None if name == "full" else rho, **extra))
    return out


# ------------------------------------------------------------- one length


def measure_length(model, ids: list[int], combos, policies, args, bar=None, note=None) -> tuple[list[dict], dict]:
    """TTFT rounds, then interleaved decode, for every policy on one prompt. One dict per combo."""
    import gc

    from hetero_jax import runtime as G
    from hetero_jax.model import layout as LY

    cfg = model.config
    n = len(combos)
    steps_total = args.warmup_steps + args.decode_steps
    tail_capacity = G.tail_capacity_for(steps_total + 1)
    bound = [G.bind_policy(model, p) for p in policies]
    for p in bound:  # budget errors before any compute; HeteroCache's permuted weights made before timing
        p.make_prefill(cfg, [len(ids)])
        LY.params_for(model, p.layout(cfg))

    def status(text):
        if bar is not None:
            bar.set_postfix_str(f"{note}: {text}" if note else text)

    # --- TTFT: one prefill per policy per round, round-robin
    engines = [None] * n
    ttft = [[] for _ in range(n)]
    ttft_warm = [[] for _ in range(n)]
    prefill_s = [[] for _ in range(n)]
    compile_s = [0.0] * n
    rounds = args.ttft_warmup + args.ttft_repeats
    for rnd in range(rounds):
        for j in range(n):
            i = (rnd + j) % n
            status(f"prefill round {rnd + 1}/{rounds}, {common.combo_label(*combos[i])}")
            engines[i] = None  # free the previous round's cache first
            gc.collect()
            c0 = G.compile_seconds()
            e = G.Engine(model, [ids], bound[i], tail_capacity=tail_capacity)
            t0 = time.perf_counter()
            e.first_tokens(0.0, 1.0)
            first_s = time.perf_counter() - t0
            compile_s[i] += G.compile_seconds() - c0
            (ttft if rnd >= args.ttft_warmup else ttft_warm)[i].append(e.prefill_seconds + first_s)
            prefill_s[i].append(e.prefill_seconds)
            engines[i] = e
    after_prefill = [common.engine_kv_stats(e) for e in engines]

    # --- decode: blocks of consecutive steps per policy, order rotated every round. A block ends by
    # waiting for the policy's asynchronous work (HeteroCache's drift checks), counted in the block's last
    # step: a policy's times hold its own background work, as a user running it alone sees it, and none of
    # another policy's (which a step-by-step round-robin on shared cores would time as the next step's)
    toks = [int(e.first_tokens(0.0, 1.0)[0]) for e in engines]
    times: list[list[float]] = [[] for _ in range(n)]
    step_ids: list[list[int]] = [[] for _ in range(n)]  # each timed step's index (recall steps are told apart)
    recall_at_timing = [None] * n
    done = [0] * n
    c1 = G.compile_seconds()
    rnd = 0
    while min(done) < steps_total:
        for j in range(n):
            i = (rnd + j) % n
            for _ in range(min(args.decode_block, steps_total - done[i])):
                if done[i] == args.warmup_steps:
                    recall_at_timing[i] = common.engine_kv_stats(engines[i])["recall"]
                step_id = engines[i].steps
                nxt, seconds = engines[i].step([toks[i]], 0.0, 1.0)  # compile time excluded by Engine.step
                if done[i] >= args.warmup_steps:
                    times[i].append(seconds)
                    step_ids[i].append(step_id)
                toks[i] = int(nxt[0])
                done[i] += 1
            waited = engines[i].drain()
            if done[i] > args.warmup_steps:
                times[i][-1] += waited
        rnd += 1
        status(f"decode step {min(done)}/{steps_total} x {n} policies")
    decode_compile = G.compile_seconds() - c1
    final = [common.engine_kv_stats(e) for e in engines]
    recall_at = [set(getattr(e.state, "recall_steps", ())) for e in engines]  # steps that applied a recall
    del engines
    gc.collect()

    results = []
    for i, (name, rho) in enumerate(combos):
        r0, r1 = recall_at_timing[i] or {}, final[i]["recall"]
        checks = r1.get("drift_checks", 0) - r0.get("drift_checks", 0)
        trig = r1.get("drift_triggers", 0) - r0.get("drift_triggers", 0)
        results.append({
            "policy": name, "rho": rho, "label": common.combo_label(name, rho), "policy_repr": repr(bound[i]),
            **final[i],
            "kv_after_prefill": after_prefill[i],
            "ttft_seconds": ttft[i], "ttft_warmup_seconds": ttft_warm[i], "prefill_seconds": prefill_s[i],
            "ttft_median_seconds": statistics.median(ttft[i]),
            "compile_seconds_prefill": compile_s[i],
            "decode_seconds": times[i],
            "decode": timing_summary(times[i]),
            "decode_step_ids": step_ids[i],
            # HeteroCache: the steps that applied a recall and the others, apart
            "decode_plain": timing_summary([t for t, k in zip(times[i], step_ids[i]) if k not in recall_at[i]]),
            "decode_recall": timing_summary([t for t, k in zip(times[i], step_ids[i]) if k in recall_at[i]])
            if recall_at[i] & set(step_ids[i]) else None,
            "timed_drift_checks": checks, "timed_drift_triggers": trig,
            "timed_trigger_rate": trig / checks if checks else None,
            "timed_recalls": r1.get("recalls", 0) - r0.get("recalls", 0),
        })
    meta = {"tail_capacity": tail_capacity, "decode_compile_seconds": decode_compile,
            "prompt_tokens": len(ids)}
    return results, meta


def add_ratios(rows: list[dict], weight_bytes: int) -> None:
    """Ratios to full KV (same length) and the roofline ratio, in place. rows: one length's results."""
    full = next((r for r in rows if r["policy"] == "full"), None)
    for r in rows:
        if full is None:
            r.update(decode_ratio_p50=float("nan"), decode_ratio_mean=float("nan"), ttft_ratio=float("nan"),
                     roofline_ratio=float("nan"), measured_over_roofline=float("nan"), within_10pct=False)
            continue
        ratio_p50 = r["decode"]["p50_ms"] / full["decode"]["p50_ms"]
        roof = roofline_ratio(weight_bytes, r["kv_bytes_read_per_step"], full["kv_bytes_read_per_step"])
        r.update(
            decode_ratio_p50=ratio_p50,
            decode_ratio_mean=r["decode"]["mean_ms"] / full["decode"]["mean_ms"],
            ttft_ratio=r["ttft_median_seconds"] / full["ttft_median_seconds"],
            roofline_ratio=roof,
            measured_over_roofline=ratio_p50 / roof,
            within_10pct=within_tolerance(ratio_p50, roof),
        )


def add_fitted(runs: list[dict]) -> None:
    """The step model fitted to full KV, in place: per weights kind with full KV at two or more lengths,
    P50 = c0 + c1 x (KV bytes a step reads), least squares over full KV's rows; each row then gets the time
    the model gives its own bytes (``fitted_ms``), its ratio to full KV's P50 (``fitted_ratio``) and its
    P50 over that time (``measured_over_fitted``). The roofline ratio (bytes) assumes that a byte of weights
    and a byte of KV cost the same; a step also has costs that move with neither (dispatch, small ops,
    sampling), and on a CPU the pool kernel reads KV faster per byte than the rest of the step runs, so the
    byte ratio understates every compressing policy's share of the fixed cost. The fitted model measures
    what the roofline means (does a policy cost what its bytes cost?) with this machine's own prices."""
    for kind in {r["weights"] for r in runs}:
        full = [r for r in runs if r["weights"] == kind and r["policy"] == "full"]
        if len({r["length"] for r in full}) < 2:
            continue
        x = [float(r["kv_bytes_read_per_step"]) for r in full]
        y = [float(r["decode"]["p50_ms"]) for r in full]
        n, mx, my = len(x), sum(x) / len(x), sum(y) / len(y)
        c1 = sum((a - mx) * (b - my) for a, b in zip(x, y)) / max(sum((a - mx) ** 2 for a in x), 1e-30)
        c0 = my - c1 * mx
        full_p50 = {r["length"]: r["decode"]["p50_ms"] for r in full}
        for r in runs:
            if r["weights"] != kind or r["length"] not in full_p50:
                continue
            fitted = c0 + c1 * float(r["kv_bytes_read_per_step"])
            r.update(fitted_ms=fitted, fitted_ratio=fitted / full_p50[r["length"]],
                     measured_over_fitted=r["decode"]["p50_ms"] / fitted,
                     fit={"fixed_ms": c0, "ms_per_mib": c1 * MiB, "points": n})


# ------------------------------------------------------------------- targets
def target_check(runs: list[dict]) -> dict:
    """HeteroCache rho 0.3 at the longest context measured: the three targets, each met or not."""
    cands = [r for r in runs if r["policy"] == TARGET_POLICY and abs(r["rho"] - TARGET_RHO) < 1e-9]
    if not cands:
        return {"measured": False}
    r = max(cands, key=lambda r: r["length"])
    ratio_ok = bool(r["within_10pct"])
    ttft_ok = bool(math.isfinite(r["ttft_ratio"]) and r["ttft_ratio"] <= TTFT_TARGET)
    tail = r["decode"]["p99_over_p50"]
    tail_ok = bool(math.isfinite(tail) and tail <= TAIL_TARGET)
    return {
        "measured": True, "length": r["length"], "weights": r["weights"], "label": r["label"],
        "fitted_ratio": r.get("fitted_ratio"), "measured_over_fitted": r.get("measured_over_fitted"),
        "fit": r.get("fit"),
        "decode_ratio_p50": r["decode_ratio_p50"], "roofline_ratio": r["roofline_ratio"],
        "measured_over_roofline": r["measured_over_roofline"], "decode_within_10pct_of_roofline": ratio_ok,
        "ttft_ratio": r["ttft_ratio"], "ttft_at_most_5pct_above_full": ttft_ok,
        "p99_over_p50": tail, "p99_over_p50_at_most_1_5": tail_ok,
        "all_met": ratio_ok and ttft_ok and tail_ok,
    }


def met(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


# --------------------------------------------------------------------- run
def run(args) -> dict:
    import numpy as np
    from tqdm import tqdm

    import hetero_jax

    if not args.no_compile_cache:
        from hetero_jax.cli import enable_compilation_cache

        enable_compilation_cache()
    combos = common.make_combos(args.policies, args.budgets)
    t_start = time.perf_counter()
    # Another shape's synthetic points alone need no real model (a GPU machine may not have the embedded GGUF)
    need_real = bool(args.real_lengths) or args.synthetic_shape == MODEL
    real = hetero_jax.load(args.model, dtype="float32", progress=False) if need_real else None
    load_s = time.perf_counter() - t_start
    steps_total = args.warmup_steps + args.decode_steps + 1
    synth_prof = None
    if args.synthetic_lengths and any(n.startswith("heterocache") for n, _ in combos):  # a missing profile fails first
        synth_prof = synthetic_profile(args.synthetic_shape, args.synthetic_profile)
        synth_prof.check_compatible(synthetic_config(real.config if real is not None else None,
                                                     args.synthetic_shape, 0))
    ctx = real.config.max_position_embeddings if real is not None else None
    for L in args.real_lengths:
        if L + steps_total > ctx:
            raise SystemExit(f"real length {L} + {steps_total} decode tokens exceeds SmolLM2's {ctx}-token context; "
                             f"use at most {ctx - steps_total} (or --synthetic-lengths)")
    corpus = real.tokenizer.encode_prompt(haystack.pydoc_corpus(), chat=False) if args.real_lengths else []
    if args.real_lengths and max(args.real_lengths) > len(corpus):
        raise SystemExit(f"the pydoc corpus has {len(corpus)} tokens; --real-lengths must not exceed it")

    machine = common.machine_info()
    config = {
        "model": args.model, "dtype": "float32", "batch": 1, "temperature": 0.0,
        "synthetic_shape": args.synthetic_shape, "synthetic_dtype": args.synthetic_dtype,
        "synthetic_profile": synth_prof.model_name if synth_prof is not None else None,
        "real_lengths": args.real_lengths, "synthetic_lengths": args.synthetic_lengths,
        "policies": list(dict.fromkeys(n for n, _ in combos)), "budgets": args.budgets,
        "combos": [common.combo_label(n, r) for n, r in combos],
        "decode_steps": args.decode_steps, "warmup_steps": args.warmup_steps,
        "ttft_warmup": args.ttft_warmup, "ttft_repeats": args.ttft_repeats,
        "seed": args.seed, "preset": args.preset, "compile_cache": not args.no_compile_cache,
        "real_prompts": "first N tokens of benchmarks/haystack.py pydoc_corpus(), "
                        "tokenizer.encode_prompt(text, chat=False) (raw text)",
        "synthetic": f"random {args.synthetic_dtype} weights with {args.synthetic_shape}'s shapes (jax.random "
                     "per tensor from key(seed): N(0, 0.02^2), norms 1 + N(0, 0.1^2)), max_position_embeddings "
                     "raised; random token ids (numpy default_rng(seed)); HeteroCache: "
                     + ("the shipped SmolLM2 profile's" if args.synthetic_shape == MODEL else
                        "the HeteroCache authors' published profile's") + " roles, weights fingerprint removed",
        "ttft": "Engine.prefill_seconds (prefill + policy selection + HeteroCache reservoir copy + finish, "
                "compile excluded) + first-token sampling and read-back; one prefill per policy per round, "
                "round-robin; median of the timed rounds",
        "decode_timing": "blocks of decode_block consecutive steps per policy, order rotated per round, each "
                         "block ending with Engine.drain() counted in its last step; warm-up steps untimed; "
                         "wall time per Engine.step incl. token read-back, compile excluded",
        "decode_block": args.decode_block,
        "roofline": "(weight bytes + policy's KV bytes read per step) / (weight bytes + full KV's); bytes read = "
                    "device K/V + index arrays, for Quest the attended rows only, host fetches counted twice; "
                    "weight bytes = all params, embedding counted one row, lm_head (tied) in full; "
                    "device KV bytes = the row pool as allocated (kept prompt rows + each head's tail rows)",
        "roofline_tolerance": ROOFLINE_TOLERANCE,
        "out": str(args.out), "plot": str(args.plot),
    }
    payload = common.report_header(SECTION, config, machine)
    payload["load_seconds"] = load_s
    payload["lengths"] = []
    payload["runs"] = runs = []
    payload["refused"] = {}  # label -> {length: the budget error}: a policy that cannot run a length is left out

    points = [(L, "real") for L in args.real_lengths] + [(L, "synthetic") for L in args.synthetic_lengths]
    bar = tqdm(total=len(points), desc="latency", unit="length", dynamic_ncols=True, disable=args.no_progress)
    synth = None
    for L, weights in points:
        if weights == "real":
            model, ids = real, corpus[:L]
        else:
            if synth is None:
                synth = synthetic_model(real, max(args.synthetic_lengths) + steps_total, args.seed,
                                        args.synthetic_shape, args.synthetic_dtype)
                real = None  # free the real weights (the tokenizer lives on in synth)
            model = synth
            ids = np.random.default_rng(args.seed).integers(0, model.config.vocab_size, L).tolist()
        bar.set_description(f"{L} tok ({weights})")
        policies = make_policies(combos, synth_prof if weights == "synthetic" else None)
        labels = [common.combo_label(*c) for c in combos]
        refused = common.refused_by_length(model, labels, policies, [L])
        for lab, errs in refused.items():
            payload["refused"].setdefault(lab, {}).update(errs)
        keep = [i for i, lab in enumerate(labels) if lab not in refused]
        wb = model_weight_bytes(model.params, model.config)
        t0 = time.perf_counter()
        res, meta = measure_length(model, ids, [combos[i] for i in keep], [policies[i] for i in keep], args,
                                   bar=bar, note=f"{L} {weights}")
        for r in res:
            r.update(length=L, weights=weights)
        add_ratios(res, wb)
        runs.extend(res)
        payload["lengths"].append({"length": L, "weights": weights, "weight_bytes_per_token": wb,
                                   "max_position_embeddings": model.config.max_position_embeddings,
                                   "seconds": time.perf_counter() - t0, **meta})
        tqdm.write(length_report(res, L, weights))
        bar.update(1)
    bar.close()
    add_fitted(runs)
    payload["targets"] = target_check(runs)
    payload["total_seconds"] = time.perf_counter() - t_start
    payload["peak_rss_bytes"] = common.peak_rss_bytes()
    return payload


# ------------------------------------------------------------------ report
def model_label(cfg: dict) -> str:
    """The model a run timed: the real one, or '<shape> (synthetic)' when every point is another shape's."""
    shape = cfg.get("synthetic_shape", MODEL)
    if shape != MODEL and cfg.get("synthetic_lengths") and not cfg.get("real_lengths"):
        return f"{shape} (synthetic)"
    return cfg["model"]


def dtype_label(cfg: dict) -> str:
    dts = ([cfg["dtype"]] if cfg.get("real_lengths") else []) + \
          ([cfg.get("synthetic_dtype", "float32")] if cfg.get("synthetic_lengths") else [])
    return " / ".join(dict.fromkeys(dts)) or cfg["dtype"]


def ctx_label(length: int, weights: str) -> str:
    return f"{length:,}" + (" (synthetic)" if weights == "synthetic" else "")


def length_report(rows: list[dict], length: int, weights: str) -> str:
    """A few lines per length for the console: decode ratio beside its roofline."""
    lines = [f"[{ctx_label(length, weights)}]"]
    for r in rows:
        d = r["decode"]
        lines.append(
            f"  {r['label']:<16} TTFT {r['ttft_median_seconds']:7.2f} s ({r['ttft_ratio']:.2f}x) | decode P50 "
            f"{d['p50_ms']:6.1f} ms P99/P50 {d['p99_over_p50']:.2f} | ratio {r['decode_ratio_p50']:.2f} vs roofline "
            f"{r['roofline_ratio']:.2f} -> {r['measured_over_roofline']:.2f} "
            f"({'within' if r['within_10pct'] else 'outside'} 10 %)")
        if r.get("decode_recall"):
            lines.append(f"  {'':<16} plain steps P50 {r['decode_plain']['p50_ms']:.1f} ms ({r['decode_plain']['n']}), "
                         f"recall steps P50 {r['decode_recall']['p50_ms']:.1f} ms ({r['decode_recall']['n']}), "
                         f"{_trigger_text(r)}")
    return "\n".join(lines)


def _trigger_text(r: dict) -> str:
    if not r.get("timed_drift_checks"):
        return "—"
    return f"{r['timed_trigger_rate']:.0%} of {r['timed_drift_checks']} ({r['timed_recalls']} recalls)"


def results_table(runs: list[dict]) -> str:
    headers = ["context tok", "weights", "policy", "rho", "achieved rho", "TTFT s", "TTFT vs full",
               "decode ms mean", "P50", "P95", "P99", "P99/P50", "KV device MiB", "KV host MiB",
               "decode vs full (P50)", "roofline ratio", "measured / roofline", "within 10 %",
               "fitted ratio", "measured / fitted", "recall triggers"]
    rows = []
    for r in runs:
        d = r["decode"]
        rows.append([
            common.fmt_num(r["length"]), r["weights"], r["policy"], "—" if r["policy"] == "full" else f"{r['rho']:g}",
            common.fmt_num(r["achieved_rho"], 3), common.fmt_num(r["ttft_median_seconds"], 2),
            common.fmt_num(r["ttft_ratio"], 3), common.fmt_num(d["mean_ms"], 1), common.fmt_num(d["p50_ms"], 1),
            common.fmt_num(d["p95_ms"], 1), common.fmt_num(d["p99_ms"], 1), common.fmt_num(d["p99_over_p50"], 2),
            common.fmt_num(r["kv_bytes_device"] / MiB, 1), common.fmt_num(r["kv_bytes_host"] / MiB, 1),
            common.fmt_num(r["decode_ratio_p50"], 2), common.fmt_num(r["roofline_ratio"], 2),
            common.fmt_num(r["measured_over_roofline"], 2), "yes" if r["within_10pct"] else "no",
            common.fmt_num(r.get("fitted_ratio"), 2), common.fmt_num(r.get("measured_over_fitted"), 2),
            _trigger_text(r),
        ])
    return common.markdown_table(headers, rows, align="rllrrrrrrrrrrrrrrcrrl")


def targets_text(t: dict) -> str:
    if not t.get("measured"):
        return f"Targets (HeteroCache rho {TARGET_RHO:g} at the longest context): **not measured** in this run."
    return "\n".join([
        f"Targets for HeteroCache rho {TARGET_RHO:g} at the longest context measured "
        f"({ctx_label(t['length'], t['weights'])} tokens):",
        "",
        f"- decode ratio to full KV within 10 % of the roofline ratio: measured {t['decode_ratio_p50']:.3f} vs "
        f"roofline {t['roofline_ratio']:.3f} (x{t['measured_over_roofline']:.3f}) — "
        f"**{met(t['decode_within_10pct_of_roofline'])}**",
        f"- TTFT at most 5 % above full KV: {t['ttft_ratio']:.3f}x full KV's — "
        f"**{met(t['ttft_at_most_5pct_above_full'])}**",
        f"- decode P99/P50 at most {TAIL_TARGET:g}: {t['p99_over_p50']:.2f} — "
        f"**{met(t['p99_over_p50_at_most_1_5'])}**",
    ] + ([
        "",
        f"Beside the roofline (not a target): the step model fitted to full KV in this run "
        f"(P50 = {t['fit']['fixed_ms']:.1f} ms + {t['fit']['ms_per_mib']:.4f} ms per MiB read, "
        f"{t['fit']['points']} lengths) gives HeteroCache's bytes a ratio of {t['fitted_ratio']:.3f}: "
        f"measured x{t['measured_over_fitted']:.3f} of it.",
    ] if t.get("fit") else []))


def warmup_text(cfg: dict) -> str:
    """The untimed TTFT rounds, per length where merged runs differ."""
    per = cfg.get("ttft_warmup_per_length") or {}
    if len(set(per.values())) > 1:
        return "untimed round(s) " + ", ".join(f"{int(k):,}: {v}" for k, v in per.items())
    return f"{cfg['ttft_warmup']} untimed round(s)"


def results_section(payload: dict, plot_rel: str | None) -> str:
    cfg = payload["config"]
    synth = [x for x in payload["lengths"] if x["weights"] == "synthetic"]
    real_ctx = next((x["max_position_embeddings"] for x in payload["lengths"] if x["weights"] == "real"), None)
    shape = cfg.get("synthetic_shape", MODEL)
    per_kind: dict[str, int] = {}
    for x in payload["lengths"]:
        per_kind.setdefault(x["weights"], x["weight_bytes_per_token"])
    weight_text = ", ".join(f"{v / MiB:,.1f} MiB per token with the {k} weights" for k, v in per_kind.items())
    synth_text = ""
    if synth:
        beyond = real_ctx is None or all(x["length"] > real_ctx for x in synth)
        roles = ("the shipped SmolLM2 profile's roles" if shape == MODEL else
                 f"the roles of the HeteroCache authors' published profile ({cfg.get('synthetic_profile')})")
        synth_text = (
            "**Synthetic** rows" + (" (beyond the real model's context)" if beyond else
                                     " (at lengths the real weights cover too, to compare their timings)")
            + f": random {cfg.get('synthetic_dtype', 'float32')} weights with {shape}'s exact shapes (seed "
            f"{cfg['seed']}; `max_position_embeddings` {synth[0]['max_position_embeddings']}) and random token "
            f"ids; HeteroCache there uses {roles} with the weights fingerprint removed, so its timings are "
            "meaningful and what it keeps is not. ")
    lines = [
        common.section_header(f"Latency: {model_label(cfg)} TTFT and decode per policy and context", payload),
        "",
        f"Batch 1, greedy, {dtype_label(cfg)}. Real weights: prompts are the first N tokens of the pydoc corpus "
        "(`benchmarks/haystack.py`, raw text). "
        + synth_text
        + f"TTFT = prefill as `GenerationStats` reports it (policy selection in every layer and HeteroCache's "
        f"pinned-host reservoir copy included, compile excluded) + sampling and reading back the first token; "
        f"each policy has its own prefill, round-robin, {warmup_text(cfg)} then the median of "
        f"{cfg['ttft_repeats']}. Decode: the policies' caches of one length take turns in blocks of "
        f"{cfg.get('decode_block', 1)} consecutive steps, order rotated every round, each block ending by waiting for "
        f"the policy's own asynchronous work (counted in its last step), {cfg['warmup_steps']} untimed then "
        f"{cfg['decode_steps']} timed steps each (`Engine.step`, HeteroCache's drift checks and recalls included; "
        f"wall time incl. token read-back). 'decode vs full' = P50 over full KV's P50 from the same rounds. Roofline ratio = (weight bytes + the policy's device KV "
        f"bytes) / (weight bytes + full KV's), weight bytes = all parameters with the embedding counted as one "
        f"row and the lm_head in full ({weight_text}), device KV = the row pool as allocated: every head's kept "
        f"prompt rows + its rows for added tokens ({payload['lengths'][0]['tail_capacity']} per head). 'within 10 %': "
        f"measured / roofline in [0.9, 1.1]. Fitted ratio: the time the step model fitted to full KV's P50 at this "
        f"run's lengths (fixed ms + ms per MiB read) gives the policy's bytes, over full KV's P50; measured / fitted: "
        f"the policy's P50 over that time (see the note under the targets). Recall triggers: HeteroCache drift "
        f"checks that triggered during the timed steps.",
        "",
        results_table(payload["runs"]),
        "",
        targets_text(payload["targets"]),
    ]
    apart = [r for r in payload["runs"] if r.get("decode_recall")]
    if apart:
        lines += ["", "Steps that applied a recall and the others, apart (P50, steps):", ""]
        lines += [f"- {ctx_label(r['length'], r['weights'])}, {r['label']}: plain {r['decode_plain']['p50_ms']:.1f} ms "
                  f"({r['decode_plain']['n']}), recall {r['decode_recall']['p50_ms']:.1f} ms "
                  f"({r['decode_recall']['n']}); drift checks {_trigger_text(r)}" for r in apart]
    if payload.get("refused"):
        lines += ["", "Refused (a budget the policy cannot keep, left out): " + "; ".join(
            f"{lab} at {', '.join(common.fmt_num(int(L)) for L in errs)} tokens" for lab, errs in payload["refused"].items())]
    if cfg.get("preset") == "cpu":
        lines += ["", "(`--preset cpu` is a small configuration: at these contexts the weights dominate "
                      "the bytes a decode step reads and one TTFT round per policy is noisy; the targets are meant "
                      "for the longest context of the full grid.)"]
    elif cfg.get("ttft_repeats") == 1:
        lines += ["", "(One timed TTFT round per policy: a single sample, with the noise of this machine in it.)"]
    lines += ["", *common.closing_lines(payload, "latency", plot_rel)]
    return "\n".join(lines)


def make_plot(payload: dict, path: Path) -> Path | None:
    runs = payload["runs"]

    labels = list(dict.fromkeys(r["label"] for r in runs))
    fig, axes = common.subplots(1, 3, figsize=(17, 5))
    panels = [
        (axes[0], lambda r: r["decode"]["p50_ms"], "decode ms/token (P50)", "Decode time per token"),
        (axes[1], None, "decode time / full KV's (P50)", "Measured ratio (solid) vs roofline (dotted)"),
        (axes[2], lambda r: r["ttft_median_seconds"], "time to first token (s)", "TTFT"),
    ]
    for ax, get, ylab, title in panels:
        for ci, lab in enumerate(labels):
            rs = sorted((r for r in runs if r["label"] == lab), key=lambda r: r["length"])
            color = f"C{ci}"
            for weights, mfc, ls in (("real", color, "-"), ("synthetic", "white", "--")):
                part = [r for r in rs if r["weights"] == weights]
                if not part:
                    continue
                xs = [r["length"] for r in part]
                name = lab + (" (synthetic)" if weights == "synthetic" else "")
                if get is None:
                    if lab == "full":
                        continue
                    ax.plot(xs, [r["decode_ratio_p50"] for r in part], marker="o", color=color, mfc=mfc, ls=ls,
                            label=name)
                    ax.plot(xs, [r["roofline_ratio"] for r in part], marker="x", color=color, ls=":", lw=1)
                else:
                    ax.plot(xs, [get(r) for r in part], marker="o", color=color, mfc=mfc, ls=ls, label=name)
        synth = [r["length"] for r in runs if r["weights"] == "synthetic"]
        real = [r["length"] for r in runs if r["weights"] == "real"]
        if synth and (not real or min(synth) > max(real)):  # shade only a range that is synthetic alone
            ax.axvspan(min(synth) / 1.15, max(synth) * 1.15, color="0.9", zorder=0)
            ax.text(min(synth) / 1.1, ax.get_ylim()[1], "synthetic weights", va="top", fontsize=8, color="0.35")
        if get is None:
            ax.axhline(1.0, color="k", lw=0.8, alpha=0.5)
            ax.plot([], [], marker="x", color="0.3", ls=":", lw=1, label="roofline ratio (policy's colour)")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["length"] for r in runs})
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t / 1024:g}K" if t % 1024 == 0 else f"{t:,}" for t in ticks], fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("context (prompt tokens)")
        ax.set_ylabel(ylab)
        ax.set_title(title)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=7)
    sub = f"{model_label(payload['config'])} {dtype_label(payload['config'])}, {common.git_summary(payload['git'])}, " \
          f"{payload['machine'].get('cpu_model', '?')}"
    return common.save_figure(fig, path, f"Latency per policy (hollow markers, dashed: synthetic random weights) — {sub}")


# --------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = common.argument_parser("TTFT, decode ms/token (mean/P50/P95/P99), KV bytes and recall rate per KV-cache "
                               "policy and context length on SmolLM2-135M (synthetic random weights beyond its 8K "
                               "context), with each decode ratio to full KV beside its roofline ratio.")
    common.add_preset_argument(p, PRESETS)
    p.add_argument("--real-lengths", type=int, nargs="*", default=list(DEFAULT_REAL_LENGTHS),
                   help="prompt lengths on the real weights (context 8192: '8K' is 7900)")
    p.add_argument("--synthetic-lengths", type=int, nargs="*", default=list(DEFAULT_SYNTHETIC_LENGTHS),
                   help="prompt lengths on synthetic random weights with --synthetic-shape's shapes")
    p.add_argument("--synthetic-shape", choices=sorted(SYNTHETIC_SHAPES), default=MODEL,
                   help="shapes of the synthetic weights (llama-3.1-8b: 16 GB in bfloat16, for a GPU)")
    p.add_argument("--synthetic-dtype", choices=["float32", "bfloat16"], default=None,
                   help="dtype of the synthetic weights and KV (default: float32 for smollm2-135m, "
                        "bfloat16 for llama-3.1-8b)")
    p.add_argument("--synthetic-profile", type=Path, default=None,
                   help="head profile giving HeteroCache's roles on synthetic weights (default: the shipped one "
                        "for smollm2-135m; the authors' published one from ../shared/reference or "
                        "$HETERO_JAX_REFERENCE_DIR for llama-3.1-8b)")
    p.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), type=common.policy_spec,
                   help="registered policies, optionally with options (quest:offload=true; full KV always runs, as the reference)")
    p.add_argument("--budgets", type=float, nargs="+", default=list(DEFAULT_BUDGETS),
                   help="budgets rho in (0, 1] for every compressed policy")
    p.add_argument("--decode-steps", type=int, default=128, help="timed decode steps per policy and length")
    p.add_argument("--decode-block", type=int, default=10,
                   help="consecutive decode steps per policy before the next policy's turn (a multiple of "
                        "HeteroCache's window, so every block holds the same drift checks)")
    p.add_argument("--warmup-steps", type=int, default=8,
                   help="untimed decode steps per policy first (>= HeteroCache's window, so its first drift "
                        "check is warm too)")
    p.add_argument("--ttft-warmup", type=int, default=1, help="untimed prefill rounds per length")
    p.add_argument("--ttft-repeats", type=int, default=2, help="timed prefill rounds per length (TTFT: median)")
    p.add_argument("--seed", type=int, default=0, help="synthetic weights and token ids")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="do not use the persistent XLA compilation cache (compile time is excluded from every "
                        "timing either way)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--model", default=MODEL, help=argparse.SUPPRESS)
    common.add_output_arguments(p, "latency", SECTION)
    p.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                   help="no run: join the JSON of runs of one configuration at different lengths into one table "
                        "(with --write-results, the section of their preset)")
    args = common.parse_with_preset(p, PRESETS, argv)
    args.plot = args.plot or args.out.with_suffix(".png")
    args.synthetic_dtype = args.synthetic_dtype or SYNTHETIC_DEFAULT_DTYPE[args.synthetic_shape]
    args.budgets = common.checked_budgets(p, args.budgets)
    if args.decode_steps < 1 or args.warmup_steps < 0:
        p.error("--decode-steps must be >= 1 and --warmup-steps >= 0")
    if args.ttft_repeats < 1 or args.ttft_warmup < 0:
        p.error("--ttft-repeats must be >= 1 and --ttft-warmup >= 0")
    if not args.real_lengths and not args.synthetic_lengths:
        p.error("give at least one of --real-lengths / --synthetic-lengths")
    if any(n < 1 for n in args.real_lengths + args.synthetic_lengths):
        p.error("lengths must be positive")
    return args


def merge(args) -> dict:
    """One payload from runs of the same configuration at different lengths (``--merge A.json B.json ...``).

    A device call that may be cut off runs each length as its own process with its own JSON; this joins
    the lengths that finished into one table and target check (the first file's header: machine, commit).
    """
    import json

    parts = [json.loads(Path(f).read_text()) for f in args.merge]
    keep = ("synthetic_lengths", "real_lengths", "out", "plot", "ttft_warmup")
    base = {k: v for k, v in parts[0]["config"].items() if k not in keep}
    for f, p in zip(args.merge[1:], parts[1:]):
        other = {k: v for k, v in p["config"].items() if k not in keep}
        if other != base:
            diff = sorted(k for k in set(base) | set(other) if base.get(k) != other.get(k))
            raise SystemExit(f"--merge: {f} was run with another configuration ({', '.join(diff)} differ)")
    payload = dict(parts[0])
    order = sorted(range(len(parts)), key=lambda i: min(x["length"] for x in parts[i]["lengths"]))
    payload["lengths"] = [x for i in order for x in parts[i]["lengths"]]
    payload["runs"] = [r for i in order for r in parts[i]["runs"]]
    payload["refused"] = {}
    for p in parts:
        for lab, errs in p.get("refused", {}).items():
            payload["refused"].setdefault(lab, {}).update(errs)
    cfg = dict(parts[0]["config"])
    for k in ("synthetic_lengths", "real_lengths"):
        cfg[k] = sorted({L for p in parts for L in p["config"][k]})
    cfg["ttft_warmup"] = min(p["config"]["ttft_warmup"] for p in parts)
    cfg["ttft_warmup_per_length"] = {str(x["length"]): parts[i]["config"]["ttft_warmup"] for i in order
                                     for x in parts[i]["lengths"]}
    cfg["merged_from"] = [str(f) for f in args.merge]
    cfg["out"], cfg["plot"] = str(args.out), str(args.plot)
    payload["config"] = cfg
    add_fitted(payload["runs"])
    payload["targets"] = target_check(payload["runs"])
    payload["total_seconds"] = sum(p["total_seconds"] for p in parts)
    args.preset = cfg.get("preset")
    return payload


def main(argv=None) -> int:
    args = parse_args(argv)
    common.run_task(args, merge if args.merge else run, section=SECTION, make_plot=make_plot,
                    results_section=results_section,
                    tables=lambda payload: [results_table(payload["runs"]), targets_text(payload["targets"])],
                    plot_rows="runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
