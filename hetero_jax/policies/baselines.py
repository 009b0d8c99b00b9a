"""Baseline KV-cache policies on the shared budget definition (see "KV-cache policies" in README.md).

Each is a scoring function plus a budget rule; selection is shared
(``model.scoring.select_topk`` / ``gather_group``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.model.config import ModelConfig
from hetero_jax.model.transformer import prompt_queries
from hetero_jax.policies.base import (BudgetError, Policy, PolicyError, choice_param, distribute, int_param,
                                      real_param)
from hetero_jax.policies.selection import FullPrefill
from hetero_jax.model.scoring import attention_probs, finalize_scores, observation_window_probs
from pallas_kernels import avg_pool, gqa_reduce


@dataclasses.dataclass(frozen=True)
class FullKV(Policy):
    """No compression: every head keeps the whole prompt."""

    name: ClassVar[str] = "full"
    summary: ClassVar[str] = "no compression: every head keeps the whole prompt (rho = 1)"

    def __post_init__(self):
        super().__post_init__()
        if self.budget != 1.0:
            raise BudgetError(f"FullKV keeps the whole prompt: its budget is 1, got rho={self.budget:g}")

    def make_prefill(self, cfg, prompt_lens, compile_fn=None):
        return FullPrefill(cfg, prompt_lens, compile_fn)


@dataclasses.dataclass(frozen=True)
class StreamingLLM(Policy):
    """Attention sinks (the first ``sinks`` tokens) plus the most recent tokens."""

    sinks: int = int_param(4, 0)
    name: ClassVar[str] = "streamingllm"
    summary: ClassVar[str] = "4 attention-sink tokens + the most recent tokens (Xiao et al.)"

    def min_tokens(self):
        return self.sinks + 1, f"{self.sinks} sinks + at least one recent token"

    def token_scores(self, layer, x_in, keys, prompt_lens, cfg):
        t = jnp.arange(keys.shape[2], dtype=jnp.int32)
        recency = jnp.broadcast_to(t.astype(jnp.float32), keys.shape[:3])  # later = better
        forced = jnp.broadcast_to(t[None, :] < self.sinks, (keys.shape[0], keys.shape[2]))
        return finalize_scores(recency, prompt_lens, forced), None


def _window_forced(prompt_lens, tp: int, window: int):
    t = jnp.arange(tp, dtype=jnp.int32)
    return t[None, :] >= (prompt_lens[:, None] - window)


@dataclasses.dataclass(frozen=True)
class SnapKV(Policy):
    """Observation-window voting: the last ``window`` prompt queries' attention, summed, pooled."""

    window: int = int_param(32, 1, " (prompt queries in the observation window)")
    pool_kernel: int = int_param(5, 1)
    gqa: str = choice_param("max", ("max", "mean"))
    name: ClassVar[str] = "snapkv"
    summary: ClassVar[str] = "top tokens by pooled attention of the last 32 prompt queries + that window (Li et al.)"

    def __post_init__(self):
        super().__post_init__()
        if self.pool_kernel % 2 == 0:
            raise PolicyError(
                f"{type(self).__name__}: pool_kernel must be odd (a centred pooling window), got {self.pool_kernel}")

    def min_tokens(self):
        return self.window, f"its {self.window}-token observation window"

    def window_votes(self, layer, x_in, keys, prompt_lens, cfg):
        """Window attention probs [B, Hkv, W, G, Tp] and the prefix mask [B, Tp] (slots before the window)."""
        probs, _ = observation_window_probs(layer, x_in, keys, prompt_lens, self.window, cfg)
        prefix = ~_window_forced(prompt_lens, keys.shape[2], self.window)  # [B, Tp]
        return probs, prefix

    def token_scores(self, layer, x_in, keys, prompt_lens, cfg):
        probs, prefix = self.window_votes(layer, x_in, keys, prompt_lens, cfg)
        votes = jnp.where(prefix[:, None, None, :], probs.sum(axis=2), 0.0)  # [B, Hkv, G, Tp]
        scores = gqa_reduce(avg_pool(votes, self.pool_kernel), self.gqa, axis=2)
        return finalize_scores(scores, prompt_lens, ~prefix), None


@dataclasses.dataclass(frozen=True)
class PyramidKV(SnapKV):
    """SnapKV scoring with per-layer budgets decreasing linearly with depth (same total)."""

    beta: float = real_param(20.0, 1.0, lo_open=False)  # top / bottom layer share; 1 = flat
    name: ClassVar[str] = "pyramidkv"
    summary: ClassVar[str] = "SnapKV scores, per-layer budgets falling linearly with depth, same total (Cai et al.)"

    def layer_counts(self, cfg: ModelConfig, prompt_len: int) -> np.ndarray:
        n = self.check_budget(prompt_len)
        L = cfg.num_layers
        w = min(self.window, prompt_len)
        sel = n - w  # selectable tokens per head beyond the window, on average
        lo_sel = sel / self.beta
        hi_sel = 2 * sel - lo_sel
        steps = np.arange(L) / max(L - 1, 1)
        targets = w + hi_sel - (hi_sel - lo_sel) * steps
        return distribute(targets, n * L, lo=w, hi=prompt_len)


