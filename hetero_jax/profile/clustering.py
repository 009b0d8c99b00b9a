"""Head taxonomy and budgets (HeteroCache, paper Sec. 4.1-4.2, App. C.2).

Roles (codes equal the authors' published ``type_map``, so grids compare
directly): anchor 1, volatile 2, pivot 3, satellite 4. Full heads (keep all
prompt KV on the device) = volatile + pivot; compressed heads = anchor +
satellite.

Notation: ``L`` layers, ``H`` KV heads per layer.
"""

from __future__ import annotations

import enum
import itertools
import math
from typing import NamedTuple

import numpy as np

from hetero_jax.errors import HeteroJaxError
from hetero_jax.water_filling import water_level

__all__ = [
    "Role",
    "ROLE_NAMES",
    "FULL_ROLES",
    "COMPRESSED_ROLES",
    "Cluster",
    "RoleAssignment",
    "BudgetTooSmallError",
    "star_clustering",
    "assign_roles",
    "allocation_weights",
    "base_budget",
    "min_rho",
    "head_budgets",
    "budget_grid",
    "KMeansResult",
    "kmeans_rows",
    "synckv_roles",
    "default_n_r",
]


class Role(enum.IntEnum):
    ANCHOR = 1  # unique, stable: statically compressed
    VOLATILE = 2  # unique, shifting: full KV on device
    PIVOT = 3  # cluster centre: full KV, monitors drift for its satellites
    SATELLITE = 4  # cluster member: compressed, refreshed from host on drift


ROLE_NAMES = {r: r.name.lower() for r in Role}
FULL_ROLES = (Role.VOLATILE, Role.PIVOT)
COMPRESSED_ROLES = (Role.ANCHOR, Role.SATELLITE)

# Eq. 8 weight regulariser: w = 1 / (S + eps), as in the release (the paper
# writes 1/S, which is infinite for a head whose stability is 0).
WEIGHT_EPS = 1e-6


class Cluster(NamedTuple):
    pivot: int
    satellites: tuple[int, ...]


class RoleAssignment(NamedTuple):
    roles: np.ndarray  # int8 [L, H], Role codes
    clusters: tuple[tuple[Cluster, ...], ...]  # per layer, in selection order


class BudgetTooSmallError(HeteroJaxError, ValueError):
    """rho leaves the compressed heads less than one token each on average (Eq. 7 gives L_base < 1)."""

    def __init__(self, message: str, min_rho: float):
        super().__init__(message)
        self.min_rho = min_rho


# ----------------------------------------------------------- star clustering
def star_clustering(adj: np.ndarray) -> list[Cluster]:
    """Greedy star clustering of one layer's similarity graph (App. C.2).

    ``adj`` bool [H, H], symmetric, no self loops. Repeatedly: among
    unassigned heads take the one with the most unassigned neighbours (ties:
    lowest index); stop when that degree is 0; it becomes a pivot and its
    unassigned neighbours its satellites (ascending). Returns the clusters in
    selection order. Heads in no cluster are left for :func:`assign_roles`.
    """
    adj = np.asarray(adj)
    if adj.ndim != 2 or adj.shape[0] != adj.shape[1]:
        raise ValueError(f"adjacency must be square [H, H], got shape {adj.shape}")
    adj = adj.astype(bool)
    if np.any(np.diag(adj)):
        raise ValueError("adjacency has self loops; build it with similarity_edges()")
    if not np.array_equal(adj, adj.T):
        raise ValueError("adjacency is not symmetric")
    free = np.ones(adj.shape[0], dtype=bool)
    clusters: list[Cluster] = []
    while free.any():
        # Effective degree: neighbours that are still unassigned. Assigned
        # heads get -1 so they are never picked; argmax returns the first
        # (lowest-index) maximum, which is the tie rule.
        deg = np.where(free, (adj & free[None, :]).sum(axis=1), -1)
        p = int(np.argmax(deg))
        if deg[p] <= 0:
            break
        sats = np.flatnonzero(adj[p] & free)
        free[p] = False
        free[sats] = False
        clusters.append(Cluster(p, tuple(int(s) for s in sats)))
    return clusters


