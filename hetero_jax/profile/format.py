"""HeadProfile: the offline HeteroCache profile, its JSON file, and import of
the HeteroCache authors' published profiles.

Our file (``"format": "hetero-jax-head-profile"``, ``schema_version`` 2; version 1,
which had no copy score, still reads) is plain JSON: [L][H] nested lists, NaN written as ``null``, floats written with
Python's shortest round-trip repr, so ``to_json`` -> ``from_json`` is exact.

The authors' files (``official_profile_<model>.json``) hold ``meta.type_map``
(role name -> code), ``meta.counts``, ``classification_matrix`` [L][H] codes,
``allocation_matrix`` [L][H] (mean-1 weights, -1 for full heads) and
``leader_member_relations`` (per layer {"pivot": [satellites]}). Their role
names differ between files (anchor/volatile/pivot/satellite vs
Stable_Unique/Decaying_Unique/Similar_Leader/Similar_Member); they record no
stability, similarity, head_dim or architecture.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Mapping

import numpy as np

from hetero_jax.dims import axis_size
from hetero_jax.errors import HeteroJaxError, read_json
from hetero_jax.io.files import write_text
from hetero_jax.profile.clustering import (
    COMPRESSED_ROLES,
    FULL_ROLES,
    ROLE_NAMES,
    Cluster,
    Role,
    allocation_weights,
    assign_roles,
    budget_grid,
    synckv_roles,
)
from hetero_jax.profile.metrics import max_similarity, similarity_edges

__all__ = [
    "FORMAT_NAME",
    "SCHEMA_VERSION",
    "ProfileError",
    "ProfileSettings",
    "HeadProfile",
    "build_profile",
    "build_synckv_profile",
    "load_profile",
    "weights_fingerprint",
    "SHIPPED_PROFILES",
    "SHIPPED_SYNCKV_PROFILES",
    "shipped_profile_path",
    "default_profile",
]

FORMAT_NAME = "hetero-jax-head-profile"
SCHEMA_VERSION = 2
# Version 1 lacks copy_score and settings.copy_steps / tau_copy (read as unknown).
READABLE_SCHEMA_VERSIONS = (1, 2)
_CALIBRATE_HINT = "calibrate a profile for this model with `hetero-jax profile`"


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


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class HeadProfile:
    """Per layer, per KV head: role, stability, similarity, cluster, weight.

    Arrays are [L, H] (``similarity_matrix`` [L, H, H]) and read-only.
    ``roles``: int8 Role codes (anchor 1, volatile 2, pivot 3, satellite 4).
    ``stability``: S_stable (Eq. 2), NaN where unknown (imported profiles).
    ``similarity``: each head's max overlap with another head of its layer at
    the graph step (Eq. 3 / App. B.4), NaN where unknown.
    ``weights``: mean-1 allocation weights of compressed heads (Sec. 4.2),
    NaN for full heads. ``clusters[l]``: that layer's (pivot, satellites).
    ``copy_score``: share of the copy phase's steps at which the head's argmax
    lands on the earlier occurrence of the token just fed (our duplicate-token
    score, see ``calibrate``), NaN where unknown.
    """

    roles: np.ndarray
    clusters: tuple[tuple[Cluster, ...], ...]
    weights: np.ndarray
    stability: np.ndarray | None = None
    similarity: np.ndarray | None = None
    similarity_matrix: np.ndarray | None = None
    copy_score: np.ndarray | None = None
    architecture: str | None = None  # "llama" / "qwen2" / "qwen3"
    head_dim: int | None = None
    model_name: str | None = None
    weights_fingerprint: str | None = None
    settings: ProfileSettings = ProfileSettings()
    source: str = "hetero-jax"
    schema_version: int = SCHEMA_VERSION

    # ------------------------------------------------------------ validation
    def __post_init__(self):
        roles = np.array(self.roles)
        if roles.ndim != 2 or roles.size == 0:
            raise ProfileError(f"roles must be a non-empty [layers, KV heads] grid, got shape {roles.shape}")
        if not np.issubdtype(roles.dtype, np.integer) or not np.all(np.isin(roles, list(Role))):
            raise ProfileError(f"roles must be codes {sorted(int(r) for r in Role)}")
        roles = roles.astype(np.int8)
        shape = roles.shape

        def grid(name, value):
            a = np.full(shape, np.nan) if value is None else np.array(value, dtype=np.float64)
            if a.shape != shape:
                raise ProfileError(_grid_mismatch(name, a.shape, shape))
            a.setflags(write=False)
            return a

        weights = grid("weights", self.weights)
        comp = np.isin(roles, COMPRESSED_ROLES)
        if not np.all(np.isfinite(weights[comp]) & (weights[comp] > 0)):
            raise ProfileError("every compressed head (anchor, satellite) needs a finite weight > 0")
        if not np.all(np.isnan(weights[~comp])):
            raise ProfileError("full heads (volatile, pivot) must have weight NaN (no budget share)")
        simm = None
        if self.similarity_matrix is not None:
            simm = np.array(self.similarity_matrix, dtype=np.float64)
            if simm.shape != shape + (shape[1],):
                raise ProfileError(_grid_mismatch("similarity_matrix", simm.shape, shape + (shape[1],)))
            simm.setflags(write=False)
        clusters = _check_clusters(self.clusters, roles)
        roles.setflags(write=False)
        for name, value in (("roles", roles), ("weights", weights), ("clusters", clusters),
                            ("stability", grid("stability", self.stability)),
                            ("similarity", grid("similarity", self.similarity)),
                            ("copy_score", grid("copy_score", self.copy_score)),
                            ("similarity_matrix", simm)):
            object.__setattr__(self, name, value)
        if not isinstance(self.settings, ProfileSettings):
            raise ProfileError("settings must be a ProfileSettings")

    # ------------------------------------------------------------ properties
    num_layers = axis_size("roles", 0, "layers of the profiled model")
    num_kv_heads = axis_size("roles", 1, "KV heads per layer")

    @property
    def n_full(self) -> int:
        """Full heads (volatile + pivot) over the whole model (N_full of Eq. 7)."""
        return int(np.isin(self.roles, FULL_ROLES).sum())

    @property
    def n_compressed(self) -> int:
        """Compressed heads (anchor + satellite) over the whole model (N_comp of Eq. 7)."""
        return int(np.isin(self.roles, COMPRESSED_ROLES).sum())

    def role_grid(self) -> np.ndarray:
        """Role codes, int8 [L, H] (a writable copy)."""
        return self.roles.copy()

    def role_counts(self) -> dict[str, int]:
        """{"anchor": n, "volatile": n, "pivot": n, "satellite": n} over the model."""
        return {ROLE_NAMES[r]: int((self.roles == r).sum()) for r in Role}

    def full_heads(self, layer: int) -> np.ndarray:
        """KV heads of ``layer`` that keep their full KV (volatile + pivot), ascending."""
        return np.flatnonzero(np.isin(self.roles[layer], FULL_ROLES))

    def compressed_heads(self, layer: int) -> np.ndarray:
        """KV heads of ``layer`` with a budget (anchor + satellite), ascending."""
        return np.flatnonzero(np.isin(self.roles[layer], COMPRESSED_ROLES))

    def copy_heads(self) -> np.ndarray:
        """bool [L, H]: heads whose copy score reaches the profile's tau_copy (all False without a copy rule;
        an unknown score, NaN, never does). The copy rule keeps these whole (``clustering.assign_roles``)."""
        if self.settings.tau_copy is None or self.copy_score is None:
            return np.zeros(self.roles.shape, bool)
        return self.copy_score >= self.settings.tau_copy

    def budgets(self, rho: float, prompt_len: int) -> np.ndarray:
        """Device tokens per KV head after prefill, int64 [L, H] (Eq. 7-8)."""
        return budget_grid(rho, self.roles, self.weights, prompt_len)

    def reclustered(self, *, tau_stable: float | None = None, tau_sim: float | None = None,
                    tau_copy: float | None = None) -> "HeadProfile":
        """The same calibration statistics with other thresholds: roles, clusters and weights rebuilt.

        ``tau_copy`` needs the stored copy scores (a profile calibrated with a copy phase).

        Needs the stored similarity matrix (our profiles have it; the authors' files do not).
        """
        if self.settings.method == "synckv":
            raise ProfileError("a SyncKV profile is grouped by k-means, not by thresholds: rebuild it with "
                               "build_synckv_profile(profile.similarity_matrix, n_r)")
        if self.similarity_matrix is None:
            raise ProfileError("this profile stores no similarity matrix (the authors' format), so its heads "
                               "cannot be re-clustered; calibrate one with `hetero-jax profile`")
        tau_stable = self.settings.tau_stable if tau_stable is None else tau_stable
        tau_sim = self.settings.tau_sim if tau_sim is None else tau_sim
        if tau_copy is not None and np.isnan(self.copy_score).all():
            raise ProfileError("this profile stores no copy scores, so tau_copy cannot apply; calibrate one "
                               "with `hetero-jax profile --copy-steps N`")
        tau_copy = self.settings.tau_copy if tau_copy is None else tau_copy
        return build_profile(self.stability, self.similarity_matrix, tau_stable=tau_stable, tau_sim=tau_sim,
                             copy_score=self.copy_score, tau_copy=tau_copy, similarity=self.similarity,
                             architecture=self.architecture, head_dim=self.head_dim, model_name=self.model_name,
                             weights_fingerprint=self.weights_fingerprint, settings=self.settings)

    def describe_shape(self) -> str:
        return _shape_text(self.architecture, self.num_layers, self.num_kv_heads, self.head_dim)

    def check_compatible(self, config_like: Any, weights_fingerprint: str | None = None) -> None:
        """Raise ProfileError unless this profile fits the model.

        ``config_like``: a ModelConfig, an object with ``num_layers``,
        ``num_kv_heads``, ``head_dim``, ``architecture``, or a mapping (ours
        or an HF ``config.json`` dict). Fields unknown on either side
        (None) are not compared. The message names both shapes.
        """
        arch, n_layers, n_kv, head_dim = _model_shape(config_like)
        fp = weights_fingerprint or getattr(config_like, "weights_fingerprint", None)
        mismatch = (
            n_layers != self.num_layers
            or n_kv != self.num_kv_heads
            or (head_dim is not None and self.head_dim is not None and head_dim != self.head_dim)
            or (arch is not None and self.architecture is not None and arch != self.architecture)
        )
        who = f" ({self.model_name})" if self.model_name else ""
        if mismatch:
            raise ProfileError(
                f"profile{who} is for {self.describe_shape()}, but the model is "
                f"{_shape_text(arch, n_layers, n_kv, head_dim)}; {_CALIBRATE_HINT}"
            )
        if fp is not None and self.weights_fingerprint is not None and fp != self.weights_fingerprint:
            raise ProfileError(
                f"profile{who} was calibrated on weights {self.weights_fingerprint}, but the "
                f"model's weights are {fp} (same shape {self.describe_shape()}); {_CALIBRATE_HINT}"
            )

    # ------------------------------------------------------------ equality
    def __eq__(self, other):
        if not isinstance(other, HeadProfile):
            return NotImplemented
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                if a is None or b is None or a.shape != b.shape or not np.array_equal(a, b, equal_nan=a.dtype.kind == "f"):
                    return False
            elif a != b:
                return False
        return True

    __hash__ = None  # arrays inside: not hashable

    def __repr__(self):
        c = self.role_counts()
        return (f"HeadProfile({self.model_name or self.describe_shape()}, source={self.source!r}, "
                f"anchor={c['anchor']}, volatile={c['volatile']}, pivot={c['pivot']}, "
                f"satellite={c['satellite']})")

    # ------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        return {
            "format": FORMAT_NAME,
            "schema_version": self.schema_version,
            "source": self.source,
            "model": {
                "name": self.model_name,
                "architecture": self.architecture,
                "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim,
                "weights_fingerprint": self.weights_fingerprint,
            },
            "settings": dataclasses.asdict(self.settings),
            "role_codes": {ROLE_NAMES[r]: int(r) for r in Role},
            "roles": self.roles.tolist(),
            "stability": _floats_out(self.stability),
            "similarity": _floats_out(self.similarity),
            "similarity_matrix": None if self.similarity_matrix is None else _floats_out(self.similarity_matrix),
            "copy_score": _floats_out(self.copy_score),
            "allocation_weights": _floats_out(self.weights),
            "clusters": [[{"pivot": c.pivot, "satellites": list(c.satellites)} for c in layer]
                         for layer in self.clusters],
        }

    def to_json(self, path: str | os.PathLike) -> None:
        """Write our versioned JSON (standard JSON: NaN becomes null), whole or not at all (OutputError for a
        path that cannot be written)."""
        write_text(path, json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n")

    @classmethod
    def from_dict(cls, d: Mapping) -> "HeadProfile":
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
            prof = cls(
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

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "HeadProfile":
        """Read our JSON (see :func:`load_profile` for the authors' format too)."""
        return cls.from_dict(_read_json(path))


def _grid_mismatch(name: str, got: tuple, want: tuple) -> str:
    """The message for a profile field whose grid is not its roles' grid: parts of two models' profiles."""
    def text(g):
        return (f"{g[0]} layers x {g[1]} KV heads" + (f" x {g[2]}" if len(g) > 2 else "")) if len(g) >= 2 else str(g)
    return (f"this profile does not describe one model: its roles cover {text(want)} but its {name} covers "
            f"{text(got)} (a file assembled from another model's profile, or edited by hand); calibrate a profile "
            "for the model with `hetero-jax profile` instead of editing one")


# ====================================================================== build
def build_profile(
    stability: np.ndarray,
    similarity_matrix: np.ndarray,
    *,
    tau_stable: float,
    tau_sim: float,
    similarity: np.ndarray | None = None,
    copy_score: np.ndarray | None = None,
    tau_copy: float | None = None,
    settings: ProfileSettings | None = None,
    **identity,
) -> HeadProfile:
    """The whole offline taxonomy from calibration statistics.

    ``stability`` [L, H] (Eq. 2, see ``metrics.stability_masks``);
    ``similarity_matrix`` [L, H, H]: pairwise overlaps at the graph step
    (``metrics.similarity_matrix`` per layer). Builds the graph
    (O >= tau_sim), star-clusters each layer, assigns roles and weights.
    ``similarity`` [L, H] is the per-head score stored for the plot
    (default: max overlap at the graph step; pass Eq. 3's median over steps
    if you have it). ``copy_score`` [L, H] with ``tau_copy``: compressed heads scoring >= tau_copy are
    kept whole (``clustering.assign_roles``). ``settings.tau_*`` are filled from the arguments. ``identity``: the profile's
    ``architecture``, ``head_dim``, ``model_name`` and ``weights_fingerprint`` (see :class:`HeadProfile`).
    """
    stab = np.asarray(stability, dtype=np.float64)
    simm = np.asarray(similarity_matrix, dtype=np.float64)
    if simm.shape != stab.shape + (stab.shape[-1],):
        raise ProfileError(f"similarity_matrix {simm.shape} does not match stability {stab.shape}")
    adjs = [similarity_edges(s, tau_sim) for s in simm]
    roles, clusters = assign_roles(stab, adjs, tau_stable, copy_score=copy_score, tau_copy=tau_copy)
    settings = dataclasses.replace(settings or ProfileSettings(), tau_stable=tau_stable, tau_sim=tau_sim,
                                   tau_copy=None if copy_score is None else tau_copy)
    return HeadProfile(
        roles=roles,
        clusters=clusters,
        weights=allocation_weights(stab, roles),
        stability=stab,
        similarity=max_similarity(simm) if similarity is None else similarity,
        similarity_matrix=simm,
        copy_score=copy_score,
        settings=settings,
        **identity,
    )


def build_synckv_profile(
    similarity_matrix: np.ndarray,
    n_r: int,
    *,
    settings: ProfileSettings | None = None,
    **identity,
) -> HeadProfile:
    """A SyncKV grouping (paper §4.1) as a HeadProfile: R-heads are pivots, NR-heads satellites (weight 1,
    so ``budgets`` gives every NR head the same k), singleton clusters volatile; no stability.

    ``similarity_matrix`` [L, H, H]: each layer's mean pairwise top-k overlap over decode steps and samples
    (``calibrate_tokens(scoring="synckv")``); ``n_r``: clusters per layer (``clustering.default_n_r``);
    ``identity`` as in :func:`build_profile`.
    """
    simm = np.asarray(similarity_matrix, dtype=np.float64)
    if simm.ndim != 3 or simm.shape[1] != simm.shape[2]:
        raise ProfileError(f"similarity_matrix must be [L, H, H], got shape {simm.shape}")
    roles, clusters = synckv_roles(simm, n_r)
    weights = np.where(roles == Role.SATELLITE, 1.0, np.nan)
    settings = dataclasses.replace(settings or ProfileSettings(), method="synckv", n_clusters=int(n_r),
                                   tau_stable=None, tau_sim=None)
    return HeadProfile(roles=roles, clusters=clusters, weights=weights, similarity=max_similarity(simm),
                       similarity_matrix=simm, settings=settings, **identity)


# ====================================================================== load
# Role names used in the authors' files -> our roles (compared lower-case).
_OFFICIAL_ROLE_NAMES = {
    "anchor": Role.ANCHOR,
    "stable_unique": Role.ANCHOR,
    "volatile": Role.VOLATILE,
    "decaying_unique": Role.VOLATILE,
    "pivot": Role.PIVOT,
    "similar_leader": Role.PIVOT,
    "satellite": Role.SATELLITE,
    "similar_member": Role.SATELLITE,
}

_PAPER_DATA = "Wikipedia, 50 samples x 10K tokens (paper App. B.1; not recorded in the file)"

# Identity and settings the authors' files do not carry, keyed by a pattern on
# the file name; applied only when the grid shape agrees. From the public HF
# configs (head_dim = hidden / heads) and the paper (Sec. 3, App. B-C).
_KNOWN_MODELS = (
    (re.compile(r"llama-?3\.1-8b", re.I),
     dict(model_name="meta-llama/Llama-3.1-8B-Instruct", architecture="llama", shape=(32, 8), head_dim=128,
          settings=ProfileSettings(top_k=1024, decode_steps=100, tau_stable=0.5, tau_sim=0.5,
                                   calibration_data=_PAPER_DATA, samples=50, tokens_per_sample=10_000))),
    (re.compile(r"qwen2\.5-14b", re.I),
     dict(model_name="Qwen/Qwen2.5-14B-Instruct", architecture="qwen2", shape=(48, 8), head_dim=128,
          settings=ProfileSettings(decode_steps=100, tau_stable=0.4, tau_sim=0.5,
                                   calibration_data=_PAPER_DATA, samples=50, tokens_per_sample=10_000))),
)
_ARCH_PATTERNS = ((re.compile(r"qwen3", re.I), "qwen3"), (re.compile(r"qwen2", re.I), "qwen2"),
                  (re.compile(r"llama", re.I), "llama"))


def load_profile(
    path: str | os.PathLike,
    *,
    architecture: str | None = None,
    head_dim: int | None = None,
    model_name: str | None = None,
    weights_fingerprint: str | None = None,
    settings: ProfileSettings | None = None,
) -> HeadProfile:
    """Read a profile: ours, or the HeteroCache authors' published format.

    The format is detected from the contents. For the authors' files, roles
    are mapped by their ``type_map`` names (either naming), clusters and
    allocation values are kept as published (-1 -> NaN for full heads), and
    identity fields they lack are inferred from the file name where known.
    Keyword arguments override the corresponding fields (both formats).
    """
    data = _read_json(path)
    if isinstance(data, Mapping) and data.get("format") == FORMAT_NAME:
        prof = HeadProfile.from_dict(data)
    elif isinstance(data, Mapping) and "classification_matrix" in data:
        prof = _from_official(data, os.path.basename(os.fspath(path)))
    else:
        raise ProfileError(f"{path}: not a head profile (neither {FORMAT_NAME} nor the "
                           "HeteroCache release format with 'classification_matrix')")
    overrides = {k: v for k, v in dict(architecture=architecture, head_dim=head_dim, model_name=model_name,
                                       weights_fingerprint=weights_fingerprint, settings=settings).items()
                 if v is not None}
    return dataclasses.replace(prof, **overrides) if overrides else prof


def _from_official(d: Mapping, filename: str) -> HeadProfile:
    try:
        type_map = d["meta"]["type_map"]
        codes = np.array(d["classification_matrix"], dtype=np.int64)
        alloc = np.array(d["allocation_matrix"], dtype=np.float64)
        relations = d["leader_member_relations"]
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"{filename}: malformed HeteroCache release profile: {e!r}") from None
    # Their code -> our role, through the role NAME (codes need not match ours).
    code_to_role = {}
    for name, code in type_map.items():
        role = _OFFICIAL_ROLE_NAMES.get(str(name).lower())
        if role is None:
            raise ProfileError(f"{filename}: unknown role name {name!r} in meta.type_map; "
                               f"known: {sorted(_OFFICIAL_ROLE_NAMES)}")
        code_to_role[int(code)] = role
    if sorted(code_to_role.values()) != sorted(Role):
        raise ProfileError(f"{filename}: meta.type_map {type_map} does not name all four roles")
    if codes.ndim != 2 or alloc.shape != codes.shape or len(relations) != codes.shape[0]:
        raise ProfileError(f"{filename}: classification {codes.shape}, allocation {alloc.shape} and "
                           f"{len(relations)} cluster layers disagree")
    unknown = set(np.unique(codes).tolist()) - set(code_to_role)
    if unknown:
        raise ProfileError(f"{filename}: role codes {sorted(unknown)} not in meta.type_map")
    roles = np.vectorize(code_to_role.__getitem__, otypes=[np.int8])(codes)
    # Their meta.counts must agree with their matrix; a mismatch means a damaged file.
    for name, n in (d["meta"].get("counts") or {}).items():
        role = _OFFICIAL_ROLE_NAMES.get(str(name).lower())
        if role is not None and int((roles == role).sum()) != int(n):
            raise ProfileError(f"{filename}: meta.counts says {n} {name} heads, matrix has "
                               f"{int((roles == role).sum())}")
    weights = np.where(np.isin(roles, COMPRESSED_ROLES), alloc, np.nan)
    clusters = tuple(
        tuple(Cluster(int(p), tuple(int(s) for s in sats)) for p, sats in layer.items())
        for layer in relations
    )
    ident: dict[str, Any] = {}
    for pattern, info in _KNOWN_MODELS:
        if pattern.search(filename) and info["shape"] == codes.shape:
            ident = {k: v for k, v in info.items() if k != "shape"}
            break
    else:
        for pattern, arch in _ARCH_PATTERNS:
            if pattern.search(filename):
                ident = {"architecture": arch}
                break
    return HeadProfile(roles=roles, clusters=clusters, weights=weights,
                       source=f"heterocache-release:{filename}", **ident)


# ====================================================================== helpers
def _check_clusters(clusters, roles: np.ndarray) -> tuple[tuple[Cluster, ...], ...]:
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


def _shape_text(arch, n_layers, n_kv, head_dim) -> str:
    return (f"{arch or 'unknown architecture'} {n_layers} layers x {n_kv} KV heads x "
            f"head_dim {head_dim if head_dim is not None else '?'}")


def _model_shape(cfg: Any):
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


def _read_json(path) -> Any:
    path = os.fspath(path)
    return read_json(path, ProfileError, missing=f"profile file not found: {path}; {_CALIBRATE_HINT}",
                     fix=_CALIBRATE_HINT)


# ====================================================================== identity / shipped profiles
_FINGERPRINT_SAMPLES = 64  # values hashed per parameter array (start and middle of it)


def weights_fingerprint(params: Any) -> str:
    """A cheap identity of a params pytree: ``"sha256:<16 hex>"``.

    Hashes each leaf's tree path and shape plus ``2 x 64`` values (the first
    ones and those from the middle of the flattened array), rounded to
    bfloat16 first so that the same checkpoint loaded in float32 or bfloat16
    gives the same fingerprint. Reads a few KB, not the weights: it tells
    checkpoints apart, it is not a checksum of every value.
    """
    import hashlib

    import jax
    import ml_dtypes

    h = hashlib.sha256()
    n = _FINGERPRINT_SAMPLES
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        shape = tuple(int(s) for s in np.shape(leaf))
        size = int(np.prod(shape)) if shape else 1
        flat = leaf.reshape(-1) if hasattr(leaf, "reshape") else np.reshape(leaf, -1)
        mid = max(0, size // 2 - n // 2)
        parts = [np.asarray(flat[:n]), np.asarray(flat[mid:mid + n])]
        vals = np.concatenate([p.astype(np.float32) for p in parts]).astype(ml_dtypes.bfloat16)
        h.update(f"{jax.tree_util.keystr(path)}{shape};".encode())
        h.update(vals.view(np.uint16).tobytes())
    return "sha256:" + h.hexdigest()[:16]


# Profiles shipped as package data (hetero_jax/data/), by known model name.
SHIPPED_PROFILES = {"smollm2-135m": "smollm2-135m.profile.json"}
# SyncKV groupings (``hetero-jax profile --method synckv``), same format.
SHIPPED_SYNCKV_PROFILES = {"smollm2-135m": "smollm2-135m.synckv.json"}


def shipped_data_path(table: dict[str, str], model_name: str) -> str | None:
    """Path of the package-data file (hetero_jax/data/) that ``table`` names for ``model_name``, or None."""
    fname = table.get(model_name)
    if fname is None:
        return None
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", fname)
    return path if os.path.isfile(path) else None


def shipped_profile_path(model_name: str) -> str | None:
    """Path of the profile shipped for known model ``model_name``, or None."""
    return shipped_data_path(SHIPPED_PROFILES, model_name)


def default_profile(model_or_config: Any, fingerprint: str | None = None,
                    table: dict[str, str] | None = None) -> HeadProfile | None:
    """The shipped HeadProfile that fits this model, or None (``table``: which shipped files to search,
    default ``SHIPPED_PROFILES``, HeteroCache's; ``SHIPPED_SYNCKV_PROFILES`` for SyncKV's).

    ``model_or_config``: a ``hetero_jax.io.hub.Model`` (its params are
    fingerprinted) or a ModelConfig-like object. A shipped profile fits when
    architecture, layers, KV heads and head_dim agree and, when a fingerprint
    is known (a Model, or ``fingerprint=``), the fingerprints agree.
    With a bare config and no fingerprint only the shape is compared.
    """
    cfg = getattr(model_or_config, "config", model_or_config)
    params = getattr(model_or_config, "params", None)
    fp = fingerprint
    table = SHIPPED_PROFILES if table is None else table
    for name in table:
        path = shipped_data_path(table, name)
        if path is None:
            continue
        prof = load_profile(path)
        try:
            prof.check_compatible(cfg)
        except ProfileError:
            continue
        if fp is None and params is not None:
            fp = weights_fingerprint(params)
        if fp is not None and prof.weights_fingerprint is not None and fp != prof.weights_fingerprint:
            continue
        return prof
    return None
