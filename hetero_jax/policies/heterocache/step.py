"""HeteroCache's traced decode step: one pass of attention that also scores the pivots and copy heads, the
pivots' pooled scores and chance-normalised overlap (Eq. 9), and the drift decision of every pivot at once
(Eq. 10), with what a recall reads (the top sets of the latest scores) and the new K_base."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from flax import struct

from hetero_jax.model.cache import capacity_bucket
from hetero_jax.model.spec import axes_field
from hetero_jax.policies.profiled import take_slots


@struct.dataclass
class PivotBase:
    """A pivot layer's decode state: each pivot's K_base (Eq. 9's reference set).

    In a batch the width is the largest L_base; sequence b's rows hold its own L_base[b] positions and -1
    after them, so the count of positions (``base_sizes``) is its L_base and it is checked as if alone."""

    k_base: jax.Array = axes_field("batch", "pivots", "slots")  # [B, Np, max L_base] int32 positions; -1 = none


def base_sizes(k_base):
    """Each pivot's own L_base [B, Np] int32: the positions its K_base holds (the rest of the row is -1)."""
    return (k_base >= 0).sum(axis=-1, dtype=jnp.int32)


def base_width(l_base) -> int:
    """K_base's static width for a batch whose sequences keep ``l_base`` [B] positions each: the largest,
    bucketed as a layer's key bound is (``cache.capacity_bucket``), so prompts of nearby lengths share the decode
    step and the drift check (each row keeps its own L_base, -1 after it)."""
    return capacity_bucket(int(np.max(l_base)))


def mask_base(idx, l_base):
    """A K_base of each sequence's own size from the top-(largest L_base) positions idx [B, Np, K] (best first,
    ``lax.top_k``, whose first n are the top-n): -1 past l_base[b] ([B] int)."""
    keep = jnp.arange(idx.shape[-1], dtype=jnp.int32)[None, None, :] < jnp.asarray(l_base, jnp.int32)[:, None, None]
    return jnp.where(keep, idx, -1).astype(jnp.int32)


def spread_checks() -> bool:
    """Where the pivots' drift statistics are computed (read at trace time): in every decode step (True: the
    CPU; the check then takes the median of the buffered o'_t, so no step does W steps' work) or all at once
    at the check from the buffered logits (False: a GPU, where a layer's statistics in the step cost a dozen
    launches and the check's are a few kernels for every pivot of the model). Same numbers either way."""
    return not pallas_kernels.traced_for_gpu()


def pivot_statistics(logits, lengths, k_base):
    """A pivot's pooled scores and o'_t from its logits over its prompt rows: logits [B, Np, ..., G, T] (any
    steps between), lengths [B, Np], k_base [B, Np, K] (each row its own L_base positions, ``PivotBase``).
    Returns (scores [B, Np, ..., T]: softmax over the prompt rows, 5-tap pooling, GQA max,
    ``pallas_kernels.pivot_pooled_scores``; o'_t [B, Np, ...]: the chance-normalised overlap of their
    top-L_base with K_base, Eq. 9, ``pallas_kernels.base_overlap``, with each pivot's own L_base)."""
    B, Np = logits.shape[:2]
    mid, (G, T) = logits.shape[2:-2], logits.shape[-2:]
    n = int(np.prod(mid, dtype=np.int64))
    scores = pallas_kernels.pivot_pooled_scores(logits.reshape(B, Np * n, G, T), jnp.repeat(lengths, n, axis=1))
    scores = scores.reshape(B, Np, n, T)
    overlaps = pallas_kernels.base_overlap(scores, k_base, base_sizes(k_base), lengths)  # [B, Np, n]
    return scores.reshape((B, Np) + mid + (T,)), overlaps.reshape((B, Np) + mid)


@struct.dataclass
class PivotScores:
    """A pivot layer's share of one step before its o'_t: what :func:`overlaps_at_once` needs."""

    scores: jax.Array  # [B, Np, T] float32 pooled scores (``pallas_kernels.pivot_pooled_scores``)
    lengths: jax.Array  # [B, Np] int32 the pivots' prompt rows
    k_base: jax.Array  # [B, Np, K] int32 K_base (``PivotBase``)


def overlaps_at_once(shares: tuple) -> tuple:
    """Every pivot layer's o'_t of one step in one ``pallas_kernels.base_overlap`` (Eq. 9): shares, per layer a
    ``PivotScores`` or anything else (passed through). Returns the same tuple with each ``PivotScores`` as
    ``pivot_statistics`` gives it, (scores [B, Np_l, T], o'_t [B, Np_l]). The membership's bisection is 32
    passes of a few small kernels each; one over every pivot of the model, not one per layer, is what costs
    little on a CPU, where those kernels cost more than their data (RESULTS `drift-statistics-one-loop`)."""
    pending = [s for s in shares if isinstance(s, PivotScores)]
    if not pending:
        return shares
    T = max(p.scores.shape[-1] for p in pending)
    K = max(p.k_base.shape[-1] for p in pending)
    scores = jnp.concatenate([jnp.pad(p.scores, ((0, 0), (0, 0), (0, T - p.scores.shape[-1])),
                                      constant_values=pallas_kernels.MASK_VALUE) for p in pending], axis=1)
    k_base = jnp.concatenate([jnp.pad(p.k_base, ((0, 0), (0, 0), (0, K - p.k_base.shape[-1])), constant_values=-1)
                              for p in pending], axis=1)
    lengths = jnp.concatenate([p.lengths for p in pending], axis=1)
    overlaps = pallas_kernels.base_overlap(scores[:, :, None], k_base, base_sizes(k_base), lengths)[:, :, 0]
    cuts = np.cumsum([0] + [p.scores.shape[1] for p in pending])
    done = iter((p.scores, overlaps[:, a:b]) for p, a, b in zip(pending, cuts[:-1], cuts[1:]))
    return tuple(next(done) if isinstance(s, PivotScores) else s for s in shares)


def attend_step(q, step, pivot_slots, copy_slots=()):
    """A decode step's attention in one layer with what its pivots' drift check and its copy heads' pointer
    need (``HeteroCache.attend``), from one pass over the pool.

    q [B, Nkv, G, D]; step: ``model.pool.LayerStep``; ``pivot_slots``, ``copy_slots``: layout slots (full
    heads: their first rows are the whole prompt in position order). Returns (out [B, Nkv, G, D], the pivots'
    share or None, pointer [B, Nc] int32 or None). The kernel writes the scored heads' logits over their
    prompt rows in the same pass, so the drift check never reads their keys again. The share: the pivots'
    logits [B, Np, G, T], buffered and checked all at once every ``window`` steps (:func:`drift_check`); or,
    where checks are spread (:func:`spread_checks`), this step's (pooled scores, o'_t): with the native CPU
    kernels from the attention's own call on one device (``LayerStep.attend_statistics``; the logits never
    leave the kernel), on a mesh from ``pallas_kernels.pivot_statistics`` on the logits; without native
    kernels the pooled scores as a ``PivotScores``, whose o'_t :func:`overlaps_at_once` computes with every
    other pivot layer's at the step's end (``finish_step``). The
    pointer: each copy head's most attended prompt position by its pooled scores (``copy_window.moved_windows``).
    """
    pivot_slots, copy_slots = tuple(pivot_slots), tuple(copy_slots)
    scored = pivot_slots + copy_slots
    if spread_checks() and pallas_kernels.native_statistics() and step.local:
        # one native call: the statistics of each scored head come from the thread that merged it
        bases = [step.layer.state.k_base] if pivot_slots else []
        if copy_slots:  # copy heads: their pooled scores only (an empty K_base)
            bases.append(jnp.full((q.shape[0], len(copy_slots), bases[0].shape[-1] if bases else 1), -1, jnp.int32))
        k_base = jnp.concatenate(bases, axis=1) if len(bases) > 1 else bases[0]
        out, scores, overlap = step.attend_statistics(q, scored, take_slots(step.layer.lengths, scored), k_base)
        n = len(pivot_slots)
        pivot = (scores[:, :n], overlap[:, :n]) if pivot_slots else None
        pointer = jnp.argmax(scores[:, n:], axis=-1).astype(jnp.int32) if copy_slots else None
        return out, pivot, pointer
    out, _, logits = step.attend(q, score_heads=pallas_kernels.score_flags(q.shape[1], scored),
                                 score_len=step.layer.capacity)
    pivot = None
    if pivot_slots:
        pivot = take_slots(logits, pivot_slots)
        if spread_checks():
            lengths = take_slots(step.layer.lengths, pivot_slots)
            if pallas_kernels.native_statistics():  # scores and o'_t in one native call
                pivot = pallas_kernels.pivot_statistics(pivot, lengths, step.layer.state.k_base)
            else:
                pivot = PivotScores(scores=pallas_kernels.pivot_pooled_scores(pivot, lengths), lengths=lengths,
                                    k_base=step.layer.state.k_base)
    pointer = None
    if copy_slots:
        scores = pallas_kernels.pivot_pooled_scores(take_slots(logits, copy_slots),
                                                    take_slots(step.layer.lengths, copy_slots))
        pointer = jnp.argmax(scores, axis=-1).astype(jnp.int32)
    return out, pivot, pointer


@functools.partial(jax.jit, static_argnames=("pivot_slots", "l_base", "tau", "cap"))
def drift_check(shares, layer_lengths, k_base, set_sizes, pivot_slots, l_base: int, tau: float, cap: int):
    """The drift check of every pivot of the model at once, from the ``window`` buffered decode steps.

    shares: per pivot layer, per buffered step, what ``attend_step`` returned for its pivots: their logits
    [B, Np_l, G, T], or (pooled scores [B, Np_l, T], o'_t [B, Np_l]) where the steps computed them;
    layer_lengths: per pivot layer [B, H] every head's prompt rows, of which ``pivot_slots`` (static, per
    layer) are the pivots'; k_base: per pivot layer [B, Np_l, l_base] (``l_base`` the batch's largest L_base;
    each row holds its own, ``PivotBase``); set_sizes: per pivot layer [B, Np_l, K_l] int, the sizes of the
    top sets a recall reads per pivot (its satellites' l_s; with a copy window also l_s - w), 0 for none, each
    at most ``cap``. The layers' pivots are checked as one batch [B, Np, W, ...]: one executable and a few
    kernels, whatever the layers.

    Returns drift [B, Np] bool over every pivot of the model (Np, layer after layer; median_t o'_t < tau, Eq.
    10, normalised), read by the decode once per check; per pivot layer its K_base after the check [B, Np_l,
    l_base] int32, on the device as ``k_base`` is (a drifted pivot's: the top-L_base of the latest step's
    pooled scores, its own L_base, ascending, -1 past it or where masked; any other's as it was), so a recall
    moves K_base on without a host round trip; top sets [B, Np, K, cap] of the latest pooled scores, K the
    layers' largest K_l (``pallas_kernels.topk_sets``: ascending positions, -1 past each size; -1 everywhere
    when none drifted), read only when a pivot drifted; o'_t [B, Np, W].
    """
    lengths = tuple(take_slots(l, s) for l, s in zip(layer_lengths, pivot_slots))
    K = max(s.shape[-1] for s in set_sizes)
    lens = jnp.concatenate(lengths, axis=1)
    base = jnp.concatenate(k_base, axis=1).astype(jnp.int32)
    sizes = jnp.concatenate([jnp.pad(s.astype(jnp.int32), ((0, 0), (0, 0), (0, K - s.shape[-1])))
                             for s in set_sizes], axis=1)
    if isinstance(shares[0][0], tuple):  # the steps scored their pivots: the latest scores, every o'_t
        latest = jnp.concatenate([sh[-1][0] for sh in shares], axis=1)  # [B, Np, T]
        overlaps = jnp.concatenate([jnp.stack([st[1] for st in sh], axis=-1) for sh in shares], axis=1)
    else:
        x = jnp.concatenate([jnp.stack(sh, axis=2) for sh in shares], axis=1)  # [B, Np, W, G, T]
        scores, overlaps = pivot_statistics(x, lens, base)
        latest = scores[:, :, -1]
    B, Np, T = latest.shape
    drift = jnp.median(overlaps, axis=-1) < tau
    n_base = min(l_base, T)
    own = jnp.minimum(base_sizes(base), n_base)  # each pivot's own L_base: its new K_base is that large

    def ranked(s):
        want = jnp.concatenate([own[..., None], sizes], -1)
        sets = pallas_kernels.topk_sets(s, want, max(cap, n_base))
        top = sets[..., 0, :n_base]
        hit = jnp.take_along_axis(s, jnp.maximum(top, 0), axis=-1) > pallas_kernels.MASK_VALUE * 0.5
        top = jnp.pad(jnp.where((top >= 0) & hit, top, -1), ((0, 0), (0, 0), (0, l_base - n_base)),
                      constant_values=-1)
        return top, sets[..., 1:, :cap]

    def unchanged(s):
        return base, jnp.full((B, Np, K, cap), -1, jnp.int32)

    if pallas_kernels.traced_for_gpu():
        # a GPU reads a conditional's predicate on the host, which would hold the host until the step ran:
        # rank always (a few kernels every W steps); the sets are -1 where none drifted
        top, sets = ranked(latest)
        sets = jnp.where(drift.any(), sets, -1)
    else:  # read only for a drifted pivot: skip the selection (lax.cond runs one branch) otherwise
        top, sets = jax.lax.cond(drift.any(), ranked, unchanged, latest)
    kept = jnp.where(drift[..., None], top, base)
    cuts = np.cumsum([b.shape[1] for b in k_base])[:-1]
    return drift, tuple(jnp.split(kept, cuts, axis=1)), sets, overlaps

