"""HeteroCache's decode state: re-selection after a session's turn, drift checks every ``window`` steps,
recalls from the host copy one step later, and the copy window that follows an answer copying the prompt."""

from __future__ import annotations

import collections
import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from flax import struct

from hetero_jax.model.cache import KVCache, head_offsets, layer_rows
from hetero_jax.model.host_store import HostKVStore, row_bucket, write_host_rows
from hetero_jax.model.spec import axes_field
from hetero_jax.policies.protocol import DecodeState
from hetero_jax.policies.profiled import LayerRoles, ProfiledPolicy, take_slots
from hetero_jax.policies.selection import cap_bucket
from hetero_jax.policies.heterocache.scores import select_rows, turn_k_base, turn_scores


@dataclasses.dataclass(frozen=True)
class HeteroPrefilled:
    """What HeteroCache's prefill hands its decode: roles, budgets and the host copy of the compressed heads."""

    policy: ProfiledPolicy  # the HeteroCache that made it (its package's policy.py imports this module)
    roles: list[LayerRoles]
    counts: list[np.ndarray]  # per layer [B, Hc] tokens kept by each compressed head (layout order)
    l_base: np.ndarray  # [B] L_base of each sequence
    lens: np.ndarray  # [B] prompt lengths
    # per layer: the compressed heads' full prompt K/V, [B, Hc, T, D] on one device; under tensor
    # parallelism every head's [B, H, T, D] in layout order, split over "model" (``store_heads``)
    store: HostKVStore
    offsets: list[np.ndarray]  # per layer [B, H] each head's first pool row (layout slots), at prefill
    tp: int = 1  # shards of the model axis the layout is made for
    placement: dict | None = None  # under tensor parallelism: tokens per shard, balanced vs contiguous
    # copy window (one device, ``copy_window`` > 0), per layer with compressed heads (else None): the prompt
    # position in each slot of each compressed head [B, Hc, cap] (-1: padding) and its window slots
    # [B, Hc, W] (-1: none), the slots of its least-scored kept rows (``window_slots``)
    held: list | None = None
    window_slots: list | None = None

    def store_heads(self, li: int) -> np.ndarray:
        """Index in the layer's host store of each compressed head (0..Hc-1 on one device; its layout slot
        under tensor parallelism)."""
        if self.tp == 1:
            return np.arange(self.counts[li].shape[1])
        return np.asarray(self.roles[li].comp_slots, np.int64)

    def host_bytes_by_role(self) -> dict[str, int]:
        """Pinned-host KV bytes per role: the satellites' (the paper's reservoir), the anchors', and under
        tensor parallelism the full heads' copies that keep the store split like the device cache."""
        out = {"satellite": 0, "anchor": 0}
        for li, r in enumerate(self.roles):
            per_head = self.store.head_bytes(li)
            if per_head:
                n_comp = self.counts[li].shape[1]
                out["satellite"] += per_head * len(r.satellites)
                out["anchor"] += per_head * (n_comp - len(r.satellites))
                if self.tp > 1:
                    out["full"] = out.get("full", 0) + per_head * r.n_full
        return out


@struct.dataclass
class PivotBase:
    """A pivot layer's decode state: each pivot's K_base (Eq. 9's reference set).

    In a batch the width is the largest L_base; sequence b's rows hold its own L_base[b] positions and -1
    after them, so the count of positions (``base_sizes``) is its L_base and it is checked as if alone."""

    k_base: jax.Array = axes_field("batch", "pivots", "slots")  # [B, Np, max L_base] int32 positions; -1 = none


def base_sizes(k_base):
    """Each pivot's own L_base [B, Np] int32: the positions its K_base holds (the rest of the row is -1)."""
    return (k_base >= 0).sum(axis=-1, dtype=jnp.int32)


def mask_base(idx, l_base):
    """A K_base of each sequence's own size from the top-(largest L_base) positions idx [B, Np, K] (best first,
    ``lax.top_k``, whose first n are the top-n): -1 past l_base[b] ([B] int)."""
    keep = jnp.arange(idx.shape[-1], dtype=jnp.int32)[None, None, :] < jnp.asarray(l_base, jnp.int32)[:, None, None]
    return jnp.where(keep, idx, -1).astype(jnp.int32)


def spread_checks() -> bool:
    """Where the pivots' drift statistics are computed (read at trace time): in every decode step (True: the
    CPU; the check then takes the median of the buffered o'_t, so no step does W steps' work) or all at once
    at the check from the buffered logits (False: a GPU, where a layer's statistics in the step cost a dozen
    launches and the check's are a few kernels for every pivot of the model). Same numbers either way."""
    return not pallas_kernels.traced_for_gpu()