def assign_roles(stability: np.ndarray, adjs, tau_stable: float, copy_score: np.ndarray | None = None,
                 tau_copy: float | None = None) -> RoleAssignment:
    """Roles for every head of the model (Sec. 4.1 as pinned by the design notes, shared/design/METHODS.md,
    plus our copy rule).

    ``stability`` float [L, H] (Eq. 2); ``adjs`` bool [L, H, H] (or a sequence
    of L [H, H] graphs) from :func:`similarity_edges`. Clustered heads become
    pivot/satellite; each unclustered head is anchor if S >= tau_stable, else
    volatile (a NaN stability fails the test and gives volatile: keeping full
    KV is the safe side).

    Departure (ours): ``copy_score`` float [L, H] (duplicate-token score of the
    calibration's copy phase, NaN unknown) with ``tau_copy``: a compressed head
    (anchor or satellite) scoring >= tau_copy becomes volatile. A satellite
    leaves its cluster; a pivot left with no satellite becomes volatile too (it
    would watch over nobody). Such heads look stable by top-k overlap yet put
    half their attention on a few tokens while a span is copied, which a static
    selection cannot know in advance (README, "Where the misses came from").
    """
    stab = np.asarray(stability, dtype=np.float64)
    if stab.ndim != 2:
        raise ValueError(f"stability must be [L, H], got shape {stab.shape}")
    n_layers, n_heads = stab.shape
    if len(adjs) != n_layers:
        raise ValueError(f"got {len(adjs)} adjacency matrices for {n_layers} layers")
    copy_heads = np.zeros(stab.shape, bool)
    if copy_score is not None and tau_copy is not None:
        cs = np.asarray(copy_score, dtype=np.float64)
        if cs.shape != stab.shape:
            raise ValueError(f"copy_score {cs.shape} and stability {stab.shape} differ in shape")
        copy_heads = cs >= tau_copy  # NaN (unknown) compares False: the head keeps its role
    roles = np.where(stab >= tau_stable, Role.ANCHOR, Role.VOLATILE).astype(np.int8)
    all_clusters = []
    for layer, adj in enumerate(adjs):
        if np.shape(adj) != (n_heads, n_heads):
            raise ValueError(f"layer {layer}: adjacency shape {np.shape(adj)} != ({n_heads}, {n_heads})")
        clusters = []
        for c in star_clustering(adj):
            sats = tuple(s for s in c.satellites if not copy_heads[layer, s])
            roles[layer, [s for s in c.satellites if s not in sats]] = Role.VOLATILE
            if not sats:
                roles[layer, c.pivot] = Role.VOLATILE
                continue
            roles[layer, c.pivot] = Role.PIVOT
            roles[layer, list(sats)] = Role.SATELLITE
            clusters.append(Cluster(c.pivot, sats))
        all_clusters.append(tuple(clusters))
    roles[copy_heads & (roles == Role.ANCHOR)] = Role.VOLATILE
    return RoleAssignment(roles, tuple(all_clusters))


def allocation_weights(stability: np.ndarray, roles: np.ndarray) -> np.ndarray:
    """Inverse-stability weights (Sec. 4.2): float64 [L, H].

    w_i = 1 / (S_i + 1e-6) over the compressed heads (anchor + satellite) of
    the whole model, scaled so they average exactly 1 over those heads (then
    Eq. 8 reduces to l_i = L_base * w_i). Full heads (volatile, pivot) get
    NaN: they have no budget share, and NaN makes any accidental use loud.
    """
    stab = np.asarray(stability, dtype=np.float64)
    roles = np.asarray(roles)
    if stab.shape != roles.shape:
        raise ValueError(f"stability {stab.shape} and roles {roles.shape} differ in shape")
    comp = np.isin(roles, COMPRESSED_ROLES)
    w = np.full(stab.shape, np.nan)
    if comp.any():
        s = stab[comp]
        if not np.all(np.isfinite(s)) or np.any(s < 0):
            raise ValueError("compressed heads need finite, non-negative stability scores")
        raw = 1.0 / (s + WEIGHT_EPS)
        w[comp] = raw / raw.mean()
    return w


