"""HeteroCache's decode state: what one request keeps between decode steps and the hooks the engine runs around
them. It buffers the pivots' shares of each step and dispatches the drift check every ``window`` steps
(``step.drift_check``), plans its recalls before the next step and lands their rows one step after that, their
transfers run while that step computes (``recall``, ``inflight``), re-selects after a session's turn
(``reselect``) and moves the copy window (``copy_window``); every row goes through one host_store call.

Every attribute a turn may change is a number, a container, a numpy array or a frozen record (``Counters``,
``inflight.InFlight``): a session's checkpoint copies those (``runtime.engine``) and a failed turn is undone by
putting them back. The recall in flight and its ``inflight.Lane`` are shared, not copied: a recall put back
after the turn dropped it finds its lane moved on and sends its rows again where it lands.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from hetero_jax.model.cache import KVCache, head_offsets
from hetero_jax.model.host_store import TRANSFER_ERRORS
from hetero_jax.policies.heterocache.copy_window import moved_windows, window_rows
from hetero_jax.policies.heterocache.counters import Counters, summary
from hetero_jax.policies.heterocache.inflight import AsyncRecalls, Lane, warn_failed
from hetero_jax.policies.heterocache.prefilled import HeteroPrefilled, write_rows
from hetero_jax.policies.heterocache.recall import (check_executable, check_inputs, observe_check, recall_chunk,
                                                    set_sizes_by_layer)
from hetero_jax.policies.heterocache.reselect import reselect
from hetero_jax.policies.heterocache.step import drift_check
from hetero_jax.policies.protocol import DecodeState

# ``drift_check`` is named here too: benchmarks/bench_step_ops.py times the check the decode state dispatches
__all__ = ["HeteroDecode", "HeteroPrefilled", "drift_check"]


class HeteroDecode(AsyncRecalls, DecodeState):
    """Per-request decode-time state of HeteroCache: query buffer, pending checks, copy windows, counters."""

    wants_turn_queries = True
    reencodes_turn = True  # the question is encoded again over the re-selected rows

    def __init__(self, prefilled: HeteroPrefilled, compile_fn=None):
        self.prefilled, self.policy = prefilled, prefilled.policy
        self.compile_fn = compile_fn or (lambda f, *a, **st: functools.partial(f, **st))
        # the last `window` steps: tuples over layers of the pivots' share of the check (device; ``attend_step``)
        self.buffer: collections.deque = collections.deque(maxlen=prefilled.policy.window)
        self.pivot_layers = [li for li, r in enumerate(prefilled.roles) if r.pivots]
        # where each pivot layer's pivots sit in the check's outputs (``drift_check``: layer after layer)
        self.pivot_cuts = np.cumsum([0] + [len(prefilled.roles[li].pivots) for li in self.pivot_layers])
        self.pending, self._check_fn = None, None  # a dispatched check (step, outputs); its (key, executable)
        self.recall, self.lane = None, Lane()  # the recall in flight (``inflight.InFlight``), its channel
        self.counters, self.recall_steps = Counters(), []
        # copy window: per layer each compressed head's held positions and window slots (own copies, rewritten
        # here), the copy heads' pointers at the last step (device) and the step before (host)
        self.held = [None if h is None else h.copy() for h in (prefilled.held or [])]
        self.win = [None if w is None else w.copy() for w in (prefilled.window_slots or [])]
        self.pointer_pending = self.pointer_prev = None
        self.window_start = np.full(len(prefilled.lens), -1, np.int64)  # per sequence; -1: no copy seen
        self.window_dirty: set = set()  # sequences whose windows must be (re)filled before the next step
        # per layer [B, H] each head's first pool row (host: the cache's would wait for the step in flight)
        self.offsets = [np.asarray(o, np.int64) for o in prefilled.offsets]
        self.set_sizes = set_sizes_by_layer(prefilled, self.win)  # per pivot layer (device sizes, largest)
        self.recall_chunk = recall_chunk(prefilled)
        self.check_observers: list = []  # given each check's o'_t (``recall.observe_check``; bench_drift_metric)

    def fresh(self) -> "HeteroDecode":
        """A state as prefill left it, with its own lane and no recall in flight. A send of this state's still
        running is waited for (it would be timed as the new state's work); this state keeps that recall, its
        rows landing on its own cache at the step they were due."""
        if self.recall is not None:
            self.recall.block_until_ready()
        return HeteroDecode(self.prefilled, compile_fn=self.compile_fn)

    def after_step(self, step: int, extras, cache: KVCache) -> None:
        """Buffer step ``step``'s pivot shares (``HeteroCache.attend``'s extras: (pivot share, copy pointer) per
        layer); every ``window`` steps dispatch the check. The pointers are read in ``before_step``."""
        pointers = [e[1] for e in extras if e is not None and e[1] is not None]
        if pointers:
            self.pointer_pending = jnp.concatenate(pointers, axis=1) if len(pointers) > 1 else pointers[0]
            self.pointer_pending.copy_to_host_async()
        self.buffer.append(tuple(None if e is None else e[0] for e in extras))
        if len(self.buffer) == self.policy.window and self.pivot_layers:
            self._dispatch_check(step, cache)
            self.buffer.clear()

    def after_extend(self, turn_queries, cache: KVCache) -> KVCache:
        """Re-select after a turn (``reselect``); a check pending from the previous answer is dropped (it would
        recall over the new rows), and so is a recall in flight. All or nothing: a failed transfer returns the
        input cache, with a warning."""
        self._drop_recall()
        self.pending = self.pointer_pending = self.pointer_prev = None
        self.buffer.clear()
        self.window_start[:] = -1
        try:
            return self._reselect(turn_queries, cache)
        except TRANSFER_ERRORS as e:
            self.counters = self.counters.add(reselect_failures=1)
            warn_failed("the re-selection after a turn", e, "the device cache keeps its previous rows")
            return cache

    def _reselect(self, turn_queries, cache: KVCache) -> KVCache:
        cache, items, held_new = reselect(self.prefilled, turn_queries, cache, self.held, self.compile_fn)
        cache, nbytes = write_rows(self.prefilled, cache, self.offsets, items, self.compile_fn)
        self.counters = self.counters.add(reselections=1, bytes_reselected=nbytes)
        for li, (held, win) in held_new.items():
            self.held[li], self.win[li] = held, win
        return cache

    def pool_moved(self, cache: KVCache) -> None:
        self.offsets = head_offsets(cache)  # repacked (a session outgrew its tail rows): the heads' new offsets
        self.lane.settle()  # a recall in flight was bound for the old rows: sent again where it lands

    def _dispatch_check(self, step: int, cache: KVCache) -> None:
        """Dispatch the check of every pivot as one executable; its flags are read before the next step."""
        args, static = check_inputs(self.buffer, cache, self.pivot_layers, self.set_sizes, self.prefilled,
                                    self.policy.drift_threshold)
        self._check_fn = check_executable(self._check_fn, args, static, self.compile_fn)
        drift, k_bases, sets, overlaps = self._check_fn[1](*args)
        drift.copy_to_host_async()  # read before the next step is dispatched, never waited on now
        observe_check(self.check_observers, self.pivot_layers, self.pivot_cuts, args, static, overlaps,
                      self.prefilled.l_base)
        self.pending = (step, (drift, k_bases, sets))

    def before_step(self, step: int, cache: KVCache) -> KVCache:
        """Land the recall sent before the last step, plan the last check's (its rows are sent while this step
        runs), then move the copy windows. A failed transfer changes nothing but a warning and a failure count
        (the pool and K_base as before the plan): the next check or step tries again."""
        if self.recall is not None:
            cache = self._land(step, cache)
        if self.pending is not None:
            saved = self.counters
            try:
                cache = self._plan_recalls(step, cache)
            except TRANSFER_ERRORS as e:
                self.counters = saved
                self._failed(step, e)
        if self.pointer_pending is not None or self.window_dirty:
            try:
                cache = self._follow_copy(cache)
            except TRANSFER_ERRORS as e:  # the windows stay dirty: filled at the next step
                self.counters = self.counters.add(copy_failures=1)
                warn_failed(f"the copy window at decode step {step}", e, "it is filled again before the next step")
        return cache

    def _follow_copy(self, cache: KVCache) -> KVCache:
        """Move the windows the pointers call for (``moved_windows``), then fill them (``window_rows``)."""
        if self.pointer_pending is not None:
            ptr = np.asarray(self.pointer_pending).astype(np.int64)  # [B, Nc]
            prev, self.pointer_prev, self.pointer_pending = self.pointer_prev, ptr, None
            self.window_start, moved = moved_windows(ptr, prev, self.window_start, self.policy.copy_window)
            self.window_dirty.update(moved)
            self.counters = self.counters.add(copy_moves=len(moved))
        if not self.window_dirty:
            return cache
        items = window_rows(self.prefilled, self.held, self.win, self.window_start, self.window_dirty)
        cache, nbytes = write_rows(self.prefilled, cache, self.offsets, items, self.compile_fn)
        self.counters = self.counters.add(bytes_copied=nbytes)
        for li, b, j, slots, want in items:
            self.held[li][b, j, slots] = want
        self.window_dirty = set()
        return cache

    def in_flight(self):
        return self.pending, self.recall

    def host_arrays(self) -> tuple:
        return self.prefilled.store.arrays()

    def recalled_bytes(self) -> int:
        c = self.counters
        return c.bytes_recalled + c.bytes_copied + c.bytes_reselected

    def host_bytes_by_role(self) -> dict[str, int]:
        return self.prefilled.host_bytes_by_role()

    def summary(self) -> str:
        return summary(self.counters, self.prefilled.placement)

    def stats(self) -> dict:
        """``dataclasses.asdict(self.counters)``, and under tensor parallelism the prefill's placement record."""
        placement = self.prefilled.placement
        return {**dataclasses.asdict(self.counters), **({"placement": placement} if placement else {})}
