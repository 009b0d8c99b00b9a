"""HeteroCache's drift recall, host side: the inputs of the check (``step.drift_check``) from the buffered
steps, the top-set sizes it selects for each pivot's satellites, and the recall plan once it has run (each
drifted pivot's satellites take the top-l_s rows of its latest scores from the host copy; K_base moves on).

Planning only: the decode state (``decode.HeteroDecode``) dispatches the check, plans its recall before the
next step and writes the rows named here one step after that (``inflight``: sent while that step runs), and
counts them.
"""

from __future__ import annotations

import jax
import numpy as np

from hetero_jax.model.cache import KVCache, capacity_bucket
from hetero_jax.model.host_store import row_bucket
from hetero_jax.model.sharding import to_host
from hetero_jax.policies.heterocache.prefilled import HeteroPrefilled
from hetero_jax.policies.heterocache.step import PivotBase, drift_check
from hetero_jax.policies.profiled import take_slots


def recall_set_sizes(members: dict, n_pivots: int, counts: np.ndarray, window: np.ndarray | None):
    """Per pivot, the top-set sizes a recall of its satellites reads (``drift_check``'s set_sizes), int32
    [B, Np, K]: at k = j its j-th satellite's l_s (counts [B, Hc]), and with a copy window (window [B, Hc]:
    each head's w) at k = S + j its l_s - w; K = S or 2S, S the most satellites a pivot has, 0 elsewhere."""
    S = max((len(v) for v in members.values()), default=0)
    B = counts.shape[0]
    sizes = np.zeros((B, n_pivots, S * (2 if window is not None else 1)), np.int32)
    for p, sats in members.items():
        for j, sat in enumerate(sats):
            sizes[:, p, j] = counts[:, sat]
            if window is not None:
                sizes[:, p, S + j] = counts[:, sat] - window[:, sat]
    return sizes



def set_sizes_by_layer(prefilled: HeteroPrefilled, win: list) -> dict[int, tuple[jax.Array, int]]:
    """Per pivot layer, the top-set sizes its check selects for a recall (``recall_set_sizes``; on the device)
    and the largest (an int: reading it from the device would wait for the step in flight). ``win``: per layer
    the copy window's slots [B, Hc, W] or None (each head's w counts its slots >= 0)."""
    out = {}
    for li, r in enumerate(prefilled.roles):
        if r.pivots:
            w = (win[li] >= 0).sum(axis=-1) if win and win[li] is not None else None
            sizes = recall_set_sizes(r.members, len(r.pivots), prefilled.counts[li], w)
            out[li] = (jax.device_put(sizes), int(sizes.max(initial=0)))
    return out


def recall_chunk(prefilled: HeteroPrefilled) -> int:
    """Rows per scatter executable of a recall: the most rows one layer's satellites recall, bucketed
    (``row_bucket``), so that every recall runs one executable, compiled once (docs/architecture.md,
    "Recall writes")."""
    return row_bucket(max((int(prefilled.counts[li][:, [s for v in r.members.values() for s in v]].sum(axis=1).max())
                           for li, r in enumerate(prefilled.roles) if r.members), default=1))


def check_inputs(buffer, cache: KVCache, pivot_layers: list[int], set_sizes: dict, prefilled: HeteroPrefilled,
                 tau: float) -> tuple[tuple, dict]:
    """(arguments, static arguments) of ``drift_check`` on the buffered steps' shares (``buffer``: per step, per
    layer what ``attend_step`` returned for its pivots), every pivot layer at once."""
    layers = pivot_layers
    args = (tuple(tuple(b[li] for b in buffer) for li in layers),
            tuple(cache.layers[li].lengths for li in layers),
            tuple(cache.layers[li].state.k_base for li in layers),
            tuple(set_sizes[li][0] for li in layers))
    slots = tuple(tuple(prefilled.roles[li].pivot_slots()) for li in layers)
    T = jax.tree.leaves(args[0][0][0])[0].shape[-1]
    # K_base's width, and the top sets' (bucketed: nearby prompt lengths share the check's executable)
    static = dict(pivot_slots=slots, l_base=int(args[2][0].shape[-1]),
                  tau=tau, cap=min(capacity_bucket(max(1, max(set_sizes[li][1] for li in layers))), T))
    return args, static


