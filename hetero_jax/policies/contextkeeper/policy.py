"""ContextKeeper: an offline ranking of KV heads; the top heads keep the whole prompt, the rest sinks + recent.

Paper §3.2-3.3 (heads that read the middle of the context keep their full KV, "locality" heads keep
``sink`` first and ``recent`` last prompt tokens and every generated token) and §4.2 (the fraction
of full heads is a knob). The ranking is computed offline (``ranking.py`` beside this module).

Budget mode (ours, the spec's B1 rule solved for the number of full heads): for a prompt of L tokens,
N = layers x KV heads and c = min(L, sink + recent), the largest N_full with
``N_full * L + (N - N_full) * c <= rho * N * L``; the full heads are the first N_full of the global
ranking. If even N_full = 0 does not fit (c > rho * L) a BudgetError names the smallest rho.
Defaults are the paper's s = 128, r = 256 (Table 1), not scaled for short prompts: a prompt of at most
384 tokens keeps everything, so only rho = 1 is accepted there.

Layout: one fixed permutation per (model, ranking): each layer's KV heads in ranking order, so for
every prompt length the full heads of a layer are a prefix and no weights are re-permuted. In the row
pool each head of each sequence keeps exactly its own rows (the whole prompt, or sinks + recent), so a
batch of prompts of different lengths keeps what each would alone, in bytes too.

A static policy: no decode hooks. Generated tokens follow each head's prompt rows; every head attends them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.model.cache import LayerPrefill
from hetero_jax.model.config import ModelConfig
from hetero_jax.model.layout import HeadLayout
from hetero_jax.policies.base import BudgetError, Policy, PolicyError, int_param
from hetero_jax.policies.protocol import DecodeState, PrefillPlan
from hetero_jax.model.scoring import gather_group
from hetero_jax.policies.selection import bytes_rho
from hetero_jax.policies.contextkeeper.ranking import (DEFAULT_RECENT, DEFAULT_SINK, CARanking, default_ranking,
                                                       load_ranking, model_fingerprint)
from hetero_jax.profile.schema import ProfileError

_gather = jax.jit(gather_group)


def kept_positions(prompt_len: int, sink: int, recent: int) -> np.ndarray:
    """Prompt positions a compressed head keeps: [0, sink) and [L - recent, L), or all of a short prompt."""
    if prompt_len <= sink + recent:
        return np.arange(prompt_len)
    return np.concatenate([np.arange(sink), np.arange(prompt_len - recent, prompt_len)])


@dataclasses.dataclass(frozen=True)
class ContextKeeper(Policy):
    """ContextKeeper (``ranking=None``: the shipped ranking of the loaded model; a str is a file path)."""

    ranking: CARanking | None = dataclasses.field(default=None, compare=False, hash=False, repr=False)
    budget: float = 0.5
    sink: int = int_param(DEFAULT_SINK, 0)
    recent: int = int_param(DEFAULT_RECENT, 1)
    ranking_key: str = dataclasses.field(default="", init=False)

    name: ClassVar[str] = "contextkeeper"
    summary: ClassVar[str] = ("offline-ranked heads keep the whole prompt as far as rho allows, the others "
                              "sinks + recent tokens (static)")

    def __post_init__(self):
        super().__post_init__()
        r = self.ranking
        if isinstance(r, str):
            r = load_ranking(r)
            object.__setattr__(self, "ranking", r)
        if r is not None and not isinstance(r, CARanking):
            raise PolicyError(f"ContextKeeper: ranking must be a CARanking, a path to a ranking JSON or None, "
                              f"got {type(r).__name__}")
        object.__setattr__(self, "ranking_key", r.key() if r is not None else "")

    def bind(self, model) -> "ContextKeeper":
        r = self.ranking
        if r is None:
            r = default_ranking(model)
            if r is None:
                raise ProfileError(
                    f"ContextKeeper(ranking=None) needs the shipped head ranking of the loaded model, but "
                    f"hetero-jax ships none for {getattr(model, 'name', 'this model')}; calibrate one with "
                    "`hetero-jax profile --method contextkeeper` and pass ContextKeeper(ranking='file.json')")
        r.check_compatible(model.config, model_fingerprint(model) if r.weights_fingerprint else None)
        return dataclasses.replace(self, ranking=r) if r is not self.ranking else self

    def _need_ranking(self) -> CARanking:
        if self.ranking is None:
            raise ProfileError("ContextKeeper has no ranking yet: call policy.bind(model) (generate does this)")
        return self.ranking

    # ---------------------------------------------------------------- budgets
    def _fits(self, rho: float, n_full: int, n: int, prompt_len: int) -> bool:
        c = min(prompt_len, self.sink + self.recent)
        return n_full * prompt_len + (n - n_full) * c <= rho * n * prompt_len * (1 + 1e-12)

    def min_rho(self, prompt_len: int, n: int = 1) -> float:
        """Smallest rho (4 decimals, rounded up) at which no head keeps everything: min(L, s + r) / L."""
        c = min(prompt_len, self.sink + self.recent)
        rho = math.ceil(c / prompt_len * 1e4 - 1e-6) / 1e4
        while not self._fits(rho, 0, n, prompt_len):
            rho = round(rho + 1e-4, 4)
        return min(rho, 1.0)

    def n_full(self, cfg: ModelConfig, prompt_len: int) -> int:
        """Heads (model-wide, in ranking order) that keep the whole prompt at this budget; BudgetError if
        even none fits."""
        n = cfg.num_layers * cfg.num_kv_heads
        c = min(prompt_len, self.sink + self.recent)
        if c == prompt_len:  # a compressed head would keep the whole prompt too
            if not self._fits(self.budget, n, n, prompt_len):
                raise BudgetError(self._budget_message(prompt_len, 1.0))
            return n
        if not self._fits(self.budget, 0, n, prompt_len):
            raise BudgetError(self._budget_message(prompt_len, self.min_rho(prompt_len, n)))
        nf = int(math.floor((self.budget * n * prompt_len - n * c) / (prompt_len - c) + 1e-9))
        nf = max(0, min(n, nf))
        while nf < n and self._fits(self.budget, nf + 1, n, prompt_len):
            nf += 1
        while nf > 0 and not self._fits(self.budget, nf, n, prompt_len):
            nf -= 1
        return nf

    def _budget_message(self, prompt_len: int, rho_min: float) -> str:
        return (f"ContextKeeper: budget rho={self.budget:g} cannot be kept for a {prompt_len}-token prompt: "
                f"every head keeps at least sink + recent = {self.sink}+{self.recent} tokens (or the whole "
                f"prompt when shorter); the smallest rho that works for this prompt is rho={rho_min:g}")

    def check_budget(self, prompt_len: int) -> int:
        c = min(prompt_len, self.sink + self.recent)
        if c == prompt_len and self.budget < 1.0:
            raise BudgetError(self._budget_message(prompt_len, 1.0))
        if self.budget * prompt_len * (1 + 1e-12) < c:
            raise BudgetError(self._budget_message(prompt_len, self.min_rho(prompt_len)))
        return prompt_len

    def full_per_layer(self, cfg: ModelConfig, prompt_len: int) -> np.ndarray:
        """[layers] heads of each layer that keep the whole prompt (a prefix of the layer in layout order)."""
        nf = self.n_full(cfg, prompt_len)
        top = self._need_ranking().order()[:nf]
        return np.bincount(top[:, 0], minlength=cfg.num_layers).astype(np.int64)

    # ----------------------------------------------------------------- layout
    def layout(self, cfg: ModelConfig) -> HeadLayout:
        """Each layer's KV heads in ranking order (the split into full and compressed heads is per request)."""
        rank = self._need_ranking().rank()
        return HeadLayout.from_orders(np.argsort(rank[l], kind="stable") for l in range(cfg.num_layers))

    def make_prefill(self, cfg, prompt_lens, compile_fn=None):
        return ContextKeeperPrefill(self, cfg, prompt_lens, compile_fn=compile_fn)

    def token_scores(self, layer, x_in, keys, prompt_lens, cfg):
        raise NotImplementedError("ContextKeeper keeps whole heads or sinks + recent tokens; it scores no token")


