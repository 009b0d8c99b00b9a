"""Token scorers: which prompt tokens a head keeps first, apart from how many it keeps (``allocators.py``).

A scorer is a frozen, hashable dataclass of hyper-parameters (a static jit argument, like the policy holding it)
with two methods:
- ``min_tokens()`` (host): (fewest tokens a head may keep, why), e.g. the observation window; the allocator
  the scorer is composed with never gives a head fewer (``allocators.Floor``);
- ``scores(layer, x_in, keys, prompt_lens, cfg)`` (traced): float32 [B, Hkv, Tp], FORCE on tokens the head
  must keep (sinks, the window), MASK_VALUE beyond the prompt; selection keeps each head's top ones.

Fields are declared with the policies' ``int_param`` & co., so a scorer built on its own checks its values as
a policy does (the named policies check their own, identical, fields first).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hetero_jax.model.config import ModelConfig
from hetero_jax.model.scoring import attention_probs, finalize_scores, observation_window_probs
from hetero_jax.model.transformer import prompt_queries
from hetero_jax.policies.base import check_fields, choice_param, int_param, odd_param, real_param
from pallas_kernels import avg_pool, gqa_reduce


class Floor(NamedTuple):
    """Fewest tokens a head may keep under a scorer (at most the prompt), and why (ends the budget error)."""

    tokens: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Scorer:
    """Base of the token scorers: checks the declared fields; subclasses define ``scores``."""

    def __post_init__(self):
        check_fields(self)

    def min_tokens(self) -> Floor:
        return Floor(1, "every head keeps at least one token")

    def scores(self, layer, x_in, keys, prompt_lens, cfg: ModelConfig):
        """Traced: float32 [B, Hkv, Tp] (x_in [B, Tp, hidden], keys [B, Hkv, Tp, D], prompt_lens [B])."""
        raise NotImplementedError


def window_forced(prompt_lens, tp: int, window: int):
    """bool [B, Tp]: the last ``window`` prompt tokens of each sequence."""
    t = jnp.arange(tp, dtype=jnp.int32)
    return t[None, :] >= (prompt_lens[:, None] - window)


@dataclasses.dataclass(frozen=True)
class SinksRecent(Scorer):
    """StreamingLLM: the first ``sinks`` tokens (attention sinks), then the most recent ones."""

    sinks: int = int_param(4, 0)

    def min_tokens(self):
        return Floor(self.sinks + 1, f"{self.sinks} sinks + at least one recent token")

    def scores(self, layer, x_in, keys, prompt_lens, cfg):
        t = jnp.arange(keys.shape[2], dtype=jnp.int32)
        recency = jnp.broadcast_to(t.astype(jnp.float32), keys.shape[:3])  # later = better
        forced = jnp.broadcast_to(t[None, :] < self.sinks, (keys.shape[0], keys.shape[2]))
        return finalize_scores(recency, prompt_lens, forced)


@dataclasses.dataclass(frozen=True)
class WindowVotes(Scorer):
    """SnapKV: the last ``window`` prompt queries' attention, summed over the window, pooled, reduced over the
    query group; the window itself is kept."""

    window: int = int_param(32, 1, " (prompt queries in the observation window)")
    pool_kernel: int = odd_param(5)
    gqa: str = choice_param("max", ("max", "mean"))

    def min_tokens(self):
        return Floor(self.window, f"its {self.window}-token observation window")

    def votes(self, layer, x_in, keys, prompt_lens, cfg):
        """Window attention probs [B, Hkv, W, G, Tp] and the prefix mask [B, Tp] (slots before the window)."""
        probs, _ = observation_window_probs(layer, x_in, keys, prompt_lens, self.window, cfg)
        return probs, ~window_forced(prompt_lens, keys.shape[2], self.window)

    def scores(self, layer, x_in, keys, prompt_lens, cfg):
        probs, prefix = self.votes(layer, x_in, keys, prompt_lens, cfg)
        votes = jnp.where(prefix[:, None, None, :], probs.sum(axis=2), 0.0)  # [B, Hkv, G, Tp]
        scores = gqa_reduce(avg_pool(votes, self.pool_kernel), self.gqa, axis=2)
        return finalize_scores(scores, prompt_lens, ~prefix)


def window_moments(probs, prefix, prompt_lens, window: int):
    """Mean and variance over the window's valid rows of its attention on the prefix: each [B, Hkv, G, Tp].

    probs: [B, Hkv, W, G, Tp]; prefix: [B, Tp]. A prompt shorter than the window has fewer valid rows."""
    rows_valid = (prompt_lens[:, None] - window + jnp.arange(window)[None, :]) >= 0  # [B, W]
    n_rows = jnp.maximum(rows_valid.sum(axis=1), 1).astype(jnp.float32)  # [B]
    pm = jnp.where(prefix[:, None, None, None, :], probs, 0.0)
    mean = pm.sum(axis=2) / n_rows[:, None, None, None]
    sq = jnp.where(rows_valid[:, None, :, None, None], (pm - mean[:, :, None]) ** 2, 0.0)
    return mean, sq.sum(axis=2) / n_rows[:, None, None, None]


@dataclasses.dataclass(frozen=True)
class WindowMeanVar(WindowVotes):
    """CAKE's token score: mean + gamma * variance of the window's attention, pooled, reduced over the group."""

    gamma: float = real_param(200.0, 0.0, lo_open=False)

    def scores(self, layer, x_in, keys, prompt_lens, cfg):
        probs, prefix = self.votes(layer, x_in, keys, prompt_lens, cfg)
        mean, var = window_moments(probs, prefix, prompt_lens, self.window)
        token = gqa_reduce(avg_pool(mean + self.gamma * var, self.pool_kernel), self.gqa, axis=2)
        return finalize_scores(token, prompt_lens, ~prefix)


@dataclasses.dataclass(frozen=True)
class HeavyHitters(Scorer):
    """H2O: attention accumulated over every prompt query (in chunks of ``query_chunk``), plus a recent window."""

    window: int = int_param(32, 1, " (recent tokens always kept)")
    gqa: str = choice_param("max", ("max", "mean"))
    query_chunk: int = int_param(256, 1)

    def min_tokens(self):
        return Floor(self.window, f"its {self.window}-token recent window")

    def scores(self, layer, x_in, keys, prompt_lens, cfg):
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
        return finalize_scores(scores, prompt_lens, window_forced(prompt_lens, Tp, self.window))


SCORERS = (SinksRecent, WindowVotes, WindowMeanVar, HeavyHitters)
