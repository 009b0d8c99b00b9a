"""Head layouts: permute KV heads once so each role group is a contiguous slice.

A policy that treats heads differently (HeteroCache: full heads and
compressed heads) asks for a layout; the parameters are permuted once per
(model, layout), the query heads following their KV head and the output
projection's rows following the query heads, so the model computes exactly
the same function. The cache then holds heads in layout order; ``perms``
maps a cache head back to its original index.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from hetero_jax.model.config import ModelConfig
from hetero_jax.model.sharding import shard_params


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    # per layer: perms[l][i] = original KV head stored at position i
    perms: tuple[tuple[int, ...], ...]
    # per layer: heads per group, in order (sum = num_kv_heads); with tp > 1 each a multiple of tp
    group_sizes: tuple[tuple[int, ...], ...]
    # tensor-parallel shards the groups are cut for: group g of m = size/tp heads per shard holds the
    # local slots [o, o + m) of every shard (``cache.group_spans``); 1 = contiguous slices of the heads
    tp: int = 1

    @classmethod
    def identity(cls, cfg: ModelConfig) -> "HeadLayout":
        h = cfg.num_kv_heads
        return cls(tuple(tuple(range(h)) for _ in range(cfg.num_layers)), tuple((h,) for _ in range(cfg.num_layers)))

    @classmethod
    def from_groups(cls, groups_per_layer) -> "HeadLayout":
        """groups_per_layer: per layer, a list of head-index lists (one per group, in order)."""
        perms = tuple(tuple(int(h) for g in layer for h in g) for layer in groups_per_layer)
        sizes = tuple(tuple(len(g) for g in layer if len(g)) for layer in groups_per_layer)
        return cls(perms, sizes)

    @classmethod
    def from_rows(cls, rows_per_layer, tp: int) -> "HeadLayout":
        """A layout for tp shards. rows_per_layer: per layer, a list of groups, each a list of local rows,
        each row the tp head indices it puts on shards 0..tp-1. Shard s then holds, in slot
        s * n_local + j, the s-th head of the layer's j-th row (rows counted across groups)."""
        perms, sizes = [], []
        for layer in rows_per_layer:
            rows = [row for group in layer for row in group]
            perms.append(tuple(int(rows[j][s]) for s in range(tp) for j in range(len(rows))))
            sizes.append(tuple(tp * len(group) for group in layer if len(group)))
        return cls(tuple(perms), tuple(sizes), tp)

    def check(self, cfg: ModelConfig) -> None:
        if len(self.perms) != cfg.num_layers or len(self.group_sizes) != cfg.num_layers:
            raise ValueError(f"layout has {len(self.perms)} layers, the model {cfg.num_layers}")
        for l, (p, g) in enumerate(zip(self.perms, self.group_sizes)):
            if sorted(p) != list(range(cfg.num_kv_heads)):
                raise ValueError(f"layer {l}: {p} is not a permutation of the {cfg.num_kv_heads} KV heads")
            if sum(g) != cfg.num_kv_heads or min(g) < 1:
                raise ValueError(f"layer {l}: group sizes {g} must be positive and sum to {cfg.num_kv_heads}")
            if any(n % self.tp for n in g):
                raise ValueError(f"layer {l}: group sizes {g} must be multiples of tp={self.tp}")

    def slots(self, layer: int) -> list[list[int]]:
        """Per group of layer ``layer``: the layout slot of each group head (:func:`group_slots`)."""
        return group_slots(self.group_sizes[layer], self.tp, len(self.perms[layer]))

    @property
    def is_identity(self) -> bool:
        return all(p == tuple(range(len(p))) for p in self.perms)


def group_spans_of(sizes, tp: int) -> list[tuple[int, int]]:
    """Per group of ``sizes`` heads cut for tp shards: (o, m), the m = size / tp local slots [o, o + m)
    it holds on every shard (tp = 1: the contiguous slice [o, o + size))."""
    out, o = [], 0
    for size in sizes:
        out.append((o, size // tp))
        o += size // tp
    return out


def group_slots(sizes, tp: int, num_heads: int) -> list[list[int]]:
    """Per group: the layer slot of each group head; head s*m + i is slot s*n_local + o + i."""
    n_local = num_heads // tp
    return [[s * n_local + o + i for s in range(tp) for i in range(m)] for o, m in group_spans_of(sizes, tp)]


def _q_order(perm, group_size: int) -> np.ndarray:
    return np.concatenate([np.arange(h * group_size, (h + 1) * group_size) for h in perm])


def permute_layer(layer: dict, perm, cfg: ModelConfig) -> dict:
    """Permute one layer's KV heads (and their query heads, and o_proj's rows)."""
    D, G = cfg.head_dim, cfg.group_size
    kv = np.asarray(perm)
    q = _q_order(perm, G)
    out = dict(layer)

    def cols(w, order, n):  # [..., n*D] -> heads reordered
        sh = w.shape
        return w.reshape(*sh[:-1], n, D)[..., order, :].reshape(sh)

    out["q_proj"] = cols(layer["q_proj"], q, cfg.num_heads)
    out["k_proj"] = cols(layer["k_proj"], kv, cfg.num_kv_heads)
    out["v_proj"] = cols(layer["v_proj"], kv, cfg.num_kv_heads)
    for name, order, n in (("q_bias", q, cfg.num_heads), ("k_bias", kv, cfg.num_kv_heads), ("v_bias", kv, cfg.num_kv_heads)):
        if name in layer:
            out[name] = cols(layer[name], order, n)
    o = layer["o_proj"]  # [Nq*D, H]
    out["o_proj"] = o.reshape(cfg.num_heads, D, o.shape[-1])[q].reshape(o.shape)
    return out


def permute_params(params: dict, cfg: ModelConfig, layout: HeadLayout) -> dict:
    """A new params pytree with every layer's heads in ``layout`` order."""
    layout.check(cfg)
    new = dict(params)
    new["layers"] = [permute_layer(layer, p, cfg) for layer, p in zip(params["layers"], layout.perms)]
    return new


_PERMUTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def params_for(model, layout: HeadLayout | None) -> dict:
    """``model.params`` in ``layout`` order, permuted once per (model bundle, layout) and reused."""
    if layout is None or layout.is_identity:
        return model.params
    per_model = _PERMUTED.setdefault(model, {})
    if layout not in per_model:
        params = permute_params(model.params, model.config, layout)
        if getattr(model, "mesh", None) is not None:  # permuted heads go back to the devices of their slot
            params = shard_params(params, model.config, model.mesh)
        per_model[layout] = params
    return per_model[layout]

