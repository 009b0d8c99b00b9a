"""What the policies driven by an offline ``HeadProfile`` share (HeteroCache, SyncKV).

A profile gives every KV head a role (``profile.clustering.Role``): pivots and volatile heads keep their
full prompt KV on the device, satellites (and HeteroCache's anchors) a budget of it; each pivot leads
the satellites of its cluster. :class:`ProfileBound` binds the profile to a model (also for a scored
policy with the profile's budgets, ``baselines.ProfiledSnapKV``); :class:`ProfiledPolicy` adds the
profile-dependent parts of HeteroCache and SyncKV: the head layout [full heads] [compressed heads] of each layer,
the per-head budgets (Eq. 7-8, the B1 rule for uniform weights) and the pivots' decode queries.
"""

from __future__ import annotations

import dataclasses
import os
from typing import ClassVar

import numpy as np

from hetero_jax.model.config import ModelConfig
from hetero_jax.model.layout import HeadLayout
from hetero_jax.policies.allocators import profile_grid, profile_key
from hetero_jax.policies.base import Policy
from hetero_jax.profile.clustering import Role
from hetero_jax.profile.head_profile import HeadProfile
from hetero_jax.profile.schema import ProfileError
from hetero_jax.profile.shipped import SHIPPED_PROFILES

# profile_key lives with the profile's budgets (allocators.py); HeteroCache and SyncKV import it from here
__all__ = ["LayerRoles", "ProfileBound", "ProfiledPolicy", "profile_key", "take_slots"]


@dataclasses.dataclass
class LayerRoles:
    n_full: int  # number of full heads (on one device: the layout slots [0, n_full))
    pivots: list[int]  # indices of the pivots among the full heads (the first ones)
    satellites: list[int]  # indices of the satellites among the compressed heads (the first ones)
    # cluster of each pivot: indices of its satellites among the compressed heads
    members: dict[int, list[int]]
    full_slots: list[int] = dataclasses.field(default_factory=list)  # layout slot of each full head
    comp_slots: list[int] = dataclasses.field(default_factory=list)  # layout slot of each compressed head

    def pivot_slots(self) -> list[int]:
        return self.full_slots[: len(self.pivots)]


class ProfileBound(Policy):
    """Mix-in of a frozen policy dataclass with a ``profile: HeadProfile | None`` field (None: the shipped one):
    binding the profile to a model."""

    profile_table: ClassVar[dict[str, str]] = SHIPPED_PROFILES  # shipped profiles bind() looks in
    calibrate_hint: ClassVar[str] = ("calibrate one with `hetero-jax profile --model M --data FILE --out "
                                     "profile.json` and pass {cls}(profile='profile.json') (on the command line: "
                                     "generate --profile profile.json, serve --option profile=profile.json)")

    def _load_profile_path(self) -> None:
        """A ``profile`` given as a path (``--option profile=PATH``, a server's flag) loaded in place: the
        policy holds the profile itself."""
        if isinstance(self.profile, (str, os.PathLike)):
            from hetero_jax.profile.official import load_profile

            object.__setattr__(self, "profile", load_profile(os.fspath(self.profile)))

    def _refuse_synckv_grouping(self) -> None:
        """ProfileError for a SyncKV head grouping given as a HeteroCache role profile: its R-heads would be
        kept whole as pivots and every other head compressed by one weight, silently another method."""
        prof = self.profile
        if isinstance(prof, HeadProfile) and prof.settings.method == "synckv":
            cls = type(self).__name__
            raise ProfileError(f"{cls} needs a HeteroCache role profile, but this profile is a SyncKV head grouping "
                               f"(calibrated with --method synckv): leave profile out for the shipped one, or "
                               + self.calibrate_hint.format(cls=cls))

    # -------------------------------------------------------------- binding
    def bind(self, model):
        """This policy with its profile resolved (the shipped one when None) and checked against ``model``."""
        from hetero_jax.profile.shipped import default_profile, weights_fingerprint

        cls = type(self).__name__
        prof = self.profile
        if prof is None:
            prof = default_profile(model, table=self.profile_table)
            if prof is None:
                raise ProfileError(
                    f"{cls}(profile=None) needs the shipped profile of the loaded model, but hetero-jax ships "
                    f"none for {getattr(model, 'name', 'this model')}; " + self.calibrate_hint.format(cls=cls))
        prof.check_compatible(model.config, weights_fingerprint=weights_fingerprint(model.params)
                              if prof.weights_fingerprint else None)
        return dataclasses.replace(self, profile=prof) if prof is not self.profile else self

    def _need_profile(self) -> HeadProfile:
        if self.profile is None:
            raise ProfileError(f"{type(self).__name__} has no profile yet: call policy.bind(model) (generate "
                               "does this)")
        return self.profile