class ContextKeeperPrefill(PrefillPlan):
    """Each head of each sequence keeps its whole prompt (the first ``per_layer`` heads of a layer, in
    ranking order) or its sinks + recent tokens."""

    def __init__(self, policy: ContextKeeper, cfg: ModelConfig, prompt_lens, compile_fn=None):
        self.policy, self.cfg = policy, cfg
        self.lens = np.asarray(prompt_lens, np.int64)
        policy._need_ranking().check_compatible(cfg)
        self.n_full = np.array([policy.n_full(cfg, int(L)) for L in self.lens])  # validates every prompt first
        self.per_layer = np.stack([policy.full_per_layer(cfg, int(L)) for L in self.lens])  # [B, layers]
        self.kept = [kept_positions(int(L), policy.sink, policy.recent) for L in self.lens]
        L, H = cfg.num_layers, cfg.num_kv_heads
        self.counts = np.array([[[len(self._positions(b, li, h)) for h in range(H)] for b in range(len(self.lens))]
                                for li in range(L)], np.int64)  # [layers, B, H]

    def _positions(self, b: int, li: int, h: int) -> np.ndarray:
        return np.arange(self.lens[b]) if h < self.per_layer[b, li] else self.kept[b]

    def prompt_counts(self) -> np.ndarray:
        return self.counts

    def build_layer(self, li, layer, x_in, k_buf, v_buf, lens) -> LayerPrefill:
        B, H, T, _ = k_buf.shape
        counts = self.counts[li]  # [B, H]
        idx = np.zeros((B, H, int(counts.max())), np.int32)
        for b in range(B):
            for h in range(H):
                pos = self._positions(b, li, h)
                idx[b, h, : len(pos)] = pos
                idx[b, h, len(pos):] = pos[-1]
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, H, T))
        block = _gather(k_buf, v_buf, positions, jnp.asarray(idx), jnp.asarray(counts, jnp.int32))
        return LayerPrefill(blocks=(block.replace(heads=tuple(range(H))),))

    def finish(self, cache):
        return cache, ContextKeeperDecode(self, cache)


