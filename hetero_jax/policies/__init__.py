"""KV-cache policies on one budget definition, and the registry that names them.

``rho`` (``budget``) = fraction of the prompt's full KV (tokens x KV heads x
layers) kept on the device after prefill; sinks and windows count inside it,
tokens added after prefill come on top.
"""

from __future__ import annotations

import dataclasses

from hetero_jax.policies.base import (
    BudgetError, Policy, PolicyError, UnknownOptionError, UnknownPolicyError, check_budget, check_options, smallest_rho,
    tokens_for,
)
from hetero_jax.policies.baselines import CAKE, H2O, FullKV, ProfiledSnapKV, PyramidKV, SnapKV, StreamingLLM
from hetero_jax.policies.composed import Composed, ScoredPolicy
from hetero_jax.policies.contextkeeper import ContextKeeper
from hetero_jax.policies.freekv import FreeKV
from hetero_jax.policies.hcattention import HCAttention
from hetero_jax.policies.heterocache import HeteroCache
from hetero_jax.policies.quest import Quest
from hetero_jax.policies.protocol import DecodeState, PrefillPlan, achieved_rho
from hetero_jax.policies.selection import PolicyPrefill
from hetero_jax.policies.synckv import SyncKV

REGISTRY: dict[str, type[Policy]] = {
    cls.name: cls for cls in (FullKV, StreamingLLM, SnapKV, PyramidKV, H2O, CAKE, HeteroCache, Quest, FreeKV,
                      ContextKeeper, SyncKV, HCAttention, ProfiledSnapKV)
}


def default_policy(policy) -> Policy:
    """``policy``, or full KV (``FullKV()``) for None: the default of the package's front doors
    (``hetero_jax.generate``, ``hetero_jax.Session``) and of the server; the runtime takes a policy object."""
    return FullKV() if policy is None else policy


def parse_options(items) -> dict:
    """``KEY=VALUE`` strings as keyword arguments: true/false, int, float, else the text."""
    out = {}
    for item in items:
        key, sep, raw = str(item).partition("=")
        if not sep or not key.strip():
            raise PolicyError(f"a policy option is KEY=VALUE (e.g. offload=true), got {item!r}")
        low = raw.strip().lower()
        if low in ("true", "false"):
            value = low == "true"
        else:
            try:
                value = int(raw)
            except ValueError:
                try:
                    value = float(raw)
                except ValueError:
                    value = raw
        name = key.strip().replace("-", "_")
        if name in out:
            raise PolicyError(f"the policy option {name!r} is given twice ({name}={out[name]!r} and {item!r}); "
                              "give each option once")
        out[name] = value
    return out


def registry_key(spec: str) -> str:
    """The ``REGISTRY`` key a policy name or spec names: the name before any options, case, '-' and '_' ignored
    ('heterocache:copy_window=16' and 'Hetero-Cache' are both 'heterocache')."""
    return spec.partition(":")[0].lower().replace("-", "").replace("_", "")


def make_policy(name: str, budget: float | None = None, /, **kwargs) -> Policy:
    """A policy from its registry name (case-insensitive), e.g. ``make_policy("snapkv", 0.3)``.

    The name may carry options after a colon, comma-separated: ``make_policy("quest:offload=true", 0.1)``
    (the form benchmark grids and ``--policy`` use). An option given both there and as a keyword argument
    (``--option`` on the command line) is refused, as is ``budget`` as an option: which one was meant is
    the caller's to say.
    """
    if not isinstance(name, str):
        raise UnknownPolicyError(f"policy name must be a string, got {name!r}; known policies: {', '.join(REGISTRY)}")
    if "budget" in kwargs:
        raise PolicyError(f"the budget is not an option (got budget={kwargs['budget']!r}); give it as "
                          "make_policy's second argument (--budget on the command line)")
    if ":" in name:
        name, _, spec = name.partition(":")
        in_spec = parse_options([x for x in spec.split(",") if x.strip()])
        both = sorted(set(in_spec) & set(kwargs))
        if both:
            raise PolicyError(f"the policy option {both[0]!r} is given twice: {both[0]}={in_spec[both[0]]!r} in "
                              f"the name {name}:{spec} and {both[0]}={kwargs[both[0]]!r} as an option (--option "
                              "or a flag on the command line); give each option once")
        kwargs = {**in_spec, **kwargs}
    key = registry_key(name)
    if key not in REGISTRY:
        raise UnknownPolicyError(f"unknown policy {name!r}; known policies: {', '.join(REGISTRY)}")
    cls = REGISTRY[key]
    check_options(cls, sorted(kwargs), exclude=("budget",))  # a budget option was refused above
    if budget is None or cls is FullKV:
        if cls is FullKV and budget not in (None, 1.0):
            check_budget("FullKV", budget)  # not a budget at all (out of (0, 1], NaN, a string): that error first
            raise BudgetError(f"the full policy keeps the whole prompt; give no budget (drop --budget on the "
                              f"command line; got {budget})")
        return cls(**kwargs)
    return cls(budget=budget, **kwargs)


def default_budget(cls) -> float:
    """The budget policy class ``cls`` runs at when none is given."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == "budget")


def describe_policies() -> str:
    """One line per registered policy, with its default budget."""
    return "\n".join(f"{name:14s} {cls.summary} [default budget {default_budget(cls):g}]"
                     for name, cls in REGISTRY.items())


__all__ = [
    "BudgetError", "Policy", "PolicyError", "UnknownOptionError", "UnknownPolicyError", "smallest_rho", "tokens_for",
    "FullKV", "StreamingLLM", "SnapKV", "PyramidKV", "H2O", "CAKE", "HeteroCache", "Quest", "FreeKV", "ContextKeeper",
    "SyncKV", "HCAttention", "ProfiledSnapKV", "Composed", "ScoredPolicy",
    "PolicyPrefill", "PrefillPlan", "DecodeState", "achieved_rho", "REGISTRY", "default_policy", "make_policy",
    "registry_key",
    "parse_options", "describe_policies", "default_budget",
]
