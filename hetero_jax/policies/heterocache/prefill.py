"""HeteroCache's prefill: role budgets (Eq. 7-8), per-head selection, the host copy of the compressed heads,
K_base of each pivot; ``finish`` hands a ``HeteroPrefilled`` record to the decode state."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.model.cache import HeadGroup, KVCache, PooledGroup, PromptPool, full_group, take_heads
from hetero_jax.model.config import ModelConfig
from hetero_jax.model.host_store import HostKVStore
from hetero_jax.model.layout import group_spans_of
from hetero_jax.policies.protocol import PrefillPlan
from hetero_jax.policies.profiled import LayerRoles, ProfiledPolicy, take_slots
from hetero_jax.policies.selection import select_group
from hetero_jax.policies.heterocache.decode import HeteroDecode, HeteroPrefilled, window_slots
from hetero_jax.policies.heterocache.scores import last_token_scores, window_scores


def split_runs(group: HeadGroup, counts: np.ndarray, runs) -> list[HeadGroup]:
    """The compressed heads' group cut into the layout's runs of heads (``HeteroCache.layout``: heads of close
    budgets), each as long as its longest head's budget (counts [B, H]); every head keeps its own l_i rows
    (``lengths``), the rest of its run's capacity is padding."""
    out, j = [], 0
    for m in runs:
        c = int(counts[:, j : j + m].max())
        out.append(HeadGroup(k=group.k[:, j : j + m, :c], v=group.v[:, j : j + m, :c],
                             positions=group.positions[:, j : j + m, :c], lengths=group.lengths[:, j : j + m]))
        j += m
    return out


class HeteroPrefill(PrefillPlan):
    """``build_layer`` hook for HeteroCache plus the state its decode needs (see module docstring)."""

    def __init__(self, policy: ProfiledPolicy, cfg: ModelConfig, prompt_lens, compile_fn=None):  # a HeteroCache
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
        # per layer on one device with a copy window: the compressed heads' kept positions and their selection
        # scores, both [B, Hc, cap] (device), from which ``finish`` picks each head's window slots; else None
        self.kept: list = []
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
            scores = self.compile_fn(last_token_scores, *args, cfg=cfg)(*args)
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
                scores = self.compile_fn(window_scores, *args, cfg=cfg, window=window)(*args)
            group, kept = select_group(scores[:, nf:], k_buf[:, nf:], v_buf[:, nf:], positions,
                                       jnp.asarray(counts, jnp.int32), int(counts.max()), self.compile_fn)
            groups.extend(split_runs(group, counts, self.layout.group_sizes[li][1 if nf else 0:]))
            self.kept.append((group.positions, kept) if self.policy.copy_window else None)
            self.counts.append(counts)
            self.store.put(li, k_buf[:, nf:, :t_max], v_buf[:, nf:, :t_max])
        else:
            self.counts.append(np.zeros((len(self.lens), 0), np.int64))
            self.kept.append(None)
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
            scores = self.compile_fn(last_token_scores, *args, cfg=cfg)(*args)
        if r.pivots:
            _, idx = jax.lax.top_k(take_slots(scores, r.pivot_slots()), int(self.l_base.max()))
            self.k_base.append(idx.astype(jnp.int32))
        else:
            self.k_base.append(None)
        if n_comp and window > 1:
            scores = self.compile_fn(window_scores, *args, cfg=cfg, window=window)(*args)
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
            self.pool = self.compile_fn(pool_write, *args, tp=tp)(*args)  # the row group itself is dropped
            groups.append(PooledGroup(offsets=offsets, lengths=group.lengths, capacity=group.capacity))
        self.kept.append(None)  # the copy window is built for one device
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
        held, win = [], []
        for counts, kept in zip(self.counts, self.kept):
            if kept is None:
                held.append(None)
                win.append(None)
                continue
            pos, score = (np.asarray(a) for a in kept)
            held.append(pos.astype(np.int64))
            win.append(window_slots(score, counts, self.policy.copy_window))
        prefilled = HeteroPrefilled(policy=self.policy, roles=self.roles, counts=self.counts, l_base=self.l_base,
                                    lens=self.lens, store=self.store, pool_offsets=pool_offsets,
                                    placement=placement, held=held, window_slots=win)
        return cache.replace(layers=tuple(layers)), HeteroDecode(prefilled, compile_fn=self.compile_fn)


@functools.partial(jax.jit, static_argnames=("tp",), donate_argnums=(0,))
def pool_write(pool: PromptPool, group: HeadGroup, offsets, tp: int) -> PromptPool:
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
