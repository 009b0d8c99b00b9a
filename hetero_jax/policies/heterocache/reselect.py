"""HeteroCache's re-selection after a session's turn (our departure): every compressed head re-takes its top-l_i
(budgets unchanged) from its host keys, scored by the pooled attention of the turn's queries as prefill scores
its window (``scores.turn_scores``), rows in position order; each pivot's K_base restarts from the turn's last
query.

Planning and scoring only: the decode state (``decode.HeteroDecode.after_extend``) writes the rows named here,
all or nothing, and counts them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.model.cache import KVCache, layer_rows
from hetero_jax.model.sharding import to_host
from hetero_jax.policies.heterocache.copy_window import window_slots
from hetero_jax.policies.heterocache.prefilled import HeteroPrefilled
from hetero_jax.policies.heterocache.scores import select_rows, turn_k_base, turn_scores
from hetero_jax.policies.heterocache.step import PivotBase, base_width, mask_base
from hetero_jax.policies.profiled import take_slots
from hetero_jax.policies.selection import cap_bucket

BLOCK = 16  # turn queries scored per block (``turn_scores``)


def pivot_keys(cache: KVCache, li: int, slots) -> tuple[jax.Array, jax.Array]:
    """(keys [B, n, T, D], prompt lengths [B, n]) of the full heads at layout ``slots`` of layer ``li``, read out
    of the pool (a gather, for observers and re-selection: the decode step reads the pool in place)."""
    k, _, _, _ = layer_rows(cache, li)
    lengths = take_slots(cache.layers[li].lengths, slots)
    return take_slots(k, slots), lengths


def reselect(prefilled: HeteroPrefilled, turn_queries, cache: KVCache, held: list, compile_fn):
    """The re-selection after a turn. turn_queries: per layer [B, Nkv, N, G, D] (layout order), the N appended
    tokens' queries; held: per layer the copy window's held positions or None (``HeteroDecode.held``).

    Returns (the cache with each pivot layer's new K_base, not yet its rows; rows: (layer, b, compressed
    head j, slots in its region [c], prompt rows [c]) for every compressed head; per layer with a copy window,
    its heads' new positions [B, Hc, cap] and window slots, to set once every row is written)."""
    n = turn_queries[0].shape[2]
    n_pad = -(-n // BLOCK) * BLOCK
    row_valid = jnp.arange(n_pad) < n
    l_base = base_width(prefilled.l_base)  # K_base's width; each sequence keeps its own (mask_base)
    lens = jnp.asarray(prefilled.lens, jnp.int32)
    layers = list(cache.layers)
    items, held_new = [], {}
    for li, r in enumerate(prefilled.roles):
        lc, q = layers[li], turn_queries[li]
        if r.pivots:
            keys, lengths = pivot_keys(cache, li, r.pivot_slots())
            args = (take_slots(q, r.pivot_slots())[:, :, -1:], keys, lengths)
            idx = compile_fn(turn_k_base, *args, l_base=l_base)(*args)
            layers[li] = lc.replace(state=PivotBase(k_base=mask_base(idx, prefilled.l_base)))
        counts = prefilled.counts[li]  # [B, Hc]
        if not counts.shape[1]:
            continue
        qc = take_slots(q, r.comp_slots)
        qc = jnp.pad(qc, ((0, 0), (0, 0), (0, n_pad - n), (0, 0), (0, 0)))
        # one layer's compressed keys on the device, for this scoring only
        keys = prefilled.store.device_keys(li, r.comp_slots)
        args = (qc, row_valid, keys, lens)
        scores = compile_fn(turn_scores, *args, block=BLOCK)(*args)
        # compiled per 64-slot bucket, not per layer's largest budget (as ``select_group``)
        cap = cap_bucket(int(counts.max()), scores.shape[-1])
        args = (scores, jnp.asarray(counts, jnp.int32))
        idx = to_host(compile_fn(select_rows, *args, cap=cap)(*args))  # [B, Hc, cap]
        if held and held[li] is not None:  # the copy window's slots in the new rows
            hc = held[li].shape[2]
            valid = np.arange(hc)[None, None] < counts[:, :, None]
            kept = np.take_along_axis(to_host(scores), idx[:, :, :hc], axis=2)
            held_new[li] = (np.where(valid, idx[:, :, :hc], -1),
                            window_slots(kept, counts, prefilled.policy.copy_window))
        for b in range(idx.shape[0]):
            for j in range(counts.shape[1]):
                c = int(counts[b, j])
                items.append((li, b, j, np.arange(c), idx[b, j, :c]))
    return cache.replace(layers=tuple(layers)), items, held_new