@dataclasses.dataclass(frozen=True)
class H2O(Policy):
    """Heavy hitters: cumulative attention from every prompt query (chunked), plus a recent window."""

    window: int = int_param(32, 1, " (recent tokens always kept)")
    gqa: str = choice_param("max", ("max", "mean"))
    query_chunk: int = int_param(256, 1)
    name: ClassVar[str] = "h2o"
    summary: ClassVar[str] = "top tokens by attention accumulated over all prompt queries + 32 recent (Zhang et al.)"

    def min_tokens(self):
        return self.window, f"its {self.window}-token recent window"

    def token_scores(self, layer, x_in, keys, prompt_lens, cfg):
        B, _, Tp, _ = keys.shape
        C = min(self.query_chunk, Tp)
        while Tp % C:  # Tp is a multiple of the prefill chunk (a power of two)
            C //= 2

        def body(i, acc):
            rows = jnp.broadcast_to(i * C + jnp.arange(C, dtype=jnp.int32), (B, C))
            q = prompt_queries(layer, x_in, rows, cfg)  # [B, Hkv, C, G, D]
            p = attention_probs(q, keys, rows, prompt_lens)
            real = rows < prompt_lens[:, None]  # padding queries vote for nothing
            return acc + jnp.where(real[:, None, :, None, None], p, 0.0).sum(axis=2)

        acc = jax.lax.fori_loop(
            0, Tp // C, body, jnp.zeros((B, cfg.num_kv_heads, cfg.group_size, Tp), jnp.float32)
        )
        scores = gqa_reduce(acc, self.gqa, axis=2)
        return finalize_scores(scores, prompt_lens, _window_forced(prompt_lens, Tp, self.window)), None


@dataclasses.dataclass(frozen=True)
class CAKE(SnapKV):
    """Layer budgets from a preference score, token scores mean + gamma * variance of window attention.

    Layer preference P_l = entropy x variance of the window attention over the
    prefix (tau1 = tau2 = 1), averaged over heads. Budgets follow CAKE's
    cascade while prefilling layer by layer: after layer l the total
    (l + 1) * n is split in proportion to P_0..P_l; a layer keeps
    min(L, its share at its own step) candidates and is only ever cut down
    afterwards, ending at the smallest share it was given (at least the window).
    """

    gamma: float = real_param(200.0, 0.0, lo_open=False)
    tau1: float = real_param(1.0, 0.0)
    tau2: float = real_param(1.0, 0.0)
    name: ClassVar[str] = "cake"
    summary: ClassVar[str] = "per-layer budgets by attention entropy x variance, tokens by mean + 200 var (Qin et al.)"

    def layer_counts(self, cfg, prompt_len):
        return None  # planned during prefill from the layers' preferences

    def token_scores(self, layer, x_in, keys, prompt_lens, cfg):
        probs, prefix = self.window_votes(layer, x_in, keys, prompt_lens, cfg)  # [B,Hkv,W,G,Tp]
        rows_valid = (prompt_lens[:, None] - self.window + jnp.arange(self.window)[None, :]) >= 0  # [B, W]
        n_rows = jnp.maximum(rows_valid.sum(axis=1), 1).astype(jnp.float32)  # [B]
        pm = jnp.where(prefix[:, None, None, None, :], probs, 0.0)
        mean = pm.sum(axis=2) / n_rows[:, None, None, None]  # [B, Hkv, G, Tp]
        sq = jnp.where(rows_valid[:, None, :, None, None], (pm - mean[:, :, None]) ** 2, 0.0)
        var = sq.sum(axis=2) / n_rows[:, None, None, None]
        token = gqa_reduce(avg_pool(mean + self.gamma * var, self.pool_kernel), self.gqa, axis=2)
        # layer preference: entropy of the mean attention and total variance, per head, averaged
        dist = mean / jnp.maximum(mean.sum(axis=-1, keepdims=True), 1e-30)
        entropy = -(dist * jnp.log(jnp.maximum(dist, 1e-30))).sum(axis=-1)  # [B, Hkv, G]
        variance = var.sum(axis=-1)
        pref = (jnp.maximum(entropy, 1e-12) ** (1.0 / self.tau1) * jnp.maximum(variance, 1e-12) ** (1.0 / self.tau2))
        return finalize_scores(token, prompt_lens, ~prefix), pref.mean(axis=(1, 2))

    def cascade(self, prefs, n: int, prompt_len: int, num_layers: int) -> tuple[np.ndarray, np.ndarray]:
        """CAKE's cascading budgets for one sequence keeping n tokens per head on average.

        prefs: [k] preferences of the layers prefilled so far (k <= num_layers).
        After step l the total n * (l + 1) is split among layers 0..l in
        proportion to P_0..P_l, each share within [min(window, L), L] (excess
        water-filled into the others, integers by largest remainder).
        Returns (own [k]: candidates layer j keeps at its own step j,
        final [k]: the smallest share layer j was given over steps j..k-1).
        """
        prefs = np.maximum(np.asarray(prefs, np.float64), 1e-12)
        k = len(prefs)
        w = min(self.window, prompt_len)
        own = np.zeros(k, np.int64)
        final = np.full(k, np.iinfo(np.int64).max)
        for l in range(k):
            alloc = distribute(prefs[: l + 1], n * (l + 1), lo=w, hi=prompt_len)
            own[l] = alloc[l]
            final[: l + 1] = np.minimum(final[: l + 1], alloc)
        return own, final


BASELINES = (FullKV, StreamingLLM, SnapKV, PyramidKV, H2O, CAKE)