# ------------------------------------------------------------------- budgets
def min_rho(n_total: int, n_full: int, n_comp: int, prompt_len: int) -> float:
    """The rho at which Eq. 7 gives L_base = 1 token: (N_full + N_comp / L) / N."""
    return (n_full + n_comp / prompt_len) / n_total


# L_base within this of 1 token counts as 1: rho * N in floating point may land a hair below N_full + N_comp / L.
_L_BASE_EPS = 1e-9


def smallest_working_rho(n_total: int, n_full: int, n_comp: int, prompt_len: int) -> float:
    """The smallest rho with 4 decimals that ``base_budget`` accepts; rho - 0.0001 is refused."""
    need = min_rho(n_total, n_full, n_comp, prompt_len)
    rho = math.ceil(need * 1e4 - 1e-6) / 1e4  # 0.2008 stays 0.2008 despite 0.2008 * 1e4 = 2008.0000000000002
    while (rho * n_total - n_full) * prompt_len / n_comp < 1.0 - _L_BASE_EPS:
        rho = round(rho + 1e-4, 4)
    return min(rho, 1.0)


def base_budget(rho: float, n_total: int, n_full: int, n_comp: int, prompt_len: int) -> float:
    """Eq. 7: L_base = (rho * N - N_full) * L / N_comp (real-valued, not floored).

    N, N_full, N_comp count KV heads over ALL layers; L is the prompt length.
    Raises BudgetTooSmallError (a ValueError) when L_base < 1 token (below
    that, Eq. 8's floor would leave compressed heads empty and the clamp to 1
    token would keep more than rho), naming the smallest working rho with 4
    decimals: that value runs and the one 0.0001 below it is refused.
    L_base >= 1 does not bound the total, though: a head with L_base * w_i < 1
    still gets 1 token (``head_budgets``), so with uneven weights and L_base
    near 1 the compressed heads can keep a few tokens more than Eq. 7's
    (rho * N - N_full) * L, at most one per such head.
    """
    if n_total <= 0 or n_full < 0 or n_comp < 0 or n_full + n_comp != n_total:
        raise ValueError(f"need N_full + N_comp == N > 0, got N={n_total}, "
                         f"N_full={n_full}, N_comp={n_comp}")
    if prompt_len < 1:
        raise ValueError(f"prompt length must be >= 1, got {prompt_len}")
    if n_comp == 0:
        raise ValueError("the profile has no compressed heads: every head keeps its full KV "
                         "(rho is effectively 1); Eq. 7 is undefined")
    l_base = (rho * n_total - n_full) * prompt_len / n_comp
    if l_base < 1.0 - _L_BASE_EPS:
        need = min_rho(n_total, n_full, n_comp, prompt_len)
        shown = smallest_working_rho(n_total, n_full, n_comp, prompt_len)
        raise BudgetTooSmallError(
            f"rho={rho:g} is too small for this profile: {n_full} of {n_total} KV heads "
            f"keep their full KV, which alone needs rho >= {n_full / n_total:.4f}, leaving "
            f"L_base = {l_base:.4g} tokens for the {n_comp} compressed heads at prompt "
            f"length {prompt_len}; the smallest rho that works is {shown:.4f} "
            f"(L_base = 1 token)",
            min_rho=need,
        )
    return l_base


def head_budgets(l_base: float, weights: np.ndarray, prompt_len: int) -> np.ndarray:
    """Eq. 8 per compressed head: l_i = min(L, floor(L_base * w_i)), at least 1.

    ``weights`` float [...] (mean-1 weights of compressed heads; all finite
    and > 0) -> int64 [...]. The clamp to >= 1 token is ours: a head with an
    empty cache would give NaN attention (a pitfall the design notes list). It
    adds up to 1 token per head whose L_base * w_i is below 1, which the floor
    of the other heads need not offset: the total may then exceed Eq. 7's
    L_base * N_comp. The floor is
    plain IEEE (e.g. 100 * 0.29 = 28.999... -> 28), as in the equation.
    """
    w = np.asarray(weights, dtype=np.float64)
    if not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError("head_budgets takes the weights of compressed heads only "
                         "(finite and > 0); full heads keep all L tokens")
    if prompt_len < 1:
        raise ValueError(f"prompt length must be >= 1, got {prompt_len}")
    l = np.floor(l_base * w)
    return np.clip(l, 1, prompt_len).astype(np.int64)


