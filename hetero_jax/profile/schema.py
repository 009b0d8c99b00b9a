"""The head profile's file: its JSON document, settings, error, and the rules a valid profile keeps.

Our file (``"format": "hetero-jax-head-profile"``, ``schema_version`` 2; version 1,
which had no copy score, still reads) is plain JSON: [L][H] nested lists, NaN written as ``null``, floats written with
Python's shortest round-trip repr, so ``to_json`` -> ``from_json`` is exact. ``to_document`` writes a profile's
fields as that document and ``from_document`` reads them back (``HeadProfile``, ``head_profile.py``, builds
and checks the record); ``check_clusters``, ``grid_mismatch`` and ``check_fits`` are the checks the record runs.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

import numpy as np

from hetero_jax.errors import HeteroJaxError, read_json
from hetero_jax.profile.clustering import ROLE_NAMES, Cluster, Role

FORMAT_NAME = "hetero-jax-head-profile"
SCHEMA_VERSION = 2
# Version 1 lacks copy_score and settings.copy_steps / tau_copy (read as unknown).
READABLE_SCHEMA_VERSIONS = (1, 2)
CALIBRATE_HINT = "calibrate a profile for this model with `hetero-jax profile`"


class ProfileError(HeteroJaxError, ValueError):
    """A head profile that is malformed, unreadable or for another model."""


@dataclasses.dataclass(frozen=True)
class ProfileSettings:
    """How the profile was calibrated (None = not recorded)."""

    top_k: int | None = None  # |K| of each top-k set
    decode_steps: int | None = None  # T of Eq. 2
    tau_stable: float | None = None
    tau_sim: float | None = None
    seed: int | None = None
    calibration_data: str | None = None  # free text: source, selection
    samples: int | None = None  # calibration texts
    tokens_per_sample: int | None = None  # prompt length of each text
    method: str | None = None  # "synckv" for a SyncKV grouping (k-means); None: HeteroCache's taxonomy
    n_clusters: int | None = None  # SyncKV: clusters (R-heads) asked for per layer
    copy_steps: int | None = None  # teacher-forced steps of the copy phase (0: none)
    tau_copy: float | None = None  # copy score from which a compressed head is kept whole


def to_document(p) -> dict:
    """Our JSON document of a ``HeadProfile`` ``p``."""
    return {
        "format": FORMAT_NAME,
        "schema_version": p.schema_version,
        "source": p.source,
        "model": {
            "name": p.model_name,
            "architecture": p.architecture,
            "num_layers": p.num_layers,
            "num_kv_heads": p.num_kv_heads,
            "head_dim": p.head_dim,
            "weights_fingerprint": p.weights_fingerprint,
        },
        "settings": dataclasses.asdict(p.settings),
        "role_codes": {ROLE_NAMES[r]: int(r) for r in Role},
        "roles": p.roles.tolist(),
        "stability": _floats_out(p.stability),
        "similarity": _floats_out(p.similarity),
        "similarity_matrix": None if p.similarity_matrix is None else _floats_out(p.similarity_matrix),
        "copy_score": _floats_out(p.copy_score),
        "allocation_weights": _floats_out(p.weights),
        "clusters": [[{"pivot": c.pivot, "satellites": list(c.satellites)} for c in layer]
                     for layer in p.clusters],
    }


def from_document(d: Mapping, make):
    """``make(**fields)`` (``HeadProfile``) of the fields our document ``d`` holds; ProfileError for another
    format, version or role coding, a malformed document, or a model entry whose shape is not the roles'."""
    if d.get("format") != FORMAT_NAME:
        raise ProfileError(f"not a {FORMAT_NAME} document (format={d.get('format')!r})")
    version = d.get("schema_version")
    if version not in READABLE_SCHEMA_VERSIONS:
        raise ProfileError(f"profile schema_version {version!r} is not supported by this "
                           f"hetero-jax (it reads versions {', '.join(map(str, READABLE_SCHEMA_VERSIONS))}); "
                           "re-calibrate or upgrade")
    codes = {ROLE_NAMES[r]: int(r) for r in Role}
    if d.get("role_codes") != codes:
        raise ProfileError(f"profile role codes {d.get('role_codes')} differ from ours {codes}")
    try:
        m = d["model"]
        roles = np.array(d["roles"], dtype=np.int64)
        prof = make(
            roles=roles,
            clusters=tuple(tuple(Cluster(int(c["pivot"]), tuple(int(s) for s in c["satellites"]))
                                 for c in layer) for layer in d["clusters"]),
            weights=_floats_in(d["allocation_weights"]),
            stability=_floats_in(d["stability"]),
            similarity=_floats_in(d["similarity"]),
            similarity_matrix=None if d.get("similarity_matrix") is None else _floats_in(d["similarity_matrix"]),
            copy_score=_floats_in(d["copy_score"]) if version >= 2 else None,
            architecture=m.get("architecture"),
            head_dim=m.get("head_dim"),
            model_name=m.get("name"),
            weights_fingerprint=m.get("weights_fingerprint"),
            settings=ProfileSettings(**d.get("settings", {})),
            source=d.get("source", "hetero-jax"),
        )
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ProfileError):
            raise
        raise ProfileError(f"malformed {FORMAT_NAME} document: {e!r}") from None
    if (m.get("num_layers"), m.get("num_kv_heads")) != roles.shape:
        raise ProfileError(f"model says {m.get('num_layers')} layers x {m.get('num_kv_heads')} "
                           f"KV heads but the role grid is {roles.shape}")
    return prof


