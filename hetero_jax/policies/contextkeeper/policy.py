"""ContextKeeper: an offline ranking of KV heads; the top heads keep the whole prompt, the rest sinks + recent.

Paper §3.2-3.3 (heads that read the middle of the context keep their full KV, "locality" heads keep
``sink`` first and ``recent`` last prompt tokens and every generated token) and §4.2 (the fraction
of full heads is a knob). The ranking is computed offline (``ranking.py`` beside this module).

A scored policy: StreamingLLM's token scorer (``scorers.SinksRecent``: the sinks, then the most recent
tokens) composed with the ranking's allocator (``allocators.RankedFull``: the budget rule, ours, the spec's B1
rule solved for the number of full heads; a BudgetError names the smallest rho when even no full head fits).
Defaults are the paper's s = 128, r = 256 (Table 1), not scaled for short prompts: a prompt of at most
384 tokens keeps everything, so only rho = 1 is accepted there. Ours: heads become full with a layer floor,
each layer's best-ranked head before any layer's second (``RankedFull.order``), where the paper takes a global
prefix of the ranking (RESULTS ``contextkeeper-layer-floor``).

Layout: one fixed permutation per (model, ranking): each layer's KV heads in ranking order, so for
every prompt length the full heads of a layer are a prefix and no weights are re-permuted. In the row
pool each head of each sequence keeps exactly its own rows (the whole prompt, or sinks + recent), so a
batch of prompts of different lengths keeps what each would alone (the pool array is as long as the longest
sequence's rows: allocated bytes are the longest's, times the batch).

A static policy: no decode hooks. Generated tokens follow each head's prompt rows; every head attends them.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from hetero_jax.model.config import ModelConfig
from hetero_jax.model.layout import HeadLayout
from hetero_jax.policies.allocators import RankedFull
from hetero_jax.policies.base import PolicyError, int_param
from hetero_jax.policies.composed import ScoredPolicy
from hetero_jax.policies.protocol import DecodeState
from hetero_jax.policies.scorers import SinksRecent
from hetero_jax.policies.selection import PolicyPrefill, bytes_rho
from hetero_jax.policies.contextkeeper.ranking import (DEFAULT_RECENT, DEFAULT_SINK, CARanking, default_ranking,
                                                       load_ranking, model_fingerprint)
from hetero_jax.profile.schema import ProfileError


@dataclasses.dataclass(frozen=True)
class ContextKeeper(ScoredPolicy):
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

    scorer = property(lambda self: SinksRecent(self.sink))
    allocator = property(lambda self: RankedFull(self._need_ranking(), self.sink, self.recent))

    # ----------------------------------------------------------------- layout
    def layout(self, cfg: ModelConfig) -> HeadLayout:
        """Each layer's KV heads in ranking order (the split into full and compressed heads is per request)."""
        return self.allocator.layout(cfg)

    def make_prefill(self, cfg, prompt_lens, compile_fn=None):
        return ContextKeeperPrefill(self, cfg, prompt_lens, compile_fn=compile_fn)


class ContextKeeperPrefill(PolicyPrefill):
    """The scored plan (each head keeps its top ``SinksRecent`` tokens: the whole prompt for the full heads,
    a prefix of each layer in ranking order, sinks + recent for the others), its state carrying the split."""

    def finish(self, cache):
        return cache, ContextKeeperDecode(self, cache)


class ContextKeeperDecode(DecodeState):
    """No decode-time work; carries the prefill's split and its byte-based rho for the stats."""

    writes_prompt_rows = False

    def __init__(self, plan: ContextKeeperPrefill | None, cache=None, info: dict | None = None):
        if info is None:
            cfg, policy = plan.cfg, plan.policy
            alloc, n = policy.allocator, cfg.num_layers * cfg.num_kv_heads
            n_full = [alloc.n_full(type(policy).__name__, policy.budget, cfg, int(L)) for L in plan.lens]
            kept = [int(plan.counts[:, b].sum()) for b in range(len(plan.lens))]  # [layers, B, H] rows per head
            rank = alloc.order()
            info = {
                "n_full": n_full,
                "n_full_per_layer": [alloc.full_per_layer(nf, cfg).tolist() for nf in n_full],
                "full_heads": [[[int(l), int(h)] for l, h in rank[:nf]] for nf in n_full],
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

