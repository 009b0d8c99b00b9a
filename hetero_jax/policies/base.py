"""The policy interface and the one budget definition.

``rho`` (``budget``) is the fraction of the prompt's full KV (tokens x KV
heads x layers) kept on the device after prefill. Sinks and observation /
recent windows count inside it; tokens added after prefill (the tail) come
on top. A policy is a frozen, hashable dataclass (a static jit argument)
holding hyper-parameters only; everything that changes while decoding lives
in the cache pytree.

A policy provides
- ``token_scores(layer, x_in, keys, prompt_lens, cfg)`` (traced): per-head
  float32 scores [B, Hkv, Tp] (FORCE on tokens it must keep, INVALID beyond
  the prompt) and a per-sequence auxiliary value (CAKE's layer preference);
- ``layer_counts(cfg, prompt_len)`` (host): tokens kept per head in each
  layer for one sequence, or ``None`` for policies that plan while prefilling
  (CAKE overrides ``plan``).
Selection (top-k, position order, gather into a group) is shared.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import numpy as np

from hetero_jax.config import ModelConfig
from hetero_jax.errors import HeteroJaxError


class BudgetError(HeteroJaxError, ValueError):
    """A budget outside (0, 1] or too small for a policy."""


def tokens_for(rho: float, prompt_len: int) -> int:
    """Tokens per head kept at budget rho: round(rho * L), at most L."""
    return min(prompt_len, int(math.floor(rho * prompt_len + 0.5)))


def smallest_rho(min_tokens: int, prompt_len: int) -> float:
    """Smallest rho (4 decimals, rounded up) whose ``tokens_for`` reaches ``min_tokens``."""
    rho = math.ceil((min_tokens - 0.5) / prompt_len * 1e4) / 1e4
    while tokens_for(rho, prompt_len) < min_tokens:
        rho = round(rho + 1e-4, 4)
    return min(rho, 1.0)


@dataclasses.dataclass(frozen=True)
class Policy:
    budget: float = 1.0

    name: ClassVar[str] = "policy"
    summary: ClassVar[str] = ""

    def __post_init__(self):
        b = self.budget
        if not isinstance(b, (int, float)) or not (0.0 < float(b) <= 1.0) or math.isnan(b):
            raise BudgetError(
                f"{type(self).__name__}: budget rho={b!r} is out of range; rho is the fraction of the "
                "prompt's KV kept on the device and must be in (0, 1]"
            )

    # ---------------------------------------------------------------- budgets
    def min_tokens(self, prompt_len: int) -> int:
        """Fewest tokens a head may keep (sinks + window, at least 1), capped at the prompt length."""
        return 1

    def min_tokens_reason(self) -> str:
        return "every head keeps at least one token"

    def check_budget(self, prompt_len: int) -> int:
        """Tokens per head for this prompt at this budget; BudgetError if too small."""
        n = tokens_for(self.budget, prompt_len)
        need = min(self.min_tokens(prompt_len), prompt_len)
        if n < need:
            raise BudgetError(
                f"{type(self).__name__}: budget rho={self.budget:g} keeps {n} token(s) per head of a "
                f"{prompt_len}-token prompt, but it needs at least {need} ({self.min_tokens_reason()}); "
                f"the smallest budget that works for this prompt is rho={smallest_rho(need, prompt_len):g}"
            )
        return n

    def layer_counts(self, cfg: ModelConfig, prompt_len: int) -> np.ndarray:
        """[num_layers] tokens kept per head in each layer (uniform by default)."""
        return np.full(cfg.num_layers, self.check_budget(prompt_len), np.int64)

    # ----------------------------------------------------------------- scores
    def token_scores(self, layer, x_in, keys, prompt_lens, cfg: ModelConfig):
        """Traced: (scores [B, Hkv, Tp] float32, aux [B] float32 or None)."""
        raise NotImplementedError

    @property
    def keeps_everything(self) -> bool:
        return self.budget >= 1.0


def distribute(targets: np.ndarray, total: int, lo: int, hi: int) -> np.ndarray:
    """Integer per-layer budgets near ``targets`` (floats) with exact ``total``, each in [lo, hi].

    Water-fills values above ``hi`` or below ``lo`` into the other layers, then
    rounds by largest remainder (ties to the lower layer).
    """
    t = np.asarray(targets, np.float64).copy()
    n = len(t)
    assert lo * n <= total <= hi * n, (lo, hi, total, n)
    t *= total / t.sum() if t.sum() > 0 else 0
    fixed = np.zeros(n, bool)
    for _ in range(2 * n + 1):
        over, under = (t > hi) & ~fixed, (t < lo) & ~fixed
        if not over.any() and not under.any():
            break
        t[over], t[under] = hi, lo
        fixed |= over | under
        free = ~fixed
        rest = total - t[fixed].sum()
        if free.any():
            cur = t[free].sum()
            t[free] = t[free] * (rest / cur) if cur > 0 else rest / free.sum()
    base = np.floor(t + 1e-9).astype(np.int64)
    base = np.clip(base, lo, hi)
    short = total - int(base.sum())
    frac = t - base
    order = np.lexsort((np.arange(n), -frac))  # largest remainder first, then lower layer
    i = 0
    while short != 0 and i < 4 * n:
        j = order[i % n]
        if short > 0 and base[j] < hi:
            base[j] += 1
            short -= 1
        elif short < 0 and base[j] > lo:
            base[j] -= 1
            short += 1
        i += 1
    assert base.sum() == total, (base, total)
    return base