def pivot_statistics(logits, lengths, k_base):
    """A pivot's pooled scores and o'_t from its logits over its prompt rows: logits [B, Np, ..., G, T] (any
    steps between), lengths [B, Np], k_base [B, Np, K] (each row its own L_base positions, ``PivotBase``).
    Returns (scores [B, Np, ..., T]: softmax over the prompt rows, 5-tap pooling, GQA max,
    ``pallas_kernels.pivot_pooled_scores``; o'_t [B, Np, ...]: the chance-normalised overlap of their
    top-L_base with K_base, Eq. 9, ``pallas_kernels.base_overlap``, with each pivot's own L_base)."""
    B, Np = logits.shape[:2]
    mid, (G, T) = logits.shape[2:-2], logits.shape[-2:]
    n = int(np.prod(mid, dtype=np.int64))
    scores = pallas_kernels.pivot_pooled_scores(logits.reshape(B, Np * n, G, T), jnp.repeat(lengths, n, axis=1))
    scores = scores.reshape(B, Np, n, T)
    overlaps = pallas_kernels.base_overlap(scores, k_base, base_sizes(k_base), lengths)  # [B, Np, n]
    return scores.reshape((B, Np) + mid + (T,)), overlaps.reshape((B, Np) + mid)


def attend_step(q, step, pivot_slots, copy_slots=()):
    """A decode step's attention in one layer with what its pivots' drift check and its copy heads' pointer
    need (``HeteroCache.attend``), from one pass over the pool.

    q [B, Nkv, G, D]; step: ``model.pool.LayerStep``; ``pivot_slots``, ``copy_slots``: layout slots (full
    heads: their first rows are the whole prompt in position order). Returns (out [B, Nkv, G, D], the pivots'
    share or None, pointer [B, Nc] int32 or None). The kernel writes the scored heads' logits over their
    prompt rows in the same pass, so the drift check never reads their keys again. The share: the pivots'
    logits [B, Np, G, T], buffered and checked all at once every ``window`` steps (:func:`drift_check`); or,
    where checks are spread (:func:`spread_checks`), this step's (pooled scores [B, Np, T], o'_t [B, Np])
    (:func:`pivot_statistics`). The pointer: each copy head's most attended prompt position by its pooled
    scores (``HeteroDecode._follow_copy``).
    """
    pivot_slots, copy_slots = tuple(pivot_slots), tuple(copy_slots)
    scored = pivot_slots + copy_slots
    flags = np.zeros(q.shape[1], np.int32)
    flags[list(scored)] = 1
    out, _, logits = step.attend(q, score_heads=jnp.asarray(flags), score_len=step.layer.capacity)
    pivot = None
    if pivot_slots:
        pivot = take_slots(logits, pivot_slots)
        if spread_checks():
            k_base = step.layer.state.k_base
            pivot = pivot_statistics(pivot, take_slots(step.layer.lengths, pivot_slots), k_base)
    pointer = None
    if copy_slots:
        scores = pallas_kernels.pivot_pooled_scores(take_slots(logits, copy_slots),
                                                    take_slots(step.layer.lengths, copy_slots))
        pointer = jnp.argmax(scores, axis=-1).astype(jnp.int32)
    return out, pivot, pointer


