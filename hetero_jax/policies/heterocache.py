"""HeteroCache: role-aware budgets, host copies of the compressed heads, re-selection per turn, drift recall.

Prefill (per request, prompt length L):
- L_base by Eq. 7 over the whole model, l_i by Eq. 8 (``HeadProfile.budgets``);
- full heads (volatile, pivot) keep the whole prompt on the device;
- compressed heads (anchor, satellite) keep their top-l_i tokens by the pooled
  attention (GQA max) of the last ``select_window`` prompt queries, summed
  (causal), stored in position order. The paper scores by the last token alone
  (``select_window=1``); our default 8 reaches past the chat template's
  closing tokens into the question (docs/architecture.md);
- every compressed head's full prompt KV goes to pinned host memory (the paper
  keeps only the satellites'; the anchors' copy is what lets a later turn re-select);
- each pivot records K_base = the top-L_base of its pooled last-token attention.

A session's turn (``after_extend``, our departure): once a question has been appended
(chunked, ``model.extend``), every compressed head re-takes its top-l_i from its host
keys, scored by the pooled attention of the turn's queries exactly as prefill scores
its window (budgets unchanged), and each pivot's K_base restarts from the turn's last
query; this lands before the answer's first token is sampled. For a single request
(``generate``) nothing changes.

Decode: every ``window`` steps the buffered pivot queries are scored against
the pivot's prompt keys (``pallas_kernels.drift_check``); when the median
overlap with K_base, read against its chance level (o - c) / (1 - c) with
c = L_base / L (our departure: the raw overlap mostly measures rho), drops
below ``tau_drift``, each satellite of that pivot
gets its own top-l_s positions of the pivot's latest pooled scores, gathered
from the host copy and written into its device slots, and K_base moves on.

Asynchrony and lag: the check is dispatched right after step t's decode and
its small outputs (flags, indices) are copied to the host asynchronously;
they are read before step t + 1 is dispatched, and recalled rows are written
then, so a recall takes effect exactly one step after the check. The
gather runs on the host (numpy view of the pinned array) and the rows go to
the device with an asynchronous ``device_put``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import warnings
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels import avg_pool, gqa_reduce
from hetero_jax.model.cache import HeadGroup, KVCache, PooledGroup, PromptPool, full_group, materialize, take_heads
from hetero_jax.model.config import ModelConfig
from hetero_jax.model.host_store import HostKVStore, put_rows, scatter_rows
from hetero_jax.model.layout import group_spans_of
from hetero_jax.model.transformer import prompt_queries
from hetero_jax.policies.base import BudgetError, PolicyError, check_int
from hetero_jax.policies.protocol import DecodeState, PrefillPlan
from hetero_jax.policies.primitives import attention_probs, finalize_scores, observation_window_probs, select_topk
from hetero_jax.policies.profiled import LayerRoles, ProfiledPolicy, profile_key, take_slots
from hetero_jax.policies.selection import cap_bucket, select_group
from hetero_jax.profile.format import HeadProfile


def _check_hetero_args(p: "HeteroCache") -> None:
    """Types and ranges of HeteroCache's numeric arguments (before the older checks in __post_init__)."""
    if p.profile is not None and not isinstance(p.profile, HeadProfile):
        raise PolicyError(f"HeteroCache: profile must be a HeadProfile (load_profile('profile.json')) or None "
                          f"for the model's shipped profile, got {type(p.profile).__name__}")
    check_int("HeteroCache", "window", p.window, 1, " (decode steps between drift checks)")
    if isinstance(p.select_window, bool):  # an int to isinstance, but True is no number of queries
        raise PolicyError(f"HeteroCache: select_window must be an int >= 1 prompt query (1 = the paper's last "
                          f"token), got {p.select_window!r}")
    tau = p.tau_drift
    if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float, np.integer, np.floating))
                            or not np.isfinite(float(tau) if abs(tau) < 1e300 else np.inf)):
        raise PolicyError(f"HeteroCache: tau_drift must be a finite number (a drift is a median top-k overlap "
                          f"below it, so [0, 1] is meaningful) or None for the profile's tau_stable, got {tau!r}")


