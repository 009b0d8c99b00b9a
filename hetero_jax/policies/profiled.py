"""What the policies driven by an offline ``HeadProfile`` share (HeteroCache, SyncKV).

A profile gives every KV head a role (``profile.clustering.Role``): pivots and volatile heads keep their
full prompt KV on the device, satellites (and HeteroCache's anchors) a budget of it; each pivot leads
the satellites of its cluster. :class:`ProfiledPolicy` holds the profile-dependent parts of such a
policy: binding the profile to a model, the head layout [full heads] [compressed heads] of each layer,
the per-head budgets (Eq. 7-8, the B1 rule for uniform weights) and the pivots' decode queries.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import ClassVar

import numpy as np

from hetero_jax import model as M
from hetero_jax.config import ModelConfig
from hetero_jax.layout import HeadLayout
from hetero_jax.policies.base import BudgetError, Policy
from hetero_jax.profile.clustering import Role
from hetero_jax.profile.format import SHIPPED_PROFILES, HeadProfile, ProfileError


def profile_key(profile: HeadProfile | None) -> str:
    """A short hash of the roles, weights and clusters: what makes two bound policies compile differently."""
    if profile is None:
        return ""
    h = hashlib.sha256(np.ascontiguousarray(profile.roles).tobytes())
    h.update(np.nan_to_num(np.asarray(profile.weights, np.float64), nan=-1.0).tobytes())
    h.update(repr(profile.clusters).encode())
    return h.hexdigest()[:16]


@dataclasses.dataclass
class LayerRoles:
    n_full: int  # heads [0, n_full) of the layer (layout order) keep everything
    pivots: list[int]  # layout positions of pivots (inside the full group)
    satellites: list[int]  # positions inside the compressed group (the first ones)
    # cluster of each pivot: positions of its satellites inside the compressed group
    members: dict[int, list[int]]


class ProfiledPolicy(Policy):
    """Mix-in of a frozen policy dataclass with a ``profile: HeadProfile | None`` field (None: the shipped one)."""

    profile_table: ClassVar[dict[str, str]] = SHIPPED_PROFILES  # shipped profiles bind() looks in
    calibrate_hint: ClassVar[str] = ("calibrate one with `hetero-jax profile --model M --data FILE --out "
                                     "profile.json` and pass {cls}(profile=load_profile('profile.json'))")

    # -------------------------------------------------------------- binding
    def bind(self, model):
        """This policy with its profile resolved (the shipped one when None) and checked against ``model``."""
        from hetero_jax.profile.format import default_profile, weights_fingerprint

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

    # ---------------------------------------------------------------- layout
    def roles_in_layout(self, layer: int) -> dict[str, list[int]]:
        """Original KV-head indices per role of one layer, in layout order within each role."""
        r = self._need_profile().roles[layer]
        pick = lambda role: [int(h) for h in np.flatnonzero(r == role)]  # noqa: E731
        return {"pivot": pick(Role.PIVOT), "volatile": pick(Role.VOLATILE),
                "satellite": pick(Role.SATELLITE), "anchor": pick(Role.ANCHOR)}

    def layout(self, cfg: ModelConfig) -> HeadLayout:
        """Per layer: [pivots + volatiles] (full) then [satellites + anchors] (compressed)."""
        groups = []
        for l in range(cfg.num_layers):
            r = self.roles_in_layout(l)
            groups.append([g for g in (r["pivot"] + r["volatile"], r["satellite"] + r["anchor"]) if g])
        return HeadLayout.from_groups(groups)

    def layer_roles(self, cfg: ModelConfig) -> list[LayerRoles]:
        """Per layer, the layout positions of the pivots and satellites and each pivot's satellites."""
        out = []
        for l in range(cfg.num_layers):
            r = self.roles_in_layout(l)
            full = r["pivot"] + r["volatile"]
            comp = r["satellite"] + r["anchor"]
            sat_pos = {h: comp.index(h) for h in r["satellite"]}
            members = {full.index(int(p)): [sat_pos[int(s)] for s in sats] for p, sats in self.profile.clusters[l]}
            out.append(LayerRoles(len(full), list(range(len(r["pivot"]))), [sat_pos[h] for h in r["satellite"]],
                                  members))
        return out

    # --------------------------------------------------------------- budgets
    def budget_grid(self, prompt_len: int) -> tuple[np.ndarray, int]:
        """(tokens per KV head [L, H] in original order, L_base as an int) for one prompt (Eq. 7-8)."""
        from hetero_jax.profile.clustering import base_budget

        prof = self._need_profile()
        cls = type(self).__name__
        if prof.n_compressed == 0:  # every head keeps its full KV: nothing to budget
            if self.budget < 1.0:  # it would keep rho = 1, far above the request
                raise BudgetError(
                    f"{cls}: budget rho={self.budget:g} cannot be kept: the profile has no compressed heads "
                    "(every head is a pivot or volatile and keeps its full KV); the smallest rho that works "
                    "is 1 (use budget=1.0, or a profile with compressed heads)")
            return np.full(prof.roles.shape, prompt_len, np.int64), prompt_len
        try:
            grid = prof.budgets(self.budget, prompt_len)
            n_comp = prof.n_compressed
            l_base = base_budget(self.budget, prof.roles.size, prof.roles.size - n_comp, n_comp, prompt_len)
        except ValueError as e:
            raise BudgetError(f"{cls}: {e}") from None
        return grid, int(max(1, min(prompt_len, np.floor(l_base))))

    def check_budget(self, prompt_len: int) -> int:
        self.budget_grid(prompt_len)
        return prompt_len

    def layer_counts(self, cfg, prompt_len):
        return None

    def token_scores(self, layer, x_in, keys, prompt_lens, cfg):
        raise NotImplementedError(f"{type(self).__name__} selects per role in its own prefill plan")

    # ----------------------------------------------------------------- decode
    def attend(self, li, q, layer_cache, tail_lens, seq_lens):
        """Every kept slot (as the base policy); the extra is the layer's pivot queries [B, Np, G, D] (None
        without pivots), which the decode state reads after the step."""
        n_pivots = len(self.roles_in_layout(li)["pivot"])
        out = M.layer_decode_attention(q, layer_cache, tail_lens)
        return out, layer_cache, (q[:, :n_pivots] if n_pivots else None)
