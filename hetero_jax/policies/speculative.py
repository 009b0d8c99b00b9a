"""Speculative page retrieval from pinned host memory, shared by FreeKV and offloaded Quest.

A compressed layer keeps its whole prompt K/V in the host store and, as the
prompt part of each KV head's region of the row pool, ``[start | k page slots |
window]``: ``start`` leading tokens (FreeKV's sinks, none for Quest), k pages of
``page_size`` tokens and the prompt's last tokens (FreeKV's window, Quest's
partial page). Decode step i attends the region with its page slots holding
Sel(q_{i-1}), the pages the previous step's query chose, and computes Sel(q_i)
(``select``). Only the pages of a selection that are not resident move, each
into the slot of a page no longer selected. Where they move from depends on the
backend (``recall_in_step``):

- a GPU, or a mesh: the step returns Sel(q_i) and, between steps, the host
  recalls the pages that changed (``PageRecallDecode.before_step`` ->
  ``host_store.write_head_rows``, the path HeteroCache's recall takes): only
  those rows cross to the device, and the jitted step never waits on the host.
- a CPU backend on one device, whose device memory is the host's: the store's
  arrays are the step's operands and each layer moves Sel(q_{i-1})'s new pages
  into its slots itself, before it attends them (``pallas_kernels.page_recall``,
  a native call that copies only those rows); Sel(q_i) stays in the layer's
  ``PageSlots.slots`` for the next step. No host work between steps, the same rows in
  the same slots as the host recall.

Selection: per KV head, the group's Quest bounds over the page summaries
(``pages.group_page_scores``, "max" for Quest, "mean_softmax" for FreeKV), the
top ``k_sel`` pages. After prefill the slots hold Sel(q_last) of the prompt's
last query; after a session turn, Sel of the turn's last query.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

import pallas_kernels

from hetero_jax.model import transformer as M
from hetero_jax.model.cache import KVCache, LayerPrefill, RowBlock, block_width, capacity_bucket, head_offsets
from hetero_jax.model.host_store import (TRANSFER_ERRORS, HostKVStore, in_step_operand, kv_rows_nbytes, sums_in_step,
                                         write_head_rows)
from hetero_jax.model.sharding import to_host
from hetero_jax.model.spec import axes_field
from hetero_jax.policies.pages import fit_pages, page_bucket, page_shapes, page_summaries
from hetero_jax.policies.protocol import DecodeState, achieved_rho


# Columns of ``PageSlots.seq``, one [B] int32 per sequence each. One array rather than six: every cache leaf is an
# operand the decode step takes, donates and returns, a few microseconds of host time each per step and layer.
SEQ_FIELDS = 6
N_PAGES, K_SEL, PROMPT_LEN, START, MOVED, STORE = range(SEQ_FIELDS)


@struct.dataclass
class PageSlots:
    """A compressed layer's decode state (its K/V rows are in the pool: [start | page slots | window], or the whole
    prompt for in-device Quest). ``slots`` where the step recalls its own pages (``recall_in_step``); elsewhere
    the page in each slot is kept on the host only (``PageRecallDecode.resident``): no step reads it there, and a
    device copy would cost a transfer per layer and recall."""

    kmin: jax.Array = axes_field("batch", "kv_heads", "pages", "head_dim")  # [B, H, P, D] per-channel min key
    kmax: jax.Array = axes_field("batch", "kv_heads", "pages", "head_dim")  # [B, H, P, D] per-channel max key
    # [B, SEQ_FIELDS] int32 per sequence: selectable pages, page slots used, prompt length, rows before the first
    # page slot, pages the steps moved into the slots since prefill (a running count), the host store's handle
    seq: jax.Array = axes_field("batch", "seq_fields")
    # [B, H, 2, k] int32 or None: [..., 0, :] the page each slot holds, [..., 1, :] Sel(q_{i-1}), the pages it
    # should hold before the step attends them
    slots: jax.Array | None = axes_field("batch", "kv_heads", "slot_pages", "page_slots", default=None)
    n_select: int = struct.field(pytree_node=False, default=1)  # page slots k per head (the longest sequence's)
    page_size: int = struct.field(pytree_node=False, default=1)

    n_pages = property(lambda self: self.seq[:, N_PAGES], doc="[B] int32 selectable pages of each prompt")
    k_sel = property(lambda self: self.seq[:, K_SEL], doc="[B] int32 page slots of each sequence")
    prompt_lens = property(lambda self: self.seq[:, PROMPT_LEN], doc="[B] int32")
    start = property(lambda self: self.seq[:, START], doc="[B] int32 rows before a region's first page slot")
    moved = property(lambda self: self.seq[:, MOVED], doc="[B] int32 pages the steps moved into the slots")
    store = property(lambda self: self.seq[0, STORE], doc="int32 handle of the host store (-1: none)")


def page_slots(kmin, kmax, n_pages, k_sel, prompt_lens, start, store, n_select: int, page_size: int) -> PageSlots:
    """Traced: a ``PageSlots`` without slots; n_pages, k_sel, prompt_lens, start [B] int32, store a scalar."""
    B = n_pages.shape[0]
    cols = [n_pages, k_sel, prompt_lens, start, jnp.zeros((B,), jnp.int32), jnp.broadcast_to(store, (B,))]
    return PageSlots(kmin=kmin, kmax=kmax, seq=jnp.stack([jnp.asarray(c, jnp.int32) for c in cols], axis=1),
                     n_select=n_select, page_size=page_size)


def recall_in_step(cache: KVCache) -> bool:
    """Whether the steps recall their own pages: on a CPU backend with the pool on one device, where the store's
    arrays are the device's memory (``host_store.sums_in_step``); elsewhere the host recalls between steps."""
    return sums_in_step() and cache.mesh is None and cache.pool.num_shards == 1


