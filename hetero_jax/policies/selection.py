"""Applying a policy during layer-major prefill: score, select, gather, per layer, into row blocks for the pool."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.model import transformer as M
from hetero_jax.model.cache import KVCache, LayerPrefill, RowBlock, prompt_kv_bytes
from hetero_jax.model.config import ModelConfig
from hetero_jax.policies.base import tokens_for
from hetero_jax.policies.protocol import DecodeState, PrefillPlan, TailOnlyDecode
from pallas_kernels import MASK_VALUE
from hetero_jax.model.scoring import gather_group, select_topk
from hetero_jax.model.sharding import to_host


@functools.partial(jax.jit, static_argnames=("policy", "cfg"))
def layer_scores(layer, x_in, keys, prompt_lens, policy, cfg: ModelConfig):
    """(scores [B, Hkv, Tp] float32, aux [B] or None) of one layer under ``policy``."""
    return policy.token_scores(layer, x_in, keys, prompt_lens, cfg)


# Selection compiles per 64-slot bucket of the block size, and the block keeps that size (its padding is dropped
# when written into the pool), so per-layer budgets (PyramidKV, CAKE) do not compile once per layer.
CAP_QUANTUM = 64


def cap_bucket(cap: int, n_slots: int) -> int:
    """The compiled selection size for a block of ``cap`` slots out of ``n_slots``: the next multiple of
    CAP_QUANTUM, at most ``n_slots``."""
    return min(-(-cap // CAP_QUANTUM) * CAP_QUANTUM, n_slots)


@functools.partial(jax.jit, static_argnames=("cap",))
def _select_bucket(scores, k, v, positions, counts, cap: int):
    idx = select_topk(scores, counts, cap)
    kept = jnp.take_along_axis(scores, idx, axis=2)
    # padding slots repeat a kept token; they must never win a later re-selection (CAKE's cascade)
    padding = jnp.arange(cap)[None, None, :] >= counts[..., None]
    return gather_group(k, v, positions, idx, counts), jnp.where(padding, MASK_VALUE, kept)


def select_group(scores, k, v, positions, counts, cap: int, heads=(), compile_fn=None) -> tuple[RowBlock, jax.Array]:
    """Keep each head's top-``counts`` slots (position order) in a row block of ``cap_bucket(cap)`` slots, the
    slots past each head's count padding (``RowBlock``), which the pool's write drops.

    scores: [B, H, T]; k, v: [B, H, T, D]; positions: [B, H, T]; counts: [B, H] (<= cap); ``heads``: the
    block's layout slots. Returns the block and the kept slots' scores [B, H, bucket] (MASK_VALUE on padding).
    The block is not cut to ``cap``: a cut is an eager slice of each array, compiled anew for every size, and
    its size would key the pool write's compile too; at the bucket both are shared by layers and prompt lengths.
    """
    compile_fn = compile_fn or (lambda f, *a, **st: functools.partial(f, **st))
    args = (scores, k, v, positions, counts)
    block, kept = compile_fn(_select_bucket, *args, cap=cap_bucket(cap, scores.shape[-1]))(*args)
    return block.replace(heads=tuple(int(h) for h in heads)), kept


class PolicyPrefill(PrefillPlan):
    """The prefill plan of a scored policy (``composed.ScoredPolicy``): its scorer scores tokens, its allocator
    says how many each head keeps, and each head keeps its top ones.

    Budgets are checked on the host before any compute (``__init__``). For an allocator that plans while
    prefilling (CAKE's cascade) the kept candidates are cut to their final budgets in :meth:`cut`.
    """

    def __init__(self, policy, cfg: ModelConfig, prompt_lens, compile_fn=None):
        self.policy, self.cfg = policy, cfg
        self.lens = np.asarray(prompt_lens, np.int64)
        self.compile_fn = compile_fn or (lambda f, *a, **st: functools.partial(f, **st))
        per_seq = [policy.head_budgets(cfg, int(L)) for L in self.lens]  # each [num_layers, Hkv] or None
        self.planned = per_seq[0] is not None
        if self.planned:
            self.counts = np.stack(per_seq, axis=1)  # [num_layers, B, Hkv]
        else:
            self.n = np.array([tokens_for(policy.budget, int(L)) for L in self.lens])  # checked above
            self.floor = policy.scorer.min_tokens().tokens
            self.prefs: list[np.ndarray] = []
            self.kept_scores: list[jax.Array] = []

    def prompt_counts(self):
        if not self.planned:
            return None
        return self.counts

    def _call(self, fn, *args, **static):
        return self.compile_fn(fn, *args, **static)(*args)

    def build_layer(self, li, layer, x_in, k_buf, v_buf, lens) -> LayerPrefill:
        cfg = self.cfg
        scores, aux = self._call(layer_scores, layer, x_in, k_buf, lens, policy=self.policy, cfg=cfg)
        B, H, T, _ = k_buf.shape
        if self.planned:
            per_bh = self.counts[li]  # [B, H]
        else:  # CAKE: this layer's share at its own step, given the preferences so far
            self.prefs.append(to_host(aux).astype(np.float64))
            prefs = np.stack(self.prefs, axis=1)  # [B, li + 1]
            per_b = np.array([self.policy.allocator.shares(prefs[b], int(self.n[b]), int(self.lens[b]),
                                                           self.floor)[0][li] for b in range(len(self.lens))])
            per_bh = np.broadcast_to(per_b[:, None], (B, H))
        counts = jnp.asarray(per_bh, jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, H, T))
        block, kept = select_group(scores, k_buf, v_buf, positions, counts, int(per_bh.max()), range(H),
                                   self.compile_fn)
        if not self.planned:
            self.kept_scores.append(kept)
        return LayerPrefill(blocks=(block,))

    def cut(self, outputs: list[LayerPrefill]) -> tuple[list[LayerPrefill], np.ndarray]:
        """CAKE: each layer's candidates cut to the smallest share the cascade gave it; (outputs, counts
        [L, B, H])."""
        prefs = np.stack(self.prefs, axis=1)  # [B, num_layers]
        finals = np.stack([self.policy.allocator.shares(prefs[b], int(self.n[b]), int(self.lens[b]), self.floor)[1]
                           for b in range(len(self.lens))], axis=1)  # [num_layers, B]
        out = []
        for li, (prev, kept) in enumerate(zip(outputs, self.kept_scores)):
            (g,) = prev.blocks
            B, H = g.lengths.shape
            counts = jnp.asarray(np.broadcast_to(finals[li][:, None], (B, H)), jnp.int32)
            block, _ = select_group(kept, g.k, g.v, g.positions, counts, int(finals[li].max()), g.heads,
                                    self.compile_fn)
            out.append(LayerPrefill(blocks=(block,)))
        self.kept_scores = []
        self.counts = np.repeat(finals[:, :, None], self.cfg.num_kv_heads, axis=2)  # [num_layers, B, Hkv]
        return out, self.counts

    def finish(self, cache: KVCache) -> tuple[KVCache, DecodeState]:
        """(the cache, its decode state): a static policy's decode has no hooks."""
        return cache, TailOnlyDecode()


class FullPrefill(M.FullKVPlan, PrefillPlan):
    """Full KV's prefill plan: every head keeps its whole prompt (no scoring, no selection)."""

    def __init__(self, cfg: ModelConfig, prompt_lens, compile_fn=None):
        super().__init__(prompt_lens, cfg.num_layers, cfg.num_kv_heads)

    def finish(self, cache: KVCache) -> tuple[KVCache, DecodeState]:
        return cache, TailOnlyDecode()


def bytes_rho(cache, cfg: ModelConfig) -> float:
    """Device bytes of the kept prompt rows over a full KV cache of the same batch (every head holding the
    longest prompt): for one sequence, exactly the kept fraction in bytes."""
    t_max = int(np.max(np.asarray(cache.prompt_lens)))
    full = cache.batch_size * t_max * cfg.num_kv_heads * cfg.num_layers * (
        2 * cfg.head_dim * cache.pool.k.dtype.itemsize)
    return prompt_kv_bytes(cache) / full
