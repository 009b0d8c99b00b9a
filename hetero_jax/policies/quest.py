"""Quest (Tang et al., 2024): query-aware page selection at every decode step.

Each KV head's prompt is cut into pages of ``page_size`` tokens, summarised on
the device by their per-channel min and max keys (``pages.page_summaries``).
At every decode step, in every layer from ``full_layers`` on, each KV head
attends only its pages with the highest upper bound
u(q, p) = sum_d max(q_d kmin_d, q_d kmax_d) (``pages.group_page_scores``, the
group max over its query heads), plus the partial last page and the tail
(tokens added after prefill, attended by every policy). The first
``full_layers`` layers attend everything, as in the paper.

Two modes, one budget definition:

- in-device (``offload=False``, the paper): every head keeps its whole prompt
  in its region of the row pool and ``budget`` is the fraction attended per
  step: round(rho L) tokens per head of a sparse layer. A step attends its
  selected pages, then its partial page and the tail, as page-sized blocks of
  the head's region read in place (``LayerStep.attend_blocks``: one pool
  attention call per layer, no gather copy; the Pallas kernel reads pages of a
  power of two >= 16 rows, the paper's 16 included, others take the plain-JAX
  reference). No memory saving (achieved rho 1).
- offloaded (``offload=True``): the sparse layers' prompt K/V lives in the host
  store; the prompt part of each head's region holds k pages and the partial
  last page (what a step attends). A step attends the pages the previous
  step's query chose, recalled by the host between steps (only the pages that
  changed), and returns its own selection for the next recall: FreeKV's
  speculative retrieval (``policies/speculative.py``), with Quest's selection
  and budget. Device bytes, summaries counted (one page's kmin + kmax = one
  token's K + V), are at most rho of the prompt's full KV:
  ``pages.pages_for_budget``.

Our departures: selection is per KV head (group max of the G query heads'
bounds, FreeKV's "maxS" Quest baseline) rather than per query head, so one
gather serves the whole group (per-head selection moves G times the rows; not
measured against it). Generated tokens are never paged: the tail is attended
in full beside the pages, as by every policy here, where Quest's new tokens
join the last page and compete for the budget (docs/policies.md, "The budget
and the row pool", has what it costs).
Offloaded, step i attends the pages chosen by q_{i-1}, not q_i: fetching q_i's
pages would be a host round trip inside the jitted step, one per layer, which a
GPU serialises; the in-device mode (same selection, current query) is the
reference for what the lag costs (RESULTS ``fidelity-freekv-correction``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.model import transformer as M
from hetero_jax.model.cache import KVCache, LayerPrefill, row_nbytes, tail_kv_bytes
from hetero_jax.model.config import ModelConfig
from hetero_jax.model.host_store import attend_chunk_over_host_prompt
from hetero_jax.model.sharding import to_host
from hetero_jax.policies.base import BudgetError, Policy, PolicyError, bool_param, int_param, smallest_rho, tokens_for
from hetero_jax.policies.protocol import DecodeState, PrefillPlan
from hetero_jax.policies.pages import (fit_pages, page_bucket, page_shapes, page_summaries, pages_for_budget,
                                      smallest_page_rho)
from hetero_jax.policies.speculative import PageRecallPrefill, PageSlots, attend_slots, page_slots, select_pages


@dataclasses.dataclass(frozen=True)
class Quest(Policy):
    """Quest; ``offload=True`` keeps the sparse layers' prompt in host memory (see module docstring)."""

    budget: float = 0.3
    page_size: int = int_param(16, 1)
    full_layers: int = int_param(2, 0)
    offload: bool = bool_param(False)

    name: ClassVar[str] = "quest"
    summary: ClassVar[str] = ("query-aware pages at every decode step (min/max key bounds, 16-token pages); "
                              "offload=True: prompt KV on the host, the previous step's pages recalled between steps")

    def sparse_layers(self, cfg: ModelConfig) -> list[int]:
        return list(range(min(self.full_layers, cfg.num_layers), cfg.num_layers))

    def smallest_budget(self, model, prompt_len: int, at_least: float = 0.0) -> float:
        """In device, every budget runs (one page at least): the smallest is the one whose pages hold exactly
        one page beside the partial page; offloaded, the budget check's (``Policy.smallest_budget``)."""
        P, r = divmod(prompt_len, self.page_size)
        if self.offload or P == 0:
            return super().smallest_budget(model, prompt_len, at_least)
        return max(smallest_rho(self.page_size + r, prompt_len), round(at_least, 4))

    def plan_pages(self, cfg: ModelConfig, prompt_len: int) -> tuple[int, int, int]:
        """(full pages P, partial-page tokens r, pages selected per step k) of one prompt; BudgetError when
        the budget cannot hold one page (offloaded: naming the smallest rho)."""
        L, ps = prompt_len, self.page_size
        if not self.sparse_layers(cfg):
            raise PolicyError(f"Quest: full_layers={self.full_layers} leaves no layer of the model's "
                              f"{cfg.num_layers} to select pages in; it must be below num_layers (for full KV "
                              "everywhere use the full policy)")
        P, r = L // ps, L % ps
        if not self.offload or P == 0:  # a prompt shorter than one page has no page to select: all of it is kept
            return P, r, min(P, max(1, (tokens_for(self.budget, L) - r) // ps))
        n_full = cfg.num_layers - len(self.sparse_layers(cfg))
        kw = dict(fixed_tokens=r, summary_pages=page_bucket(P))  # as allocated
        k = pages_for_budget(self.budget, L, cfg.num_layers, n_full, ps, **kw)
        if k < 1:
            rho = smallest_page_rho(L, cfg.num_layers, n_full, ps, **kw)
            if rho > 1.0:
                raise BudgetError(
                    f"Quest(offload=True): no budget fits a {L}-token prompt with {ps}-token pages: one page, the "
                    f"{P} page summaries and the {r}-token partial page per head take more than the prompt itself "
                    f"(rho={rho:g}); use a smaller page_size, offload=False, or a longer prompt")
            raise BudgetError(
                f"Quest(offload=True): budget rho={self.budget:g} cannot hold one {ps}-token page per head of a "
                f"{L}-token prompt ({n_full} full layers, the page summaries and the partial page come first); "
                f"the smallest budget that works for this prompt is rho={rho:g}")
        return P, r, min(P, k)

    def make_prefill(self, cfg, prompt_lens, compile_fn=None):
        return QuestPrefill(self, cfg, prompt_lens, compile_fn)

    def attend(self, li, q, step):
        """Layers below ``full_layers``: every row. Others: the selected pages + partial page + tail (offloaded:
        the pages the previous step chose, ``speculative.attend_slots``). Extra: the selected pages [B, H, k]
        (offloaded where the step recalls its own pages: the pages it moved [B]; None in full layers)."""
        st = step.layer.state
        if st is None:
            return step.attend(q)[0], step, None
        if self.offload:
            return attend_slots(q, step, "max")
        pages, valid = select_pages(q, st, "max", local=step.local)
        block_rows, lengths = _page_blocks(pages, valid, st.n_pages, st.prompt_lens, step.tail_lens, self.page_size,
                                           step.tail_capacity)
        out = step.attend_blocks(q, block_rows, lengths, self.page_size)
        return out, step, pages

    def attend_chunk(self, li, q, step):
        """A session's turn attends the whole prompt, as Quest's prefill does (dense); offloaded, a sparse
        layer reads its prompt from the host store for the turn."""
        st = step.layer.state
        if not self.offload or st is None:
            return step.attend_chunk(q)
        n_slots = st.kmin.shape[2] * self.page_size + self.page_size  # >= the longest prompt
        return attend_chunk_over_host_prompt(li, q, step, st.store, st.prompt_lens, n_slots)


def _page_blocks(pages, valid, n_pages, prompt_lens, tail_lens, ps: int, tail_capacity: int):
    """What a head attends, as page-sized blocks of its region (row j = position j, the tail right after the
    prompt): its valid selected pages, then the rows from its last full page's end on (the partial page and
    the tail), which are consecutive. pages, valid [B, H, k] (valid a prefix, ``top_pages``); n_pages,
    prompt_lens, tail_lens [B]. Returns (block_rows [B, H, k + n_rest] int32, the first region row of each
    block; lengths [B, H] int32, the rows visible), n_rest = ceil((ps + tail_capacity) / ps) blocks covering
    the partial page (< ps rows) and the tail."""
    B, H, k = pages.shape
    n_rest = -(-(ps + tail_capacity) // ps)
    n_valid = valid.sum(axis=-1, dtype=jnp.int32)[..., None]  # [B, H, 1]
    i = jnp.arange(k + n_rest, dtype=jnp.int32)
    chosen = jnp.take(pages, jnp.minimum(i, k - 1), axis=-1) * ps  # [B, H, k + n_rest]
    rest = (n_pages * ps)[:, None, None] + (i - n_valid) * ps
    block_rows = jnp.where(i < n_valid, chosen, rest)
    lengths = n_valid[..., 0] * ps + (prompt_lens - n_pages * ps + tail_lens)[:, None]
    return block_rows.astype(jnp.int32), lengths.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("page_size", "n_pages", "n_select"))
def _summaries(k_buf, lens, k_sel, page_size: int, n_pages: int, n_select: int) -> PageSlots:
    """An in-device sparse layer's decode state: the page summaries of k_buf [B, H, T, D] (lens, k_sel [B] int32),
    ``n_pages`` of them per head (``pages.page_bucket``), and no host store (a step's selection is its extra
    output only: kept in the state too, it would be one output twice and XLA would copy it, a kernel per layer
    and step)."""
    kmin, kmax, counts = page_summaries(k_buf, lens, page_size)
    kmin, kmax, n_pages = fit_pages(kmin, n_pages), fit_pages(kmax, n_pages), counts
    zero = jnp.zeros_like(lens)
    return page_slots(kmin, kmax, n_pages, k_sel, lens, zero, jnp.int32(-1), n_select, page_size)


class QuestPrefill(PrefillPlan):
    """Full layers keep their prompt; sparse layers keep it too with their page summaries (in-device), or put it
    in the host store and keep k pages + the partial page (offloaded, ``speculative.PageRecallPrefill``)."""

    def __init__(self, policy: Quest, cfg: ModelConfig, prompt_lens, compile_fn=None):
        self.policy, self.cfg = policy, cfg
        self.lens = np.asarray(prompt_lens, np.int64)
        self.compile_fn = compile_fn or (lambda f, *a, **st: functools.partial(f, **st))
        plans = np.array([policy.plan_pages(cfg, int(L)) for L in self.lens])  # validates every prompt first
        self.n_pages, self.partial, self.k_sel = plans[:, 0], plans[:, 1], plans[:, 2]
        self.sparse = set(policy.sparse_layers(cfg))
        self.pages = (PageRecallPrefill(cfg, policy.page_size, "max", self.lens, np.zeros_like(self.lens),
                                        self.partial, self.n_pages, self.k_sel, compile_fn)
                      if policy.offload else None)

    def attended(self) -> np.ndarray:
        """[B] prompt rows a head of a sparse layer attends per step: k pages + the partial page."""
        return np.minimum(self.k_sel, self.n_pages) * self.policy.page_size + self.partial

    def prompt_counts(self) -> np.ndarray:
        """Every head its prompt; offloaded, a sparse layer's heads the rows they attend."""
        counts = np.broadcast_to(self.lens[None, :, None], (self.cfg.num_layers, len(self.lens),
                                                            self.cfg.num_kv_heads)).copy()
        if self.policy.offload:
            for li in self.sparse:
                counts[li] = self.attended()[:, None]
        return counts

    def build_layer(self, li, layer, x_in, k_buf, v_buf, lens) -> LayerPrefill:
        t_max = int(self.lens.max())
        if li not in self.sparse:
            return M.full_rows(k_buf, v_buf, lens, t_max)
        if self.policy.offload:
            return self.pages.build_layer(li, layer, x_in, k_buf, v_buf, lens)
        args = (k_buf[:, :, :t_max], lens, jnp.asarray(self.k_sel, jnp.int32))  # no summaries of the chunk padding
        n_pages, n_select = page_shapes(self.n_pages, self.k_sel)
        state = self.compile_fn(_summaries, *args, page_size=self.policy.page_size, n_pages=n_pages,
                                n_select=n_select)(*args)
        return M.full_rows(k_buf, v_buf, lens, t_max).replace(state=state)

    def finish(self, cache: KVCache):
        n_sparse, n = len(self.sparse), self.cfg.num_layers
        attended = ((n - n_sparse) * self.lens + n_sparse * self.attended()) / (n * self.lens)
        if self.pages is not None:
            return self.pages.finish(cache, attended)
        return cache, QuestDecode(self.policy, self.cfg, self.attended(), attended, self.k_sel, self.n_pages)


class QuestDecode(DecodeState):
    """In-device Quest's decode counters; the selection itself runs inside the step (``Quest.attend``), over the
    prompt rows the pool already holds (no hook rewrites them)."""

    writes_prompt_rows = False

    def __init__(self, policy: Quest, cfg: ModelConfig, rows, attended, k_sel, n_pages):
        """rows: [B] prompt rows a sparse head attends per step; attended: [B] the prompt fraction a step attends."""
        self.policy, self.cfg = policy, cfg
        self.rows, self.attended, self.k_sel, self.n_pages = rows, attended, k_sel, n_pages
        self.steps = 0

    def fresh(self) -> "QuestDecode":
        return QuestDecode(self.policy, self.cfg, self.rows, self.attended, self.k_sel, self.n_pages)

    def after_step(self, step, extras, cache) -> None:
        self.steps += 1

    def kv_bytes_read(self, cache, steps: int) -> int:
        """Full layers' prompt rows, each sparse layer's attended rows, the state records (summaries, ...) and
        the rest of the pool (the tails, ``cache.tail_kv_bytes``)."""
        sparse = self.policy.sparse_layers(self.cfg)
        rows = int(self.rows.sum()) * self.cfg.num_kv_heads * len(sparse)
        full = sum(int(to_host(lc.lengths).astype(np.int64).sum()) for li, lc in enumerate(cache.layers)
                   if li not in sparse) * row_nbytes(cache)
        return int(full + rows * row_nbytes(cache) + tail_kv_bytes(cache) + self.index_bytes(cache))

    def stats(self) -> dict:
        n_sparse = len(self.policy.sparse_layers(self.cfg))
        return {
            "steps": self.steps,
            "pages_per_step": int(np.minimum(self.k_sel, self.n_pages).sum()) * n_sparse * self.cfg.num_kv_heads,
            "attended_fraction": float(np.mean(self.attended)),
        }

    def summary(self) -> str:
        s = self.stats()
        return f"attended {s['attended_fraction']:.0%} of the prompt, {s['pages_per_step']} pages/step"
