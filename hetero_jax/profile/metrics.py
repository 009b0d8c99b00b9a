"""Set metrics for head profiling (HeteroCache, paper Sec. 3 and App. B/C).

Everything here is small, exact numpy on index sets. A set of token indices
is given either as a 1-D integer array (order and duplicates are ignored) or
as a boolean membership mask over the token axis. The mask forms are the
vectorised ones: intersections become ``&`` + ``sum`` (or a matmul for all
pairs) with no sorting, which is also what the runtime drift check uses.

Notation: ``H`` KV heads in one layer, ``T`` tokens, ``S`` decode steps.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = [
    "topk_set",
    "topk_mask",
    "indices_to_mask",
    "overlap",
    "overlap_masks",
    "stability",
    "stability_masks",
    "similarity_matrix",
    "similarity_edges",
    "max_similarity",
    "similarity_score",
]


# --------------------------------------------------------------------- top-k
def _topk_order(scores: np.ndarray) -> np.ndarray:
    # A stable sort of the negated scores puts larger scores first and keeps
    # equal scores in index order, so ties go to the lower index. float64
    # holds every float32/float16 value exactly, so the order is unchanged.
    # NaN sorts last (numpy puts NaN at the end), i.e. it counts as smallest.
    neg = -np.asarray(scores, dtype=np.float64)
    return np.argsort(neg, axis=-1, kind="stable")


def topk_set(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest entries of ``scores`` [T], sorted ascending.

    This is K(X) of the paper's Eq. 1. Ties are broken toward the lower
    index (deterministic, unlike ``jax.lax.top_k`` on some backends); NaN
    counts as the smallest value. ``k >= T`` returns every index.
    Returns int64 [min(k, T)].
    """
    scores = np.asarray(scores)
    if scores.ndim != 1:
        raise ValueError(f"topk_set expects 1-D scores [T], got shape {scores.shape}")
    k = _check_k(k)
    return np.sort(_topk_order(scores)[:k]).astype(np.int64)


def topk_mask(scores: np.ndarray, k: int) -> np.ndarray:
    """Boolean membership mask of the top-``k`` entries along the last axis.

    ``scores`` [..., T] -> bool [..., T] with ``min(k, T)`` True per row; same
    tie rule as :func:`topk_set` (lower index wins).
    """
    scores = np.asarray(scores)
    if scores.ndim < 1:
        raise ValueError("topk_mask expects scores with a token axis [..., T]")
    k = _check_k(k)
    top = _topk_order(scores)[..., :k]
    mask = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(mask, top, True, axis=-1)
    return mask


def _check_k(k: int) -> int:
    if int(k) != k or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    return int(k)


def indices_to_mask(indices: np.ndarray, length: int) -> np.ndarray:
    """Index set [n] -> bool mask [length]. Indices must lie in [0, length)."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= length):
        raise ValueError(f"index out of range for a mask of length {length}: "
                         f"min {idx.min()}, max {idx.max()}")
    mask = np.zeros(int(length), dtype=bool)
    mask[idx] = True
    return mask


# ------------------------------------------------------------------- overlap
def overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Overlap coefficient |A ∩ B| / min(|A|, |B|) of two index sets (Eq. 1).

    Duplicates are ignored (sets). An empty set has no defined overlap and
    raises ValueError rather than returning a silent 0 or NaN.
    """
    sa = np.unique(np.asarray(a, dtype=np.int64))
    sb = np.unique(np.asarray(b, dtype=np.int64))
    denom = min(sa.size, sb.size)
    if denom == 0:
        raise ValueError("overlap of an empty index set is undefined")
    inter = np.intersect1d(sa, sb, assume_unique=True).size
    return inter / denom


