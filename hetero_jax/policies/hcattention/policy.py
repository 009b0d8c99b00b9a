"""HCAttention (Yang et al., 2025): approximate scores on the device, values summed on the host.

After prefill no prompt value stays on the device: every layer's prompt V [B, Hkv, L, D] goes to the
pinned host store. The device keeps, per layer, in its state record (``HCState``), either the exact
post-RoPE keys ("values on host", the paper's 50% point) or, with a key codebook
(``codebook.py`` beside this module), only each key's g int16 codes plus the layer's codebook [c, d]
(paper §3.1). Every head keeps 0 prompt rows in the row pool: its region holds only the tail.

Decode, per layer, per query head q (paper §3.2), inside the jitted step:
- scores z_t = q . k_t (exact keys), or from the look-up table T[i, j] = q_i . C[j] over the g
  sub-vectors q_i of q: z~_t = sum_i T[i, P[t, i]] (Eq. 3);
- a = softmax(z / sqrt(D)) over the prompt; the mass set Pi = the k* most probable tokens,
  k* = min{k : sum of the k largest a >= tau} (Eq. 4; tau >= 1 keeps every token);
- the host returns y = sum_{t in Pi} a_t V_t (Eq. 5): on a GPU through a callback
  (``host_store.host_weighted_sum``, numpy, only the kept rows read); on a CPU backend, whose device memory
  is the host's, the step reads the pinned values itself (``host_store.weighted_sum_in_step``: they come in
  as an operand the step never donates, ``HCDecode.host_operands``), which spares the callback's round trip;
- merged with the exact attention over the tail (tokens added after prefill, in the head's region of
  the pool, ``LayerStep.attend_tail``) by log-sum-exp. ``renormalize=True`` (the issue's default) divides y by its kept mass sum_Pi a_t: the
  result is softmax attention over Pi and the tail. ``renormalize=False`` is the paper's Eq. 5: the
  kept tokens keep their weights under the softmax over the whole prompt and the tail, so the
  weights sum to less than 1.

A session turn's chunk does the same for each of its queries (so a turn equals decoding its tokens).

Budget: byte-based. Operating points per prompt: values on host, rho 0.5 (keys L x D of 2 L x D);
per codebook, rho = (codes L x g x 2 B + codebook c x d x itemsize per layer) / full K+V bytes, e.g.
fp32 SmolLM2 (D 64): g 16 -> 0.0625 + the codebook's share. ``budget`` must lie within 5% of a
point's rho for every prompt, else BudgetError lists the points.

Modules, imports running one way: ``policy.py`` (the policy, its operating points and budget) -> ``prefill.py``
-> ``decode.py`` (the counters); ``attention.py`` (the traced prompt part: scores, mass set, host sum) below
``policy.py`` and ``prefill.py``; ``codebook.py`` (the key codebook's file and training).

Departures: the tail stays exact on the device (the paper quantizes generated keys too); the device
sends every query row's weights over the whole prompt, zero off the mass set (a static callback shape),
where the paper sends only the k* kept ones; the codebook is per layer, shared by heads and groups.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

import pallas_kernels

from hetero_jax.model.config import ModelConfig
from hetero_jax.policies.base import BudgetError, Policy, PolicyError, bool_param, real_param
from hetero_jax.policies.hcattention.attention import prompt_part
from hetero_jax.policies.hcattention.codebook import KeyCodebook, load_codebook, shipped_codebooks
from hetero_jax.policies.hcattention.prefill import HCPrefill

MATCH = 0.05  # a budget picks the operating point whose rho is within 5% of it
CODE_BYTES = 2  # int16 codes


@dataclasses.dataclass(frozen=True)
class OperatingPoint:
    """One way HCAttention can hold a prompt: values on host (``codebook`` None) or a codebook's codes."""

    rho: float  # device bytes (keys, or codes + codebook) / the prompt's full K+V bytes
    codebook: KeyCodebook | None

    def label(self, head_dim: int) -> str:
        if self.codebook is None:
            return f"values on host, exact keys: rho={self.rho:.4g}"
        cb = self.codebook
        return f"codebook g={cb.groups(head_dim)} (d={cb.sub_dim}, c={cb.size}): rho={self.rho:.4g}"


