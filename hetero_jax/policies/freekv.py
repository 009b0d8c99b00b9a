"""FreeKV (Liu et al., 2025): speculative page retrieval from pinned host memory.

Every compressed layer (all but the first ``skip_layers``, App. A) keeps its
whole prompt K/V in the pinned-host store and, on the device, as the prompt
part of each KV head's region of the row pool, ``sinks`` first tokens, k
selected pages of ``page_size`` tokens and the prompt's last tokens (the
window): ``[sinks | page slots | window]``, attended as it is with the tail
(``policies/speculative.py``, shared with offloaded Quest). The state record
(``speculative.PageSlots``) holds the page summaries (per-channel min/max key,
§3.2) and the page id held by each slot: the §4.1 data placement. The skipped
layers keep their prompt. Pages cover ``[S, S + P*p)``, P being the full pages
left before the window, so the window holds W to W + p - 1 tokens.

Selection Sel(q) (§3.2, App. B.2 "MeanS"): per query head, the softmax over the
pages of the Quest bound sum_d max(q_d kmin_d, q_d kmax_d); the group mean of
those; the top k per KV head. One selection per KV head keeps the group
consistent (§2.1).

Decode, step i: the page slots hold Sel(q_{i-1}), recalled by the host between
steps i-1 and i (only the pages that were not resident,
``host_store.write_host_rows``); the step attends them and returns Sel(q_i).
After prefill the slots hold Sel(q_last) of the prompt's last query, so step 0
is speculative too, where the authors' system code blocks on a fresh selection.

Departure (docs/architecture.md, "FreeKV"): the paper
corrects, before attention, the KV heads whose query moved (group-mean cosine
below tau, §3.3) by fetching Sel(q_i) from the host inside the step. That fetch
is a host round trip in the middle of the jitted step, one per layer, which a
GPU serialises; we never make it. Every head attends Sel(q_{i-1}) at step i,
the paper's tau = 0 row (App. B.3, Table 7); the measured effect on answers is
in RESULTS ``fidelity-freekv-correction``. Tokens added after prefill (the
tail) are attended in full, where FreeKV pages its generated tokens too.

Budget: the project's B1 rule with the skipped layers as full heads,
B_c = (rho * NL - n_skip) * L / (NL - n_skip) tokens per compressed head; the
sinks, the window and the summaries come first (``pages.pages_for_budget``), at
least one page must fit. Sinks and window default to B_c / 16 rounded to a
multiple of 4, at least 4: the paper's S = W = 128 at B = 2048; where that
leaves no room for one page, the largest smaller multiple of 4 that does (so
every budget from the smallest up fits: the window takes the partial page, and
a larger one can cost a whole page of room). The page ids are counted as
device bytes but not budgeted.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import numpy as np

from hetero_jax.model import transformer as M
from hetero_jax.model.cache import KVCache, LayerPrefill
from hetero_jax.model.config import ModelConfig
from hetero_jax.model.host_store import attend_chunk_over_host_prompt
from hetero_jax.policies.base import BudgetError, Policy, PolicyError, int_param
from hetero_jax.policies.protocol import PrefillPlan
from hetero_jax.policies.pages import page_bucket, pages_for_budget
from hetero_jax.policies.speculative import PageRecallDecode, PageRecallPrefill, attend_slots


@dataclasses.dataclass(frozen=True)
class FreeKV(Policy):
    """FreeKV; ``sinks``/``window`` None = B_c / 16 (see module docstring)."""

    budget: float = 0.3
    page_size: int = int_param(32, 1)
    sinks: int | None = int_param(None, 0, " or None (B_c / 16)", optional=True)
    window: int | None = int_param(None, 0, " or None (B_c / 16)", optional=True)
    skip_layers: int = int_param(1, 0)

    name: ClassVar[str] = "freekv"
    summary: ClassVar[str] = ("speculative page retrieval: prompt KV on the host, the pages chosen with the "
                              "previous step's query recalled between steps (MeanS selection)")

    # --------------------------------------------------------------- budgets
    def compressed_layers(self, cfg: ModelConfig) -> list[int]:
        return list(range(min(self.skip_layers, cfg.num_layers), cfg.num_layers))

    def _b_c(self, cfg: ModelConfig, prompt_len: int, rho: float) -> float:
        """Per-head budget of a compressed layer (B1 rule, the skipped layers as full heads)."""
        n_skip = cfg.num_layers - len(self.compressed_layers(cfg))
        return (rho * cfg.num_layers - n_skip) * prompt_len / (cfg.num_layers - n_skip)

    def sinks_window(self, cfg: ModelConfig, prompt_len: int, rho: float | None = None) -> tuple[int, int]:
        """(S, W) for one prompt at budget rho (default: the policy's): the options; where None, B_c / 16
        rounded to a multiple of 4 (>= 4), lowered in steps of 4 until one page fits (module docstring)."""
        if self.sinks is not None and self.window is not None:
            return self.sinks, self.window
        rho = self.budget if rho is None else rho
        rule = max(4, 4 * int(math.floor(self._b_c(cfg, prompt_len, rho) / 64 + 0.5)))
        for auto in range(rule, 3, -4):  # down to 4, which is what an error reports when no page fits
            S, W = (auto if self.sinks is None else self.sinks), (auto if self.window is None else self.window)
            if auto == 4 or self._pages_that_fit(cfg, prompt_len, rho, S, W) >= 1:
                return S, W

    def _pages_that_fit(self, cfg: ModelConfig, prompt_len: int, rho: float, S: int, W: int) -> int:
        """Pages per compressed head that budget rho holds beside S sinks, a window of at least W and the
        summaries (0 or less: none)."""
        P = max(0, (prompt_len - S - W) // self.page_size)
        if P < 1:
            return 0
        n_skip = cfg.num_layers - len(self.compressed_layers(cfg))
        return pages_for_budget(rho, prompt_len, cfg.num_layers, n_skip, self.page_size,
                                fixed_tokens=prompt_len - P * self.page_size, summary_pages=page_bucket(P))

    def _layout(self, cfg: ModelConfig, prompt_len: int, rho: float) -> tuple[int, int, int]:
        """(S, window tokens w, selectable pages P) at budget rho; w = L - S - P*p lies in [W, W + p)."""
        S, W = self.sinks_window(cfg, prompt_len, rho)
        P = max(0, (prompt_len - S - W) // self.page_size)
        return S, prompt_len - S - P * self.page_size, P

    def plan_pages(self, cfg: ModelConfig, prompt_len: int) -> tuple[int, int, int, int]:
        """(sinks S, window tokens w, selectable pages P, pages kept per head k) of one prompt; BudgetError
        when the budget cannot hold one page next to the sinks, the window and the summaries."""
        L, ps = prompt_len, self.page_size
        n_comp = len(self.compressed_layers(cfg))
        if n_comp == 0:
            raise PolicyError(f"FreeKV: skip_layers={self.skip_layers} leaves no layer of the model's "
                              f"{cfg.num_layers} to compress; it must be below num_layers")
        n_skip = cfg.num_layers - n_comp
        S, w, P = self._layout(cfg, L, self.budget)
        if P < 1:
            W = self.sinks_window(cfg, L, self.budget)[1]
            raise BudgetError(f"FreeKV: a {L}-token prompt is too short for {S} sinks + a {W}-token window + one "
                              f"{ps}-token page ({S + W + ps} tokens); use smaller sinks/window/page_size or full KV")
        k = pages_for_budget(self.budget, L, cfg.num_layers, n_skip, ps, fixed_tokens=S + w, summary_pages=page_bucket(P))
        if k < 1:
            rho = self._smallest_rho(cfg, L)
            workable = self._workable_page_size(cfg, L) if rho is None else None
            if rho is None and workable is None:
                hint = ("no budget up to rho=1 does with any page size: use fewer sinks or a smaller window, or "
                        "full KV for a prompt this short")
            elif rho is None:
                hint = (f"no budget up to rho=1 does: use page_size={workable} (one page and the page summaries "
                        "take the least room near the root of the pages' span), or fewer sinks or a smaller window")
            else:
                hint = f"the smallest budget that works for this prompt is rho={rho:g}"
            raise BudgetError(
                f"FreeKV: budget rho={self.budget:g} cannot hold one {ps}-token page per head of a {L}-token "
                f"prompt ({n_skip} uncompressed layers, then {S} sinks, a {w}-token window and the summaries of "
                f"its {P} pages ({page_bucket(P)} allocated) per compressed head come first); {hint}")
        return S, w, P, min(P, k)

    def _one_page_fits(self, cfg: ModelConfig, prompt_len: int, rho: float) -> bool:
        """Whether budget rho holds one page beside the sinks, the window and the summaries it plans."""
        S, W = self.sinks_window(cfg, prompt_len, rho)
        return self._pages_that_fit(cfg, prompt_len, rho, S, W) >= 1

    def _smallest_rho(self, cfg: ModelConfig, prompt_len: int) -> float | None:
        """The smallest rho (4 decimals) that holds one page, None if rho 1 does not: a bisection of the plan's
        own rule (sinks and window follow the budget, and fewer pages can mean fewer summaries allocated)."""
        if not self._one_page_fits(cfg, prompt_len, 1.0):
            return None
        lo, hi = 0, 10_000
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self._one_page_fits(cfg, prompt_len, mid / 1e4) else (mid, hi)
        return hi / 1e4

    def _workable_page_size(self, cfg: ModelConfig, prompt_len: int) -> int | None:
        """The page size nearest the root of the pages' span (p + span / p is least there) with which rho 1 holds
        one page; None when none does."""
        S, W = (4 if self.sinks is None else self.sinks), (4 if self.window is None else self.window)
        span = max(1, prompt_len - S - W)
        root = max(1, round(math.sqrt(span)))
        for p in sorted(range(1, span + 1), key=lambda p: (abs(p - root), p)):
            if dataclasses.replace(self, page_size=p)._one_page_fits(cfg, prompt_len, 1.0):
                return p
        return None

    def make_prefill(self, cfg, prompt_lens, compile_fn=None):
        return FreeKVPrefill(self, cfg, prompt_lens, compile_fn)

    # ----------------------------------------------------------------- decode
    def attend(self, li, q, step):
        """Skipped layers: every row. Compressed layers: the page slots as recalled (Sel(q_{i-1})), the sinks,
        the window and the tail (``speculative.attend_slots``). Extra: Sel(q_i) [B, H, k], which the host
        recalls for the next step (§3.2), or the pages the step recalled itself; None in skipped layers."""
        st = step.layer.state
        if st is None:
            return step.attend(q)[0], step, None
        return attend_slots(q, step, "mean_softmax")

    def attend_chunk(self, li, q, step):
        """A session's turn attends the whole prompt, as prefill did (dense): a compressed layer reads it from
        the host store; ``PageRecallDecode.after_extend`` then re-selects from the turn's last query."""
        st = step.layer.state
        if st is None:
            return step.attend_chunk(q)
        n_slots = st.kmin.shape[2] * self.page_size + step.layer.capacity  # >= S + P*p + w
        return attend_chunk_over_host_prompt(li, q, step, st.store, st.prompt_lens, n_slots)


class FreeKVPrefill(PrefillPlan):
    """Skipped layers keep their prompt; compressed layers put it in the host store and keep
    sinks + Sel(q_last) + window in the pool (``speculative.PageRecallPrefill``)."""

    def __init__(self, policy: FreeKV, cfg: ModelConfig, prompt_lens, compile_fn=None):
        self.policy, self.cfg = policy, cfg
        self.lens = np.asarray(prompt_lens, np.int64)
        plans = np.array([policy.plan_pages(cfg, int(L)) for L in self.lens])  # validates every prompt first
        sinks, win, n_pages, k_sel = (plans[:, i] for i in range(4))
        self.compressed = set(policy.compressed_layers(cfg))
        self.pages = PageRecallPrefill(cfg, policy.page_size, "mean_softmax", self.lens, sinks, win, n_pages, k_sel,
                                       compile_fn)

    def prompt_counts(self) -> np.ndarray:
        """Skipped layers: the prompt; compressed layers: sinks + k pages + window, every head."""
        held = self.pages.held()  # [B]
        return np.stack([np.broadcast_to((held if li in self.compressed else self.lens)[:, None],
                                         (len(self.lens), self.cfg.num_kv_heads))
                         for li in range(self.cfg.num_layers)]).astype(np.int64)

    def build_layer(self, li, layer, x_in, k_buf, v_buf, lens) -> LayerPrefill:
        if li not in self.compressed:
            return M.full_rows(k_buf, v_buf, lens, int(self.lens.max()))
        return self.pages.build_layer(li, layer, x_in, k_buf, v_buf, lens)

    def finish(self, cache: KVCache) -> tuple[KVCache, PageRecallDecode]:
        # the prompt fraction a step attends: skipped layers whole, compressed ones their rows
        n_comp, n = len(self.compressed), self.cfg.num_layers
        attended = ((n - n_comp) * self.lens + n_comp * self.pages.held()) / (n * self.lens)
        return self.pages.finish(cache, attended)
