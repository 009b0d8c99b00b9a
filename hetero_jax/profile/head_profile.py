"""HeadProfile: the offline HeteroCache profile (roles, statistics, clusters, weights per KV head), checked when
built, and its construction from calibration statistics (``build_profile``; SyncKV's k-means grouping,
``build_synckv_profile``). The file it reads and writes is ``schema.py``'s."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import numpy as np

from hetero_jax.dims import axis_size
from hetero_jax.io.files import write_text
from hetero_jax.profile.clustering import (
    COMPRESSED_ROLES,
    FULL_ROLES,
    ROLE_NAMES,
    Cluster,
    WEIGHT_EPS,
    Role,
    allocation_weights,
    assign_roles,
    budget_grid,
    synckv_roles,
)
from hetero_jax.profile.metrics import max_similarity, similarity_edges
from hetero_jax.profile.schema import (EDIT_HINT, FORMAT_NAME, SCHEMA_VERSION, ProfileError, ProfileSettings, check_clusters,
                                       check_fits, check_unit, from_document, grid_mismatch, read_document,
                                       read_fraction, read_int, read_str, shape_text, to_document)

_TAU_FIX = "thresholds are finite numbers in [0, 1], as `hetero-jax profile --tau-stable/--tau-sim/--tau-copy` requires"
_UNIT_FIX = ("stability, similarity, similarity_matrix and copy_score are overlaps and shares, which lie in [0, 1]; "
             "pass NaN where one is unknown")
# Eq. 7-8 hand the compressed heads exactly rho's budget only when their weights average 1.
WEIGHT_MEAN_TOL = 1e-6


def _thresholds(tau_stable, tau_sim, tau_copy) -> tuple[float, float, float | None]:
    """The thresholds of ``build_profile`` / ``reclustered`` checked as calibration checks them (ProfileError)."""
    return (read_fraction(tau_stable, "tau_stable", optional=False, fix=_TAU_FIX),
            read_fraction(tau_sim, "tau_sim", optional=False, fix=_TAU_FIX),
            read_fraction(tau_copy, "tau_copy", fix=_TAU_FIX + " (or None for no copy rule)"))


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class HeadProfile:
    """Per layer, per KV head: role, stability, similarity, cluster, weight.

    Arrays are [L, H] (``similarity_matrix`` [L, H, H]) and read-only.
    ``roles``: int8 Role codes (anchor 1, volatile 2, pivot 3, satellite 4).
    ``stability``: S_stable (Eq. 2), NaN where unknown (imported profiles).
    ``similarity``: each head's max overlap with another head of its layer at
    the graph step (Eq. 3 / App. B.4), NaN where unknown.
    ``weights``: mean-1 allocation weights of compressed heads (Sec. 4.2; a mean
    off 1 by more than ``WEIGHT_MEAN_TOL`` is refused), NaN for full heads.
    ``clusters[l]``: that layer's (pivot, satellites).
    ``copy_score``: share of the copy phase's steps at which the head's argmax
    lands on the earlier occurrence of the token just fed (our duplicate-token
    score, see ``calibrate``), NaN where unknown.
    Stability, similarity, similarity_matrix and copy_score lie in [0, 1] or are NaN (the file's range checks).
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

        def grid(name, value, unit=True):
            a = np.full(shape, np.nan) if value is None else np.array(value, dtype=np.float64)
            if a.shape != shape:
                raise ProfileError(grid_mismatch(name, a.shape, shape))
            if unit:  # the reader's range check: the API writes no file that from_json refuses
                check_unit(a, name, fix=_UNIT_FIX)
            a.setflags(write=False)
            return a

        weights = grid("weights", self.weights, unit=False)
        comp = np.isin(roles, COMPRESSED_ROLES)
        if not np.all(np.isfinite(weights[comp]) & (weights[comp] > 0)):
            raise ProfileError("every compressed head (anchor, satellite) needs a finite weight > 0")
        if not np.all(np.isnan(weights[~comp])):
            raise ProfileError("full heads (volatile, pivot) must have weight NaN (no budget share)")
        if comp.any() and abs(weights[comp].mean() - 1.0) > WEIGHT_MEAN_TOL:
            raise ProfileError(
                f"the allocation weights of the {int(comp.sum())} compressed heads (anchor, satellite) average "
                f"{weights[comp].mean():.9g}, not 1: Eq. 7-8 give them rho's budget only with mean-1 weights; "
                f"divide them by their mean (as build_profile does), or, for a file: {EDIT_HINT}")
        simm = None
        if self.similarity_matrix is not None:
            simm = np.array(self.similarity_matrix, dtype=np.float64)
            if simm.shape != shape + (shape[1],):
                raise ProfileError(grid_mismatch("similarity_matrix", simm.shape, shape + (shape[1],)))
            check_unit(simm, "similarity_matrix", fix=_UNIT_FIX)
            simm.setflags(write=False)
        clusters = check_clusters(self.clusters, roles)
        roles.setflags(write=False)
        for name, value in (("roles", roles), ("weights", weights), ("clusters", clusters),
                            ("stability", grid("stability", self.stability)),
                            ("similarity", grid("similarity", self.similarity)),
                            ("copy_score", grid("copy_score", self.copy_score)),
                            ("similarity_matrix", simm)):
            object.__setattr__(self, name, value)
        if not isinstance(self.settings, ProfileSettings):
            raise ProfileError("settings must be a ProfileSettings")
        read_int(self.head_dim, "head_dim", minimum=1, fix=None)
        for name in ("architecture", "model_name", "weights_fingerprint", "source"):
            read_str(getattr(self, name), name, optional=name != "source", fix=None)

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
        _thresholds(0.0 if tau_stable is None else tau_stable, 0.0 if tau_sim is None else tau_sim,
                    tau_copy)  # refuse a bad argument before anything else
        if tau_copy is not None and np.isnan(self.copy_score).all():
            raise ProfileError("this profile stores no copy scores, so tau_copy cannot apply; calibrate one "
                               "with `hetero-jax profile --copy-steps N`")
        tau_copy = self.settings.tau_copy if tau_copy is None else tau_copy
        return build_profile(self.stability, self.similarity_matrix, tau_stable=tau_stable, tau_sim=tau_sim,
                             copy_score=self.copy_score, tau_copy=tau_copy, similarity=self.similarity,
                             architecture=self.architecture, head_dim=self.head_dim, model_name=self.model_name,
                             weights_fingerprint=self.weights_fingerprint, settings=self.settings)

    def describe_shape(self) -> str:
        return shape_text(self.architecture, self.num_layers, self.num_kv_heads, self.head_dim)

    def check_compatible(self, config_like: Any, weights_fingerprint: str | None = None) -> None:
        """Raise ProfileError unless this profile fits the model (``schema.check_fits``: ``config_like`` is a
        ModelConfig, an object with its shape fields or a mapping, ours or an HF ``config.json`` dict)."""
        check_fits(self, config_like, weights_fingerprint)

    # ------------------------------------------------------------ equality
    def __eq__(self, other):
        if not isinstance(other, HeadProfile):
            return NotImplemented
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                if (a is None or b is None or a.shape != b.shape
                        or not np.array_equal(a, b, equal_nan=a.dtype.kind == "f")):
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
        return to_document(self)

    def to_json(self, path: str | os.PathLike) -> None:
        """Write our versioned JSON (standard JSON: NaN becomes null), whole or not at all (OutputError for a
        path that cannot be written)."""
        write_text(path, json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n", kind=FORMAT_NAME)

    @classmethod
    def from_dict(cls, d: Mapping, *, where: str | None = None) -> "HeadProfile":
        """The profile of our JSON document ``d`` (ProfileError, prefixed with ``where``, for a malformed one)."""
        return from_document(d, cls, where)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "HeadProfile":
        """Read our JSON (see :func:`load_profile` for the authors' format too)."""
        d = read_document(path)
        if not isinstance(d, Mapping):
            raise ProfileError(f"{os.fspath(path)}: not a head profile (a JSON {type(d).__name__}, not an object)")
        return cls.from_dict(d, where=os.fspath(path))


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
    kept whole (``clustering.assign_roles``). A NaN stability (unknown) makes an unclustered head volatile and is
    refused on a satellite, whose weight needs it. ``settings.tau_*`` are filled from the arguments. ``identity``: the
    profile's ``architecture``, ``head_dim``, ``model_name`` and ``weights_fingerprint`` (see :class:`HeadProfile`).
    """
    tau_stable, tau_sim, tau_copy = _thresholds(tau_stable, tau_sim, tau_copy)
    stab = np.asarray(stability, dtype=np.float64)
    simm = np.asarray(similarity_matrix, dtype=np.float64)
    if stab.ndim != 2:
        raise ProfileError(f"stability must be a [layers, KV heads] grid, got shape {stab.shape}")
    if simm.shape != stab.shape + (stab.shape[-1],):
        raise ProfileError(f"similarity_matrix {simm.shape} does not match stability {stab.shape}")
    if copy_score is not None:
        copy_score = np.asarray(copy_score, dtype=np.float64)
        if copy_score.shape != stab.shape:
            raise ProfileError(f"copy_score {copy_score.shape} does not match stability {stab.shape}")
        check_unit(copy_score, "copy_score", fix=_UNIT_FIX)
    check_unit(stab, "stability", fix=_UNIT_FIX)
    check_unit(simm, "similarity_matrix", fix=_UNIT_FIX)
    adjs = [similarity_edges(s, tau_sim) for s in simm]
    roles, clusters = assign_roles(stab, adjs, tau_stable, copy_score=copy_score, tau_copy=tau_copy)
    unknown = (roles == Role.SATELLITE) & np.isnan(stab)
    if unknown.any():  # an unclustered NaN head is volatile; a satellite needs S for its weight 1 / (S + eps)
        layer, head = (int(i) for i in np.argwhere(unknown)[0])
        pivot = next(c.pivot for c in clusters[layer] if head in c.satellites)
        raise ProfileError(
            f"layer {layer} head {head}: stability is NaN (unknown), but the similarity graph (tau_sim={tau_sim}) "
            f"makes it a satellite of pivot {pivot}, and a satellite's budget weight is 1 / (S + {WEIGHT_EPS:g}); "
            "pass its measured stability (NaN only suits a head that stays unclustered: it becomes volatile)")
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
