"""The policy interface and the one budget definition.

``rho`` (``budget``) is the fraction of the prompt's full KV (tokens x KV
heads x layers) kept on the device after prefill. Sinks and observation /
recent windows count inside it; tokens added after prefill (the tail) come
on top. A policy is a frozen, hashable dataclass (a static jit argument)
holding hyper-parameters only (declared with ``int_param``, ``real_param``,
``choice_param`` or ``bool_param``, so ``Policy.__post_init__`` checks their
ranges); everything that changes while decoding lives in the cache pytree.

A policy provides
- ``make_prefill(cfg, prompt_lens)``: the prefill plan, whose ``build_layer``
  turns each layer's full prompt KV into that layer's head groups and whose
  ``finish(cache)`` returns ``(cache, DecodeState)``: the per-request state the
  engine hands to the decode hooks (data flows one way: prefill -> state -> decode);
  the plan checks the policy's budget rules in its constructor, before any compute;
- ``attend(li, q, layer_cache, tail_lens, seq_lens)`` (traced inside the jitted
  decode step, the policy being a static argument): one layer's attention,
  returning ``(out, layer_cache, extra)``; the default attends every kept slot.
The policies that score tokens and keep each head's top ones (the static baselines)
compose a token scorer with a budget allocator (``composed.ScoredPolicy``); a policy
with its own plan (HeteroCache, the peers) has no scorer and no allocator hook to switch off.

A ``DecodeState`` declares the host-side hooks the engine runs around every
jitted step (``before_step``, ``after_step`` with the layers' ``extra``
outputs, ``after_extend`` after a session's turn) and the policy's stats.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import ClassVar

import numpy as np

from hetero_jax.model.config import ModelConfig
from hetero_jax.errors import HeteroJaxError


class BudgetError(HeteroJaxError, ValueError):
    """A budget outside (0, 1] or too small for a policy."""


class PolicyError(BudgetError):
    """A policy name or hyper-parameter the policy does not allow (window 0, unknown GQA mode, ...).

    A subclass of BudgetError because HeteroCache refused a bad ``window`` with BudgetError before
    this class existed: handlers written for that keep working.
    """


class UnknownOptionError(PolicyError, TypeError):
    """An option a policy does not have (also a TypeError, which the dataclass constructor raised before)."""


def check_options(cls, names, *, exclude: tuple[str, ...] = (), hint: str = "") -> None:
    """UnknownOptionError naming the first of ``names`` that is not an init field of policy class ``cls``, with
    the options it has (less ``exclude``) and ``hint``."""
    known = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in exclude]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UnknownOptionError(f"{cls.__name__} has no option {unknown[0]!r}; its options are: "
                                 f"{', '.join(known) or 'none'}{hint}")


class _PolicyType(type):
    """Checks a policy constructor's keywords against its fields before the dataclass ``__init__`` runs, so a
    misspelt option is the project's error naming the options rather than a bare TypeError."""

    def __call__(cls, *args, **kwargs):
        if dataclasses.is_dataclass(cls):
            check_options(cls, kwargs)
            n_init = sum(f.init for f in dataclasses.fields(cls))
            if len(args) > n_init:
                raise UnknownOptionError(f"{cls.__name__} takes at most {n_init} positional argument(s) (got "
                                         f"{len(args)}); give options by name")
        return super().__call__(*args, **kwargs)


class UnknownPolicyError(PolicyError, KeyError):
    """A policy name that is not in the registry (also a KeyError, which ``make_policy`` raised before)."""

    __str__ = Exception.__str__  # KeyError would quote the message


def check_int(owner: str, name: str, value, lo: int, why: str = "") -> None:
    """PolicyError unless ``value`` is a Python/numpy int (not a bool) >= ``lo``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < lo:
        raise PolicyError(f"{owner}: {name} must be an integer >= {lo}{why}, got {value!r}")


def check_real(owner: str, name: str, value, lo: float, *, lo_open: bool = True, hi: float = math.inf,
               hi_open: bool = True) -> None:
    """PolicyError unless ``value`` is a finite real number inside the interval (open/closed as told)."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    if ok:
        try:
            v = float(value)
        except OverflowError:  # an int beyond float's range: not finite either
            v = math.inf
        ok = (math.isfinite(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi))
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise PolicyError(f"{owner}: {name} must be a finite number in {interval}, got {value!r}")