@functools.partial(jax.jit, static_argnames=("pivot_slots", "l_base", "tau", "cap"))
def drift_check(shares, layer_lengths, k_base, set_sizes, pivot_slots, l_base: int, tau: float, cap: int):
    """The drift check of every pivot of the model at once, from the ``window`` buffered decode steps.

    shares: per pivot layer, per buffered step, what ``attend_step`` returned for its pivots: their logits
    [B, Np_l, G, T], or (pooled scores [B, Np_l, T], o'_t [B, Np_l]) where the steps computed them;
    layer_lengths: per pivot layer [B, H] every head's prompt rows, of which ``pivot_slots`` (static, per
    layer) are the pivots'; k_base: per pivot layer [B, Np_l, l_base] (``l_base`` the batch's largest L_base;
    each row holds its own, ``PivotBase``); set_sizes: per pivot layer [B, Np_l, K_l] int, the sizes of the
    top sets a recall reads per pivot (its satellites' l_s; with a copy window also l_s - w), 0 for none, each
    at most ``cap``. The layers' pivots are checked as one batch [B, Np, W, ...]: one executable and a few
    kernels, whatever the layers.

    Returns, over every pivot of the model (Np, layer after layer) in one array each, so that a decode reads
    one flag array per check and the rest only when a pivot drifted: drift [B, Np] bool (median_t o'_t < tau,
    Eq. 10, normalised); new K_base [B, Np, l_base] (the top-L_base of the latest step's pooled scores, each
    pivot's own L_base, ascending, -1 past it or where masked; the old K_base when no pivot of the model
    drifted); top sets [B, Np, K, cap] of the latest pooled scores, K the layers' largest K_l
    (``pallas_kernels.topk_sets``: ascending positions, -1 past each size; -1 everywhere when none drifted);
    o'_t [B, Np, W].
    """
    lengths = tuple(take_slots(l, s) for l, s in zip(layer_lengths, pivot_slots))
    K = max(s.shape[-1] for s in set_sizes)
    lens = jnp.concatenate(lengths, axis=1)
    base = jnp.concatenate(k_base, axis=1).astype(jnp.int32)
    sizes = jnp.concatenate([jnp.pad(s.astype(jnp.int32), ((0, 0), (0, 0), (0, K - s.shape[-1])))
                             for s in set_sizes], axis=1)
    if isinstance(shares[0][0], tuple):  # the steps scored their pivots: the latest scores, every o'_t
        latest = jnp.concatenate([sh[-1][0] for sh in shares], axis=1)  # [B, Np, T]
        overlaps = jnp.concatenate([jnp.stack([st[1] for st in sh], axis=-1) for sh in shares], axis=1)
    else:
        x = jnp.concatenate([jnp.stack(sh, axis=2) for sh in shares], axis=1)  # [B, Np, W, G, T]
        scores, overlaps = pivot_statistics(x, lens, base)
        latest = scores[:, :, -1]
    B, Np, T = latest.shape
    drift = jnp.median(overlaps, axis=-1) < tau
    n_base = min(l_base, T)
    own = jnp.minimum(base_sizes(base), n_base)  # each pivot's own L_base: its new K_base is that large

    def ranked(s):
        want = jnp.concatenate([own[..., None], sizes], -1)
        sets = pallas_kernels.topk_sets(s, want, max(cap, n_base))
        top = sets[..., 0, :n_base]
        hit = jnp.take_along_axis(s, jnp.maximum(top, 0), axis=-1) > pallas_kernels.MASK_VALUE * 0.5
        top = jnp.pad(jnp.where((top >= 0) & hit, top, -1), ((0, 0), (0, 0), (0, l_base - n_base)),
                      constant_values=-1)
        return top, sets[..., 1:, :cap]

    def unchanged(s):
        return base, jnp.full((B, Np, K, cap), -1, jnp.int32)

    if pallas_kernels.traced_for_gpu():
        # a GPU reads a conditional's predicate on the host, which would hold the host until the step ran:
        # rank always (a few kernels every W steps) and keep the old K_base where none drifted
        top, sets = ranked(latest)
        new_base = jnp.where(drift.any(), top, base)
        sets = jnp.where(drift.any(), sets, -1)
    else:  # read only for a drifted pivot: skip the selection (lax.cond runs one branch) otherwise
        new_base, sets = jax.lax.cond(drift.any(), ranked, unchanged, latest)
    return drift, new_base, sets, overlaps


def recall_set_sizes(members: dict, n_pivots: int, counts: np.ndarray, window: np.ndarray | None):
    """Per pivot, the top-set sizes a recall of its satellites reads (``drift_check``'s set_sizes), int32
    [B, Np, K]: at k = j its j-th satellite's l_s (counts [B, Hc]), and with a copy window (window [B, Hc]:
    each head's w) at k = S + j its l_s - w; K = S or 2S, S the most satellites a pivot has, 0 elsewhere."""
    S = max((len(v) for v in members.values()), default=0)
    B = counts.shape[0]
    sizes = np.zeros((B, n_pivots, S * (2 if window is not None else 1)), np.int32)
    for p, sats in members.items():
        for j, sat in enumerate(sats):
            sizes[:, p, j] = counts[:, sat]
            if window is not None:
                sizes[:, p, S + j] = counts[:, sat] - window[:, sat]
    return sizes