def overlap_masks(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Eq. 1 on boolean masks: ``a``, ``b`` broadcastable [..., T] -> float64 [...].

    Bitmap form: popcount(a & b) / min(popcount a, popcount b); no sorting.
    Masks of different widths must be padded with False by the caller (a
    decode step sees more tokens than the prefill). Raises ValueError if any
    set is empty.
    """
    a = np.asarray(a, dtype=bool)
    b = np.asarray(b, dtype=bool)
    inter = np.sum(a & b, axis=-1)
    denom = np.minimum(np.sum(a, axis=-1), np.sum(b, axis=-1))
    if np.any(denom == 0):
        raise ValueError("overlap of an empty index set is undefined")
    return inter / denom


# ----------------------------------------------------------------- stability
def stability(prefill_set: np.ndarray, decode_sets: Sequence[np.ndarray]) -> float:
    """S_stable of one head (Eq. 2): median over steps t of O(K_t, K_prefill).

    ``prefill_set``: index array; ``decode_sets``: S index arrays (one per
    decode step; their lengths may differ). With an even S the median is the
    mean of the two middle overlaps (``np.median``).
    """
    if len(decode_sets) == 0:
        raise ValueError("stability needs at least one decode step")
    return float(np.median([overlap(prefill_set, d) for d in decode_sets]))


def stability_masks(prefill: np.ndarray, decode: np.ndarray) -> np.ndarray:
    """Vectorised Eq. 2: ``prefill`` bool [..., T], ``decode`` bool [S, ..., T] -> [...].

    Median over the leading step axis of the bitmap overlaps; e.g. prefill
    [L, H, T] with decode [S, L, H, T] gives stability [L, H].
    """
    decode = np.asarray(decode, dtype=bool)
    if decode.ndim < 2 or decode.shape[0] == 0:
        raise ValueError("decode masks need a leading, non-empty step axis [S, ..., T]")
    return np.median(overlap_masks(np.asarray(prefill, bool)[None], decode), axis=0)


# ---------------------------------------------------------------- similarity
def similarity_matrix(sets_per_head) -> np.ndarray:
    """Pairwise overlap [H, H] of the heads of one layer at one step.

    ``sets_per_head``: bool masks [H, T], or a sequence of H index arrays
    (converted to masks). Entry (i, j) = O(K(i), K(j)) (Eq. 1); symmetric,
    diagonal 1. All pairs at once through one integer matmul of the masks.
    """
    if isinstance(sets_per_head, np.ndarray) and sets_per_head.dtype == bool:
        masks = sets_per_head
    else:
        idx = [np.asarray(s, dtype=np.int64).reshape(-1) for s in sets_per_head]
        width = 1 + max((int(s.max()) for s in idx if s.size), default=-1)
        masks = np.stack([indices_to_mask(s, width) for s in idx]) if idx else np.zeros((0, 0), bool)
    if masks.ndim != 2:
        raise ValueError(f"similarity_matrix expects masks [H, T], got shape {masks.shape}")
    m = masks.astype(np.int64)
    sizes = m.sum(axis=1)
    if np.any(sizes == 0):
        raise ValueError("overlap of an empty index set is undefined "
                         f"(empty set for head(s) {np.flatnonzero(sizes == 0).tolist()})")
    inter = m @ m.T
    return inter / np.minimum(sizes[:, None], sizes[None, :])


def similarity_edges(sim: np.ndarray, tau_sim: float) -> np.ndarray:
    """Similarity graph of one layer: bool [H, H], edge when O >= tau_sim.

    Same-layer only (the caller passes one layer's matrix). No self loops.
    Symmetric by construction: an edge needs the threshold met both ways,
    which for the (symmetric) overlap coefficient changes nothing but guards
    against a hand-built asymmetric matrix.
    """
    sim = np.asarray(sim, dtype=np.float64)
    if sim.ndim != 2 or sim.shape[0] != sim.shape[1]:
        raise ValueError(f"similarity matrix must be square [H, H], got {sim.shape}")
    adj = sim >= tau_sim
    adj &= adj.T
    np.fill_diagonal(adj, False)
    return adj


def max_similarity(sim: np.ndarray) -> np.ndarray:
    """Each head's largest overlap with another head of its layer: [..., H, H] -> [..., H].

    The per-step term of Eq. 3 (App. B.4 uses a single representative step).
    A layer with one head has no other head: NaN.
    """
    sim = np.array(sim, dtype=np.float64)
    h = sim.shape[-1]
    if h < 2:
        return np.full(sim.shape[:-1], np.nan)
    eye = np.eye(h, dtype=bool)
    sim[..., eye] = -np.inf  # exclude the head itself
    return sim.max(axis=-1)


def similarity_score(sims_per_step: np.ndarray) -> np.ndarray:
    """S_sim (Eq. 3): median over steps of the per-step max overlap.

    ``sims_per_step`` [S, ..., H, H] (e.g. [S, L, H, H]) -> [..., H].
    """
    sims = np.asarray(sims_per_step, dtype=np.float64)
    if sims.ndim < 3 or sims.shape[0] == 0:
        raise ValueError("expected per-step similarity matrices [S, ..., H, H]")
    return np.median(max_similarity(sims), axis=0)
