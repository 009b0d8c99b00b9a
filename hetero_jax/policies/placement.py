"""Which tensor-parallel shard holds which KV head, when heads keep different numbers of tokens.

Under tensor parallelism over KV heads, shard s of a layer holds ``n_local = H / tp`` of its heads. With
per-head budgets (HeteroCache's full heads keep the whole prompt, compressed heads a few percent), the
naive contiguous split of the role-grouped layout puts every full head of a layer on the first shards:
those devices hold several times the mean. A layer's heads may go to any shard (the projections follow
the head permutation), so a placement can spread the large heads.

``balanced_placement`` keeps the per-layer padding of an SPMD layout at its minimum (heads of similar
size share a head group) and spreads each group's heads over the shards so that the shards' totals over
all layers are even. Costs are tokens; bytes are tokens x 2 x head_dim x itemsize.
"""

from __future__ import annotations

import numpy as np


def _check(budgets: np.ndarray, tp: int) -> tuple[int, int, int]:
    b = np.asarray(budgets)
    if b.ndim != 2:
        raise ValueError(f"budgets must be [layers, kv_heads], got shape {b.shape}")
    L, H = b.shape
    if tp < 1 or H % tp:
        raise ValueError(f"tp={tp} must divide the {H} KV heads")
    return L, H, H // tp


def contiguous_placement(num_layers: int, num_kv_heads: int, tp: int, order: np.ndarray | None = None) -> np.ndarray:
    """[L, H] shard of each (layer, head): the layout order (``order[l]`` = heads in slot order, default
    identity) cut into tp consecutive blocks, as a plain NamedSharding of the head axis does."""
    n_local = num_kv_heads // tp
    shard_of_slot = np.arange(num_kv_heads) // n_local
    out = np.empty((num_layers, num_kv_heads), np.int64)
    for l in range(num_layers):
        heads = np.arange(num_kv_heads) if order is None else np.asarray(order[l])
        out[l, heads] = shard_of_slot
    return out


def role_grouped_order(budgets: np.ndarray) -> np.ndarray:
    """[L, H] each layer's heads largest budget first (stable): the role-grouped layout, full heads first."""
    return np.argsort(-np.asarray(budgets), axis=1, kind="stable")


def shard_tokens(budgets: np.ndarray, placement: np.ndarray, tp: int) -> np.ndarray:
    """[tp] tokens each shard holds over all layers."""
    out = np.zeros(tp, np.int64)
    np.add.at(out, np.asarray(placement).ravel(), np.asarray(budgets, np.int64).ravel())
    return out


def balanced_placement(budgets: np.ndarray, tp: int) -> np.ndarray:
    """[L, H] shard of each head.

    Each layer's heads, largest first, are cut into ``n_local`` rows of tp heads; a row puts one head on
    every shard, so a row is one SPMD head group whose capacity is its largest head (the least padding any
    placement allows: :func:`padded_tokens_per_shard`). Within each row the largest head goes to the shard
    with the fewest tokens so far (rows with the widest spread first), then swaps inside a row lower the
    largest shard while they can.
    """
    L, H, n_local = _check(budgets, tp)
    b = np.asarray(budgets, np.int64)
    rows = role_grouped_order(b).reshape(L, n_local, tp)  # [L, n_local, tp] head ids
    placement = np.empty((L, H), np.int64)
    load = np.zeros(tp, np.int64)
    spread = np.array([[b[l, r].max() - b[l, r].min() for r in rows[l]] for l in range(L)])
    for flat in np.argsort(-spread.ravel(), kind="stable"):
        l, j = divmod(int(flat), n_local)
        for h, s in zip(rows[l, j], np.argsort(load, kind="stable")):  # rows[l, j] is largest first
            placement[l, h] = s
            load[s] += b[l, h]
    _improve_by_swaps(b, rows, placement, load)
    return placement