def check_choice(owner: str, name: str, value, choices) -> None:
    if not isinstance(value, str) or value not in choices:
        raise PolicyError(f"{owner}: {name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def check_bool(owner: str, name: str, value) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise PolicyError(f"{owner}: {name} must be True or False, got {value!r} (on the command line: "
                          f"{name}=true or {name}=false)")


# Hyper-parameters declare their range where they are declared; Policy.__post_init__ checks every field
# that carries a "check" (called as check(owner, name, value)), so a policy needs no validation code.
def int_param(default, lo: int, why: str = "", *, optional: bool = False):
    """A dataclass field holding an int >= ``lo`` (or None when ``optional``); ``why`` ends the error."""
    def check(owner, name, value):
        if not (optional and value is None):
            check_int(owner, name, value, lo, why)
    return dataclasses.field(default=default, metadata={"check": check})


def real_param(default, lo: float, *, lo_open: bool = True, hi: float = math.inf, hi_open: bool = True):
    """A dataclass field holding a finite real number in the given interval."""
    def check(owner, name, value):
        check_real(owner, name, value, lo, lo_open=lo_open, hi=hi, hi_open=hi_open)
    return dataclasses.field(default=default, metadata={"check": check})


def choice_param(default: str, choices: tuple[str, ...]):
    """A dataclass field holding one of ``choices``."""
    return dataclasses.field(default=default, metadata={"check": lambda o, n, v: check_choice(o, n, v, choices)})


def odd_param(default: int):
    """A dataclass field holding an odd int >= 1 (a centred pooling window)."""
    def check(owner, name, value):
        check_int(owner, name, value, 1)
        if value % 2 == 0:
            raise PolicyError(f"{owner}: {name} must be odd (a centred pooling window), got {value}")
    return dataclasses.field(default=default, metadata={"check": check})


def check_fields(obj) -> None:
    """Run every declared field check of dataclass ``obj`` (``int_param`` & co.), naming its class."""
    for f in dataclasses.fields(obj):
        if "check" in f.metadata:
            f.metadata["check"](type(obj).__name__, f.name, getattr(obj, f.name))


def bool_param(default: bool):
    """A dataclass field holding True or False."""
    return dataclasses.field(default=default, metadata={"check": check_bool})


def tokens_for(rho: float, prompt_len: int) -> int:
    """Tokens per head kept at budget rho: round(rho * L), at most L."""
    return min(prompt_len, int(math.floor(rho * prompt_len + 0.5)))


def smallest_rho(min_tokens: int, prompt_len: int) -> float:
    """Smallest rho (4 decimals, rounded up) whose ``tokens_for`` reaches ``min_tokens``."""
    # the -1e-6 keeps an exact 4-decimal answer from rounding up a step on float noise; the loop corrects any
    # undershoot, so the result runs and the value 0.0001 below it does not
    rho = math.ceil((min_tokens - 0.5) / prompt_len * 1e4 - 1e-6) / 1e4
    while tokens_for(rho, prompt_len) < min_tokens:
        rho = round(rho + 1e-4, 4)
    return min(rho, 1.0)


RECENT_RECALLS = 4096  # entries a decode state's ``recall_steps`` keeps; its counters count every recall


def note_recall_steps(steps: list[int], step: int, n: int = 1) -> None:
    """Append ``step`` ``n`` times to ``steps`` (a decode state's ``recall_steps``), keeping the last
    RECENT_RECALLS entries, so a session that decodes for days holds a bounded list."""
    steps.extend([step] * n)
    if len(steps) > 2 * RECENT_RECALLS:  # trimmed in halves: amortised O(1) per entry
        del steps[:-RECENT_RECALLS]


def check_budget(owner: str, b) -> float:
    """``b`` as a float if it is a budget rho in (0, 1]; BudgetError naming ``owner`` (a policy class) else."""
    if isinstance(b, (bool, np.bool_)) or not isinstance(b, numbers.Real):
        raise BudgetError(f"{owner}: budget rho must be a number in (0, 1], the fraction of the prompt's KV kept on "
                          f"the device; got {b!r} of type {type(b).__name__}")
    if math.isnan(float(b)) or not (0.0 < float(b) <= 1.0):
        raise BudgetError(f"{owner}: budget rho={float(b)!r} is out of range; rho is the fraction of the prompt's KV "
                          "kept on the device and must be in (0, 1]")
    return float(b)


@dataclasses.dataclass(frozen=True)
class Policy(metaclass=_PolicyType):
    budget: float = 1.0

    name: ClassVar[str] = "policy"
    summary: ClassVar[str] = ""

    def __post_init__(self):
        # a numpy scalar becomes the float it stands for
        object.__setattr__(self, "budget", check_budget(type(self).__name__, self.budget))
        check_fields(self)

    def bind(self, model) -> "Policy":
        """This policy resolved against a loaded model (HeteroCache picks its profile); default: itself."""
        return self

    def smallest_budget(self, model, prompt_len: int, at_least: float = 0.0) -> float:
        """The smallest rho (4 decimals, at least ``at_least``) this policy accepts for a ``prompt_len``-token
        prompt on ``model``.

        Every registered policy accepts every budget above its smallest (tests/test_smallest_budget.py), so a
        bisection of the 4-decimal grid of (0, 1] against the plan's budget check finds it in 14 tries
        (``make_prefill`` checks every budget rule before any compute). BudgetError (the policy's own, at
        rho = 1) when no budget fits the prompt."""
        bound = self.bind(model)  # once: a profile's checks against the model do not depend on the budget

        def fits(steps: int) -> bool:
            try:
                dataclasses.replace(bound, budget=steps / 1e4).bind(model).make_prefill(model.config, [prompt_len])
            except BudgetError:
                return False
            return True

        # rho = 1 first: when it is refused, the policy's own error says why
        dataclasses.replace(bound, budget=1.0).bind(model).make_prefill(model.config, [prompt_len])
        lo, hi = max(0, math.ceil(at_least * 1e4 - 1e-6) - 1), 10_000  # lo: refused (or below the floor)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        return hi / 1e4

    def make_prefill(self, cfg: ModelConfig, prompt_lens, compile_fn=None):
        """The prefill plan (``build_layer``, ``finish(cache) -> (cache, DecodeState)``); checks budgets first."""
        raise NotImplementedError(f"{type(self).__name__} defines no prefill plan")

    # ----------------------------------------------------------------- decode
    def attend(self, li: int, q, step):
        """Traced, once per layer inside the decode step: one query per sequence over the layer's rows.

        q: [B, Hkv, G, D] (after RoPE); ``step`` (``model.pool.LayerStep``): the pool with this step's token
        appended, the layer's offsets, lengths and state, the tail rows each head attends. Returns (out
        [B, Hkv, G, D], step, extra): a decode-time policy may select or fetch here and update the pool or its
        layer's state (same shapes); ``extra`` (a pytree or None) reaches ``DecodeState.after_step``.
        Default: every kept row and the tail, every head in one call.
        """
        return step.attend(q)[0], step, None

    def finish_step(self, extras: tuple) -> tuple:
        """Traced, once per decode step after the last layer: the layers' ``attend`` extras (a tuple over
        layers) as ``DecodeState.after_step`` receives them. A policy batches here work its layers would each
        do alone (HeteroCache's drift statistics). Default: unchanged."""
        return extras

    def attend_chunk(self, li: int, q, step):
        """Traced, once per layer of a chunked turn (``model.extend``): C new queries [B, Hkv, G, C, D] over
        the layer's rows, causal over the tail (``step.tail_lens`` - 1 + c for query c). Default: every kept
        row."""
        return step.attend_chunk(q)

    def layout(self, cfg: ModelConfig):
        """The head layout this policy needs (a ``HeadLayout``: the order of each layer's heads), or None."""
        return None
