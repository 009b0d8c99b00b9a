"""HeteroCache's prefill: role budgets (Eq. 7-8), per-head selection, the host copy of the compressed heads,
K_base of each pivot; ``finish`` hands a ``HeteroPrefilled`` record to the decode state.

One code path on one device and on a mesh: each head's kept rows go to its own region of the row pool
(``model.cache``), full heads the whole prompt, compressed heads their top-l_i in position order.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from hetero_jax.model.cache import KVCache, LayerPrefill, RowBlock, block_width, head_offsets
from hetero_jax.model.config import ModelConfig
from hetero_jax.model.host_store import HostKVStore
from hetero_jax.policies.protocol import PrefillPlan
from hetero_jax.policies.profiled import LayerRoles, ProfiledPolicy, take_slots
from hetero_jax.policies.selection import select_group
from hetero_jax.policies.heterocache.copy_window import window_slots
from hetero_jax.policies.heterocache.decode import HeteroDecode
from hetero_jax.policies.heterocache.prefilled import HeteroPrefilled
from hetero_jax.policies.heterocache.scores import last_token_scores, top_positions, window_scores
from hetero_jax.policies.heterocache.step import PivotBase, base_width, mask_base


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
        # per layer: pinned-host prompt KV of every compressed head, named by layout slot (``put_heads``: where
        # the heads are split over devices, every head's, so the host copy splits like the pool)
        self.store = HostKVStore(cfg.num_layers)
        # [L, B, H] rows each head keeps, layout order: full heads their prompt, compressed heads l_i (Eq. 8)
        self.counts = np.stack([self.grid[:, li, np.asarray(perm)] for li, perm in enumerate(self.layout.perms)])
        # per layer with a copy window (one device: ``HeteroCache.bind``): the compressed heads' kept positions
        # and their selection scores, both [B, Hc, cap] (device), from which ``finish`` picks each head's window
        # slots; else None
        self.kept: list = []

    def prompt_counts(self) -> np.ndarray:
        return self.counts

    def _placement(self, pool_rows: int) -> dict:
        """Tokens each shard's heads keep (the whole batch) and the prompt tokens a shard allocates (a sequence's
        regions on a shard hold its kept rows: the largest (sequence, shard) total, x batch), beside the same two
        of the naive contiguous split of the role-grouped layout (full heads first); and the pool rows a shard
        allocates, which add every head's tail rows and the rounding to the prompt's."""
        from hetero_jax.policies.placement import contiguous_placement, role_grouped_order, shard_tokens

        tp, H, B = self.layout.tp, self.cfg.num_kv_heads, len(self.lens)
        per_row = self.counts.reshape(self.cfg.num_layers, B, tp, H // tp).sum(axis=(0, 3))  # [B, tp]
        kept = per_row.sum(axis=0)
        total = self.grid.sum(axis=0)  # [L, H] original order
        naive = contiguous_placement(self.cfg.num_layers, H, tp, role_grouped_order(total))
        naive_kept = shard_tokens(total, naive, tp)
        naive_row = max(int(shard_tokens(self.grid[b], naive, tp).max()) for b in range(B))
        return {"tp": tp, "kept_tokens_per_shard": kept.tolist(), "kept_max_over_mean": float(kept.max() / kept.mean()),
                "allocated_tokens_per_shard": int(per_row.max()) * B, "pool_rows_per_shard": int(pool_rows) * B,
                "contiguous_kept_tokens_per_shard": naive_kept.tolist(),
                "contiguous_kept_max_over_mean": float(naive_kept.max() / naive_kept.mean()),
                "contiguous_allocated_tokens_per_shard": naive_row * B}

    def build_layer(self, li, layer, x_in, k_buf, v_buf, lens) -> LayerPrefill:
        cfg, r = self.cfg, self.roles[li]
        t_max = int(self.lens.max())
        window = self.policy.select_window
        counts = self.counts[li]  # [B, H]
        n_comp = len(r.comp_slots)
        args = (layer, x_in, k_buf, lens)
        scores = None
        if r.pivots or (n_comp and window == 1):  # K_base is always the last token's (the paper's)
            scores = self.compile_fn(last_token_scores, *args, cfg=cfg)(*args)
        state = None
        if r.pivots:
            # ``base_width`` wide; each sequence keeps its own top-L_base (``PivotBase``)
            idx = top_positions(take_slots(scores, r.pivot_slots()), base_width(self.l_base))
            state = PivotBase(k_base=mask_base(idx, self.l_base))
        blocks = []
        B, H, T, _ = k_buf.shape
        if r.full_slots:
            full = r.full_slots
            w = block_width(t_max, T)
            positions = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (B, len(full), w))
            blocks.append(RowBlock(k=take_slots(k_buf, full)[:, :, :w], v=take_slots(v_buf, full)[:, :, :w],
                                   positions=positions, lengths=jnp.asarray(counts[:, full], jnp.int32),
                                   heads=tuple(full)))
        self.kept.append(None)
        if n_comp:
            comp = r.comp_slots
            c = counts[:, comp]  # [B, Hc]
            if window > 1:
                scores = self.compile_fn(window_scores, *args, cfg=cfg, window=window)(*args)
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, n_comp, T))
            block, kept = select_group(take_slots(scores, comp), take_slots(k_buf, comp), take_slots(v_buf, comp),
                                       positions, jnp.asarray(c, jnp.int32), int(c.max()), comp, self.compile_fn)
            blocks.append(block)
            if self.policy.copy_window:
                self.kept[-1] = (block.positions, kept)
            self.store.put_heads(li, k_buf[:, :, :t_max], v_buf[:, :, :t_max], comp)
        return LayerPrefill(blocks=tuple(blocks), state=state)

    def finish(self, cache: KVCache) -> tuple[KVCache, "HeteroDecode"]:
        """The cache as built, and the decode state (one way: the decode never sees this plan)."""
        self.store.settle_on_huge_pages()  # a CPU's recall gathers from huge pages
        held, win = [], []
        comp_counts = [self.counts[li][:, r.comp_slots] for li, r in enumerate(self.roles)]
        for counts, kept in zip(comp_counts, self.kept):
            if kept is None:
                held.append(None)
                win.append(None)
                continue
            cap = int(counts.max(initial=0))  # the block's slots past every head's count are padding
            pos, score = (np.asarray(a)[:, :, :cap] for a in kept)
            held.append(pos.astype(np.int64))
            win.append(window_slots(score, counts, self.policy.copy_window))
        prefilled = HeteroPrefilled(
            policy=self.policy, roles=self.roles, counts=comp_counts, l_base=self.l_base, lens=self.lens,
            store=self.store, offsets=head_offsets(cache),
            placement=self._placement(cache.pool.num_rows) if self.layout.tp > 1 else None,
            held=held, window_slots=win)
        return cache, HeteroDecode(prefilled, compile_fn=self.compile_fn)
