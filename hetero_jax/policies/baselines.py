"""Baseline KV-cache policies on the shared budget definition (see "KV-cache policies" in README.md).

Each is a token scorer (``scorers.py``) composed with a budget allocator (``allocators.py``), built from the
policy's own options; selection is shared (``selection.PolicyPrefill``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from hetero_jax.policies.allocators import Cascade, ProfileBudgets, Pyramid, Uniform
from hetero_jax.policies.base import BudgetError, Policy, PolicyError, choice_param, int_param, odd_param, real_param
from hetero_jax.policies.composed import ScoredPolicy
from hetero_jax.policies.profiled import ProfileBound, profile_key
from hetero_jax.policies.scorers import HeavyHitters, SinksRecent, WindowMeanVar, WindowVotes
from hetero_jax.policies.selection import FullPrefill
from hetero_jax.profile.head_profile import HeadProfile


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
class StreamingLLM(ScoredPolicy):
    """Attention sinks (the first ``sinks`` tokens) plus the most recent tokens, the same count per head."""

    sinks: int = int_param(4, 0)
    name: ClassVar[str] = "streamingllm"
    summary: ClassVar[str] = "4 attention-sink tokens + the most recent tokens (Xiao et al.)"

    scorer = property(lambda self: SinksRecent(self.sinks))
    allocator = property(lambda self: Uniform())


@dataclasses.dataclass(frozen=True)
class SnapKV(ScoredPolicy):
    """Observation-window voting: the last ``window`` prompt queries' attention, summed, pooled; the same count
    per head."""

    window: int = int_param(32, 1, " (prompt queries in the observation window)")
    pool_kernel: int = odd_param(5)
    gqa: str = choice_param("max", ("max", "mean"))
    name: ClassVar[str] = "snapkv"
    summary: ClassVar[str] = "top tokens by pooled attention of the last 32 prompt queries + that window (Li et al.)"

    scorer = property(lambda self: WindowVotes(self.window, self.pool_kernel, self.gqa))
    allocator = property(lambda self: Uniform())


@dataclasses.dataclass(frozen=True)
class PyramidKV(SnapKV):
    """SnapKV's scores with per-layer budgets falling linearly with depth (same total)."""

    beta: float = real_param(20.0, 1.0, lo_open=False)  # the average share / the last layer's (Pyramid); 1 = flat
    name: ClassVar[str] = "pyramidkv"
    summary: ClassVar[str] = "SnapKV scores, per-layer budgets falling linearly with depth, same total (Cai et al.)"

    allocator = property(lambda self: Pyramid(self.beta))


@dataclasses.dataclass(frozen=True)
class H2O(ScoredPolicy):
    """Heavy hitters: cumulative attention from every prompt query (chunked), plus a recent window."""

    window: int = int_param(32, 1, " (recent tokens always kept)")
    gqa: str = choice_param("max", ("max", "mean"))
    query_chunk: int = int_param(256, 1)
    name: ClassVar[str] = "h2o"
    summary: ClassVar[str] = "top tokens by attention accumulated over all prompt queries + 32 recent (Zhang et al.)"

    scorer = property(lambda self: HeavyHitters(self.window, self.gqa, self.query_chunk))
    allocator = property(lambda self: Uniform())


@dataclasses.dataclass(frozen=True)
class CAKE(SnapKV):
    """Layer budgets from a preference score (CAKE's cascade), token scores mean + gamma * variance of the
    window attention (``allocators.Cascade``, ``scorers.WindowMeanVar``)."""

    gamma: float = real_param(200.0, 0.0, lo_open=False)
    tau1: float = real_param(1.0, 0.0)
    tau2: float = real_param(1.0, 0.0)
    name: ClassVar[str] = "cake"
    summary: ClassVar[str] = "per-layer budgets by attention entropy x variance, tokens by mean + 200 var (Qin et al.)"

    scorer = property(lambda self: WindowMeanVar(self.window, self.pool_kernel, self.gqa, self.gamma))
    allocator = property(lambda self: Cascade(self.window, self.tau1, self.tau2))


@dataclasses.dataclass(frozen=True)
class ProfiledSnapKV(ProfileBound, SnapKV):
    """SnapKV's scores with the profile's per-head budgets (Eq. 7-8), as AdaKV pairs a scorer with head-wise
    budgets (``profile=None``: the shipped HeteroCache profile of the loaded model)."""

    profile: HeadProfile | None = dataclasses.field(default=None, compare=False, hash=False, repr=False)
    profile_key: str = dataclasses.field(default="", init=False)
    name: ClassVar[str] = "profiledsnapkv"
    summary: ClassVar[str] = ("SnapKV scores, per-head budgets from the model's HeteroCache profile: full heads "
                              "keep the prompt (AdaKV-style)")

    def __post_init__(self):
        super().__post_init__()
        self._load_profile_path()
        if self.profile is not None and not isinstance(self.profile, HeadProfile):
            raise PolicyError(f"ProfiledSnapKV: profile must be a HeadProfile, a path to a profile JSON or "
                              f"None for the model's shipped profile, got {type(self.profile).__name__}")
        self._refuse_synckv_grouping()
        object.__setattr__(self, "profile_key", profile_key(self.profile))

    allocator = property(lambda self: ProfileBudgets(self._need_profile()))


BASELINES = (FullKV, StreamingLLM, SnapKV, PyramidKV, H2O, CAKE, ProfiledSnapKV)