@dataclasses.dataclass(frozen=True)
class HeteroCache(ProfiledPolicy):
    """HeteroCache (``profile=None``: the shipped profile of the loaded model)."""

    profile: HeadProfile | None = dataclasses.field(default=None, compare=False, hash=False, repr=False)
    budget: float = 0.3
    window: int = 5
    tau_drift: float | None = None
    pool_kernel: int = 5
    select_window: int = 8
    profile_key: str = dataclasses.field(default="", init=False)
    # set by bind() on a mesh: the row layout for tp shards and, per layer, its pivots' layout slots
    head_tp: int = dataclasses.field(default=1, init=False)
    row_pivot_slots: tuple = dataclasses.field(default=(), init=False, compare=False, repr=False)

    name: ClassVar[str] = "heterocache"
    summary: ClassVar[str] = ("role-aware head budgets from an offline profile, compressed heads' full KV in pinned "
                              "host memory, re-selection at each session turn, drift-triggered recall")

    def __post_init__(self):
        super().__post_init__()
        _check_hetero_args(self)
        if not isinstance(self.select_window, int) or self.select_window < 1:
            raise BudgetError(f"HeteroCache: select_window must be an int >= 1 prompt query (1 = the paper's "
                              f"last token), got {self.select_window!r}")
        if self.pool_kernel != 5:
            raise BudgetError("HeteroCache: the pooled-score kernel supports pool_kernel=5 only")
        object.__setattr__(self, "profile_key", profile_key(self.profile))

    def bind(self, model):
        """The profile resolved and checked (``ProfiledPolicy.bind``); on a mesh with tp > 1 model shards,
        the role-balanced row layout (``row_layout``), so every head group splits over "model"."""
        bound = super().bind(model)
        mesh = getattr(model, "mesh", None)
        tp = 1 if mesh is None else int(mesh.shape["model"])
        if tp == bound.head_tp:
            return bound
        bound = dataclasses.replace(bound)  # a copy: head_tp back to its default, set below
        object.__setattr__(bound, "head_tp", tp)
        if tp > 1:
            slots = tuple(tuple(r.pivot_slots()) for r in bound.layer_roles(model.config))
            object.__setattr__(bound, "row_pivot_slots", slots)
        return bound

    def layout(self, cfg: ModelConfig):
        """``ProfiledPolicy.layout``; on one device each compressed head is a group of its own (heads of a
        layer keep different l_i: ``_split_heads``)."""
        base = super().layout(cfg)
        if base.tp > 1:
            return base
        sizes = []
        for l in range(cfg.num_layers):
            n_full = len(self.roles_in_layout(l)["pivot"]) + len(self.roles_in_layout(l)["volatile"])
            sizes.append(((n_full,) if n_full else ()) + (1,) * (cfg.num_kv_heads - n_full))
        return dataclasses.replace(base, group_sizes=tuple(sizes))

    @property
    def drift_threshold(self) -> float:
        """tau_drift, on the check's chance-normalised scale (o - c) / (1 - c) (``pallas_kernels.drift_check``).

        Default: the profile's tau_stable (the paper sets them equal), carried to that scale at the
        calibration's chance level c = top_k / tokens_per_sample (0.4 at c = 0.2 -> 0.25 for SmolLM2);
        c = 0 when the profile does not record it, 0.5 when it records no tau_stable either.
        """
        if self.tau_drift is not None:
            return float(self.tau_drift)
        s = self.profile.settings if self.profile is not None else None
        tau = 0.5 if s is None or s.tau_stable is None else float(s.tau_stable)
        c = s.top_k / s.tokens_per_sample if s is not None and s.top_k and s.tokens_per_sample else 0.0
        return (tau - c) / (1.0 - c)

    def make_prefill(self, cfg, prompt_lens, compile_fn=None):
        return HeteroPrefill(self, cfg, prompt_lens, compile_fn=compile_fn)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _last_token_scores(layer, x_in, keys, prompt_lens, cfg):
    """Pooled last-prompt-token attention, GQA max: [B, Hkv, Tp] (MASK_VALUE beyond the prompt)."""
    q = prompt_queries(layer, x_in, (prompt_lens - 1)[:, None], cfg)  # [B, Hkv, 1, G, D]
    lengths = jnp.broadcast_to(prompt_lens[:, None], keys.shape[:2])
    return pallas_kernels.scores(q, keys, lengths, gqa="max")[:, :, 0]


@functools.partial(jax.jit, static_argnames=("cfg", "window"))
def _window_scores(layer, x_in, keys, prompt_lens, cfg, window: int):
    """Pooled attention of the last ``window`` prompt queries, summed (causal), GQA max: [B, Hkv, Tp]."""
    probs, _ = observation_window_probs(layer, x_in, keys, prompt_lens, window, cfg)  # [B, Hkv, W, G, Tp]
    return finalize_scores(gqa_reduce(avg_pool(probs.sum(axis=2)), "max", axis=2), prompt_lens)