def window_slots(kept_scores: np.ndarray, counts: np.ndarray, window: int) -> np.ndarray:
    """Each compressed head's copy-window slots: the slots of its ``w`` least-scored kept rows, w =
    min(window, count // 4) (a head keeps three quarters of its own selection at least), -1 past w.

    kept_scores: [B, Hc, cap] the selection scores of the rows in each slot; counts: [B, Hc] rows kept.
    Returns int64 [B, Hc, window], each head's slots in ascending score order (ties to the lower slot).
    """
    B, Hc, cap = kept_scores.shape
    out = np.full((B, Hc, window), -1, np.int64)
    for b in range(B):
        for j in range(Hc):
            c = int(counts[b, j])
            w = min(window, c // 4)
            if w:
                out[b, j, :w] = np.argsort(np.asarray(kept_scores[b, j, :c], np.float64), kind="stable")[:w]
    return out


def copy_rows(start: int, w: int, held: np.ndarray, prompt_len: int) -> np.ndarray:
    """The ``w`` prompt positions a copy window starting at ``start`` holds for a head whose other slots
    hold ``held`` (positions): the first w of start, start + 1, ..., prompt_len - 1, then start - 1, ...,
    0 that the head does not hold already (so no row is attended twice). Sorted, int64."""
    held = np.asarray(held, np.int64)
    s = min(max(0, int(start)), prompt_len)

    def free(a):  # a head holds thousands of rows, the window looks at a few dozen: compare those in a's span
        return a[~np.isin(a, held[(held >= a.min()) & (held <= a.max())])] if a.size else a

    for span in (4 * w, prompt_len):  # the near rows first; the whole prompt only if too many are held
        fwd = free(np.arange(s, min(prompt_len, s + span), dtype=np.int64))
        if len(fwd) >= w:
            return np.sort(fwd[:w])
        if s + span >= prompt_len:  # every row after start is in: the rest from start - 1 down
            back = free(np.arange(s - 1, max(-1, s - 1 - span), -1, dtype=np.int64))
            if len(fwd) + len(back) >= w or span >= prompt_len:
                return np.sort(np.concatenate([fwd, back[: w - len(fwd)]]))
    raise AssertionError("unreachable: the second span is the whole prompt")


def pivot_keys(cache: KVCache, li: int, slots) -> tuple[jax.Array, jax.Array]:
    """(keys [B, n, T, D], prompt lengths [B, n]) of the full heads at layout ``slots`` of layer ``li``, read out
    of the pool (a gather, for observers and re-selection: the decode step reads the pool in place)."""
    k, _, _, _ = layer_rows(cache, li)
    lengths = take_slots(cache.layers[li].lengths, slots)
    return take_slots(k, slots), lengths


class HeteroDecode(DecodeState):
    """Per-request decode-time state of HeteroCache: query buffer, pending checks, re-selection and recall stats."""

    wants_turn_queries = True
    reencodes_turn = True  # the question is encoded again over the re-selected rows

    def __init__(self, prefilled: HeteroPrefilled, compile_fn=None):
        self.prefilled = prefilled
        self.policy = prefilled.policy
        self.compile_fn = compile_fn or (lambda f, *a, **st: functools.partial(f, **st))
        # the last `window` steps: tuples over layers of the pivots' share of the check (device; ``attend_step``)
        self.buffer: collections.deque = collections.deque(maxlen=prefilled.policy.window)
        self.pivot_layers = [li for li, r in enumerate(prefilled.roles) if r.pivots]
        # where each pivot layer's pivots sit in the check's outputs (``drift_check``: layer after layer)
        self.pivot_cuts = np.cumsum([0] + [len(prefilled.roles[li].pivots) for li in self.pivot_layers])
        self.pending = None  # (step, (drift, new K_base, top sets) over every pivot) of a dispatched check
        self._check_fn = None  # (argument shapes, the check's executable)
        self.checks = 0  # pivot checks run (pivots x checks)
        self.triggers = 0  # pivot checks that drifted
        self.recalls = 0  # satellite heads refreshed by a drift
        self.bytes_recalled = 0
        self.reselections = 0  # turns after which the compressed heads re-selected
        self.bytes_reselected = 0  # K/V bytes written to the device by those re-selections
        self.recall_failures = 0  # recalls dropped because their transfer failed (see before_step)
        self.reselect_failures = 0  # re-selections dropped the same way (see after_extend)
        self.recall_steps: list[int] = []
        # copy window: per layer the positions each compressed head's slots hold and its window slots (this
        # state's own copies: recalls, re-selections and the window rewrite them), the pointers of the copy
        # heads at the last step (device, copied to the host asynchronously) and the step before (host)
        self.held = [None if h is None else h.copy() for h in (prefilled.held or [])]
        self.win = [None if w is None else w.copy() for w in (prefilled.window_slots or [])]
        roles = prefilled.roles
        # per layer [B, H] each head's first pool row (host copies: reading the cache's would wait for the
        # step in flight); refreshed when the pool is repacked (``pool_moved``)
        self.offsets = [np.asarray(o, np.int64) for o in prefilled.offsets]
        # per pivot layer, the top-set sizes its check selects for a recall (``recall_set_sizes``, on the
        # device) and the largest (host: reading it from the device would wait for the step in flight)
        self.set_sizes = {}
        for li, r in enumerate(roles):
            if r.pivots:
                sizes = recall_set_sizes(r.members, len(r.pivots), prefilled.counts[li], (self.win[li] >= 0).sum(
                    axis=-1) if self.held and self.held[li] is not None else None)
                self.set_sizes[li] = (jax.device_put(sizes), int(sizes.max(initial=0)))
        # a recall's rows go in chunks of one executable, sized to the satellites of one layer (the most rows a
        # layer recalls, bucketed): power-of-two buckets of each recall's total ran three or four executables
        # at 16K, each compiled (about 100 ms on a CPU) and cold (10 to 20 ms more) on its first recall
        self.recall_chunk = row_bucket(max((int(prefilled.counts[li][:, [s for v in r.members.values() for s in v]]
                                                .sum(axis=1).max()) for li, r in enumerate(roles) if r.members),
                                           default=1))
        self.pointer_pending = None
        self.pointer_prev = None
        self.window_start = np.full(len(prefilled.lens), -1, np.int64)  # per sequence; -1: no copy seen
        self.window_dirty: set = set()  # sequences whose windows must be (re)filled before the next step
        self.copy_failures = 0  # window fills dropped (filled again at the next step)
        self.copy_moves = 0  # times a sequence's window moved to a copied span
        self.bytes_copied = 0
        # called as f(layer, overlaps [B, Np, W], lengths [B, Np], l_base=[B] each sequence's L_base) with each
        # pivot layer's o'_t of every check (benchmarks/bench_drift_metric.py records them this way)
        self.check_observers: list = []

    def fresh(self) -> "HeteroDecode":
        return HeteroDecode(self.prefilled, compile_fn=self.compile_fn)

    def after_step(self, step: int, extras, cache: KVCache) -> None:
        """Buffer decode step ``step``'s pivot overlaps (``HeteroCache.attend``'s extras); every ``window``
        steps dispatch the check. The copy heads' pointers are read before the next step (``before_step``)."""
        pointers = [e[1] for e in extras if e is not None and e[1] is not None]  # (pivot logits, pointer)
        if pointers:
            self.pointer_pending = jnp.concatenate(pointers, axis=1) if len(pointers) > 1 else pointers[0]
            self.pointer_pending.copy_to_host_async()
        self.buffer.append(tuple(None if e is None else e[0] for e in extras))
        if len(self.buffer) == self.policy.window and self.pivot_layers:
            self._dispatch_check(step, cache)
            self.buffer.clear()

    def after_extend(self, turn_queries, cache: KVCache) -> KVCache:
        """Re-select after a turn: every compressed head re-takes its top-l_i (budgets unchanged) from its
        host keys, scored by the pooled attention of the turn's queries (``turn_scores``), rows in
        position order; each pivot's K_base restarts from the turn's last query.

        turn_queries: per layer [B, Nkv, N, G, D] (layout order), the N appended tokens' queries.
        A check still pending from the previous answer is dropped (it would recall over the new rows),
        and the drift buffer restarts with the next decode step. All or nothing, like a recall: if a
        transfer fails the input cache is returned, with a RuntimeWarning.
        """
        self.pending = None
        self.buffer.clear()
        self.pointer_pending = self.pointer_prev = None
        self.window_start[:] = -1
        saved = self.bytes_reselected
        try:
            return self._reselect(turn_queries, cache)
        except (RuntimeError, MemoryError) as e:
            self.bytes_reselected = saved
            self.reselect_failures += 1
            warnings.warn(f"HeteroCache: the re-selection after a turn failed ({type(e).__name__}: {e}); the "
                          "device cache keeps its previous rows", RuntimeWarning, stacklevel=2)
            return cache

    def _reselect(self, turn_queries, cache: KVCache) -> KVCache:
        n = turn_queries[0].shape[2]
        block = 16
        n_pad = -(-n // block) * block
        row_valid = jnp.arange(n_pad) < n
        l_base = int(self.prefilled.l_base.max())  # K_base's width; each sequence keeps its own (mask_base)
        lens = jnp.asarray(self.prefilled.lens, jnp.int32)
        layers = list(cache.layers)
        items = []  # (layer, b, compressed head j, slots [n], prompt rows [n]) into the pool
        held_new = {}  # copy window: per layer the new rows' positions and window slots, set once all is written
        for li, r in enumerate(self.prefilled.roles):
            lc, q = layers[li], turn_queries[li]
            if r.pivots:
                keys, lengths = pivot_keys(cache, li, r.pivot_slots())
                args = (take_slots(q, r.pivot_slots())[:, :, -1:], keys, lengths)
                idx = self.compile_fn(turn_k_base, *args, l_base=l_base)(*args)
                layers[li] = lc.replace(state=PivotBase(k_base=mask_base(idx, self.prefilled.l_base)))
            counts = self.prefilled.counts[li]  # [B, Hc]
            if counts.shape[1]:
                host_k, _ = self.prefilled.store.view(li)  # [B, Hc (H under tp), T, D]
                sh = self.prefilled.store_heads(li)  # compressed head j is host head sh[j]
                qc = take_slots(q, r.comp_slots)
                qc = jnp.pad(qc, ((0, 0), (0, 0), (0, n_pad - n), (0, 0), (0, 0)))
                # one layer's compressed keys on the device, for this scoring only
                keys = jnp.asarray(host_k if len(sh) == host_k.shape[1] else host_k[:, sh])
                args = (qc, row_valid, keys, lens)
                scores = self.compile_fn(turn_scores, *args, block=block)(*args)
                # compiled per 64-slot bucket, not per layer's largest budget (as ``select_group``)
                cap = cap_bucket(int(counts.max()), scores.shape[-1])
                args = (scores, jnp.asarray(counts, jnp.int32))
                idx = np.asarray(self.compile_fn(select_rows, *args, cap=cap)(*args))  # [B, Hc, cap]
                if self.held and self.held[li] is not None:  # the copy window's slots in the new rows
                    hc = self.held[li].shape[2]
                    valid = np.arange(hc)[None, None] < counts[:, :, None]
                    kept = np.take_along_axis(np.asarray(scores), idx[:, :, :hc], axis=2)
                    held_new[li] = (np.where(valid, idx[:, :, :hc], -1),
                                    window_slots(kept, counts, self.policy.copy_window))
                for b in range(idx.shape[0]):
                    for j in range(counts.shape[1]):
                        c = int(counts[b, j])
                        items.append((li, b, j, np.arange(c), idx[b, j, :c]))
        cache, nbytes = self._write_rows(cache.replace(layers=tuple(layers)), items)
        self.bytes_reselected += nbytes
        self.reselections += 1
        for li, (held, win) in held_new.items():
            self.held[li], self.win[li] = held, win
        return cache

    def _write_rows(self, cache: KVCache, items: list, chunk: int | None = None) -> tuple[KVCache, int]:
        """Rows of compressed heads from the host copy into their regions of the pool: one transfer set and
        one scatter executable for all of them, whatever the layers (``host_store.write_host_rows``: every transfer
        starts before anything is written, so a failed transfer leaves the pool as it was). items: (layer,
        b, compressed head j, slots in its region [n], prompt rows [n]). Returns (the cache, K/V bytes moved)."""
        if not items:
            return cache, 0
        H = cache.layers[0].num_heads
        n_local = H // cache.pool.num_shards
        by_layer = collections.defaultdict(list)
        for li, b, j, slots, rows in items:
            h = self.prefilled.roles[li].comp_slots[j]
            n = len(rows)
            by_layer[li].append((np.full(n, b), np.full(n, self.prefilled.store_heads(li)[j]), np.asarray(rows),
                                 np.full(n, h // n_local), self.offsets[li][b, h] + np.asarray(slots, np.int64)))
        requests = [(li, *(np.concatenate([p[i] for p in by_layer[li]]) for i in range(5))) for li in sorted(by_layer)]
        pool, _, nbytes = write_host_rows(cache.pool, self.prefilled.store, requests, self.compile_fn, chunk=chunk)
        return cache.replace(pool=pool), nbytes

    def pool_moved(self, cache: KVCache) -> None:
        """The pool was repacked (a session outgrew its tail rows): read the heads' new offsets."""
        self.offsets = head_offsets(cache)

    def _dispatch_check(self, step: int, cache: KVCache) -> None:
        """Dispatch the drift check of every pivot layer on the buffered steps' shares, as one executable
        (``drift_check``); its flags are copied to the host asynchronously and read before the next step, the
        new K_base and top sets only when a pivot drifted."""
        layers = self.pivot_layers
        args = (tuple(tuple(b[li] for b in self.buffer) for li in layers),
                tuple(cache.layers[li].lengths for li in layers),
                tuple(cache.layers[li].state.k_base for li in layers),
                tuple(self.set_sizes[li][0] for li in layers))
        slots = tuple(tuple(self.prefilled.roles[li].pivot_slots()) for li in layers)
        T = jax.tree.leaves(args[0][0][0])[0].shape[-1]
        static = dict(pivot_slots=slots, l_base=int(self.prefilled.l_base.max()),  # K_base's width
                      tau=self.policy.drift_threshold,
                      cap=min(max(1, max(self.set_sizes[li][1] for li in layers)), T))
        # the executable is looked up by its arguments' shapes alone: hashing every leaf's dtype and sharding
        # (``compiled``'s key) for the hundreds of buffered arrays cost milliseconds per check
        key = (tuple(x.shape for x in jax.tree.leaves(args)), tuple(sorted(static.items())))
        if self._check_fn is None or self._check_fn[0] != key:
            self._check_fn = (key, self.compile_fn(drift_check, *args, **static))
        drift, new_base, sets, overlaps = self._check_fn[1](*args)
        drift.copy_to_host_async()  # read before the next step is dispatched, never waited on now
        if self.check_observers:
            cuts = self.pivot_cuts
            for i, li in enumerate(layers):
                lengths = take_slots(args[1][i], slots[i])
                for observe in self.check_observers:
                    observe(li, overlaps[:, cuts[i]:cuts[i + 1]], lengths, l_base=self.prefilled.l_base)
        self.pending = (step, (drift, new_base, sets))

    def before_step(self, step: int, cache: KVCache) -> KVCache:
        """Apply the previous check's recalls (one step after it ran), all or nothing; then move the copy
        windows (``_follow_copy``) if the last step's pointers say an answer copies from the prompt.

        A recall whose host -> device transfer fails (a RuntimeError from ``jax.device_put``, e.g. out of
        device memory) leaves the cache and the recall stats as they were, with a RuntimeWarning:
        the recall is an accuracy aid, and decoding (a session's turn) goes on without it. K_base is
        kept too, so the next check sees the drift again and retries the recall.
        """
        if self.pending is not None:
            saved = (self.checks, self.triggers, self.recalls, self.bytes_recalled, len(self.recall_steps))
            try:
                cache = self._apply_recalls(step, cache)
            except (RuntimeError, MemoryError) as e:
                (self.checks, self.triggers, self.recalls, self.bytes_recalled, n) = saved
                del self.recall_steps[n:]
                self.recall_failures += 1
                warnings.warn(f"HeteroCache: the recall at decode step {step} failed ({type(e).__name__}: {e}); "
                              "the device cache is unchanged and the drift will be checked again", RuntimeWarning,
                              stacklevel=2)
        if self.pointer_pending is not None or self.window_dirty:
            saved = self.bytes_copied
            try:
                cache = self._follow_copy(cache)
            except (RuntimeError, MemoryError) as e:  # the windows stay dirty: filled at the next step
                self.bytes_copied = saved
                self.copy_failures += 1
                warnings.warn(f"HeteroCache: the copy window at decode step {step} failed ({type(e).__name__}: "
                              f"{e}); it is filled again before the next step", RuntimeWarning, stacklevel=2)
        return cache

    def _apply_recalls(self, step: int, cache: KVCache) -> KVCache:
        """Each drifted pivot's satellites take the top-l_s rows of its latest scores from the host copy.

        Only those rows cross to the device and are written in place, every layer's through one scatter
        executable, in chunks of ``recall_chunk`` rows (``_write_rows``): the pool is never read back.
        """
        _, (drift_all, new_base_all, sets_all) = self.pending
        self.pending = None
        drift_all = np.asarray(drift_all)  # [B, Np] over every pivot layer
        self.checks += drift_all.size
        self.triggers += int(drift_all.sum())
        if not drift_all.any():
            return cache
        new_base_all, sets_all = np.asarray(new_base_all), np.asarray(sets_all)
        layers = list(cache.layers)
        items = []  # (layer, b, satellite j, slots, rows) into the pool
        held_updates = []  # copy window: (layer, b, satellite, its new positions, its new window slots)
        for li, a, z in zip(self.pivot_layers, self.pivot_cuts[:-1], self.pivot_cuts[1:]):
            r = self.prefilled.roles[li]
            drift = drift_all[:, a:z]
            if not drift.any():
                continue
            new_base = new_base_all[:, a:z]
            sets = sets_all[:, a:z, : self.set_sizes[li][0].shape[-1]]
            counts = self.prefilled.counts[li]  # [B, Hc]
            n_sat = sets.shape[2] // 2 if self.held and self.held[li] is not None else sets.shape[2]
            for b, p in zip(*np.nonzero(drift)):
                for j, sat in enumerate(r.members.get(int(p), [])):
                    l_s = int(counts[b, sat])
                    pos = sets[b, p, j, :l_s]  # its top-l_s, ascending
                    items.append((li, b, sat, np.arange(l_s), pos))
                    if self.held and self.held[li] is not None:  # its window: the rows past its top-(l_s - w)
                        low = pos[~np.isin(pos, sets[b, p, n_sat + j])]
                        held_updates.append((li, b, sat, pos, np.searchsorted(pos, low)))
            base = np.where(drift[..., None], new_base, np.asarray(layers[li].state.k_base))
            layers[li] = layers[li].replace(state=PivotBase(k_base=jax.device_put(base.astype(np.int32))))
            self.recall_steps.append(step)
        cache, nbytes = self._write_rows(cache.replace(layers=tuple(layers)), items, chunk=self.recall_chunk)
        self.bytes_recalled += nbytes
        self.recalls += len(items)
        for li, b, sat, pos, slots in held_updates:
            self.held[li][b, sat, : len(pos)] = pos
            self.win[li][b, sat, : len(slots)] = slots
            if self.window_start[b] >= 0:  # a copy window is open: fill the satellite's again
                self.window_dirty.add(b)
        return cache

    def _follow_copy(self, cache: KVCache) -> KVCache:
        """The copy window: when a copy head's pointer (its most attended prompt position) moved one or two
        tokens forward since the step before, the answer is copying a span of the prompt from there, and
        every compressed head's window slots take the ``copy_window`` prompt rows from two tokens before it
        (``copy_rows``: rows the head holds already are skipped) from the host copy, so that the heads which
        follow a copy (duplicate-token heads the profile calls stable) see the span's next tokens. The window
        moves again once the pointer passes its middle. Rows cross to the device only when a window moves."""
        if self.pointer_pending is not None:
            ptr = np.asarray(self.pointer_pending).astype(np.int64)  # [B, Nc]
            self.pointer_pending = None
            prev, self.pointer_prev = self.pointer_prev, ptr
            W = self.policy.copy_window
            if prev is not None:
                for b in range(len(ptr)):
                    adv = ptr[b] - prev[b]
                    hits = np.flatnonzero((adv >= 1) & (adv <= 2))
                    if not hits.size:
                        continue
                    c = int(ptr[b, hits[0]])
                    start = self.window_start[b]
                    if start < 0 or c < start + 2 or c > start + W // 2:
                        self.window_start[b] = max(0, c - 2)
                        self.window_dirty.add(b)
                        self.copy_moves += 1
        if not self.window_dirty:
            return cache
        dirty = sorted(self.window_dirty)
        items, updates = [], []  # rows into the pool (``_write_rows``); the held positions to update
        for li, r in enumerate(self.prefilled.roles):
            held = self.held[li] if self.held else None
            if held is None:
                continue
            for b in dirty:
                T = int(self.prefilled.lens[b])
                for j in range(held.shape[1]):
                    slots = self.win[li][b, j]
                    slots = np.sort(slots[slots >= 0])
                    if not slots.size:
                        continue
                    c = int(self.prefilled.counts[li][b, j])
                    want = copy_rows(int(self.window_start[b]), len(slots), np.delete(held[b, j, :c], slots), T)
                    if np.array_equal(np.sort(held[b, j, slots]), want):
                        continue
                    items.append((li, b, j, slots, want))
                    updates.append((li, b, j, slots, want))
        cache, nbytes = self._write_rows(cache, items)
        self.bytes_copied += nbytes
        for li, b, j, sl, want in updates:
            self.held[li][b, j, sl] = want
        self.window_dirty = set()
        return cache

    def in_flight(self):
        return self.pending

    def host_arrays(self) -> tuple:
        return self.prefilled.store.arrays()

    def host_bytes_by_role(self) -> dict[str, int]:
        return self.prefilled.host_bytes_by_role()

    def summary(self) -> str:
        text = (f"drift checks {self.checks}, triggered {self.triggers / self.checks if self.checks else 0:.0%}, "
                f"recalls {self.recalls} ({self.bytes_recalled / 2**10:.0f} KiB)")
        if self.copy_moves:
            text += f", copy window moved {self.copy_moves}x ({self.bytes_copied / 2**10:.0f} KiB)"
        if self.reselections:
            text += f", re-selected {self.reselections}x ({self.bytes_reselected / 2**20:.1f} MiB)"
        p = self.prefilled.placement
        if p:
            text += (f", tp {p['tp']}: kept max/mean {p['kept_max_over_mean']:.2f} (contiguous "
                     f"{p['contiguous_kept_max_over_mean']:.2f}), {p['allocated_tokens_per_shard']} tokens allocated "
                     f"per shard (contiguous {p['contiguous_allocated_tokens_per_shard']})")
        return text

    def stats(self) -> dict:
        return {
            "drift_checks": self.checks,
            "drift_triggers": self.triggers,
            "trigger_rate": self.triggers / self.checks if self.checks else 0.0,
            "recalls": self.recalls,
            "bytes_recalled": self.bytes_recalled,
            "reselections": self.reselections,
            "bytes_reselected": self.bytes_reselected,
            "recall_failures": self.recall_failures,
            "copy_moves": self.copy_moves,
            "bytes_copied": self.bytes_copied,
            "copy_failures": self.copy_failures,
            "reselect_failures": self.reselect_failures,
            **({"placement": self.prefilled.placement} if self.prefilled.placement else {}),
        }