def attend_slots(q: jax.Array, step, how: str):
    """A compressed layer's ``attend``: q [B, H, G, D] over [start | page slots | window] and the tail, the slots
    holding Sel(q_{i-1}). Returns (out [B, H, G, D], step, extra): where the step recalls its own pages
    (``PageSlots.slots``) it first moves them from the store (``step.host``: its K and V) and keeps Sel(q_i) in
    the state, the extra being the pages the steps moved so far per sequence [B] int32 (a running count in the
    state: the host reads only the latest, when it reports); otherwise the extra is Sel(q_i)
    [B, H, k], for the host's recall (also for a step traced without host operands, as a GPU's step is when its
    structure is counted on a CPU, ``benchmarks/step_ops_compile.py``)."""
    st = step.layer.state
    if st.slots is None or step.host is None:
        return step.attend(q)[0], step, select(q, st, how, local=step.local)
    pool = step.pool
    store_k, store_v = (in_step_operand(a) for a in step.host)
    k, v, positions, resident, moved = pallas_kernels.page_recall(
        pool.k, pool.v, pool.positions, store_k, store_v, step.layer.offsets, st.slots[:, :, 1], st.slots[:, :, 0],
        st.start, st.k_sel, st.page_size)
    step = step.replace(pool=pool.replace(k=k, v=v, positions=positions))
    out = step.attend(q)[0]
    st = st.replace(slots=jnp.stack([resident, select(q, st, how, local=step.local)], axis=2),
                    seq=st.seq.at[:, MOVED].add(moved))
    return out, step.replace(layer=step.layer.replace(state=st)), st.moved


def select_pages(q: jax.Array, st: PageSlots, how: str, local: bool = False) -> tuple[jax.Array, jax.Array]:
    """Traced: the top ``k_sel`` pages of each KV head for q [B, H, G, D] and which slots are valid, both
    [B, H, k] (``pallas_kernels.page_select``). ``local`` (the heads on one device, ``LayerStep.local``): its
    native CPU kernel may run; otherwise (a mesh's step, prefill, a turn) the plain-JAX reference."""
    return pallas_kernels.page_select(q, st.kmin, st.kmax, st.n_pages, st.n_select, st.k_sel, how,
                                      backend=None if local else "reference")


def select(q: jax.Array, st: PageSlots, how: str, local: bool = False) -> jax.Array:
    """Traced Sel(q): the top ``k_sel`` pages [B, H, k] int32 of each KV head (:func:`select_pages`' pages)."""
    return select_pages(q, st, how, local)[0]


@functools.partial(jax.jit, static_argnames=("how",))
def _select_jit(q, st: PageSlots, how: str):
    return select(q, st, how)


@functools.partial(jax.jit, static_argnames=("how",))
def _reselect_jit(q, st: PageSlots, how: str) -> PageSlots:
    """``st`` with Sel(q) as its pending pages (where the steps recall in-step): one dispatch per layer."""
    return st.replace(slots=st.slots.at[:, :, 1].set(select(q, st, how)))


