"""The policies ``bench_step_ops.py`` compiles a step for: registry specs ('name[:opts][@rho]') and the stand-ins
for calibration files Llama-3.1-8B has none of (SyncKV groups and a ContextKeeper ranking from the HeteroCache
authors' profile, a random HCAttention codebook)."""

from __future__ import annotations

from pathlib import Path


SHAPE = "llama-3.1-8b"
HCATTENTION_SUB_DIM, HCATTENTION_CODES = 4, 512  # g = 128 / 4 = 32 codes per key (the paper's g for D = 128)


def authors_profile(path: Path | None = None):
    """The HeteroCache authors' Llama-3.1-8B-Instruct profile (weights fingerprint dropped), from ``path`` or
    ``harness.synthetic.reference_dir``."""
    from harness.synthetic import synthetic_profile

    return synthetic_profile(SHAPE, path)


def synckv_profile_from(profile):
    """A SyncKV grouping from a HeteroCache profile: each cluster's pivot an R-head with its satellites as NR-heads;
    volatile and anchor heads clusters of one (SyncKV's volatile: full KV). Satellites weight 1, others NaN."""
    import numpy as np

    from hetero_jax.profile.clustering import Role
    from hetero_jax.profile import HeadProfile, ProfileSettings

    roles = np.asarray(profile.roles).copy()
    roles[roles == Role.ANCHOR] = Role.VOLATILE
    weights = np.where(roles == Role.SATELLITE, 1.0, np.nan)
    settings = ProfileSettings(method="synckv", n_clusters=None, tau_stable=None, tau_sim=None)
    return HeadProfile(roles=roles, clusters=profile.clusters, weights=weights, settings=settings,
                       architecture=profile.architecture, head_dim=profile.head_dim,
                       model_name=f"{profile.model_name} (SyncKV groups from the HeteroCache authors' clusters)")


def contextkeeper_ranking_from(profile):
    """A fixed ContextKeeper ranking: the profile's full-KV heads (pivots, volatiles) first, then by allocation
    weight (larger first), then (layer, head)."""
    import numpy as np

    from hetero_jax.profile.clustering import Role
    from hetero_jax.policies.contextkeeper.ranking import CARanking

    roles = np.asarray(profile.roles)
    full = (roles == Role.PIVOT) | (roles == Role.VOLATILE)
    w = np.nan_to_num(np.asarray(profile.weights, np.float64), nan=0.0)
    scores = np.where(full, 10.0 + w, w)
    return CARanking(scores=scores, votes=np.zeros(roles.shape, np.int64), model="llama-3.1-8b (stand-in ranking)",
                     architecture="llama", head_dim=profile.head_dim,
                     settings={"stand_in": "full-KV heads of the HeteroCache authors' profile first, then by "
                                            "allocation weight"})


def random_codebook(cfg, sub_dim: int = HCATTENTION_SUB_DIM, size: int = HCATTENTION_CODES, seed: int = 0):
    """A random key codebook [layers, c, d] of the shape HCAttention needs (N(0, 1) float32, seed ``seed``)."""
    import numpy as np

    from hetero_jax.policies.hcattention.codebook import KeyCodebook

    cents = np.random.default_rng(seed).standard_normal((cfg.num_layers, size, sub_dim)).astype(np.float32)
    return KeyCodebook(centroids=cents, model="llama-3.1-8b (random stand-in codebook)", architecture="llama",
                       head_dim=cfg.head_dim, num_kv_heads=cfg.num_kv_heads,
                       settings={"stand_in": f"random, seed {seed}"})


def parse_spec(spec: str, rho: float) -> tuple[str, float]:
    """'name[:opts][@rho]' -> (registry spec, rho), the name as its registry key ('HeteroCache' -> 'heterocache')."""
    from hetero_jax.policies import registry_key

    name, _, r = spec.partition("@")
    base, sep, options = name.partition(":")
    return registry_key(base) + sep + options, (float(r) if r else rho)


def label(spec: str, rho: float) -> str:
    name, r = parse_spec(spec, rho)
    return "full" if name == "full" else f"{name}@{r:g}"


def make_policy(spec: str, rho: float, profile, cfg, ranking=None, codebook=None):
    """A policy for ``spec`` ('name[:opts][@rho]') with the stand-ins this shape needs; (policy, stand-in note)."""
    from hetero_jax.policies import make_policy as registry_policy

    name, r = parse_spec(spec, rho)
    base = name.split(":")[0]
    if base == "full":
        return registry_policy("full"), ""
    if base == "heterocache":
        return registry_policy(name, r, profile=profile), "the HeteroCache authors' published profile"
    if base == "synckv":
        return (registry_policy(name, r, profile=synckv_profile_from(profile)),
                "groups = the authors' HeteroCache clusters (pivot = R-head, satellites = NR-heads; volatile and "
                "anchor heads singleton clusters, full KV)")
    if base == "contextkeeper":
        return (registry_policy(name, r, ranking=ranking or contextkeeper_ranking_from(profile)),
                "fixed ranking: the authors' pivots and volatiles first, then by allocation weight")
    if base == "hcattention":
        cb = codebook or random_codebook(cfg)
        note = ("exact keys on the device, values on the host (no codebook needed)" if abs(r - 0.5) < 0.05 else
                f"random codebook, g={cfg.head_dim // cb.sub_dim} (d={cb.sub_dim}, c={cb.size}), seed 0")
        return registry_policy(name, r, codebook=cb), note
    return registry_policy(name, r), ""