def budget_grid(rho: float, roles: np.ndarray, weights: np.ndarray, prompt_len: int) -> np.ndarray:
    """Tokens each KV head keeps on the device after prefill: int64 [L, H].

    Full heads (volatile, pivot) keep all ``prompt_len``; compressed heads
    get Eq. 8 with L_base from Eq. 7 over the whole model.
    """
    roles = np.asarray(roles)
    comp = np.isin(roles, COMPRESSED_ROLES)
    n_comp = int(comp.sum())
    l_base = base_budget(rho, roles.size, roles.size - n_comp, n_comp, prompt_len)
    out = np.full(roles.shape, prompt_len, dtype=np.int64)
    w = np.asarray(weights, dtype=np.float64)[comp]
    out[comp] = head_budgets(l_base, w, prompt_len)
    if np.any(l_base * w > prompt_len):
        # Eq. 8 caps these heads at L and is silent on the excess; we hand it to the other
        # compressed heads (water-filling), so the model-wide total of Eq. 7 is kept and
        # rho = 1 keeps every token. Without a capped head this is plain Eq. 8.
        target = l_base * n_comp
        if target >= n_comp * prompt_len:
            out[comp] = prompt_len
        else:
            lo_c, _ = water_level(w, target, 0.0, prompt_len)
            out[comp] = np.clip(np.floor(np.minimum(prompt_len, lo_c * w) + 1e-9), 1, prompt_len)
    return out


# ----------------------------------------------------------- SyncKV: k-means over distance rows
class KMeansResult(NamedTuple):
    labels: np.ndarray  # int64 [H]: cluster of each point (clusters numbered by their representative)
    centroids: np.ndarray  # float64 [n, F]
    representatives: np.ndarray  # int64 [n]: per cluster, the member closest to its centroid (ascending)
    inertia: float  # sum of squared distances to the assigned centroids


KMEANS_EXHAUSTIVE = 256  # C(H, n) initialisations at most are all tried; beyond, k-means++ restarts
KMEANS_RESTARTS = 32