def read_document(path) -> Any:
    """The JSON at ``path``; ProfileError (with the fix) when it is missing or not JSON."""
    path = os.fspath(path)
    return read_json(path, ProfileError, missing=f"profile file not found: {path}; {CALIBRATE_HINT}",
                     fix=CALIBRATE_HINT)


def grid_mismatch(name: str, got: tuple, want: tuple) -> str:
    """The message for a profile field whose grid is not its roles' grid: parts of two models' profiles."""
    def text(g):
        return (f"{g[0]} layers x {g[1]} KV heads" + (f" x {g[2]}" if len(g) > 2 else "")) if len(g) >= 2 else str(g)
    return (f"this profile does not describe one model: its roles cover {text(want)} but its {name} covers "
            f"{text(got)} (a file assembled from another model's profile, or edited by hand); calibrate a profile "
            "for the model with `hetero-jax profile` instead of editing one")


def check_clusters(clusters, roles: np.ndarray) -> tuple[tuple[Cluster, ...], ...]:
    n_layers, n_heads = roles.shape
    if len(clusters) != n_layers:
        raise ProfileError(f"clusters cover {len(clusters)} layers, expected {n_layers}")
    out = []
    for layer, cl in enumerate(clusters):
        seen = np.zeros(n_heads, dtype=int)
        layer_out = []
        for c in cl:
            p, sats = int(c[0]), tuple(int(s) for s in c[1])
            heads = (p,) + sats
            if min(heads) < 0 or max(heads) >= n_heads:
                raise ProfileError(f"layer {layer}: cluster {p}->{list(sats)} names a head outside 0..{n_heads - 1}")
            if not sats:
                raise ProfileError(f"layer {layer}: pivot {p} has no satellites")
            if roles[layer, p] != Role.PIVOT or np.any(roles[layer, list(sats)] != Role.SATELLITE):
                raise ProfileError(f"layer {layer}: cluster {p}->{list(sats)} disagrees with the role grid")
            seen[list(heads)] += 1
            layer_out.append(Cluster(p, sats))
        clustered = np.isin(roles[layer], (Role.PIVOT, Role.SATELLITE))
        if np.any(seen > 1) or not np.array_equal(seen == 1, clustered):
            raise ProfileError(f"layer {layer}: every pivot and satellite must be in exactly one cluster")
        out.append(tuple(layer_out))
    return tuple(out)


def shape_text(arch, n_layers, n_kv, head_dim) -> str:
    return (f"{arch or 'unknown architecture'} {n_layers} layers x {n_kv} KV heads x "
            f"head_dim {head_dim if head_dim is not None else '?'}")


def model_shape(cfg: Any):
    if isinstance(cfg, Mapping):
        if "architectures" in cfg:  # an HF config.json dict
            from hetero_jax.model.config import ModelConfig

            cfg = ModelConfig.from_hf_dict(cfg)
        else:
            return (cfg.get("architecture"), int(cfg["num_layers"]), int(cfg["num_kv_heads"]),
                    cfg.get("head_dim"))
    try:
        return (getattr(cfg, "architecture", None), int(cfg.num_layers), int(cfg.num_kv_heads),
                getattr(cfg, "head_dim", None))
    except AttributeError:
        raise ProfileError(f"cannot read num_layers / num_kv_heads from {type(cfg).__name__}") from None


def _floats_out(a: np.ndarray) -> list:
    # float() of a float64 reprs with the shortest round-trip string: exact.
    return [_floats_out(x) for x in a] if a.ndim > 1 else [None if math.isnan(x) else float(x) for x in a]


def _floats_in(x) -> np.ndarray:
    return np.array(x, dtype=np.float64)  # None -> nan with dtype float64


def check_fits(p, config_like: Any, weights_fingerprint: str | None = None) -> None:
    """Raise ProfileError unless the ``HeadProfile`` ``p`` fits the model.

    ``config_like``: a ModelConfig, an object with ``num_layers``,
    ``num_kv_heads``, ``head_dim``, ``architecture``, or a mapping (ours
    or an HF ``config.json`` dict). Fields unknown on either side
    (None) are not compared. The message names both shapes.
    """
    arch, n_layers, n_kv, head_dim = model_shape(config_like)
    fp = weights_fingerprint or getattr(config_like, "weights_fingerprint", None)
    mismatch = (
        n_layers != p.num_layers
        or n_kv != p.num_kv_heads
        or (head_dim is not None and p.head_dim is not None and head_dim != p.head_dim)
        or (arch is not None and p.architecture is not None and arch != p.architecture)
    )
    who = f" ({p.model_name})" if p.model_name else ""
    if mismatch:
        raise ProfileError(
            f"profile{who} is for {p.describe_shape()}, but the model is "
            f"{shape_text(arch, n_layers, n_kv, head_dim)}; {CALIBRATE_HINT}"
        )
    if fp is not None and p.weights_fingerprint is not None and fp != p.weights_fingerprint:
        raise ProfileError(
            f"profile{who} was calibrated on weights {p.weights_fingerprint}, but the "
            f"model's weights are {fp} (same shape {p.describe_shape()}); {CALIBRATE_HINT}"
        )
