"""FreeKV (Liu et al., 2025): speculative page retrieval with fine-grained correction.

Every compressed layer (all but the first ``skip_layers``, App. A) keeps its
whole prompt K/V in the pinned-host store and, on the device, as the prompt
part of each KV head's region of the row pool, ``sinks`` first tokens, k
selected pages of ``page_size`` tokens and the prompt's last tokens (the
window): ``[sinks | page slots | window]``, a valid prefix that
``LayerStep.attend`` attends as it is, with the tail. Its state record
(``FreeKVState``) holds the page summaries (per-channel min/max key, §3.2), the
page id held by each page slot (``resident``) and the previous step's query
(``q_prev``): the §4.1 data placement. The skipped layers keep their prompt.
Pages cover ``[S, S + P*p)``, P being the full pages left before the window,
so the window holds W to W + p - 1 tokens.

Selection Sel(q) (§3.2, App. B.2 "MeanS"): per query head, the softmax over the
pages of the Quest bound sum_d max(q_d kmin_d, q_d kmax_d); the group mean of
those; the top k per KV head. One selection per KV head keeps the group
consistent (§2.1).

Decode, step i (compressed layers):
- speculative retrieval (§3.2): the page slots hold Sel(q_{i-1}); the host
  recalled it between steps i-1 and i, moving only the pages that were not
  resident into the page slots of the pool (``FreeKVDecode.before_step``:
  ``write_host_rows``, by each head's offset);
- fine-grained correction (§3.3): a KV head whose group-mean cosine
  cos(q_i, q_{i-1}) is below ``tau`` (App. B.3) fetches Sel(q_i) inside the
  step, before its attention, and writes them into its page slots of the pool
  (``FreeKV.attend``, ``pages.write_region_rows``); nothing is fetched when no
  head is corrected. ``tau > 1`` corrects every head (no speculation), ``tau < -1``
  none.
After prefill the page slots hold Sel(q_last) of the prompt's last query, so
step 0 is speculative too (q_prev = q_last), where the authors' system code
blocks on a fresh selection at the first step.

Budget: the project's B1 rule with the skipped layers as full heads,
B_c = (rho * NL - n_skip) * L / (NL - n_skip) tokens per compressed head; the
sinks, the window and the summaries come first (``pages.pages_for_budget``), at
least one page must fit. Sinks and window default to B_c / 16 rounded to a
multiple of 4, at least 4: the paper's S = W = 128 at B = 2048. q_prev (G/2
token rows per head) and the page ids are counted as device bytes but not
budgeted.

Departures: tokens added after prefill (the tail) are attended in full, where
FreeKV pages its generated tokens too; the in-step fetch returns every head's
selected pages (a static callback shape); only the corrected heads' rows are
written.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from hetero_jax.model import transformer as M
from hetero_jax.model.cache import KVCache, LayerPrefill, RowBlock
from hetero_jax.model.config import ModelConfig
from hetero_jax.model.host_store import (HostKVStore, attend_chunk_over_host_prompt, host_gather,
                                         write_host_rows)
from hetero_jax.model.sharding import to_host
from hetero_jax.model.spec import axes_field
from hetero_jax.policies.base import BudgetError, Policy, PolicyError, int_param, real_param
from hetero_jax.policies.protocol import DecodeState, PrefillPlan
from hetero_jax.policies.pages import (group_page_scores, page_summaries, page_token_index, pages_for_budget,
                                       query_cosine, smallest_page_rho, top_pages, write_region_rows)


@struct.dataclass
class FreeKVState:
    """A compressed layer's decode state (its K/V rows are in the pool: [sinks | page slots | window])."""

    kmin: jax.Array = axes_field("batch", "kv_heads", "pages", "head_dim")  # [B, H, P, D] per-channel min key
    kmax: jax.Array = axes_field("batch", "kv_heads", "pages", "head_dim")  # [B, H, P, D] per-channel max key
    n_pages: jax.Array = axes_field("batch")  # [B] int32 selectable pages of each prompt
    sinks: jax.Array = axes_field("batch")  # [B] int32 sink rows (the page slots start there)
    k_sel: jax.Array = axes_field("batch")  # [B] int32 page slots of each sequence
    resident: jax.Array = axes_field("batch", "kv_heads", "slots")  # [B, H, k] int32 page id in each page slot
    q_prev: jax.Array = axes_field("batch", "kv_heads", "group", "head_dim")  # [B, H, G, D] previous query
    prompt_lens: jax.Array = axes_field("batch")  # [B] int32
    store: jax.Array = axes_field()  # int32 handle of the host store holding the prompt (``host_gather``)


