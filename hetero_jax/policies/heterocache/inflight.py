"""HeteroCache's recall in flight (the paper's AsyncUpdate): a check's recall is planned before step t + 1
(``decode.HeteroDecode``), its rows are gathered from the host copy and sent to the device on a background
thread while step t + 1 is dispatched and runs, and they are written into the pool before step t + 2, waiting
there only for transfers not yet done. Always that step, never "whenever they are ready", so the tokens do
not depend on timing: run to run, and a batch equals each prompt alone.

Each decode state has a ``Lane``: its own staging rows (the copy window and the re-selection send from the
store's, on the main thread, while a recall's gather may be running) and an epoch that every send, landing
and drop moves on. A recall lands from its own transfers only if nothing happened on its lane since it was
sent; otherwise (a session's checkpoint put it back after the turn dropped it, or the pool was repacked under
it: its pool rows are stale) its rows are sent again, synchronously, at the same step.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
import warnings

import jax

from hetero_jax.model.cache import KVCache
from hetero_jax.model.host_store import (TRANSFER_ERRORS, Staging, head_row_requests, kv_rows_nbytes, scatter_rows,
                                        send_host_rows)
from hetero_jax.model.sharding import to_host
from hetero_jax.policies.base import note_recall_steps
from hetero_jax.policies.heterocache.copy_window import update_held
from hetero_jax.policies.heterocache.prefilled import HeteroPrefilled, head_requests, write_rows
from hetero_jax.policies.heterocache.recall import plan_recall

_lock = threading.Lock()
_executor: list = []  # one worker per process, made on the first recall: sends run one after another


def warn_failed(what: str, e: Exception, then: str) -> None:
    """The warning of a hook whose transfer failed (the decode state counts it)."""
    warnings.warn(f"HeteroCache: {what} failed ({type(e).__name__}: {e}); {then}", RuntimeWarning, stacklevel=3)


def _worker() -> concurrent.futures.ThreadPoolExecutor:
    with _lock:
        if not _executor:
            _executor.append(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="recall-send"))
    return _executor[0]


class Lane:
    """One decode state's recall channel: the staging rows its sends fill (reused between recalls), the last
    send's future and the epoch (a count that moves on at every send, landing and drop)."""

    def __init__(self):
        self.staging = Staging()
        self.future: concurrent.futures.Future | None = None
        self.epoch = 0

    def settle(self) -> None:
        """Wait for the last send, whatever its outcome, and move the epoch on: no recall sent before this
        lands from its own transfers (its staging rows may be filled again from now on)."""
        if self.future is not None:
            concurrent.futures.wait([self.future])
            self.future = None
        self.epoch += 1


@dataclasses.dataclass(frozen=True, eq=False)
class InFlight:
    """A planned recall whose rows are on their way. Never changed once made: a session's checkpoint shares it."""

    step: int  # the step before which it was planned (it lands before step + 1)
    layers: int  # pivot layers that drifted (``recall_steps`` counts one per layer)
    items: tuple  # the rows: (layer, b, compressed head j, slots in its region, prompt rows), ``write_rows``'
    held_updates: tuple  # copy-window updates (``plan_recall``), applied when the rows land
    old_base: dict  # layer -> its ``PivotBase`` before the plan: put back if the recall fails
    lane: Lane
    epoch: int  # the lane's epoch right after this send
    future: concurrent.futures.Future | None  # send_host_rows' (parts, rows); None: no rows

    def block_until_ready(self) -> "InFlight":
        """Wait for the gather and the transfers (``Engine.drain`` calls this through ``in_flight``); a failed
        send is not raised here but where the recall lands."""
        if self.future is not None and self.lane.epoch == self.epoch:
            concurrent.futures.wait([self.future])
            if self.future.exception() is None:
                jax.block_until_ready(self.future.result()[0])
        return self


def send(lane: Lane, prefilled: HeteroPrefilled, cache: KVCache, offsets: list, items: list, chunk: int, *,
         step: int, layers: int, held_updates: list, old_base: dict) -> InFlight:
    """Start a recall's gather and transfers on the worker thread (``host_store.send_host_rows`` into the lane's
    staging rows); the rows' pool shards and rows are found here, with ``offsets`` and ``cache``'s pool."""
    lane.settle()  # a send still running (none when every recall landed) would share the staging rows
    future = None
    if items:
        store = prefilled.store
        rows = head_row_requests(store, offsets, cache.pool.num_shards, head_requests(prefilled, items))
        for li in {r[0] for r in rows}:  # the numpy views are made here: the worker only reads them
            store.prepare(li)
        future = lane.future = _worker().submit(send_host_rows, store, rows, cache.pool.num_rows, chunk=chunk,
                                                staging=lane.staging, pool=cache.pool)
    return InFlight(step, layers, tuple(items), tuple(held_updates), dict(old_base), lane, lane.epoch, future)


