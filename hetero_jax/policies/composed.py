"""A scored policy = a token scorer (``scorers.py``: which tokens) composed with an allocator (``allocators.py``:
how many per head), each a frozen, hashable dataclass, any with any.

The named baselines (``baselines.py``) build theirs from their own options, so ``make_policy`` and the options
stay flat (``pyramidkv:beta=10``); :class:`Composed` takes the two parts themselves, for combinations without
a name (``Composed(0.3, HeavyHitters(), Pyramid(beta=5))``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from hetero_jax.model.config import ModelConfig
from hetero_jax.policies.allocators import Allocator, Uniform
from hetero_jax.policies.base import Policy, PolicyError
from hetero_jax.policies.scorers import Scorer, WindowVotes
from hetero_jax.policies.selection import PolicyPrefill


class ScoredPolicy(Policy):
    """Mix-in of a policy with a ``scorer`` and an ``allocator`` (fields or properties): budgets are the
    allocator's, checked against the scorer's floor before any compute; the prefill plan is ``PolicyPrefill``."""

    def head_budgets(self, cfg: ModelConfig, prompt_len: int):
        """int64 [num_layers, Hkv] tokens per head for one prompt (None: decided while prefilling);
        BudgetError when the budget cannot be kept."""
        return self.allocator.head_budgets(type(self).__name__, self.budget, cfg, prompt_len,
                                           self.scorer.min_tokens())

    def token_scores(self, layer, x_in, keys, prompt_lens, cfg: ModelConfig):
        """Traced: (scores [B, Hkv, Tp] float32, the allocator's layer preference [B] or None)."""
        return (self.scorer.scores(layer, x_in, keys, prompt_lens, cfg),
                self.allocator.preference(layer, x_in, keys, prompt_lens, cfg))

    def make_prefill(self, cfg: ModelConfig, prompt_lens, compile_fn=None):
        return PolicyPrefill(self, cfg, prompt_lens, compile_fn=compile_fn)


@dataclasses.dataclass(frozen=True)
class Composed(ScoredPolicy):
    """Any scorer with any allocator (not in the registry: the named policies are its common cases)."""

    scorer: Scorer = WindowVotes()
    allocator: Allocator = Uniform()
    name: ClassVar[str] = "composed"
    summary: ClassVar[str] = "a token scorer with a budget allocator"

    def __post_init__(self):
        super().__post_init__()
        for field, kind in (("scorer", Scorer), ("allocator", Allocator)):
            if not isinstance(getattr(self, field), kind):
                raise PolicyError(f"Composed: {field} must be a {kind.__name__} (policies.{kind.__name__.lower()}s), "
                                  f"got {getattr(self, field)!r}")

    def layout(self, cfg):
        """The allocator's head layout where it has one (``RankedFull``'s budgets are per layout slot: each
        layer's heads in ranking order), else none."""
        own = getattr(self.allocator, "layout", None)
        return own(cfg) if own is not None else super().layout(cfg)