@dataclasses.dataclass(frozen=True)
class FreeKV(Policy):
    """FreeKV; ``sinks``/``window`` None = B_c / 16 (see module docstring)."""

    budget: float = 0.3
    page_size: int = int_param(32, 1)
    sinks: int | None = int_param(None, 0, " or None (B_c / 16)", optional=True)
    window: int | None = int_param(None, 0, " or None (B_c / 16)", optional=True)
    skip_layers: int = int_param(1, 0)
    # any finite value: a cosine lies in [-1, 1], so tau > 1 always corrects and tau < -1 never does
    tau: float = real_param(0.8, -math.inf)

    name: ClassVar[str] = "freekv"
    summary: ClassVar[str] = ("speculative page retrieval: prompt KV on the host, the pages chosen with the "
                              "previous query recalled between steps, corrected in-step where the query moved")

    # --------------------------------------------------------------- budgets
    def compressed_layers(self, cfg: ModelConfig) -> list[int]:
        return list(range(min(self.skip_layers, cfg.num_layers), cfg.num_layers))

    def _b_c(self, cfg: ModelConfig, prompt_len: int, rho: float) -> float:
        """Per-head budget of a compressed layer (B1 rule, the skipped layers as full heads)."""
        n_skip = cfg.num_layers - len(self.compressed_layers(cfg))
        return (rho * cfg.num_layers - n_skip) * prompt_len / (cfg.num_layers - n_skip)

    def sinks_window(self, cfg: ModelConfig, prompt_len: int, rho: float | None = None) -> tuple[int, int]:
        """(S, W) for one prompt: the options, or B_c / 16 rounded to a multiple of 4 (>= 4) where None."""
        auto = max(4, 4 * int(math.floor(self._b_c(cfg, prompt_len, self.budget if rho is None else rho) / 64
                                         + 0.5)))
        return (auto if self.sinks is None else self.sinks), (auto if self.window is None else self.window)

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
        k = pages_for_budget(self.budget, L, cfg.num_layers, n_skip, ps, fixed_tokens=S + w, summary_pages=P)
        if k < 1:
            rho = self._smallest_rho(cfg, L)
            hint = (f"the smallest budget that works for this prompt is rho={rho:g}" if rho <= 1.0 else
                    "no budget up to rho=1 does; use a smaller page_size, sinks or window")
            raise BudgetError(
                f"FreeKV: budget rho={self.budget:g} cannot hold one {ps}-token page per head of a {L}-token "
                f"prompt ({n_skip} uncompressed layers, then {S} sinks, a {w}-token window and {P} page "
                f"summaries per compressed head come first); {hint}")
        return S, w, P, min(P, k)

    def _smallest_rho(self, cfg: ModelConfig, prompt_len: int) -> float:
        """The smallest rho >= budget with one page; default sinks/window grow with rho, so iterate until the
        (S, W) the answer is computed with are the answer's own."""
        n_skip = cfg.num_layers - len(self.compressed_layers(cfg))
        rho = self.budget
        for _ in range(64):
            S, w, P = self._layout(cfg, prompt_len, rho)
            r = smallest_page_rho(prompt_len, cfg.num_layers, n_skip, self.page_size, fixed_tokens=S + w,
                                  summary_pages=P)
            if self._layout(cfg, prompt_len, r) == (S, w, P) or r > 1.0:
                return r
            rho = max(r, round(rho + 1e-4, 4))
        return rho

    def check_budget(self, prompt_len: int) -> int:
        return prompt_len  # checked per model in make_prefill (the skipped layers count)

    def make_prefill(self, cfg, prompt_lens, compile_fn=None):
        return FreeKVPrefill(self, cfg, prompt_lens, compile_fn)

    # ----------------------------------------------------------------- decode
    def attend(self, li, q, step):
        """Skipped layers: every row. Compressed layers: correct the heads whose query moved (§3.3), then
        attend sinks + page slots + window + tail. Extra: (Sel(q) [B, H, k], its validity, corrected [B, H]),
        which the host recalls for the next step (§3.2); None in skipped layers."""
        st = step.layer.state
        if st is None:
            return step.attend(q)[0], step, None
        ps = self.page_size
        corr = query_cosine(q, st.q_prev) < self.tau  # [B, H]
        scores = group_page_scores(q, st.kmin, st.kmax, st.n_pages, "mean_softmax")
        sel, valid = top_pages(scores, st.resident.shape[-1], st.k_sel)  # [B, H, k]

        def correct(pool):
            # The callback's shape is static, so it returns every head's selected pages (B*H*k*p rows) even
            # when only some heads are corrected; only the corrected heads' rows are written, into their page
            # slots (region rows [S, S + k_sel p)). A GPU version would copy just the corrected heads' pages
            # that are not resident yet (FreeKVDecode counts those as pages_corrected).
            idx = page_token_index(sel, ps, start=st.sinks)  # [B, H, k*p]
            k_rows, v_rows = host_gather(st.store, li, idx, pool.k)
            j = jnp.arange(idx.shape[-1], dtype=jnp.int32)
            in_pages = j[None, :] < (st.k_sel * ps)[:, None]  # [B, k*p] this sequence's page slots
            write = corr[:, :, None] & in_pages[:, None, :]  # [B, H, k*p]
            dst = jnp.where(write, st.sinks[:, None, None] + j, -1)
            return write_region_rows(pool, step.layer.offsets, dst, k_rows, v_rows, idx, step.mesh)

        pool = jax.lax.cond(corr.any(), correct, lambda p: p, step.pool)
        state = st.replace(resident=jnp.where(corr[..., None], sel, st.resident), q_prev=q.astype(st.q_prev.dtype))
        step = step.replace(pool=pool, layer=step.layer.replace(state=state))
        return step.attend(q)[0], step, (sel, valid, corr)

    def attend_chunk(self, li, q, step):
        """A session's turn attends the whole prompt, as prefill did (dense): a compressed layer reads it from
        the host store; ``FreeKVDecode.after_extend`` then re-selects from the turn's last query."""
        st = step.layer.state
        if st is None:
            return step.attend_chunk(q)
        n_slots = st.kmin.shape[2] * self.page_size + step.layer.capacity  # >= S + P*p + w
        return attend_chunk_over_host_prompt(li, q, step, st.store, st.prompt_lens, n_slots)