class ProfiledPolicy(ProfileBound):
    """A profile-driven policy (HeteroCache, SyncKV): the head layout [full heads] [compressed heads] of each
    layer, the per-head budgets (Eq. 7-8) and the pivots' decode queries."""

    head_tp = 1  # tensor-parallel shards the layout is cut for (HeteroCache: a field that ``bind`` sets)
    row_pivot_slots = ()  # with head_tp > 1: per layer, the pivots' layout slots (set with head_tp)

    # ---------------------------------------------------------------- layout
    def roles_in_layout(self, layer: int) -> dict[str, list[int]]:
        """Original KV-head indices per role of one layer, in layout order within each role."""
        r = self._need_profile().roles[layer]
        pick = lambda role: [int(h) for h in np.flatnonzero(r == role)]  # noqa: E731
        return {"pivot": pick(Role.PIVOT), "volatile": pick(Role.VOLATILE),
                "satellite": pick(Role.SATELLITE), "anchor": pick(Role.ANCHOR)}

    def layout(self, cfg: ModelConfig) -> HeadLayout:
        """Per layer: [pivots + volatiles] (full) then [satellites + anchors] (compressed). Under tensor
        parallelism (``head_tp`` > 1, set by ``bind`` on a mesh): role-balanced rows (:meth:`row_layout`)."""
        if self.head_tp > 1:
            return self.row_layout(cfg)
        orders = []
        for l in range(cfg.num_layers):
            r = self.roles_in_layout(l)
            orders.append(r["pivot"] + r["volatile"] + r["satellite"] + r["anchor"])
        return HeadLayout.from_orders(orders)

    def row_layout(self, cfg: ModelConfig) -> HeadLayout:
        """The layout for ``head_tp`` shards: each layer's heads, largest budget first, cut into rows of tp
        heads (one per shard), each row's heads spread over the shards so that every shard's tokens over all
        layers are even (``placement.balanced_placement``): each shard's pool then holds about the same rows.
        Budgets at a nominal prompt length: Eq. 7-8 scale with L, so the placement holds for every L."""
        from hetero_jax.policies.placement import balanced_rows

        grid, _ = self.budget_grid(1 << 15)
        return HeadLayout.from_rows(balanced_rows(grid, self.head_tp), self.head_tp)

    def layer_roles(self, cfg: ModelConfig) -> list[LayerRoles]:
        """Per layer: the full and compressed heads' layout slots, pivots and satellites among them, and each
        pivot's satellites."""
        layout = self.layout(cfg)
        out = []
        for l in range(cfg.num_layers):
            r = self.roles_in_layout(l)
            full = r["pivot"] + r["volatile"]
            comp = r["satellite"] + r["anchor"]
            slot_of = {int(h): i for i, h in enumerate(layout.perms[l])}
            sat_pos = {h: comp.index(h) for h in r["satellite"]}
            members = {full.index(int(p)): [sat_pos[int(s)] for s in sats] for p, sats in self.profile.clusters[l]}
            out.append(LayerRoles(len(full), list(range(len(r["pivot"]))), [sat_pos[h] for h in r["satellite"]],
                                  members, [slot_of[h] for h in full], [slot_of[h] for h in comp]))
        return out

    # --------------------------------------------------------------- budgets
    def budget_grid(self, prompt_len: int) -> tuple[np.ndarray, int]:
        """(tokens per KV head [L, H] in original order, L_base as an int) for one prompt (Eq. 7-8,
        ``allocators.profile_grid``)."""
        return profile_grid(type(self).__name__, self._need_profile(), self.budget, prompt_len)

    def check_budget(self, prompt_len: int) -> int:
        """BudgetError unless the profile's budgets work for this prompt; the prompt length (the longest a head
        keeps). Not a base-class hook: HeteroCache's and SyncKV's callers ask it before planning."""
        self.budget_grid(prompt_len)
        return prompt_len

    # ----------------------------------------------------------------- decode
    def attend(self, li, q, step):
        """Every kept row (as the base policy); the extra is the layer's pivot queries [B, Np, G, D] (None
        without pivots), which the decode state reads after the step."""
        slots = self.pivot_slots(li)
        return step.attend(q)[0], step, (take_slots(q, slots) if slots else None)

    def pivot_slots(self, li: int) -> tuple[int, ...]:
        """Layout slots of layer ``li``'s pivots (read as constants by traced code)."""
        if self.head_tp == 1:
            return tuple(range(len(self.roles_in_layout(li)["pivot"])))
        return self.row_pivot_slots[li]


def take_slots(x, slots):
    """x [B, H, ...] at the layout slots ``slots`` (a slice when they are consecutive)."""
    slots = [int(s) for s in slots]
    if slots == list(range(slots[0], slots[0] + len(slots))):
        return x[:, slots[0] : slots[0] + len(slots)]
    return x[:, np.asarray(slots)]