def _sq_dists(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    return ((x[:, None, :] - c[None, :, :]) ** 2).sum(-1)  # [H, n]


def _lloyd(x: np.ndarray, cent: np.ndarray, max_iter: int = 300) -> tuple[np.ndarray, np.ndarray, float]:
    """Lloyd iterations from ``cent`` until the assignment stops changing; an emptied cluster is re-seeded
    with the point farthest from its current centroid (ties: lowest index). Returns (labels, centroids,
    inertia)."""
    cent = cent.copy()
    labels = None
    for _ in range(max_iter):
        d = _sq_dists(x, cent)
        new = np.argmin(d, axis=1)  # ties to the lower cluster index
        for j in range(len(cent)):
            if not (new == j).any():  # empty: take the worst-served point (of a cluster with > 1 member)
                far = d[np.arange(len(x)), new]
                sizes = np.bincount(new, minlength=len(cent))
                far = np.where(sizes[new] > 1, far, -1.0)
                i = int(np.argmax(far))
                new[i] = j
        if labels is not None and np.array_equal(new, labels):
            break
        labels = new
        cent = np.stack([x[labels == j].mean(0) for j in range(len(cent))])
    inertia = float(((x - cent[labels]) ** 2).sum())
    return labels, cent, inertia


def _kmeans_pp(x: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding: first centre uniform, then each next with probability proportional to D^2."""
    idx = [int(rng.integers(len(x)))]
    for _ in range(1, n):
        d = _sq_dists(x, x[idx]).min(1)
        p = d / d.sum() if d.sum() > 0 else np.full(len(x), 1.0 / len(x))
        idx.append(int(rng.choice(len(x), p=p)))
    return x[idx]


def kmeans_rows(rows: np.ndarray, n_clusters: int) -> KMeansResult:
    """Deterministic k-means of the rows of ``rows`` [H, F] into ``n_clusters`` clusters (SyncKV §4.1).

    Initialisations: every choice of ``n_clusters`` distinct rows when there are at most
    ``KMEANS_EXHAUSTIVE`` of them, else ``KMEANS_RESTARTS`` k-means++ seedings (numpy seed 0); each runs
    Lloyd to convergence and the lowest inertia wins (ties: the first tried). Each cluster's
    representative is its member nearest the centroid (ties: lowest index); clusters are numbered in the
    order of their representatives. ``n_clusters >= H`` puts every row in its own cluster.
    """
    x = np.asarray(rows, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"kmeans_rows takes a non-empty [H, F] matrix, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("kmeans_rows: rows must be finite")
    h = x.shape[0]
    if isinstance(n_clusters, bool) or int(n_clusters) != n_clusters or n_clusters < 1:
        raise ValueError(f"n_clusters must be an integer >= 1, got {n_clusters!r}")
    n = min(int(n_clusters), h)
    if math.comb(h, n) <= KMEANS_EXHAUSTIVE:
        inits = (x[list(c)] for c in itertools.combinations(range(h), n))
    else:
        rng = np.random.default_rng(0)
        inits = (_kmeans_pp(x, n, rng) for _ in range(KMEANS_RESTARTS))
    best = None
    for c0 in inits:
        labels, cent, inertia = _lloyd(x, c0)
        if best is None or inertia < best[2] - 1e-12:
            best = (labels, cent, inertia)
    labels, cent, inertia = best
    reps = []
    for j in range(n):
        members = np.flatnonzero(labels == j)
        d = np.sqrt(((x[members] - cent[j]) ** 2).sum(-1))
        reps.append(int(members[np.argmin(d)]))  # argmin: ties to the lowest index (members ascending)
    order = np.argsort(reps)
    relabel = np.empty(n, np.int64)
    relabel[order] = np.arange(n)
    return KMeansResult(relabel[labels].astype(np.int64), cent[order], np.asarray(reps, np.int64)[order], inertia)


def default_n_r(num_kv_heads: int) -> int:
    """SyncKV's representatives per layer: a quarter of the KV heads (the paper's 2 of 8 and 1 of 4), >= 1."""
    return max(1, int(math.floor(num_kv_heads / 4 + 0.5)))


def synckv_roles(similarity: np.ndarray, n_r: int) -> RoleAssignment:
    """SyncKV's head grouping from per-layer mean top-k overlaps ``similarity`` [L, H, H].

    Per layer: D = max(S) - S, k-means of D's rows into ``n_r`` clusters (:func:`kmeans_rows`); each
    cluster's representative (R-head) becomes a pivot, its other members satellites (NR-heads). A cluster
    of one head becomes a volatile head: it keeps its full KV and has no one to lead.
    """
    simm = np.asarray(similarity, dtype=np.float64)
    if simm.ndim != 3 or simm.shape[1] != simm.shape[2]:
        raise ValueError(f"similarity must be [L, H, H], got shape {simm.shape}")
    roles = np.full(simm.shape[:2], Role.VOLATILE, np.int8)
    clusters = []
    for layer, s in enumerate(simm):
        km = kmeans_rows(s.max() - s, n_r)
        layer_clusters = []
        for j, rep in enumerate(km.representatives):
            sats = tuple(int(h) for h in np.flatnonzero(km.labels == j) if h != rep)
            if sats:
                roles[layer, rep] = Role.PIVOT
                roles[layer, list(sats)] = Role.SATELLITE
                layer_clusters.append(Cluster(int(rep), sats))
        clusters.append(tuple(layer_clusters))
    return RoleAssignment(roles, tuple(clusters))
