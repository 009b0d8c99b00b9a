"""Applying a policy during layer-major prefill: score, select, gather, per layer."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.model import transformer as M
from hetero_jax.model.cache import HeadGroup, KVCache, prompt_kv_bytes
from hetero_jax.model.config import ModelConfig
from hetero_jax.policies.protocol import DecodeState, PrefillPlan
from pallas_kernels import MASK_VALUE
from hetero_jax.policies.primitives import gather_group, select_topk
from hetero_jax.model.sharding import to_host


@functools.partial(jax.jit, static_argnames=("policy", "cfg"))
def layer_scores(layer, x_in, keys, prompt_lens, policy, cfg: ModelConfig):
    """(scores [B, Hkv, Tp] float32, aux [B] or None) of one layer under ``policy``."""
    return policy.token_scores(layer, x_in, keys, prompt_lens, cfg)


# Selection compiles per 64-slot bucket of the group size, then the group is sliced to
# its exact size, so per-layer budgets (PyramidKV, CAKE) do not compile once per layer.
CAP_QUANTUM = 64


def cap_bucket(cap: int, n_slots: int) -> int:
    """The compiled selection size for a group of ``cap`` slots out of ``n_slots``: the next multiple of
    CAP_QUANTUM, at most ``n_slots``."""
    return min(-(-cap // CAP_QUANTUM) * CAP_QUANTUM, n_slots)


@functools.partial(jax.jit, static_argnames=("cap",))
def _select_bucket(scores, k, v, positions, counts, cap: int):
    idx = select_topk(scores, counts, cap)
    kept = jnp.take_along_axis(scores, idx, axis=2)
    # padding slots repeat a kept token; they must never win a later re-selection (CAKE's cascade)
    padding = jnp.arange(cap)[None, None, :] >= counts[..., None]
    return gather_group(k, v, positions, idx, counts), jnp.where(padding, MASK_VALUE, kept)


def select_group(scores, k, v, positions, counts, cap: int, compile_fn=None) -> tuple[HeadGroup, jax.Array]:
    """Keep each head's top-``counts`` slots (position order) in a new group of exactly ``cap`` slots.

    scores: [B, H, T]; k, v: [B, H, T, D]; positions: [B, H, T]; counts: [B, H] (<= cap).
    Returns the group and the kept slots' scores [B, H, cap].
    """
    compile_fn = compile_fn or (lambda f, *a, **st: functools.partial(f, **st))
    bucket = cap_bucket(cap, scores.shape[-1])
    args = (scores, k, v, positions, counts)
    group, kept = compile_fn(_select_bucket, *args, cap=bucket)(*args)
    if bucket == cap:
        return group, kept
    cut = lambda a: a[:, :, :cap]  # noqa: E731 - the slots past cap hold only padding
    return group.replace(k=cut(group.k), v=cut(group.v), positions=cut(group.positions)), cut(kept)


class PolicyPrefill(PrefillPlan):
    """The ``build_layer`` hook of :func:`hetero_jax.model.transformer.prefill` for one policy and batch.

    Budgets are checked on the host before any compute (``__init__``). For
    policies that plan while prefilling (CAKE) the kept candidates are cut to
    their final budgets in :meth:`finish`.
    """

    def __init__(self, policy, cfg: ModelConfig, prompt_lens, compile_fn=None):
        self.policy, self.cfg = policy, cfg
        self.lens = np.asarray(prompt_lens, np.int64)
        self.compile_fn = compile_fn or (lambda f, *a, **st: functools.partial(f, **st))
        per_seq = [policy.layer_counts(cfg, int(L)) for L in self.lens]  # each [num_layers] or None
        self.planned = per_seq[0] is not None
        if self.planned:
            self.counts = np.stack(per_seq, axis=1)  # [num_layers, B]
        else:
            self.n = np.array([policy.check_budget(int(L)) for L in self.lens])  # also validates
            self.prefs: list[np.ndarray] = []
            self.kept_scores: list[jax.Array] = []

    def _call(self, fn, *args, **static):
        return self.compile_fn(fn, *args, **static)(*args)

    def build_layer(self, li, layer, x_in, k_buf, v_buf, lens) -> tuple[HeadGroup, ...]:
        cfg = self.cfg
        scores, aux = self._call(layer_scores, layer, x_in, k_buf, lens, policy=self.policy, cfg=cfg)
        if self.planned:
            per_b = self.counts[li]
        else:  # CAKE: this layer's share at its own step, given the preferences so far
            self.prefs.append(to_host(aux).astype(np.float64))
            prefs = np.stack(self.prefs, axis=1)  # [B, li + 1]
            per_b = np.array([
                self.policy.cascade(prefs[b], int(self.n[b]), int(self.lens[b]), cfg.num_layers)[0][li]
                for b in range(len(self.lens))
            ])
        B, H, T, _ = k_buf.shape
        counts = jnp.asarray(np.broadcast_to(per_b[:, None], (B, H)), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, H, T))
        group, kept = select_group(scores, k_buf, v_buf, positions, counts, int(per_b.max()), self.compile_fn)
        if not self.planned:
            self.kept_scores.append(kept)
        return (group,)

    def finish(self, cache: KVCache) -> tuple[KVCache, DecodeState]:
        """(the cache, its decode state): a static policy's decode has no hooks."""
        return self._cut(cache), DecodeState()

    def _cut(self, cache: KVCache) -> KVCache:
        if self.planned:
            return cache
        prefs = np.stack(self.prefs, axis=1)  # [B, num_layers]
        finals = np.stack([
            self.policy.cascade(prefs[b], int(self.n[b]), int(self.lens[b]), self.cfg.num_layers)[1]
            for b in range(len(self.lens))
        ], axis=1)  # [num_layers, B]
        self.counts = finals
        layers = []
        for li, (lc, kept) in enumerate(zip(cache.layers, self.kept_scores)):
            (g,) = lc.groups
            B, H = g.lengths.shape
            counts = jnp.asarray(np.broadcast_to(finals[li][:, None], (B, H)), jnp.int32)
            group, _ = select_group(kept, g.k, g.v, g.positions, counts, int(finals[li].max()), self.compile_fn)
            layers.append(lc.replace(groups=(group,)))
        self.kept_scores = []
        return cache.replace(layers=tuple(layers))


class FullPrefill(PrefillPlan):
    """Full KV's prefill plan: every layer keeps its whole prompt (no scoring, no selection)."""

    consumes_kv = True

    def __init__(self, prompt_lens, compile_fn=None):
        self.t_max = int(np.max(prompt_lens))
        self.compile_fn = compile_fn

    def build_layer(self, li, layer, x_in, k_buf, v_buf, lens) -> tuple[HeadGroup, ...]:
        return M.full_layer_groups(k_buf, v_buf, lens, self.t_max, self.compile_fn)

    def finish(self, cache: KVCache) -> tuple[KVCache, DecodeState]:
        return cache, DecodeState()


def bytes_rho(cache, cfg: ModelConfig) -> float:
    """Device bytes of the prompt K/V groups over a full KV cache of the same batch (every head holding the
    longest prompt): for one sequence, exactly the kept fraction in bytes."""
    per_slot = 2 * cfg.head_dim * cache.layers[0].tail_k.dtype.itemsize  # the prompt's K/V dtype
    t_max = int(np.max(np.asarray(cache.prompt_lens)))
    full = cache.batch_size * t_max * cfg.num_kv_heads * cfg.num_layers * per_slot
    return prompt_kv_bytes(cache) / full