@dataclasses.dataclass(frozen=True)
class HCAttention(Policy):
    """HCAttention; ``codebook``: a KeyCodebook, a path to one (.npz), a tuple of them, or None (the
    model's shipped codebooks, resolved by ``bind``)."""

    budget: float = 0.5
    tau: float = real_param(0.9, 0.0, hi=1.0, hi_open=False)
    renormalize: bool = bool_param(True)
    codebook: KeyCodebook | str | tuple | None = dataclasses.field(default=None, compare=False, hash=False,
                                                                     repr=False)
    k_cap_fraction: float = real_param(1.0, 0.0, hi=1.0, hi_open=False)
    kv_itemsize: int | None = dataclasses.field(default=None, repr=False)  # the KV dtype's, set by bind
    codebook_keys: tuple = dataclasses.field(default=(), init=False, repr=False)

    name: ClassVar[str] = "hcattention"
    summary: ClassVar[str] = ("prompt values in pinned host memory, exact keys (rho 0.5) or key codes (codebook) "
                              "on the device; each step the tokens holding tau=0.9 of the approximate attention "
                              "mass are summed on the host")

    def __post_init__(self):
        super().__post_init__()
        sz = self.kv_itemsize
        if sz is not None and (isinstance(sz, (bool, np.bool_)) or not isinstance(sz, (int, np.integer))
                               or int(sz) not in (1, 2, 4, 8)):
            raise PolicyError(f"HCAttention: kv_itemsize must be None or a dtype size in bytes (1, 2, 4 or 8), got "
                              f"{sz!r}")
        cbs = self.codebook
        if cbs is not None:
            cbs = cbs if isinstance(cbs, tuple) else (cbs,)
            cbs = tuple(load_codebook(c) if isinstance(c, (str, bytes)) or hasattr(c, "__fspath__") else c
                        for c in cbs)
            bad = [c for c in cbs if not isinstance(c, KeyCodebook)]
            if bad:
                raise PolicyError(f"HCAttention: codebook must be a KeyCodebook, a path to a codebook .npz, a tuple "
                                  f"of those or None, got {type(bad[0]).__name__}")
            object.__setattr__(self, "codebook", cbs)
            object.__setattr__(self, "codebook_keys", tuple(c.key() for c in cbs))

    def bind(self, model) -> "HCAttention":
        """This policy with its codebooks resolved (None: the model's shipped ones) and checked against
        ``model`` (shape and weights fingerprint), and the KV dtype's size recorded."""
        from hetero_jax.profile.shipped import weights_fingerprint

        itemsize = int(np.dtype(model.params["embed"].dtype).itemsize)
        if self.codebook is None:
            cbs = shipped_codebooks(model)
        else:
            fp = weights_fingerprint(model.params) if any(c.weights_fingerprint for c in self.codebook) else None
            for c in self.codebook:
                c.check_compatible(model.config, fp)
            cbs = self.codebook
        if cbs is self.codebook and itemsize == self.kv_itemsize:
            return self
        return dataclasses.replace(self, codebook=cbs, kv_itemsize=itemsize)

    # --------------------------------------------------------------- budgets
    def operating_points(self, cfg: ModelConfig, prompt_len: int) -> list[OperatingPoint]:
        """Every way to hold a ``prompt_len``-token prompt on this model, values on host first."""
        isz = self.kv_itemsize or 4
        D, H, NL = cfg.head_dim, cfg.num_kv_heads, cfg.num_layers
        full = prompt_len * H * NL * 2 * D * isz
        points = [OperatingPoint(0.5, None)]
        for cb in self.codebook or ():
            cb.check_compatible(cfg)
            dev = prompt_len * H * NL * cb.groups(D) * CODE_BYTES + NL * cb.layer_bytes()
            points.append(OperatingPoint(dev / full, cb))
        return points

    def smallest_budget(self, model, prompt_len: int, at_least: float = 0.0) -> float:
        """The rho of the smallest operating point (of those at least ``at_least``, within the 5 % a budget
        may fall short of its point): the least the device holds. Unlike the base class's bisection this is
        not the least budget accepted: a budget up to 5 % below a point runs at that point (a rounded rho such
        as 0.0638 for 0.06383 must work), and budgets between the points are refused."""
        bound = self.bind(model)
        above = [p.rho for p in bound.operating_points(model.config, prompt_len) if p.rho >= at_least * (1 - MATCH)]
        if not above:  # the budget check's own refusal, listing the points
            dataclasses.replace(bound, budget=at_least).plan(model.config, [prompt_len])
        return min(above)

    def plan(self, cfg: ModelConfig, prompt_lens) -> OperatingPoint:
        """The operating point every prompt of the batch runs at: the point nearest the budget, within 5% of it
        for every prompt; BudgetError listing the points otherwise."""
        chosen = None
        for L in (int(x) for x in prompt_lens):
            pts = self.operating_points(cfg, L)
            ok = [p for p in pts if abs(p.rho - self.budget) <= MATCH * self.budget]
            if ok:
                best = min(ok, key=lambda p: abs(p.rho - self.budget))
                same = chosen is None or (best.codebook is chosen.codebook)
                if same:
                    chosen = chosen or best
                    continue
            listing = "; ".join(p.label(cfg.head_dim) for p in pts)
            hint = ("" if len(pts) > 1 else
                    " (no key codebook for this model: train one with `hetero-jax profile --method hcattention` "
                    "and pass HCAttention(codebook='file.npz') for the smaller points)")
            raise BudgetError(
                f"HCAttention: budget rho={self.budget:g} matches no operating point of a {L}-token prompt "
                f"(within {MATCH:.0%}{', the same point for the whole batch' if ok else ''}); "
                f"its points are: {listing}{hint}. Pass one of those rho values")
        return chosen

    def make_prefill(self, cfg, prompt_lens, compile_fn=None):
        return HCPrefill(self, cfg, prompt_lens, compile_fn)

    # ----------------------------------------------------------------- decode
    def attend(self, li, q, step):
        """The prompt part (host sum over the mass set) merged with the exact tail; extra: (k* [B, H, G] int32,
        truncated [B, H, G] bool)."""
        y, lse, kstar, trunc = prompt_part(li, q, step.layer.state, "decode", self.tau, self.k_cap_fraction,
                                           self.renormalize, mesh=step.mesh, values=step.host)
        out_t, lse_t = step.attend_tail(q[:, :, None])  # [B, H, 1, G, D], [B, H, 1, G]
        out, _ = pallas_kernels.merge_attention(y.astype(out_t.dtype), lse, out_t[:, :, 0], lse_t[:, :, 0])
        return out, step, (kstar, trunc)

    def attend_chunk(self, li, q, step):
        """A session turn's C queries [B, H, G, C, D], each as one decode step would: its own mass set."""
        B, H, G, C, D = q.shape
        y, lse, _, _ = prompt_part(li, q.reshape(B, H, G * C, D), step.layer.state, "turn", self.tau,
                                   self.k_cap_fraction, self.renormalize, mesh=step.mesh, values=step.host)
        out_t, lse_t = step.attend_tail(q.transpose(0, 1, 3, 2, 4))  # [B, H, C, G, D], [B, H, C, G]
        out, _ = pallas_kernels.merge_attention(y.reshape(B, H, G, C, D), lse.reshape(B, H, G, C),
                                                out_t.transpose(0, 1, 3, 2, 4), lse_t.transpose(0, 1, 3, 2))
        return out.astype(q.dtype)