@functools.partial(jax.jit, static_argnames=("block",))
def _turn_scores(q_rows, row_valid, keys, prompt_lens, block: int = 16):
    """Pooled attention of a turn's queries over the prompt, summed, GQA max: [B, H, Tp] (MASK_VALUE beyond it).

    q_rows: [B, H, N, G, D] (N a multiple of ``block``); row_valid: [N] bool (padding rows count 0);
    keys: [B, H, Tp, D]; prompt_lens: [B]. The scoring of prefill's observation window
    (``_window_scores``: softmax per query, summed over the queries, 5-tap pooling, GQA max); every prompt
    key precedes the turn, so no causal mask. Blocks of ``block`` queries keep [B, H, block, G, Tp] at most.
    """
    B, H, N, G, D = q_rows.shape
    last = jnp.broadcast_to((prompt_lens - 1)[:, None], (B, block))  # every prompt key visible

    def body(acc, xs):
        q, ok = xs  # [B, H, block, G, D], [block]
        p = attention_probs(q, keys, last, prompt_lens)  # [B, H, block, G, Tp]
        return acc + jnp.where(ok[None, None, :, None, None], p, 0.0).sum(axis=2), None

    qb = q_rows.reshape(B, H, N // block, block, G, D).transpose(2, 0, 1, 3, 4, 5)
    acc, _ = jax.lax.scan(body, jnp.zeros((B, H, G, keys.shape[2]), jnp.float32),
                          (qb, row_valid.reshape(N // block, block)))
    return finalize_scores(gqa_reduce(avg_pool(acc), "max", axis=2), prompt_lens)


@functools.partial(jax.jit, static_argnames=("l_base",))
def _turn_k_base(q_last, keys, lengths, l_base: int):
    """A pivot's K_base from one query: top-L_base of its pooled scores (GQA max). q_last [B, Np, 1, G, D]."""
    scores = pallas_kernels.scores(q_last, keys, lengths, gqa="max")[:, :, 0]
    return jax.lax.top_k(scores, l_base)[1].astype(jnp.int32)


_select_rows = jax.jit(select_topk, static_argnames=("cap",))


def _split_heads(group: HeadGroup, counts: np.ndarray) -> list[HeadGroup]:
    """One group per head, each exactly as long as its own budget (counts [B, H]): heads of a layer get
    different l_i, and padding them to the longest would hold memory for nothing."""
    out = []
    for j in range(counts.shape[1]):
        c = int(counts[:, j].max())
        out.append(HeadGroup(k=group.k[:, j : j + 1, :c], v=group.v[:, j : j + 1, :c],
                             positions=group.positions[:, j : j + 1, :c], lengths=group.lengths[:, j : j + 1]))
    return out


class HeteroPrefill(PrefillPlan):
    """``build_layer`` hook for HeteroCache plus the state its decode needs (see module docstring)."""

    def __init__(self, policy: HeteroCache, cfg: ModelConfig, prompt_lens, compile_fn=None):
        self.policy, self.cfg = policy, cfg
        self.lens = np.asarray(prompt_lens, np.int64)
        self.compile_fn = compile_fn or (lambda f, *a, **st: functools.partial(f, **st))
        grids = [policy.budget_grid(int(L)) for L in self.lens]  # validates every prompt first
        self.grid = np.stack([g for g, _ in grids])  # [B, L, H] original head order
        self.l_base = np.array([lb for _, lb in grids])  # [B]
        self.layout = policy.layout(cfg)
        self.roles: list[LayerRoles] = policy.layer_roles(cfg)
        # per layer: pinned-host [B, Hc, T, D] prompt KV of every compressed head (layout order)
        self.store = HostKVStore(cfg.num_layers)
        self.counts: list[np.ndarray] = []  # per layer [B, Hc] tokens kept by compressed heads
        self.k_base: list = []
        self.pool: PromptPool | None = None
        if self.layout.tp > 1:
            self.pool_offsets, self.pool_slots = self._plan_pool()

    def _plan_pool(self) -> tuple[list[np.ndarray], int]:
        """Under tensor parallelism every head's kept rows get a window in its shard's pool: per layer [B, H]
        (layout slots) the window starts, each shard's heads packed layer after layer; and the pool size P,
        which covers every window's full group capacity (a window reads past its head's own rows)."""
        tp, H = self.layout.tp, self.cfg.num_kv_heads
        n_local, B = H // tp, len(self.lens)
        cursor = np.zeros((B, tp), np.int64)
        offsets, end = [], 1
        for li, perm in enumerate(self.layout.perms):
            counts = self.grid[:, li, np.asarray(perm)]  # [B, H] layout order
            off = np.zeros((B, H), np.int64)
            for heads in self.layout.slots(li):
                cap = int(counts[:, heads].max())
                for h in heads:
                    off[:, h] = cursor[:, h // n_local]
                    cursor[:, h // n_local] += counts[:, h]
                    end = max(end, int(off[:, h].max()) + cap)
            offsets.append(off)
        return offsets, end

    def _placement(self) -> dict:
        """Tokens each shard's heads keep (the whole batch) and what the shard allocates (pool slots x
        batch), beside the naive contiguous split of the role-grouped layout (full heads first)."""
        from hetero_jax.policies.placement import contiguous_placement, padded_tokens_per_shard, role_grouped_order, shard_tokens

        tp, H = self.layout.tp, self.cfg.num_kv_heads
        n_local = H // tp
        kept = np.zeros(tp, np.int64)
        for li, perm in enumerate(self.layout.perms):
            per_slot = self.grid[:, li, np.asarray(perm)].sum(axis=0)
            np.add.at(kept, np.arange(H) // n_local, per_slot)
        total = self.grid.sum(axis=0)  # [L, H] original order
        naive = contiguous_placement(self.cfg.num_layers, H, tp, role_grouped_order(total))
        naive_kept = shard_tokens(total, naive, tp)
        return {"tp": tp, "kept_tokens_per_shard": kept.tolist(), "kept_max_over_mean": float(kept.max() / kept.mean()),
                "allocated_tokens_per_shard": int(self.pool_slots) * len(self.lens),
                "contiguous_kept_tokens_per_shard": naive_kept.tolist(),
                "contiguous_kept_max_over_mean": float(naive_kept.max() / naive_kept.mean()),
                "contiguous_allocated_tokens_per_shard": int(padded_tokens_per_shard(total, naive, tp))}

    def _new_pool(self, k_buf) -> PromptPool:
        """A zero pool [B, tp, P, D] made on the devices it lives on (split over "model" on a mesh)."""
        B, D, tp = k_buf.shape[0], k_buf.shape[3], self.layout.tp
        shape = (B, tp, self.pool_slots, D)

        def make():
            return PromptPool(k=jnp.zeros(shape, k_buf.dtype), v=jnp.zeros(shape, k_buf.dtype),
                              positions=jnp.full(shape[:3], -1, jnp.int32))

        mesh = getattr(getattr(k_buf, "sharding", None), "mesh", None)
        if mesh is None or not isinstance(mesh, jax.sharding.Mesh):
            return make()
        from hetero_jax.model.sharding import partition_spec
        from hetero_jax.model.spec import CACHE_AXES

        named = lambda axes, shp: jax.sharding.NamedSharding(mesh, partition_spec(axes, shp, mesh))  # noqa: E731
        out = PromptPool(k=named(CACHE_AXES["k"], shape), v=named(CACHE_AXES["v"], shape),
                         positions=named(CACHE_AXES["positions"], shape[:3]))
        return jax.jit(make, out_shardings=out)()

    def build_layer(self, li, layer, x_in, k_buf, v_buf, lens) -> tuple[HeadGroup, ...]:
        if self.layout.tp > 1:
            return self._build_rows(li, layer, x_in, k_buf, v_buf, lens)
        cfg, roles = self.cfg, self.roles[li]
        nf = roles.n_full
        t_max = int(self.lens.max())
        perm = np.asarray(self.layout.perms[li])
        groups = []
        scores = None
        n_comp = cfg.num_kv_heads - nf
        window = self.policy.select_window
        if nf:
            groups.append(full_group(k_buf[:, :nf, :t_max], v_buf[:, :nf, :t_max], lens))
        args = (layer, x_in, k_buf, lens)
        if roles.pivots or (n_comp and window == 1):  # K_base is always the last token's (the paper's)
            scores = self.compile_fn(_last_token_scores, *args, cfg=cfg)(*args)
        if roles.pivots:
            kb = int(self.l_base.max())
            _, idx = jax.lax.top_k(scores[:, : len(roles.pivots)], kb)
            self.k_base.append(idx.astype(jnp.int32))
        else:
            self.k_base.append(None)
        if n_comp:
            counts = self.grid[:, li, perm[nf:]]  # [B, Hc]
            T = k_buf.shape[2]
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (k_buf.shape[0], n_comp, T))
            if window > 1:
                scores = self.compile_fn(_window_scores, *args, cfg=cfg, window=window)(*args)
            group, _ = select_group(scores[:, nf:], k_buf[:, nf:], v_buf[:, nf:], positions,
                                    jnp.asarray(counts, jnp.int32), int(counts.max()), self.compile_fn)
            groups.extend(_split_heads(group, counts))
            self.counts.append(counts)
            self.store.put(li, k_buf[:, nf:, :t_max], v_buf[:, nf:, :t_max])
        else:
            self.counts.append(np.zeros((len(self.lens), 0), np.int64))
        return tuple(groups)

    def _build_rows(self, li, layer, x_in, k_buf, v_buf, lens) -> tuple[PooledGroup, ...]:
        """``build_layer`` for the row layout of tp shards: each group (rows of heads, one per shard) keeps
        every head's own count, full heads their whole prompt, written into each head's pool window (only
        its own rows); pivots' K_base and the host copy of the compressed heads as on one device."""
        cfg, r, tp = self.cfg, self.roles[li], self.layout.tp
        t_max = int(self.lens.max())
        window = self.policy.select_window
        args = (layer, x_in, k_buf, lens)
        n_comp = len(r.comp_slots)
        scores = None
        if r.pivots or (n_comp and window == 1):
            scores = self.compile_fn(_last_token_scores, *args, cfg=cfg)(*args)
        if r.pivots:
            _, idx = jax.lax.top_k(take_slots(scores, r.pivot_slots()), int(self.l_base.max()))
            self.k_base.append(idx.astype(jnp.int32))
        else:
            self.k_base.append(None)
        if n_comp and window > 1:
            scores = self.compile_fn(_window_scores, *args, cfg=cfg, window=window)(*args)
        counts = self.grid[:, li, np.asarray(self.layout.perms[li])]  # [B, H] layout order; full heads: L
        B, H, T, _ = k_buf.shape
        groups = []
        for (o, m), heads in zip(group_spans_of(self.layout.group_sizes[li], tp), self.layout.slots(li)):
            kg, vg = take_heads(k_buf, o, m, tp), take_heads(v_buf, o, m, tp)
            if all(h in r.full_slots for h in heads):
                group = full_group(kg[:, :, :t_max], vg[:, :, :t_max], lens)
            else:
                c = counts[:, heads]
                positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, len(heads), T))
                group, _ = select_group(take_heads(scores, o, m, tp), kg, vg, positions,
                                        jnp.asarray(c, jnp.int32), int(c.max()), self.compile_fn)
            if self.pool is None:
                self.pool = self._new_pool(k_buf)
            offsets = jnp.asarray(self.pool_offsets[li][:, heads], jnp.int32)
            args = (self.pool, group, offsets)
            self.pool = self.compile_fn(_pool_write, *args, tp=tp)(*args)  # the row group itself is dropped
            groups.append(PooledGroup(offsets=offsets, lengths=group.lengths, capacity=group.capacity))
        if n_comp:
            self.counts.append(counts[:, r.comp_slots])
            # every head of the layer, as the device holds them (split over "model"): a gather of the
            # compressed heads would leave the partitioner a layout it replicates on every device's host
            self.store.put(li, k_buf[:, :, :t_max], v_buf[:, :, :t_max])
        else:
            self.counts.append(np.zeros((B, 0), np.int64))
        return tuple(groups)

    def finish(self, cache: KVCache) -> tuple[KVCache, "HeteroDecode"]:
        """The cache with each pivot's K_base in its layer's ``aux``, and the decode state (one way: the
        decode never sees this plan)."""
        layers = tuple(
            lc.replace(aux={"k_base": kb}) if kb is not None else lc for lc, kb in zip(cache.layers, self.k_base)
        )
        pool_offsets, placement = None, None
        if self.layout.tp > 1:
            layers = tuple(lc.replace(head_tp=self.layout.tp) for lc in layers)
            cache, pool_offsets, placement = cache.replace(pool=self.pool), self.pool_offsets, self._placement()
        prefilled = HeteroPrefilled(policy=self.policy, roles=self.roles, counts=self.counts, l_base=self.l_base,
                                    lens=self.lens, store=self.store, pool_offsets=pool_offsets,
                                    placement=placement)
        return cache.replace(layers=tuple(layers)), HeteroDecode(prefilled, compile_fn=self.compile_fn)


@dataclasses.dataclass(frozen=True)
class HeteroPrefilled:
    """What HeteroCache's prefill hands its decode: roles, budgets and the host copy of the compressed heads."""

    policy: HeteroCache
    roles: list[LayerRoles]
    counts: list[np.ndarray]  # per layer [B, Hc] tokens kept by each compressed head (layout order)
    l_base: np.ndarray  # [B] L_base of each sequence
    lens: np.ndarray  # [B] prompt lengths
    # per layer: the compressed heads' full prompt K/V, [B, Hc, T, D] on one device; under tensor
    # parallelism every head's [B, H, T, D] in layout order, split over "model" (``store_heads``)
    store: HostKVStore
    # under tensor parallelism: per layer [B, H] each head's window start in its shard's pool (layout slots)
    pool_offsets: list[np.ndarray] | None = None
    placement: dict | None = None  # under tensor parallelism: tokens per shard, balanced vs contiguous

    def store_heads(self, li: int) -> np.ndarray:
        """Index in the layer's host store of each compressed head (0..Hc-1 on one device; its layout slot
        under tensor parallelism)."""
        if self.pool_offsets is None:
            return np.arange(self.counts[li].shape[1])
        return np.asarray(self.roles[li].comp_slots, np.int64)

    def host_bytes_by_role(self) -> dict[str, int]:
        """Pinned-host KV bytes per role: the satellites' (the paper's reservoir), the anchors', and under
        tensor parallelism the full heads' copies that keep the store split like the device cache."""
        out = {"satellite": 0, "anchor": 0}
        for li, r in enumerate(self.roles):
            per_head = self.store.head_bytes(li)
            if per_head:
                n_comp = self.counts[li].shape[1]
                out["satellite"] += per_head * len(r.satellites)
                out["anchor"] += per_head * (n_comp - len(r.satellites))
                if self.pool_offsets is not None:
                    out["full"] = out.get("full", 0) + per_head * r.n_full
        return out


@functools.partial(jax.jit, static_argnames=("l_base", "tau", "n_top"))
def drift_layer(q_buf, keys, k_base, lengths, l_base: int, tau: float, n_top: int):
    """One layer's drift check: q_buf [B, Np, W, G, D]; keys [B, Np, T, D]; k_base [B, Np, l_base].

    Returns (drift [B, Np] bool, new K_base [B, Np, l_base] (top-l_base of the latest pooled scores; the
    old K_base when no pivot drifted), top-n_top positions of the latest pooled scores, best first
    [B, Np, n_top]; zeros when no pivot drifted, or when ``n_top`` is 0, i.e. the recall does not use them).
    """
    drift, _, latest_scores = pallas_kernels.drift_check(q_buf, keys, k_base, l_base, tau, lengths)
    k = min(max(l_base, n_top), latest_scores.shape[-1])

    def ranked(s):  # one top-k serves both: new K_base and the recall rows are its first l_base / n_top
        vals, idx = jax.lax.top_k(s, k)
        idx = idx.astype(jnp.int32)
        base = jnp.where(vals[..., :l_base] > pallas_kernels.MASK_VALUE * 0.5, idx[..., :l_base], -1)
        return base, jnp.pad(idx[..., :n_top], [(0, 0)] * (idx.ndim - 1) + [(0, max(0, n_top - k))])

    def unchanged(s):
        return k_base.astype(jnp.int32), jnp.zeros(s.shape[:-1] + (n_top,), jnp.int32)

    # the check itself never ranks the prompt; this top-k (a fifth of the check's cost at 32K on CPU) is
    # read only for a drifted pivot: skip it (lax.cond runs one branch) otherwise
    new_base, top = jax.lax.cond(drift.any(), ranked, unchanged, latest_scores)
    return drift, new_base, top


@functools.partial(jax.jit, static_argnames=("tp",), donate_argnums=(0,))
def _pool_write(pool: PromptPool, group: HeadGroup, offsets, tp: int) -> PromptPool:
    """A row group's valid rows into the pool: head h (of m = Hg / tp per shard) of sequence b writes its
    slots [0, length) at pool[b, h // m, offsets[b, h] + t]; its padding slots are dropped, so they never
    overwrite a neighbouring window. group [B, Hg, S, D]; offsets [B, Hg]."""
    B, Hg, S = group.positions.shape
    t = jnp.arange(S, dtype=jnp.int32)
    slot = jnp.where(t < group.lengths[..., None], offsets[..., None] + t, pool.k.shape[2])  # [B, Hg, S]
    b = jnp.arange(B)[:, None, None]
    shard = (jnp.arange(Hg) // (Hg // tp))[None, :, None]
    return pool.replace(k=pool.k.at[b, shard, slot].set(group.k.astype(pool.k.dtype), mode="drop"),
                        v=pool.v.at[b, shard, slot].set(group.v.astype(pool.v.dtype), mode="drop"),
                        positions=pool.positions.at[b, shard, slot].set(group.positions, mode="drop"))


_materialize = jax.jit(materialize)


def _full_heads(lc, r: LayerRoles, slots) -> tuple[jax.Array, jax.Array]:
    """(keys [B, n, T, D], lengths [B, n]) of full heads at layout ``slots``: a slice of one group on one
    device; stacked from the rows' groups (each as long as the longest prompt) under tensor parallelism."""
    locs = [r.loc[int(s)] for s in slots]
    gi, h0 = locs[0]
    if locs == [(gi, h0 + i) for i in range(len(locs))]:
        g = lc.groups[gi]
        return g.k[:, h0 : h0 + len(locs)], g.lengths[:, h0 : h0 + len(locs)]
    return (jnp.stack([lc.groups[g].k[:, h] for g, h in locs], axis=1),
            jnp.stack([lc.groups[g].lengths[:, h] for g, h in locs], axis=1))


class HeteroDecode(DecodeState):
    """Per-request decode-time state of HeteroCache: query buffer, pending checks, re-selection and recall stats."""

    wants_turn_queries = True

    def __init__(self, prefilled: HeteroPrefilled, compile_fn=None):
        self.prefilled = prefilled
        self.policy = prefilled.policy
        self.compile_fn = compile_fn or (lambda f, *a, **st: functools.partial(f, **st))
        # the last `window` steps: tuples over layers of pivot queries [B, Np, G, D] (device)
        self.buffer: collections.deque = collections.deque(maxlen=prefilled.policy.window)
        self.pivot_layers = [li for li, r in enumerate(prefilled.roles) if r.pivots]
        self.pending = None  # (step, per layer check outputs) of a dispatched check
        self.checks = 0  # pivot checks run (pivots x checks)
        self.triggers = 0  # pivot checks that drifted
        self.recalls = 0  # satellite heads refreshed by a drift
        self.bytes_recalled = 0
        self.reselections = 0  # turns after which the compressed heads re-selected
        self.bytes_reselected = 0  # K/V bytes written to the device by those re-selections
        self.recall_failures = 0  # recalls dropped because their transfer failed (see before_step)
        self.reselect_failures = 0  # re-selections dropped the same way (see after_extend)
        self.recall_steps: list[int] = []
        # called as f(layer, q_buf, keys, k_base, lengths, l_base=...) with each pivot layer's check inputs
        # before it is dispatched (benchmarks/bench_drift_metric.py records the overlaps this way)
        self.check_observers: list = []

    def fresh(self) -> "HeteroDecode":
        return HeteroDecode(self.prefilled, compile_fn=self.compile_fn)

    def after_step(self, step: int, extras, cache: KVCache) -> None:
        """Buffer the pivots' queries of decode step ``step`` (``HeteroCache.attend``'s extras); every
        ``window`` steps dispatch the check."""
        self.buffer.append(tuple(extras))
        if len(self.buffer) == self.policy.window and self.pivot_layers:
            self._dispatch_check(step, cache)
            self.buffer.clear()

    def after_extend(self, turn_queries, cache: KVCache) -> KVCache:
        """Re-select after a turn: every compressed head re-takes its top-l_i (budgets unchanged) from its
        host keys, scored by the pooled attention of the turn's queries (``_turn_scores``), rows in
        position order; each pivot's K_base restarts from the turn's last query.

        turn_queries: per layer [B, Nkv, N, G, D] (layout order), the N appended tokens' queries.
        A check still pending from the previous answer is dropped (it would recall over the new rows),
        and the drift buffer restarts with the next decode step. All or nothing, like a recall: if a
        transfer fails the input cache is returned, with a RuntimeWarning.
        """
        self.pending = None
        self.buffer.clear()
        saved = self.bytes_reselected
        try:
            return self._reselect(turn_queries, cache)
        except (RuntimeError, MemoryError) as e:
            self.bytes_reselected = saved
            self.reselect_failures += 1
            warnings.warn(f"HeteroCache: the re-selection after a turn failed ({type(e).__name__}: {e}); the "
                          "device cache keeps its previous rows", RuntimeWarning, stacklevel=2)
            return cache

    def _reselect(self, turn_queries, cache: KVCache) -> KVCache:
        n = turn_queries[0].shape[2]
        block = 16
        n_pad = -(-n // block) * block
        row_valid = jnp.arange(n_pad) < n
        l_base = int(self.prefilled.l_base.max())
        lens = jnp.asarray(self.prefilled.lens, jnp.int32)
        layers = list(cache.layers)
        pool_rows = []  # under tensor parallelism: (layer, b, compressed head, slots, rows) into the pool
        for li, r in enumerate(self.prefilled.roles):
            lc, q = layers[li], turn_queries[li]
            groups, aux = list(lc.groups), dict(lc.aux)
            if r.pivots:
                keys, lengths = _full_heads(self._view(cache, li), r, r.pivot_slots())
                args = (take_slots(q, r.pivot_slots())[:, :, -1:], keys, lengths)
                aux["k_base"] = self.compile_fn(_turn_k_base, *args, l_base=l_base)(*args)
            counts = self.prefilled.counts[li]  # [B, Hc]
            if counts.shape[1]:
                host_k, host_v = self.prefilled.store.view(li)  # [B, Hc (H under tp), T, D]
                sh = self.prefilled.store_heads(li)  # compressed head j is host head sh[j]
                qc = take_slots(q, r.comp_slots)
                qc = jnp.pad(qc, ((0, 0), (0, 0), (0, n_pad - n), (0, 0), (0, 0)))
                # one layer's compressed keys on the device, for this scoring only
                keys = jnp.asarray(host_k if len(sh) == host_k.shape[1] else host_k[:, sh])
                args = (qc, row_valid, keys, lens)
                scores = self.compile_fn(_turn_scores, *args, block=block)(*args)
                # compiled per 64-slot bucket, not per layer's largest budget (as ``select_group``)
                cap = cap_bucket(int(counts.max()), scores.shape[-1])
                args = (scores, jnp.asarray(counts, jnp.int32))
                idx = np.asarray(self.compile_fn(_select_rows, *args, cap=cap)(*args))  # [B, Hc, cap]
                b = np.arange(idx.shape[0])[:, None]
                for j in range(counts.shape[1]):
                    c = int(counts[:, j].max())
                    rows = idx[:, j, :c]  # [B, c] position order; past a sequence's count: a repeat
                    self.bytes_reselected += 2 * host_k[b, sh[j], rows].nbytes
                    if cache.pool is not None:  # only each sequence's own rows: a window's tail is another's
                        pool_rows += [(li, bi, j, np.arange(counts[bi, j]), rows[bi, : counts[bi, j]])
                                      for bi in range(len(rows))]
                        continue
                    valid = np.arange(c)[None, :] < counts[:, j : j + 1]
                    k_new, v_new = host_k[b, sh[j], rows], host_v[b, sh[j], rows]  # [B, c, D]
                    pos = np.where(valid, rows, -1).astype(np.int32)
                    gi = r.loc[r.comp_slots[j]][0]  # one device: the head's own group, exactly c slots
                    groups[gi] = groups[gi].replace(k=jax.device_put(k_new[:, None]), v=jax.device_put(v_new[:, None]),
                                                    positions=jax.device_put(pos[:, None]))
            layers[li] = lc.replace(groups=tuple(groups), aux=aux)
        self.reselections += 1
        cache = cache.replace(layers=tuple(layers))
        return self._write_pool(cache, pool_rows) if pool_rows else cache

    def _view(self, cache: KVCache, li: int):
        """Layer ``li`` with pooled groups read out of the pool (itself on one device)."""
        lc = cache.layers[li]
        return lc if cache.pool is None else _materialize(lc, cache.pool)

    def _write_pool(self, cache: KVCache, items: list) -> KVCache:
        """Rows of compressed heads from the host copy into their pool windows, one transfer and one scatter
        for all of them. items: (layer, b, compressed head j, window slots [n], prompt rows [n])."""
        offsets = self.prefilled.pool_offsets
        tp = cache.layers[0].head_tp
        H = cache.layers[0].tail_k.shape[1]
        parts = []
        for li, b, j, slots, rows in items:
            h = self.prefilled.roles[li].comp_slots[j]
            k_rows, v_rows = self.prefilled.store.rows(li, np.full(len(rows), b), np.full(len(rows), h), rows)
            parts.append((np.full(len(rows), b), np.full(len(rows), h // (H // tp)), offsets[li][b, h] + slots,
                          k_rows, v_rows, rows))
        cat = [np.concatenate([p[i] for p in parts]) for i in range(6)]
        ops = put_rows(*cat, capacity=cache.pool.k.shape[2])
        return cache.replace(pool=scatter_rows(cache.pool, ops, self.compile_fn))

    def _dispatch_check(self, step: int, cache: KVCache) -> None:
        """Dispatch every pivot layer's drift check on the buffered steps; outputs are copied to the host
        asynchronously and read before the next step."""
        outs = [None] * len(self.prefilled.roles)
        l_base = int(self.prefilled.l_base.max())
        for li in self.pivot_layers:
            r = self.prefilled.roles[li]
            q_buf = jnp.stack([b[li] for b in self.buffer], axis=2)  # [B, Np, W, G, D]
            keys, lengths = _full_heads(self._view(cache, li), r, r.pivot_slots())
            counts = self.prefilled.counts[li]
            n_top = max(1, int(counts.max())) if counts.size else 1
            args = (q_buf, keys, cache.layers[li].aux["k_base"], lengths)
            for observe in self.check_observers:
                observe(li, *args, l_base=l_base)
            fn = self.compile_fn(drift_layer, *args, l_base=l_base, tau=self.policy.drift_threshold,
                                 n_top=min(n_top, keys.shape[2]))
            out = fn(*args)
            for a in out:
                a.copy_to_host_async()  # read before the next step is dispatched, never waited on now
            outs[li] = out
        self.pending = (step, outs)

    def before_step(self, step: int, cache: KVCache) -> KVCache:
        """Apply the previous check's recalls (one step after it ran), all or nothing.

        A recall whose host -> device transfer fails (a RuntimeError from ``jax.device_put``, e.g. out of
        device memory) leaves the cache and the recall stats as they were, with a RuntimeWarning:
        the recall is an accuracy aid, and decoding (a session's turn) goes on without it. K_base is
        kept too, so the next check sees the drift again and retries the recall.
        """
        if self.pending is None:
            return cache
        saved = (self.checks, self.triggers, self.recalls, self.bytes_recalled, len(self.recall_steps))
        try:
            return self._apply_recalls(step, cache)
        except (RuntimeError, MemoryError) as e:
            (self.checks, self.triggers, self.recalls, self.bytes_recalled, n) = saved
            del self.recall_steps[n:]
            self.recall_failures += 1
            warnings.warn(f"HeteroCache: the recall at decode step {step} failed ({type(e).__name__}: {e}); the "
                          "device cache is unchanged and the drift will be checked again", RuntimeWarning,
                          stacklevel=2)
            return cache

    def _apply_recalls(self, step: int, cache: KVCache) -> KVCache:
        """Each drifted pivot's satellites take the top-l_s rows of its latest scores from the host copy.

        Only those rows cross to the device (``host_store.put_rows``, every transfer started before any
        write) and are written in place (``scatter_rows``): the groups are never read back.
        """
        _, outs = self.pending
        self.pending = None
        layers = list(cache.layers)
        writes = []  # (layer, group index, device operands) once every transfer has started
        pool_rows = []  # under tensor parallelism: rows into the pool (``_write_pool``)
        for li, out in enumerate(outs):
            if out is None:
                continue
            drift, new_base, top = (np.asarray(a) for a in out)
            r = self.prefilled.roles[li]
            self.checks += drift.size
            self.triggers += int(drift.sum())
            if not drift.any():
                continue
            counts = self.prefilled.counts[li]  # [B, Hc]
            per_group: dict[int, list] = {}
            for b, p in zip(*np.nonzero(drift)):
                for sat in r.members.get(int(p), []):
                    l_s = int(counts[b, sat])
                    pos = np.sort(top[b, p, :l_s])
                    if cache.pool is not None:  # the satellite's window in its shard's pool
                        pool_rows.append((li, b, sat, np.arange(l_s), pos))
                        self.recalls += 1
                        self.bytes_recalled += 2 * l_s * layers[li].tail_k.shape[-1] * layers[li].tail_k.dtype.itemsize
                        continue
                    gi, hi = r.loc[r.comp_slots[sat]]  # the satellite's group and head in it
                    per_group.setdefault(gi, []).append((b, sat, hi, pos))
            for gi, items in per_group.items():
                b_idx = np.concatenate([np.full(len(pos), b) for b, _, _, pos in items])
                sats = np.concatenate([np.full(len(pos), sat) for _, sat, _, pos in items])
                h_idx = np.concatenate([np.full(len(pos), hi) for _, _, hi, pos in items])
                rows = np.concatenate([pos for _, _, _, pos in items])
                slots = np.concatenate([np.arange(len(pos)) for _, _, _, pos in items])
                k_rows, v_rows = self.prefilled.store.rows(li, b_idx, self.prefilled.store_heads(li)[sats], rows)
                ops = put_rows(b_idx, h_idx, slots, k_rows, v_rows, rows, layers[li].groups[gi].capacity)
                writes.append((li, gi, ops))
                self.recalls += len(items)
                self.bytes_recalled += k_rows.nbytes + v_rows.nbytes
            base = np.where(drift[..., None], new_base, np.asarray(layers[li].aux["k_base"]))
            aux = dict(layers[li].aux)
            aux["k_base"] = jax.device_put(base.astype(np.int32))
            layers[li] = layers[li].replace(aux=aux)
            self.recall_steps.append(step)
        for li, gi, ops in writes:  # every transfer went out: write in place
            groups = list(layers[li].groups)
            groups[gi] = scatter_rows(groups[gi], ops, self.compile_fn)
            layers[li] = layers[li].replace(groups=tuple(groups))
        cache = cache.replace(layers=tuple(layers))
        return self._write_pool(cache, pool_rows) if pool_rows else cache

    def in_flight(self):
        return self.pending

    def host_arrays(self) -> tuple:
        return self.prefilled.store.arrays()

    def host_bytes_by_role(self) -> dict[str, int]:
        return self.prefilled.host_bytes_by_role()

    def summary(self) -> str:
        text = (f"drift checks {self.checks}, triggered {self.triggers / self.checks if self.checks else 0:.0%}, "
                f"recalls {self.recalls} ({self.bytes_recalled / 2**10:.0f} KiB)")
        if self.reselections:
            text += f", re-selected {self.reselections}x ({self.bytes_reselected / 2**20:.1f} MiB)"
        p = self.prefilled.placement
        if p:
            text += (f", tp {p['tp']}: kept max/mean {p['kept_max_over_mean']:.2f} (contiguous "
                     f"{p['contiguous_kept_max_over_mean']:.2f}), {p['allocated_tokens_per_shard']} tokens allocated "
                     f"per shard (contiguous {p['contiguous_allocated_tokens_per_shard']})")
        return text

    def stats(self) -> dict:
        return {
            "drift_checks": self.checks,
            "drift_triggers": self.triggers,
            "trigger_rate": self.triggers / self.checks if self.checks else 0.0,
            "recalls": self.recalls,
            "bytes_recalled": self.bytes_recalled,
            "reselections": self.reselections,
            "bytes_reselected": self.bytes_reselected,
            "recall_failures": self.recall_failures,
            "reselect_failures": self.reselect_failures,
            **({"placement": self.prefilled.placement} if self.prefilled.placement else {}),
        }
