"""The record HeteroCache's prefill hands its decode state (roles, budgets, the host copy of the compressed
heads, each head's pool offsets, with a copy window each compressed head's kept positions), and the one call
that writes compressed heads' rows from that host copy into the pool, for the recall, the re-selection and
the copy window alike."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from hetero_jax.model.cache import KVCache
from hetero_jax.model.host_store import HostKVStore, write_head_rows
from hetero_jax.policies.profiled import LayerRoles, ProfiledPolicy


@dataclasses.dataclass(frozen=True)
class HeteroPrefilled:
    """What HeteroCache's prefill hands its decode: roles, budgets and the host copy of the compressed heads."""

    policy: ProfiledPolicy  # the HeteroCache that made it
    roles: list[LayerRoles]
    counts: list[np.ndarray]  # per layer [B, Hc] tokens kept by each compressed head (layout order)
    l_base: np.ndarray  # [B] L_base of each sequence
    lens: np.ndarray  # [B] prompt lengths
    # per layer: the compressed heads' full prompt K/V, named by layout slot (``HostKVStore.put_heads``: on a
    # mesh that splits the heads, every head's, split like the pool)
    store: HostKVStore
    offsets: list[np.ndarray]  # per layer [B, H] each head's first pool row (layout slots), at prefill
    placement: dict | None = None  # under tensor parallelism: tokens per shard, balanced vs contiguous
    # copy window (``copy_window`` > 0), per layer with compressed heads (else None): the prompt position in
    # each slot of each compressed head [B, Hc, cap] (-1: padding) and its window slots [B, Hc, W] (-1: none),
    # the slots of its least-scored kept rows (``copy_window.window_slots``)
    held: list | None = None
    window_slots: list | None = None

    def host_bytes_by_role(self) -> dict[str, int]:
        """Pinned-host KV bytes per role: the satellites' (the paper's reservoir), the anchors', and the full
        heads' copies a store split like the device cache holds ("full", only where it holds any)."""
        out = {"satellite": 0, "anchor": 0}
        for li, r in enumerate(self.roles):
            per_head = self.store.head_bytes(li)
            if per_head:
                n_comp = self.counts[li].shape[1]
                out["satellite"] += per_head * len(r.satellites)
                out["anchor"] += per_head * (n_comp - len(r.satellites))
                n_held = self.store.k[li].shape[1]
                if n_held > n_comp:
                    out["full"] = out.get("full", 0) + per_head * (n_held - n_comp)
        return out


def head_requests(prefilled: HeteroPrefilled, items: list) -> list[tuple]:
    """``host_store.write_head_rows``'s requests, one per layer, for rows of compressed heads: items (layer, b,
    compressed head j, slots in its region [n], prompt rows [n]) -> (layer, b, layout head, prompt rows, slots),
    each but the layer the layer's items concatenated."""
    by_layer = collections.defaultdict(list)
    for item in items:
        by_layer[item[0]].append(item)
    out = []
    for li in sorted(by_layer):  # a few numpy calls per layer: a recall has hundreds of items
        _, bs, js, slots, rows = zip(*by_layer[li])
        n = [len(r) for r in rows]
        heads = np.asarray(prefilled.roles[li].comp_slots, np.int64)[list(js)]
        out.append((li, np.repeat(np.array(bs, np.int64), n), np.repeat(heads, n),
                    np.concatenate([np.asarray(r) for r in rows]),
                    np.concatenate([np.asarray(s, np.int64) for s in slots])))
    return out


def write_rows(prefilled: HeteroPrefilled, cache: KVCache, offsets: list, items: list, compile_fn=None,
               chunk: int | None = None, staging=None) -> tuple[KVCache, int]:
    """Rows of compressed heads from the host copy into their regions of the pool, every layer's through one
    transfer set and one scatter executable (``host_store.write_head_rows``: every transfer starts before
    anything is written, so a failed one leaves the pool as it was). items: as ``head_requests``'; offsets: per
    layer [B, H] each head's first pool row; staging: the ``host_store.Staging`` sent from (None: the store's).
    Returns (the cache, K/V bytes moved)."""
    if not items:
        return cache, 0
    pool, _, nbytes = write_head_rows(cache.pool, prefilled.store, offsets, head_requests(prefilled, items),
                                      compile_fn, chunk=chunk, staging=staging)
    return cache.replace(pool=pool), nbytes