def check_executable(cached: tuple | None, args: tuple, static: dict, compile_fn) -> tuple:
    """(key, ``drift_check``'s executable for these arguments): ``cached`` when its key matches. The key is the
    arguments' shapes alone: ``compiled``'s own key hashes every leaf's dtype and sharding, hundreds of
    buffered arrays at every check."""
    key = (tuple(x.shape for x in jax.tree.leaves(args)), tuple(sorted(static.items())))
    if cached is None or cached[0] != key:
        cached = (key, compile_fn(drift_check, *args, **static))
    return cached


def observe_check(observers: list, pivot_layers: list[int], pivot_cuts, args: tuple, static: dict, overlaps,
                  l_base: np.ndarray) -> None:
    """Hand each pivot layer's o'_t of a check ([B, Np_l, W] of ``drift_check``'s overlaps) to every observer:
    f(layer, overlaps, its pivots' prompt lengths [B, Np_l], l_base=[B] each sequence's L_base)."""
    for i, li in enumerate(pivot_layers if observers else ()):
        lengths = take_slots(args[1][i], static["pivot_slots"][i])
        for observe in observers:
            observe(li, overlaps[:, pivot_cuts[i]:pivot_cuts[i + 1]], lengths, l_base=l_base)


def plan_recall(prefilled: HeteroPrefilled, cache: KVCache, pivot_layers: list[int], pivot_cuts, set_sizes: dict,
                held: list, drift_all: np.ndarray, k_bases: tuple, sets_all: jax.Array):
    """What a check's outputs (``drift_check``: drift flags read to the host, every pivot of the model; the other
    two on the device) recall.

    Returns (the cache with each pivot layer that has a drifted pivot holding the K_base the check left it
    (``k_bases``, per pivot layer, kept on the device), not yet its rows; the pivot layers that drifted; rows:
    (layer, b, satellite j, slots in its region, prompt rows) for ``HeteroDecode`` to write; copy window
    updates: (layer, b, satellite j, its new positions, its new window slots: the rows past its top-(l_s - w)),
    where ``held[layer]`` is not None)."""
    layers = list(cache.layers)
    items, recalled, held_updates = [], [], []
    sets_all = to_host(sets_all)
    for i, (li, a, z) in enumerate(zip(pivot_layers, pivot_cuts[:-1], pivot_cuts[1:])):
        r = prefilled.roles[li]
        drift = drift_all[:, a:z]
        if not drift.any():
            continue
        sets = sets_all[:, a:z, : set_sizes[li][0].shape[-1]]
        counts = prefilled.counts[li]  # [B, Hc]
        windowed = bool(held) and held[li] is not None
        n_sat = sets.shape[2] // 2 if windowed else sets.shape[2]
        for b, p in zip(*np.nonzero(drift)):
            for j, sat in enumerate(r.members.get(int(p), [])):
                l_s = int(counts[b, sat])
                pos = sets[b, p, j, :l_s]  # its top-l_s, ascending
                items.append((li, b, sat, np.arange(l_s), pos))
                if windowed:
                    low = pos[~np.isin(pos, sets[b, p, n_sat + j])]
                    held_updates.append((li, b, sat, pos, np.searchsorted(pos, low)))
        layers[li] = layers[li].replace(state=PivotBase(k_base=placed_as(k_bases[i], layers[li].state.k_base)))
        recalled.append(li)
    return cache.replace(layers=tuple(layers)), recalled, items, held_updates


def placed_as(x: jax.Array, like: jax.Array) -> jax.Array:
    """Device array ``x`` where ``like`` is (a device-to-device move only where a mesh's partitioner placed an
    output otherwise than the input it replaces): the decode step's executable takes K_base as it was."""
    return x if x.sharding == like.sharding else jax.device_put(x, like.sharding)
