"""Head layouts: permute KV heads once so each layer's heads are in the order a policy wants.

A policy that treats heads differently (HeteroCache: full heads first, then compressed heads; on a mesh,
heads balanced over the shards) asks for a layout; the parameters are permuted once per (model, layout),
the query heads following their KV head and the output projection's rows following the query heads, so the
model computes exactly the same function. The cache then holds heads in layout order; ``perms`` maps a
layout slot back to its original head.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from hetero_jax.model.config import ModelConfig
from hetero_jax.model.sharding import shard_params


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    # per layer: perms[l][i] = original KV head stored at layout slot i
    perms: tuple[tuple[int, ...], ...]
    # tensor-parallel shards the layout is made for: shard s holds the slots [s H/tp, (s + 1) H/tp) of every
    # layer, as the projections split (``cache``: a head's pool region lives in its slot's shard)
    tp: int = 1

    @classmethod
    def identity(cls, cfg: ModelConfig) -> "HeadLayout":
        return cls(tuple(tuple(range(cfg.num_kv_heads)) for _ in range(cfg.num_layers)))

    @classmethod
    def from_orders(cls, orders_per_layer, tp: int = 1) -> "HeadLayout":
        """orders_per_layer: per layer, the original head index at each layout slot."""
        return cls(tuple(tuple(int(h) for h in order) for order in orders_per_layer), tp)

    @classmethod
    def from_rows(cls, rows_per_layer, tp: int) -> "HeadLayout":
        """A layout for tp shards. rows_per_layer: per layer, a list of rows, each the tp head indices it puts
        on shards 0..tp-1. Shard s then holds, in slot s * n_local + j, the s-th head of the layer's j-th row."""
        return cls(tuple(tuple(int(rows[j][s]) for s in range(tp) for j in range(len(rows)))
                         for rows in rows_per_layer), tp)

    def check(self, cfg: ModelConfig) -> None:
        if len(self.perms) != cfg.num_layers:
            raise ValueError(f"layout has {len(self.perms)} layers, the model {cfg.num_layers}")
        if cfg.num_kv_heads % self.tp:
            raise ValueError(f"tp={self.tp} does not divide the {cfg.num_kv_heads} KV heads")
        for l, p in enumerate(self.perms):
            if sorted(p) != list(range(cfg.num_kv_heads)):
                raise ValueError(f"layer {l}: {p} is not a permutation of the {cfg.num_kv_heads} KV heads")

    @property
    def is_identity(self) -> bool:
        return all(p == tuple(range(len(p))) for p in self.perms)


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