def balanced_rows(budgets: np.ndarray, tp: int) -> list[list[list[int]]]:
    """Per layer, its ``n_local`` rows (largest heads first), each the tp head ids on shards 0..tp-1 as
    :func:`balanced_placement` spreads them: ``rows[l][j][s]`` is the head that shard s holds in local
    slot j of layer l."""
    L, H, n_local = _check(budgets, tp)
    placement = balanced_placement(budgets, tp)
    order = role_grouped_order(np.asarray(budgets)).reshape(L, n_local, tp)
    out = []
    for l in range(L):
        rows = []
        for heads in order[l]:
            row = [0] * tp
            for h in heads:
                row[int(placement[l, h])] = int(h)
            rows.append(row)
        out.append(rows)
    return out


def _improve_by_swaps(b: np.ndarray, rows: np.ndarray, placement: np.ndarray, load: np.ndarray,
                      max_rounds: int = 200) -> None:
    """Swap two heads of one row between the most loaded shard and another while the max drops."""
    for _ in range(max_rounds):
        top = int(np.argmax(load))
        best = None  # (new max, head on top, other head, layer)
        for l, layer_rows in enumerate(rows):
            for row in layer_rows:
                h = row[placement[l, row] == top][0]
                for g in row:
                    d = b[l, h] - b[l, g]
                    if d <= 0:
                        continue
                    new_load = load.copy()
                    new_load[top] -= d
                    new_load[placement[l, g]] += d
                    if new_load.max() < load.max() and (best is None or new_load.max() < best[0]):
                        best = (new_load.max(), h, g, l)
        if best is None:
            return
        _, h, g, l = best
        s, d = placement[l, g], b[l, h] - b[l, g]
        placement[l, h], placement[l, g] = s, top
        load[top] -= d
        load[s] += d


def padded_tokens_per_shard(budgets: np.ndarray, placement: np.ndarray, tp: int) -> int:
    """Tokens each shard allocates when every layer's cache is head groups split evenly over the shards
    (one SPMD shape for all devices): slot j of every shard shares one capacity, the largest j-th head."""
    L, H, n_local = _check(budgets, tp)
    b = np.asarray(budgets, np.int64)
    total = 0
    for l in range(L):
        per_shard = np.stack([np.sort(b[l, placement[l] == s])[::-1] for s in range(tp)])  # [tp, n_local]
        total += int(per_shard.max(axis=0).sum())
    return total


def pooled_tokens_per_shard(budgets: np.ndarray, placement: np.ndarray, tp: int) -> int:
    """Prompt tokens each shard allocates when every shard's kept rows of all layers share one row pool
    (``model.cache``: each head's region holds exactly its rows): the largest shard's total (one SPMD
    shape for all shards; the tail rows, equal on every shard, come on top)."""
    _check(budgets, tp)
    return int(shard_tokens(budgets, placement, tp).max())


def placement_report(budgets: np.ndarray, tp: int, bytes_per_token: int) -> list[dict]:
    """Per placement (identity-contiguous, role-grouped-contiguous, balanced): bytes per shard (max, mean,
    max/mean) of the tokens kept, of the SPMD-padded allocation (per-layer row groups), and for the balanced
    placement of the per-shard pool the runtime allocates (``pooled_tokens_per_shard``)."""
    L, H, _ = _check(budgets, tp)
    rows = []
    for name, placement in (
        ("contiguous (checkpoint order)", contiguous_placement(L, H, tp)),
        ("contiguous (role-grouped layout)", contiguous_placement(L, H, tp, role_grouped_order(budgets))),
        ("role-balanced", balanced_placement(budgets, tp)),
    ):
        tokens = shard_tokens(budgets, placement, tp)
        rows.append(dict(placement=name, tp=tp, kept_max=int(tokens.max()) * bytes_per_token,
                         kept_mean=float(tokens.mean()) * bytes_per_token,
                         imbalance=float(tokens.max() / tokens.mean()),
                         padded=padded_tokens_per_shard(budgets, placement, tp) * bytes_per_token,
                         pooled=(pooled_tokens_per_shard(budgets, placement, tp) * bytes_per_token
                                 if name == "role-balanced" else None)))
    return rows