def land(rec: InFlight, prefilled: HeteroPrefilled, cache: KVCache, offsets: list, compile_fn,
         chunk: int) -> tuple[KVCache, int, float]:
    """Write ``rec``'s rows into the pool: from its own transfers (``scatter_rows``), or sent again now when its
    lane moved on since. Returns (the cache, K/V bytes moved, host seconds waited for the transfers). Raises
    what the send raised (one of ``TRANSFER_ERRORS``), the pool unchanged."""
    lane, t0 = rec.lane, time.perf_counter()
    if not rec.items:
        return cache, 0, 0.0
    if rec.future is None or lane.epoch != rec.epoch:
        lane.settle()
        cache, nbytes = write_rows(prefilled, cache, offsets, list(rec.items), compile_fn, chunk=chunk,
                                   staging=lane.staging)
        return cache, nbytes, time.perf_counter() - t0
    try:
        parts, n = rec.future.result()
    finally:
        lane.settle()  # whatever the outcome, these transfers are used once
    waited = time.perf_counter() - t0
    pool = scatter_rows(cache.pool, parts, compile_fn, staging=lane.staging)
    return cache.replace(pool=pool), kv_rows_nbytes(n, prefilled.store.v[rec.items[0][0]]), waited


def put_back_base(cache: KVCache, rec: InFlight) -> KVCache:
    """``cache`` with each drifted layer's K_base as it was before ``rec`` was planned (a failed recall changes
    neither the rows nor the base, as if the check had not drifted)."""
    layers = list(cache.layers)
    for li, state in rec.old_base.items():
        layers[li] = layers[li].replace(state=state)
    return cache.replace(layers=tuple(layers))


class AsyncRecalls:
    """``decode.HeteroDecode``'s recall hooks: plan a check's recall and send its rows, land them a step later,
    drop one in flight. Uses the state's counters, check outputs (``pending``), copy window and offsets."""

    def _drop_recall(self) -> None:
        """Wait for the recall in flight and drop it (its rows were planned over a cache about to change)."""
        self.lane.settle()
        self.recall = None

    def _failed(self, step: int, e: Exception) -> None:
        self.counters = self.counters.add(recall_failures=1)
        warn_failed(f"the recall at decode step {step}", e, "the device cache is unchanged and the drift will be "
                    "checked again")

    def _plan_recalls(self, step: int, cache: KVCache) -> KVCache:
        """The pending check's recalls (``recall.plan_recall``): K_base now, the rows sent in the background
        (``send``), ``recall_chunk`` rows per part, to land before the next step."""
        (_, (drift, k_bases, sets)), self.pending = self.pending, None
        drift = to_host(drift)  # [B, Np] over every pivot layer (every process: the same recall)
        self.counters = self.counters.add(drift_checks=drift.size, drift_triggers=int(drift.sum()))
        if not drift.any():
            return cache
        planned, recalled, items, held_updates = plan_recall(self.prefilled, cache, self.pivot_layers,
                                                             self.pivot_cuts, self.set_sizes, self.held, drift,
                                                             k_bases, sets)
        self.recall = send(self.lane, self.prefilled, planned, self.offsets, items, self.recall_chunk, step=step,
                           layers=len(recalled), held_updates=held_updates,
                           old_base={li: cache.layers[li].state for li in recalled})
        return planned

    def _land(self, step: int, cache: KVCache) -> KVCache:
        """Write the recall in flight into the pool (``land``), then count it and update the copy window."""
        rec, self.recall = self.recall, None
        try:
            cache, nbytes, waited = land(rec, self.prefilled, cache, self.offsets, self.compile_fn, self.recall_chunk)
        except TRANSFER_ERRORS as e:
            self._failed(step, e)
            return put_back_base(cache, rec)
        note_recall_steps(self.recall_steps, step, rec.layers)
        self.counters = self.counters.add(recalls=len(rec.items), bytes_recalled=nbytes, recall_wait_s=waited)
        for b in update_held(self.held, self.win, list(rec.held_updates)):
            if self.window_start[b] >= 0:  # a copy window is open: fill the satellite's again
                self.window_dirty.add(b)
        return cache