class ContextKeeperDecode(DecodeState):
    """No decode-time work; carries the prefill's split and its byte-based rho for the stats."""

    writes_prompt_rows = False

    def __init__(self, plan: ContextKeeperPrefill, cache=None, info: dict | None = None):
        if info is None:
            cfg = plan.cfg
            n = cfg.num_layers * cfg.num_kv_heads
            kept = [int(nf) * int(L) + (n - int(nf)) * len(k) for nf, L, k in zip(plan.n_full, plan.lens, plan.kept)]
            rank = plan.policy.ranking.order()
            info = {
                "n_full": [int(x) for x in plan.n_full],
                "n_full_per_layer": plan.per_layer.tolist(),
                "full_heads": [[[int(l), int(h)] for l, h in rank[: int(nf)]] for nf in plan.n_full],
                "planned_rho": [k / (n * int(L)) for k, L in zip(kept, plan.lens)],
                "bytes_rho": bytes_rho(cache, cfg) if cache is not None else None,
            }
        self.info = info

    def fresh(self) -> "ContextKeeperDecode":
        return ContextKeeperDecode(None, info=self.info)

    def stats(self) -> dict:
        return dict(self.info)

    def summary(self) -> str:
        nf = self.info["n_full"]
        return f"full heads {','.join(map(str, nf))}, bytes rho {self.info['bytes_rho']:.3f}"