@functools.partial(jax.jit, static_argnames=("n_select",))
def _select(q, kmin, kmax, n_pages, k_sel, n_select: int):
    """Sel(q): the MeanS top pages [B, H, n_select] of one query per KV head (q [B, H, G, D])."""
    return top_pages(group_page_scores(q, kmin, kmax, n_pages, "mean_softmax"), n_select, k_sel)[0]


def _slot_index(pages, sinks, k_sel, win_start, prompt_lens, ps: int, cap: int):
    """Token position of every prompt row of a head, per sequence [sinks | k_sel page slots | window]; rows past a
    sequence's length point at token 0 (finite, masked by the lengths). pages [B, H, k]; the rest [B].
    Returns (idx [B, H, cap], positions (-1 past the length), lengths [B] int32)."""
    B, H, n = pages.shape
    s = jnp.arange(cap, dtype=jnp.int32)[None, None, :]
    S, kp = sinks[:, None, None], (k_sel * ps)[:, None, None]
    rel = s - S
    j = jnp.clip(rel // ps, 0, n - 1)
    page_tok = S + jnp.take_along_axis(pages, jnp.broadcast_to(j, (B, H, cap)), axis=-1) * ps + rel % ps
    win_tok = win_start[:, None, None] + rel - kp
    tok = jnp.where(s < S, s, jnp.where(rel < kp, page_tok, win_tok))
    lengths = (sinks + k_sel * ps + prompt_lens - win_start).astype(jnp.int32)
    ok = s < lengths[:, None, None]
    return jnp.where(ok, tok, 0).astype(jnp.int32), jnp.where(ok, tok, -1).astype(jnp.int32), lengths


@functools.partial(jax.jit, static_argnames=("cfg", "page_size", "n_pages", "n_select", "cap"))
def _prefill_layer(layer, x_in, k_buf, v_buf, lens, sinks, win_start, k_sel, cfg, page_size: int, n_pages: int,
                   n_select: int, cap: int):
    """One compressed layer: summaries of the pages [S, win_start), Sel(q_last) of the last prompt query, and
    each head's rows [sinks | selected pages | window]. Returns (rows, kmin, kmax, n_pages, pages, q_last)."""
    kmin, kmax, counts = page_summaries(k_buf, win_start, page_size, start=sinks)
    kmin, kmax = kmin[:, :, :n_pages], kmax[:, :, :n_pages]  # the longest sequence's pages
    q_last = M.prompt_queries(layer, x_in, (lens - 1)[:, None], cfg)[:, :, 0]  # [B, H, G, D]
    scores = group_page_scores(q_last, kmin, kmax, counts, "mean_softmax")
    pages, _ = top_pages(scores, n_select, k_sel)
    idx, pos, lengths = _slot_index(pages, sinks, k_sel, win_start, lens, page_size, cap)
    take = lambda a: jnp.take_along_axis(a, idx[..., None], axis=2)  # noqa: E731
    rows = RowBlock(k=take(k_buf), v=take(v_buf), positions=pos,
                    lengths=jnp.broadcast_to(lengths[:, None], pos.shape[:2]))
    return rows, kmin, kmax, counts, pages, q_last


class FreeKVPrefill(PrefillPlan):
    """Skipped layers keep their prompt; compressed layers put it in the host store and keep
    sinks + Sel(q_last) + window in the pool, the summaries and q_last in their state record."""

    def __init__(self, policy: FreeKV, cfg: ModelConfig, prompt_lens, compile_fn=None):
        self.policy, self.cfg = policy, cfg
        self.lens = np.asarray(prompt_lens, np.int64)
        self.compile_fn = compile_fn or (lambda f, *a, **st: functools.partial(f, **st))
        plans = np.array([policy.plan_pages(cfg, int(L)) for L in self.lens])  # validates every prompt first
        self.sinks, self.win, self.n_pages, self.k_sel = (plans[:, i] for i in range(4))
        self.compressed = set(policy.compressed_layers(cfg))
        self.store = HostKVStore(cfg.num_layers)
        self.resident: dict[int, jax.Array] = {}
        self.itemsize = 0

    def prompt_counts(self) -> np.ndarray:
        """Skipped layers: the prompt; compressed layers: sinks + k pages + window, every head."""
        kept = self.sinks + self.k_sel * self.policy.page_size + self.win  # [B]
        return np.stack([np.broadcast_to((kept if li in self.compressed else self.lens)[:, None],
                                         (len(self.lens), self.cfg.num_kv_heads))
                         for li in range(self.cfg.num_layers)]).astype(np.int64)

    def build_layer(self, li, layer, x_in, k_buf, v_buf, lens) -> LayerPrefill:
        t_max = int(self.lens.max())
        if li not in self.compressed:
            return M.full_rows(k_buf, v_buf, lens, t_max)
        ps = self.policy.page_size
        self.store.put(li, k_buf[:, :, :t_max], v_buf[:, :, :t_max])
        self.itemsize = k_buf.dtype.itemsize
        # fresh arrays per layer: the decode step donates every cache leaf separately
        arr = lambda a: jnp.asarray(np.asarray(a, np.int32))  # noqa: E731
        args = (layer, x_in, k_buf, v_buf, lens, arr(self.sinks), arr(self.lens - self.win), arr(self.k_sel))
        cap = int((self.sinks + self.k_sel * ps + self.win).max())
        rows, kmin, kmax, n_pages, pages, q_last = self.compile_fn(
            _prefill_layer, *args, cfg=self.cfg, page_size=ps, n_pages=int(self.n_pages.max()),
            n_select=int(self.k_sel.max()), cap=cap)(*args)
        state = FreeKVState(kmin=kmin, kmax=kmax, n_pages=n_pages, sinks=arr(self.sinks), k_sel=arr(self.k_sel),
                            resident=pages, q_prev=q_last, prompt_lens=arr(self.lens),
                            store=self.store.handle_array())
        self.resident[li] = pages
        return LayerPrefill(blocks=(rows.replace(heads=tuple(range(k_buf.shape[1]))),), state=state)

    def finish(self, cache: KVCache) -> tuple[KVCache, "FreeKVDecode"]:
        # copies (np.array), never views of device buffers the decode step will donate
        resident = {li: np.array(p, np.int32, copy=True) for li, p in self.resident.items()}
        self.store.materialize()  # the in-step callbacks read numpy views only (waits for the copies)
        offsets = [to_host(l.offsets).astype(np.int64) for l in cache.layers]
        state = FreeKVDecode(self.policy, self.cfg, self.lens, self.sinks, self.n_pages, self.k_sel, self.store,
                             resident, self.itemsize, offsets, self.compile_fn)
        return cache, state


class FreeKVDecode(DecodeState):
    """FreeKV between steps: reads step i's selections and corrections (copied to the host asynchronously)
    before step i + 1 and recalls the pages that changed (§3.2); keeps a host mirror of each layer's
    ``resident`` (the page id in every page slot), each head's first pool row (``offsets``) and the counters."""

    def __init__(self, policy: FreeKV, cfg: ModelConfig, lens, sinks, n_pages, k_sel, store: HostKVStore,
                 resident: dict[int, np.ndarray], itemsize: int, offsets: list[np.ndarray], compile_fn=None):
        self.policy, self.cfg, self.store, self.itemsize = policy, cfg, store, itemsize
        self.lens, self.sinks, self.n_pages, self.k_sel = lens, sinks, n_pages, k_sel
        self.offsets = offsets  # per layer [B, H] each head's first pool row (``pool_moved`` reads new ones)
        self.initial = resident  # as prefill left it (fresh() starts from it; never mutated)
        self.resident = dict(resident)  # host mirror; replaced, never written in place
        self.compile_fn = compile_fn
        self.pending = None  # (step, device extras) of the last dispatched step
        self.ready = None  # step, {layer: Sel(q) numpy}: read and counted, recall not yet applied
        self.steps = 0
        self.head_steps = 0  # (layer, sequence, KV head) checks of the cosine rule
        self.corrections = 0
        self.corrections_by_layer = {li: 0 for li in resident}
        self.pages_corrected = 0  # corrected heads' pages that were not resident (what a GPU would move)
        self.bytes_fetched_in_step = 0  # what the in-step callback moved (every head's pages, see attend)
        self.pages_recalled = 0  # speculative recalls (pages that changed between steps)
        self.bytes_recalled = 0
        self.recall_failures = 0
        self.turn_reselections = 0  # session turns after which the pages were re-selected

    def fresh(self) -> "FreeKVDecode":
        return FreeKVDecode(self.policy, self.cfg, self.lens, self.sinks, self.n_pages, self.k_sel, self.store,
                            self.initial, self.itemsize, self.offsets, self.compile_fn)

    def pool_moved(self, cache) -> None:
        """The pool was repacked (a session outgrew its tail rows): read the heads' new offsets."""
        self.offsets = [to_host(l.offsets).astype(np.int64) for l in cache.layers]

    def after_step(self, step, extras, cache) -> None:
        self.steps += 1
        out = {li: e for li, e in enumerate(extras) if e is not None}
        for e in out.values():
            for a in e:
                a.copy_to_host_async()  # read before the next step, never waited on now
        self.pending = (step, out)

    def _collect(self) -> None:
        """Read the pending step's extras: count its corrections and apply them to the host mirror (the
        step already wrote them on the device)."""
        if self.pending is None:
            return
        step, out = self.pending
        self.pending = None
        ps, D = self.policy.page_size, self.cfg.head_dim
        sels = {}
        for li, (sel, valid, corr) in out.items():
            sel, corr = np.array(sel, np.int32), np.array(corr, bool)
            self.head_steps += corr.size
            n = int(corr.sum())
            self.corrections += n
            self.corrections_by_layer[li] += n
            if n:
                mirror = self.resident[li]
                new = _not_resident(sel, mirror, self.k_sel) & corr[..., None]
                self.pages_corrected += int(new.sum())
                self.bytes_fetched_in_step += sel.size * ps * 2 * D * self.itemsize
                self.resident[li] = np.where(corr[..., None], sel, mirror)
            sels[li] = sel
        self.ready = (step, sels)

    wants_turn_queries = True

    def after_extend(self, turn_queries, cache):
        """A session's turn re-selects as prefill did: each compressed layer's page slots take Sel(q) of the
        turn's last query (recalled now, before the answer's first step) and q_prev restarts from it. The
        last answer step's selection is superseded. All or nothing: a failed transfer keeps the cache."""
        self._collect()  # the last answer step's corrections are on the device: bring the mirror up to date
        layers = list(cache.layers)
        sels = {}
        for li in self.resident:
            st = layers[li].state
            q = turn_queries[li][:, :, -1]  # [B, H, G, D]
            args = (q, st.kmin, st.kmax, st.n_pages, st.k_sel)
            sel = self.compile_fn(_select, *args, n_select=st.resident.shape[-1])(*args)
            sels[li] = np.array(sel, np.int32)
            q_prev = jax.device_put(q.astype(st.q_prev.dtype), st.q_prev.sharding)
            layers[li] = layers[li].replace(state=st.replace(q_prev=q_prev))
        self.ready = (None, sels)
        try:
            out = self._recall(cache.replace(layers=tuple(layers)))
        except (RuntimeError, MemoryError) as e:
            self.recall_failures += 1
            warnings.warn(f"FreeKV: the re-selection after a turn failed ({type(e).__name__}: {e}); the device "
                          "keeps its pages", RuntimeWarning, stacklevel=2)
            return cache
        finally:
            self.ready = None
        self.turn_reselections += 1
        return out

    def before_step(self, step, cache):
        self._collect()
        if self.ready is None:
            return cache
        try:
            return self._recall(cache)
        except (RuntimeError, MemoryError) as e:
            self.recall_failures += 1
            warnings.warn(f"FreeKV: the speculative recall before decode step {step} failed ({type(e).__name__}: "
                          f"{e}); the device keeps its pages and the cosine rule corrects where needed",
                          RuntimeWarning, stacklevel=2)
            return cache
        finally:
            self.ready = None

    def _recall(self, cache: KVCache) -> KVCache:
        """Per head, the pages of Sel(q_i) that are not resident replace, slot by slot, the resident pages
        no longer selected. Only those rows cross to the device (every transfer started before any write)
        and are scattered in place into the page slots of each head's region of the pool (pool row = its
        offset + slot, its shard = head // (H / S)); the pool is never read back."""
        _, sels = self.ready
        ps = self.policy.page_size
        layers = list(cache.layers)
        n_local = self.cfg.num_kv_heads // cache.pool.num_shards
        requests, mirrors, moved = [], {}, 0
        for li, sel in sels.items():
            mirror = self.resident[li]
            missing = _not_resident(sel, mirror, self.k_sel)  # [B, H, k] selected, not resident
            free = _not_resident(mirror, sel, self.k_sel)  # [B, H, k] resident, no longer selected
            mb, mh, mj = np.nonzero(missing)
            fb, fh, fj = np.nonzero(free)
            # each head has as many of one as of the other, and nonzero lists both row-major: zip pairs them
            assert np.array_equal(mb, fb) and np.array_equal(mh, fh)
            if not len(mb):
                continue
            pages = sel[mb, mh, mj]
            new = mirror.copy()
            new[fb, fh, fj] = pages
            mirrors[li] = new
            offs = np.arange(ps)[None, :]
            tok = (self.sinks[mb, None] + pages[:, None] * ps + offs).reshape(-1)
            slots = (self.sinks[mb, None] + fj[:, None] * ps + offs).reshape(-1)  # region rows of the page slots
            b_idx, h_idx = np.repeat(mb, ps), np.repeat(mh, ps)
            requests.append((li, b_idx, h_idx, tok, h_idx // n_local, self.offsets[li][b_idx, h_idx] + slots))
            moved += len(pages)
        if not requests:
            return cache
        # every layer's rows in one transfer set, all of it out before anything is written
        pool, _, nbytes = write_host_rows(cache.pool, self.store, requests, self.compile_fn)
        for li in mirrors:
            st = layers[li].state
            resident = jax.device_put(mirrors[li].copy(), st.resident.sharding)  # a fresh array, never mutated
            layers[li] = layers[li].replace(state=st.replace(resident=resident))
        self.resident.update(mirrors)
        self.pages_recalled += moved
        self.bytes_recalled += nbytes
        return cache.replace(pool=pool, layers=tuple(layers))

    def in_flight(self):
        return None if self.pending is None else self.pending[1]

    def host_arrays(self) -> tuple:
        return self.store.arrays()

    def stats(self) -> dict:
        self._collect()  # count the last step too (its recall, if any, waits for the next step)
        cfg = self.cfg
        n_comp = len(self.policy.compressed_layers(cfg))
        attended = self.sinks + self.k_sel * self.policy.page_size + (self.lens - self.sinks - self.n_pages
                                                                        * self.policy.page_size)
        frac = ((cfg.num_layers - n_comp) * self.lens + n_comp * attended) / (cfg.num_layers * self.lens)
        return {
            "steps": self.steps,
            "correction_rate": self.corrections / self.head_steps if self.head_steps else 0.0,
            "corrections": self.corrections,
            "corrections_by_layer": {str(li): n for li, n in self.corrections_by_layer.items()},
            "pages_corrected": self.pages_corrected,
            "bytes_fetched_in_step": self.bytes_fetched_in_step,
            "pages_recalled": self.pages_recalled,
            "bytes_recalled": self.bytes_recalled,
            "recalled_pages_per_step": self.pages_recalled / self.steps if self.steps else 0.0,
            "pages_per_step": int(self.k_sel.sum()) * n_comp * cfg.num_kv_heads,  # attended, whole batch
            "attended_fraction": float(frac.mean()),
            "recall_failures": self.recall_failures,
            "turn_reselections": self.turn_reselections,
        }

    def summary(self) -> str:
        s = self.stats()
        return (f"corrected {s['correction_rate']:.0%} of head-steps, recalled {s['pages_recalled']} pages "
                f"({s['bytes_recalled'] / 2**20:.2f} MiB), fetched in-step "
                f"{s['bytes_fetched_in_step'] / 2**20:.2f} MiB")


def _not_resident(pages: np.ndarray, held: np.ndarray, k_sel: np.ndarray) -> np.ndarray:
    """[B, H, k] True where ``pages`` (within each sequence's first k_sel slots) is not among ``held``'s."""
    ok = np.arange(pages.shape[-1])[None, None, :] < np.asarray(k_sel)[:, None, None]  # [B, 1, k]
    same = (pages[..., :, None] == held[..., None, :]) & ok[..., None, :]
    return np.broadcast_to(ok, pages.shape) & ~same.any(axis=-1)