def slot_index(pages, start, k_sel, win_start, prompt_lens, ps: int, cap: int):
    """Token position of every prompt row of a head, per sequence [start | k_sel page slots | window]; rows past a
    sequence's length point at token 0 (finite, masked by the lengths). pages [B, H, k]; the rest [B].
    Returns (idx [B, H, cap], positions (-1 past the length), lengths [B] int32)."""
    B, H, n = pages.shape
    s = jnp.arange(cap, dtype=jnp.int32)[None, None, :]
    S, kp = start[:, None, None], (k_sel * ps)[:, None, None]
    rel = s - S
    j = jnp.clip(rel // ps, 0, n - 1)
    page_tok = S + jnp.take_along_axis(pages, jnp.broadcast_to(j, (B, H, cap)), axis=-1) * ps + rel % ps
    win_tok = win_start[:, None, None] + rel - kp
    tok = jnp.where(s < S, s, jnp.where(rel < kp, page_tok, win_tok))
    lengths = (start + k_sel * ps + prompt_lens - win_start).astype(jnp.int32)
    ok = s < lengths[:, None, None]
    return jnp.where(ok, tok, 0).astype(jnp.int32), jnp.where(ok, tok, -1).astype(jnp.int32), lengths


@functools.partial(jax.jit, static_argnames=("cfg", "page_size", "n_pages", "n_select", "cap", "how"))
def _prefill_layer(layer, x_in, k_buf, v_buf, lens, start, win_start, k_sel, prompt_lens, store, cfg, page_size: int,
                   n_pages: int, n_select: int, cap: int, how: str):
    """One compressed layer: summaries of the pages [start, win_start), Sel(q_last) of the last prompt query and
    each head's rows [start | selected pages | window]. Returns (rows, PageSlots, pages [B, H, k]); start,
    win_start, k_sel, prompt_lens [B] int32, store the host store's handle."""
    kmin, kmax, counts = page_summaries(k_buf, win_start, page_size, start=start)
    kmin, kmax = fit_pages(kmin, n_pages), fit_pages(kmax, n_pages)  # the longest sequence's, bucketed
    q_last = M.prompt_queries(layer, x_in, (lens - 1)[:, None], cfg)[:, :, 0]  # [B, H, G, D]
    H = k_buf.shape[1]
    st = page_slots(kmin, kmax, counts, k_sel, prompt_lens, start, store, n_select, page_size)
    pages = select(q_last, st, how)
    idx, pos, lengths = slot_index(pages, start, k_sel, win_start, lens, page_size, cap)
    take = lambda a: jnp.take_along_axis(a, idx[..., None], axis=2)  # noqa: E731
    rows = RowBlock(k=take(k_buf), v=take(v_buf), positions=pos,
                    lengths=jnp.broadcast_to(lengths[:, None], pos.shape[:2]), heads=tuple(range(H)))
    return rows, st, pages


class PageRecallPrefill:
    """The compressed layers' share of a prefill plan: put the prompt in the host store, keep [start | Sel(q_last)
    | window] in the pool and the summaries in a ``PageSlots`` record; ``finish`` hands on a ``PageRecallDecode``.

    start, window, n_pages, k_sel: [B] ints per sequence (window tokens = prompt_len - n_pages*ps - start)."""

    def __init__(self, cfg, page_size: int, how: str, lens, start, window, n_pages, k_sel, compile_fn=None):
        self.cfg, self.page_size, self.how = cfg, page_size, how
        self.lens = np.asarray(lens, np.int64)
        self.start, self.window, self.n_pages, self.k_sel = (np.asarray(a, np.int64)
                                                             for a in (start, window, n_pages, k_sel))
        self.compile_fn = compile_fn or (lambda f, *a, **st: functools.partial(f, **st))
        self.store = HostKVStore(cfg.num_layers)
        self.resident: dict[int, jax.Array] = {}
        self._ints: tuple | None = None  # _prefill_layer's [B] int32 operands, put on the device once

    def held(self) -> np.ndarray:
        """[B] prompt rows a head of a compressed layer holds and attends: start + k pages + window."""
        return self.start + self.k_sel * self.page_size + self.window

    def build_layer(self, li, layer, x_in, k_buf, v_buf, lens):
        t_max = int(self.lens.max())
        width = t_max
        if sums_in_step() and len(k_buf.sharding.device_set) == 1:
            # the steps may recall from the store in their own graph (``recall_in_step``): its rows are a static
            # shape there, bucketed as a layer's key bound is so that nearby lengths share the step (the rows
            # past a prompt are never read: a page lies before its window)
            width = block_width(t_max, k_buf.shape[2])
        self.store.put(li, k_buf[:, :, :width], v_buf[:, :, :width])
        if self._ints is None:  # read, never donated: the record's counters are a new array per layer
            self._ints = tuple(jnp.asarray(np.asarray(a, np.int32))
                               for a in (self.start, self.lens - self.window, self.k_sel, self.lens))
        args = (layer, x_in, k_buf, v_buf, lens, *self._ints, self.store.handle_array())
        n_pages, n_select = page_shapes(self.n_pages, self.k_sel)  # a step's static shapes: nearby lengths share them
        rows, state, pages = self.compile_fn(
            _prefill_layer, *args, cfg=self.cfg, page_size=self.page_size, n_pages=n_pages, n_select=n_select,
            cap=capacity_bucket(int(self.held().max())),  # the block's rows past each head's count are not written
            how=self.how)(*args)
        self.resident[li] = pages
        return LayerPrefill(blocks=(rows,), state=state)

    def finish(self, cache: KVCache, attended: np.ndarray) -> tuple[KVCache, "PageRecallDecode"]:
        """``attended``: [B] the prompt fraction a step attends, for the stats. Where the steps recall their own
        pages (``recall_in_step``), each compressed layer's state gets its ``slots``."""
        # copies (np.array), never views of device buffers the decode step will donate
        resident = {li: to_host(p).astype(np.int32, copy=True) for li, p in self.resident.items()}
        self.store.materialize()  # a session turn's chunk reads numpy views only (waits for the copies)
        in_step = recall_in_step(cache)
        if in_step:
            layers = list(cache.layers)
            for li, pages in resident.items():
                # fresh arrays per leaf: the decode step donates every cache leaf separately
                held = jnp.asarray(np.stack([pages, pages], axis=2))
                layers[li] = layers[li].replace(state=layers[li].state.replace(slots=held))
            cache = cache.replace(layers=tuple(layers))
        return cache, PageRecallDecode(self.cfg, self.page_size, self.how, self.start, self.k_sel, self.store, resident,
                                       head_offsets(cache), attended, self.compile_fn, in_step,
                                       np.array([page_bucket(int(n)) for n in self.n_pages], np.int64))


class PageRecallDecode(DecodeState):
    """Between steps: reads step i's selections (copied to the host asynchronously) before step i + 1 and
    recalls the pages that changed; keeps a host mirror of each compressed layer's ``resident`` (the page id in
    every page slot, the only copy), each head's first pool row (``offsets``) and the counters.

    ``in_step`` (``recall_in_step``): the steps recall their own pages; this only counts the pages they moved
    (their extras, read lazily), re-selects after a session turn, and ``resident`` stays as prefill left it."""

    wants_turn_queries = True

    def __init__(self, cfg, page_size: int, how: str, start, k_sel, store: HostKVStore,
                 resident: dict[int, np.ndarray], offsets: list[np.ndarray], attended: np.ndarray,
                 compile_fn=None, in_step: bool = False, summary_pages: np.ndarray | None = None):
        self.cfg, self.page_size, self.how, self.store = cfg, page_size, how, store
        # [B] pages summarised per compressed head: their kmin + kmax count in the budget as one token's K + V
        self.summary_pages = np.zeros(len(k_sel), np.int64) if summary_pages is None else summary_pages
        self.in_step = in_step
        # in_step: the latest step's running counts of the pages moved, per compressed layer ([B] int32 on the
        # device), and the total already counted (None until the first step reads the cache's own)
        self.moved: tuple = ()
        self.counted_moves: int | None = None
        self.start, self.k_sel, self.attended = start, k_sel, attended
        self.offsets = offsets  # per layer [B, H] each head's first pool row (``pool_moved`` reads new ones)
        self.initial = resident  # as prefill left it (fresh() starts from it; never mutated)
        self.resident = dict(resident)  # host mirror; replaced, never written in place
        self.compile_fn = compile_fn or (lambda f, *a, **st: functools.partial(f, **st))
        self.pending = None  # the device selections of the last dispatched step
        self.ready = None  # {layer: Sel numpy}: read, recall not yet applied
        self.steps = 0
        self.pages_recalled = 0  # pages that entered a slot (between steps and after turns)
        self.bytes_recalled = 0
        self.recall_failures = 0
        self.turn_reselections = 0  # session turns after which the pages were re-selected

    def fresh(self) -> "PageRecallDecode":
        return PageRecallDecode(self.cfg, self.page_size, self.how, self.start, self.k_sel, self.store, self.initial,
                                self.offsets, self.attended, self.compile_fn, self.in_step, self.summary_pages)

    def achieved_rho(self, cache, cfg) -> np.ndarray:
        """[B] (prompt rows kept on the device + the page summaries, a page's kmin + kmax as one token's K + V,
        as the budget counts them: ``pages.pages_for_budget``) / the prompt's full KV."""
        return achieved_rho(cache, cfg, self.summary_pages * cfg.num_kv_heads * len(self.initial))

    def pool_moved(self, cache) -> None:
        """The pool was repacked (a session outgrew its tail rows): read the heads' new offsets."""
        self.offsets = head_offsets(cache)

    def after_step(self, step, extras, cache) -> None:
        self.steps += 1
        sels = {li: e for li, e in enumerate(extras) if e is not None}
        if self.in_step:  # running counts: only the latest are kept, read when the counters are
            self.moved = tuple(sels.values())
            return
        for sel in sels.values():
            sel.copy_to_host_async()  # read before the next step, never waited on now
        self.pending = sels

    def _count(self) -> None:
        """Add the pages the steps moved themselves (``in_step``) to the counters."""
        if not self.moved:
            return
        total = sum(int(to_host(m).sum()) for m in self.moved)
        n, self.counted_moves = total - self.counted_moves, total
        self.pages_recalled += n
        self.bytes_recalled += kv_rows_nbytes(n * self.page_size, self.store.v[next(iter(self.resident))])

    def _collect(self) -> None:
        """Read the pending step's selections (they are what the next step should attend)."""
        if self.pending is not None:
            self.ready, self.pending = {li: to_host(s).astype(np.int32) for li, s in self.pending.items()}, None

    def before_step(self, step, cache):
        if self.in_step:
            if self.counted_moves is None:  # where this state starts counting (zero after prefill)
                self.counted_moves = sum(int(to_host(cache.layers[li].state.moved).sum()) for li in self.resident)
            return cache
        self._collect()
        return self._apply(cache, f"the speculative recall before decode step {step}",
                           "the device keeps its pages (a step late)")

    def after_extend(self, turn_queries, cache):
        """A session's turn re-selects as prefill did: each compressed layer's page slots take Sel(q) of the
        turn's last query, recalled now, before the answer's first step (the last answer step's selection is
        superseded). All or nothing: a failed transfer keeps the cache. Where the steps recall their own pages,
        the answer's first step moves them."""
        self.pending = None
        if self.in_step:
            layers = list(cache.layers)
            for li in self.resident:
                st, q = layers[li].state, turn_queries[li][:, :, -1]  # q [B, H, G, D]
                layers[li] = layers[li].replace(state=self.compile_fn(_reselect_jit, q, st, how=self.how)(q, st))
            self.turn_reselections += 1
            return cache.replace(layers=tuple(layers))
        sels = {}
        for li in self.resident:
            st = cache.layers[li].state
            q = turn_queries[li][:, :, -1]  # [B, H, G, D]
            sels[li] = self.compile_fn(_select_jit, q, st, how=self.how)(q, st)
        self.ready = {li: to_host(sel).astype(np.int32) for li, sel in sels.items()}
        failures = self.recall_failures
        out = self._apply(cache, "the re-selection after a turn", "the device keeps its pages")
        self.turn_reselections += self.recall_failures == failures
        return out

    def _apply(self, cache, what: str, fallback: str):
        if self.ready is None:
            return cache
        try:
            return self._recall(cache)
        except TRANSFER_ERRORS as e:
            self.recall_failures += 1
            warnings.warn(f"{what} failed ({type(e).__name__}: {e}); {fallback}", RuntimeWarning, stacklevel=3)
            return cache
        finally:
            self.ready = None

    def _recall(self, cache: KVCache) -> KVCache:
        """Per head, the pages of the new selection that are not resident replace, slot by slot, the resident
        pages no longer selected. Only those rows cross to the device (every transfer started before any write)
        and are scattered in place into the page slots of each head's region of the pool (pool row = its offset
        + start + slot * ps + i; ``write_head_rows`` finds its shard); the pool is never read back. Planned for
        every layer at once: the step's next dispatch waits on this host work."""
        ps = self.page_size
        layers = list(self.ready)
        sel = np.stack([self.ready[li] for li in layers])  # [NL, B, H, k]
        held = np.stack([self.resident[li] for li in layers])
        ml, mb, mh, mj = np.nonzero(not_resident(sel, held, self.k_sel))  # selected, not resident
        fl, fb, fh, fj = np.nonzero(not_resident(held, sel, self.k_sel))  # resident, no longer selected
        # each head has as many of one as of the other, and nonzero lists both row-major: zip pairs them
        assert np.array_equal(ml, fl) and np.array_equal(mb, fb) and np.array_equal(mh, fh)
        if not len(ml):
            return cache
        pages = sel[ml, mb, mh, mj]
        new = held.copy()
        new[fl, fb, fh, fj] = pages
        offs = np.arange(ps)[None, :]
        tok = (self.start[mb, None] + pages[:, None] * ps + offs).reshape(-1)
        slots = (self.start[mb, None] + fj[:, None] * ps + offs).reshape(-1)  # region rows of the page slots
        b_idx, h_idx = np.repeat(mb, ps), np.repeat(mh, ps)
        cuts = np.searchsorted(ml, np.arange(len(layers) + 1)) * ps  # each layer's rows (ml is sorted)
        requests = [(li, b_idx[a:z], h_idx[a:z], tok[a:z], slots[a:z])
                    for li, a, z in zip(layers, cuts[:-1], cuts[1:]) if z > a]
        # every layer's rows in one transfer set, all of it out before anything is written
        pool, _, nbytes = write_head_rows(cache.pool, self.store, self.offsets, requests, self.compile_fn)
        self.resident.update({li: new[i] for i, li in enumerate(layers)})
        self.pages_recalled += len(pages)
        self.bytes_recalled += nbytes
        return cache.replace(pool=pool)

    def in_flight(self):
        if self.in_step:
            return self.moved
        return tuple(self.pending.values()) if self.pending else ()

    def host_arrays(self) -> tuple:
        return self.store.arrays()

    def host_operands(self) -> tuple:
        """Where the steps recall their own pages: each compressed layer's store K and V (None elsewhere)."""
        if not self.in_step:
            return ()
        return tuple((self.store.k[li], self.store.v[li]) if li in self.resident else None
                     for li in range(self.cfg.num_layers))

    def recalled_bytes(self) -> int:
        if self.in_step:
            self._count()
        return self.bytes_recalled

    def stats(self) -> dict:
        if self.in_step:
            self._count()
        n_comp, H = len(self.resident), self.cfg.num_kv_heads
        return {
            "steps": self.steps,
            "pages_recalled": self.pages_recalled,
            "bytes_recalled": self.bytes_recalled,
            "recalled_pages_per_step": self.pages_recalled / self.steps if self.steps else 0.0,
            "pages_per_step": int(self.k_sel.sum()) * n_comp * H,  # attended, whole batch
            "attended_fraction": float(np.mean(self.attended)),
            "recall_failures": self.recall_failures,
            "turn_reselections": self.turn_reselections,
        }

    def summary(self) -> str:
        s = self.stats()
        return (f"attended {s['attended_fraction']:.0%} of the prompt, recalled {s['pages_recalled']} pages "
                f"({s['bytes_recalled'] / 2**20:.2f} MiB) between steps")


def not_resident(pages: np.ndarray, held: np.ndarray, k_sel: np.ndarray) -> np.ndarray:
    """[..., B, H, k] True where ``pages`` (within each sequence's first k_sel slots) is not among ``held``'s
    (the same shape: any leading axes, e.g. layers). Page ids are >= 0. By one membership test over every head
    at once (sorting, not a k x k comparison per head: k is hundreds of pages per head at long contexts)."""
    pages, held = np.asarray(pages, np.int64), np.asarray(held, np.int64)
    ok = np.arange(pages.shape[-1])[None, None, :] < np.asarray(k_sel)[:, None, None]  # [B, 1, k]
    ok = np.broadcast_to(ok, pages.shape)
    span = int(max(pages.max(initial=0), held.max(initial=0))) + 2  # page ids of one head, and a free id
    row = np.arange(pages.size // max(1, pages.shape[-1]), dtype=np.int64).reshape(pages.shape[:-1] + (1,)) * span
    held_keys = np.where(ok, held, span - 1) + row  # slots past k_sel hold the free id: never a member
    return ok & ~np.isin(pages + row, held_keys)
