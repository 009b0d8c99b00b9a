"""HeteroCache the policy: a frozen, hashable set of hyper-parameters and the profile, bound to a model."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from hetero_jax.policies.base import BudgetError, PolicyError, int_param
from hetero_jax.policies.profiled import ProfiledPolicy, profile_key
from hetero_jax.profile.head_profile import HeadProfile
from hetero_jax.policies.heterocache.prefill import HeteroPrefill
from hetero_jax.policies.heterocache.step import attend_step, overlaps_at_once


def _check_hetero_args(p: "HeteroCache") -> None:
    """Types and ranges of HeteroCache's arguments that are not declared with ``int_param`` & co. (the profile,
    an optional tau_drift)."""
    if p.profile is not None and not isinstance(p.profile, HeadProfile):
        raise PolicyError(f"HeteroCache: profile must be a HeadProfile, a path to a profile JSON or None "
                          f"for the model's shipped profile, got {type(p.profile).__name__}")
    tau = p.tau_drift
    if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float, np.integer, np.floating))
                            or not np.isfinite(float(tau) if abs(tau) < 1e300 else np.inf)):
        raise PolicyError(f"HeteroCache: tau_drift must be a finite number (a drift is a median top-k overlap "
                          f"below it, so [0, 1] is meaningful) or None for the profile's tau_stable, got {tau!r}")


@dataclasses.dataclass(frozen=True)
class HeteroCache(ProfiledPolicy):
    """HeteroCache (``profile=None``: the shipped profile of the loaded model)."""

    profile: HeadProfile | None = dataclasses.field(default=None, compare=False, hash=False, repr=False)
    budget: float = 0.3
    window: int = int_param(5, 1, " (decode steps between drift checks)")
    tau_drift: float | None = None
    pool_kernel: int = 5
    select_window: int = int_param(16, 1, " prompt query (1 = the paper's last token)")
    copy_window: int = int_param(0, 0, " (prompt rows per compressed head that follow the copy heads; 0: off)")
    profile_key: str = dataclasses.field(default="", init=False)
    # set by bind() on a mesh: the row layout for tp shards and, per layer, its pivots' layout slots
    head_tp: int = dataclasses.field(default=1, init=False)
    row_pivot_slots: tuple = dataclasses.field(default=(), init=False, compare=False, repr=False)

    name: ClassVar[str] = "heterocache"
    summary: ClassVar[str] = ("role-aware head budgets from an offline profile, compressed heads' full KV in pinned "
                              "host memory, re-selection at each session turn, drift-triggered recall")

    def __post_init__(self):
        super().__post_init__()
        self._load_profile_path()
        _check_hetero_args(self)
        self._refuse_synckv_grouping()
        if self.pool_kernel != 5:
            raise BudgetError("HeteroCache: the pooled-score kernel supports pool_kernel=5 only")
        object.__setattr__(self, "profile_key", profile_key(self.profile))

    def bind(self, model):
        """The profile resolved and checked (``ProfiledPolicy.bind``); on a mesh with tp > 1 model shards,
        the role-balanced row layout (``row_layout``), so every head group splits over "model"."""
        mesh = getattr(model, "mesh", None)
        if self.copy_window and mesh is not None and mesh.size > 1:  # refused here: it was silently off
            raise PolicyError(f"HeteroCache: copy_window={self.copy_window} runs on one device only, but the model "
                              f"is on a mesh of tp={mesh.shape['model']} x dp={mesh.shape['data']} devices; use "
                              "copy_window=0 (off) on a mesh, or load the model without one")
        bound = super().bind(model)
        tp = 1 if mesh is None else int(mesh.shape["model"])
        if tp == bound.head_tp:
            return bound
        bound = dataclasses.replace(bound)  # a copy: head_tp back to its default, set below
        object.__setattr__(bound, "head_tp", tp)
        if tp > 1:
            slots = tuple(tuple(r.pivot_slots()) for r in bound.layer_roles(model.config))
            object.__setattr__(bound, "row_pivot_slots", slots)
        return bound

    def roles_in_layout(self, layer: int) -> dict[str, list[int]]:
        """``ProfiledPolicy.roles_in_layout``, the copy heads first among the volatiles (scored beside the
        pivots)."""
        r = super().roles_in_layout(layer)
        copy = self.profile.copy_heads()[layer]
        r["volatile"] = sorted(r["volatile"], key=lambda h: not copy[h])
        return r

    @property
    def drift_threshold(self) -> float:
        """tau_drift, on the check's chance-normalised scale (o - c) / (1 - c) (``pallas_kernels.drift_check``).

        Default: the profile's tau_stable (the paper sets them equal), carried to that scale at the
        calibration's chance level c = top_k / tokens_per_sample (0.4 at c = 0.2 -> 0.25 for SmolLM2);
        c = 0 when the profile does not record it, 0.5 when it records no tau_stable either.
        """
        if self.tau_drift is not None:
            return float(self.tau_drift)
        s = self.profile.settings if self.profile is not None else None
        tau = 0.5 if s is None or s.tau_stable is None else float(s.tau_stable)
        c = s.top_k / s.tokens_per_sample if s is not None and s.top_k and s.tokens_per_sample else 0.0
        return (tau - c) / (1.0 - c)

    def copy_slots(self, li: int) -> tuple[int, ...]:
        """Layout slots of layer ``li``'s copy heads (the profile's ``copy_heads()`` among its full heads),
        which lead its volatiles right after the pivots; () with ``copy_window=0`` (the default, and the only
        value ``bind`` accepts on a mesh)."""
        if not self.copy_window:
            return ()
        r = self.roles_in_layout(li)
        copy = self.profile.copy_heads()[li]
        n_p = len(r["pivot"])
        return tuple(n_p + i for i, h in enumerate(r["volatile"]) if copy[h])

    def attend(self, li, q, step):
        """Every kept row of every head in one call; the extra, for a layer with pivots or copy heads, is
        (pivots' share of the drift check or None, copy heads' pointer or None) (``attend_step``, from the
        same pass), which the decode state reads after the step."""
        slots, copy = self.pivot_slots(li), self.copy_slots(li)
        if not slots and not copy:
            return step.attend(q)[0], step, None
        out, pivot, pointer = attend_step(q, step, slots, copy)
        return out, step, (pivot, pointer)

    def finish_step(self, extras: tuple) -> tuple:
        """The pivots' o'_t of every layer at once (``overlaps_at_once``), where the step computes them."""
        shares = overlaps_at_once(tuple(None if e is None else e[0] for e in extras))
        return tuple(None if e is None else (sh, e[1]) for e, sh in zip(extras, shares))

    def make_prefill(self, cfg, prompt_lens, compile_fn=None):
        return HeteroPrefill(self, cfg, prompt_lens, compile_fn=compile_fn)
