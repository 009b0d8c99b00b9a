"""Pinned-host KV store, and the device row scatter that decode-time policies write through.

A policy that offloads (HeteroCache's compressed heads, FreeKV, Quest offloaded)
puts a layer's full prompt K/V in pinned host memory at prefill
(``HostKVStore.put``: asynchronous, never waited on while prefill dispatches),
and between decode steps gathers rows from numpy views of it into staging
rows (pinned on a GPU: ``Staging``), moves only those rows to the device (``jax.device_put``, asynchronous)
and writes them into the row pool with a jitted, donating scatter
(:func:`write_host_rows`): the pool is never read back or re-uploaded whole,
and one executable serves every layer.

Two reads happen inside a jitted function, through a ``jax.pure_callback`` that
finds the store by its ``handle`` (an int32 carried in the cache, so one
compiled step serves every request) and uses numpy only: a session turn's chunk
attending a whole offloaded prompt (:func:`attend_chunk_over_host_prompt`) and,
on a GPU backend, HCAttention's value sums (:func:`host_weighted_sum`; on a CPU
backend the step reads the store's arrays itself, :func:`weighted_sum_in_step`).
No decode step of FreeKV or Quest fetches from the host.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import functools
import itertools
import math
import os
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.model.cache import KVPool
from hetero_jax.model.sharding import partition_spec, tree_specs

# What a failed host <-> device transfer raises: the runtime's errors (a device or pinned host memory running
# out, a transfer aborted) and host memory running out. The hooks that recall or fetch rows between steps count
# these and go on without the rows; any other error is a defect and propagates.
TRANSFER_ERRORS = (jax.errors.JaxRuntimeError, MemoryError)


def pinned_host(device=None) -> jax.sharding.Sharding:
    """Pinned host memory of ``device`` (default: the first device)."""
    return jax.sharding.SingleDeviceSharding(device or jax.devices()[0], memory_kind="pinned_host")


def pinned_like(x: jax.Array) -> jax.Sharding:
    """Pinned host memory laid out as ``x`` is on the devices: on a mesh each device's shard goes to the
    memory of that device's host, so a host copy never gathers the heads of other devices."""
    sharding = getattr(x, "sharding", None)
    return pinned_host() if sharding is None else sharding.with_memory_kind("pinned_host")


HUGE_PAGE_BYTES = 1 << 21


def on_huge_pages(x: jax.Array) -> jax.Array:
    """A pinned-host array ``x`` on one CPU device, of at least a huge page, copied into a 64-byte aligned numpy
    buffer that the returned pinned-host array uses in place (waits for ``x``); any other array is returned as
    it is. numpy asks the kernel for huge pages for buffers of 4 MiB and more where transparent huge pages are
    in ``madvise`` mode, XLA's allocator does not, and a recall's rows from 4 KiB pages cost a page walk each
    (RESULTS ``offload-cpu-native-gather``)."""
    target = x.sharding
    devices = x.devices()
    if (len(devices) != 1 or next(iter(devices)).platform != "cpu" or x.nbytes < HUGE_PAGE_BYTES
            or not isinstance(target, jax.sharding.SingleDeviceSharding)):
        return x
    buf = aligned_empty(x.shape, x.dtype)  # jax uses a 64-byte aligned numpy buffer without copying it
    np.copyto(buf, np.asarray(x))
    return jax.device_put(buf, target)


def aligned_empty(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised C-contiguous numpy array whose first byte is 64-byte (cache line) aligned. numpy only
    promises 16, and its large buffers start 16 bytes past a page: jax copies such a buffer where it would use
    an aligned one in place, and rows written into it straddle a cache line each, which the native gather's
    non-temporal stores fill in halves (RESULTS ``offload-cpu-aligned-staging``)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    at = (-raw.ctypes.data) % 64
    return raw[at : at + nbytes].view(dtype).reshape(shape)


_STORES: "weakref.WeakValueDictionary[int, HostKVStore]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


class HostKVStore:
    """Per layer: K and V [B, H, T, D] in pinned host memory (layers without offloaded heads hold None;
    a values-only store, HCAttention's, holds V alone and K None).

    Numpy views are made on first use (``view``) or all at once (``materialize``, before a decode step
    whose callbacks read them), not at ``put``: ``np.asarray`` waits for the copy, and waiting at
    prefill would stop the host from dispatching the next layers (TTFT).
    """

    def __init__(self, num_layers: int):
        self.k: list[jax.Array | None] = [None] * num_layers
        self.v: list[jax.Array | None] = [None] * num_layers
        # per layer, the layout slot of each head the store holds, in store order (``put_heads``); None: the
        # store's heads are the layer's heads (``put``)
        self.heads: list[np.ndarray | None] = [None] * num_layers
        self._views: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._huge: set[int] = set()  # layers settle_on_huge_pages has seen since their put
        self._blocks: dict[int, dict] = {}
        self.staging = Staging()  # host rows the recalls are sent from (send_host_rows)
        self.handle = next(_HANDLES)  # what a traced step carries to find this store (host_gather)
        _STORES[self.handle] = self
        # host_weighted_sum's counters, per kind of call ("decode", "turn"): calls, seconds, rows read
        self.counters: dict[str, list] = {}

    def handle_array(self) -> jax.Array:
        """The handle as an int32 scalar on the device (a cache leaf, never a compile-time constant)."""
        return jnp.asarray(self.handle, jnp.int32)

    def materialize(self) -> None:
        """Make every layer's numpy views now (``prepare``, host side, outside any traced step), after
        :meth:`settle_on_huge_pages`."""
        self.settle_on_huge_pages()
        for li in range(len(self.k)):
            if self.has(li):
                self.prepare(li)

    def settle_on_huge_pages(self) -> None:
        """On one CPU device: each layer moved into numpy buffers on huge pages (:func:`on_huge_pages`; waits
        for the copies ``put`` started). Elsewhere nothing. Prefill's end calls it, once its copies are all
        started: a copy per layer as each is put would hold the next layer's dispatch back (a CPU's TTFT rose
        4-6 % that way), this one costs a memcpy of the store."""
        for li in range(len(self.k)):
            if not self.has(li) or li in self._huge:
                continue
            k, v = self.k[li], on_huge_pages(self.v[li])
            if v is not self.v[li]:
                self.k[li], self.v[li] = (None if k is None else on_huge_pages(k)), v
                self._views.pop(li, None)
                self._blocks.pop(li, None)
            self._huge.add(li)

    def prepare(self, li: int) -> None:
        """Make the numpy views readers of layer ``li`` use: of the whole arrays on one device, of this process's
        shards where they are split over devices (``local_blocks``). A reader on another thread or in a
        callback only reads them."""
        self.local_blocks(li) if _on_several_devices(self.v[li]) else self.view(li)

    def put(self, li: int, k: jax.Array | None, v: jax.Array) -> None:
        """Copy layer ``li``'s k, v [B, H, T, D] to pinned host memory (asynchronous); k None: values only."""
        self.k[li] = None if k is None else jax.device_put(k, pinned_like(k))
        self.v[li] = jax.device_put(v, pinned_like(v))
        self._huge.discard(li)
        self.heads[li] = None
        self._views.pop(li, None)
        self._blocks.pop(li, None)

    def put_heads(self, li: int, k: jax.Array, v: jax.Array, heads) -> None:
        """Copy the prompt K/V of layer ``li``'s layout heads ``heads`` to pinned host memory (asynchronous).

        k, v: [B, H, T, D] every head of the layer, in layout order. Where one device holds every head (one
        device, or a mesh that splits only the batch), the store holds ``heads`` alone, in that order. Where the
        heads are split over devices (a "model" mesh axis), it holds every head, split as the devices hold
        them: a gather of some heads would leave the partitioner a layout it replicates on every device's
        host. Rows are then named by layout slot either way (``head_index``, :func:`write_head_rows`)."""
        if _heads_split(k):
            self.put(li, k, v)
            self.heads[li] = np.arange(k.shape[1], dtype=np.int64)
            return
        heads = [int(h) for h in heads]
        if heads == list(range(heads[0], heads[0] + len(heads))):  # consecutive: a slice, no gather
            k, v = k[:, heads[0] : heads[0] + len(heads)], v[:, heads[0] : heads[0] + len(heads)]
        else:
            k, v = k[:, np.asarray(heads)], v[:, np.asarray(heads)]
        self.put(li, k, v)
        self.heads[li] = np.asarray(heads, np.int64)

    def head_index(self, li: int, heads) -> np.ndarray:
        """The store's index of each layout head in ``heads`` (any shape of ints) of layer ``li``: int64, the
        same shape. Raises ValueError for a head the store does not hold."""
        heads = np.asarray(heads, np.int64)
        held = self.heads[li]
        if held is None:
            return heads
        order = np.argsort(held, kind="stable")
        at = np.minimum(np.searchsorted(held[order], heads), len(held) - 1)
        idx = order[at]
        if heads.size and not np.array_equal(held[idx], heads):
            raise ValueError(f"layer {li}'s host store holds heads {held.tolist()}, not all of "
                             f"{np.unique(heads).tolist()}")
        return idx

    def head_keys(self, li: int, heads) -> np.ndarray:
        """Numpy keys [B, len(heads), T, D] of layer ``li``'s layout heads ``heads``: the view itself when they
        are every head the store holds, in its order, else a gather."""
        k, _ = self.view(li)
        idx = self.head_index(li, heads)
        return k if np.array_equal(idx, np.arange(k.shape[1])) else k[:, idx]

    def device_keys(self, li: int, heads) -> jax.Array:
        """Keys [B, len(heads), T, D] of layer ``li``'s layout heads ``heads`` on the device(s): from the numpy
        view on one device (``head_keys``); on a mesh each device copies its own shard of the pinned array
        (a host-to-device copy per device, no process reads another's rows), then the heads are taken."""
        k = self.k[li]
        if not _on_several_devices(k):
            return jnp.asarray(self.head_keys(li, heads))
        idx = self.head_index(li, heads)
        keys = jax.device_put(k, k.sharding.with_memory_kind("device"))
        return keys if np.array_equal(idx, np.arange(k.shape[1])) else keys[:, idx]

    def has(self, li: int) -> bool:
        return self.v[li] is not None

    def view(self, li: int) -> tuple[np.ndarray | None, np.ndarray]:
        """Numpy (k, v) [B, H, T, D] of layer ``li`` (read-only views of the pinned arrays; k None if not kept)."""
        if li not in self._views:
            k = self.k[li]
            self._views[li] = (None if k is None else np.asarray(k), np.asarray(self.v[li]))
        return self._views[li]

    def local_blocks(self, li: int) -> dict:
        """Layer ``li``'s rows this process holds, per device of this process: ``LocalBlock`` (numpy views of
        that device's shard of the pinned arrays, and where the shard starts). The only host rows a process
        reads when the store is split over devices (a mesh, one process or several): a view of the whole
        array would gather every device's shard, and under ``jax.distributed`` other processes' shards are
        not in this host's memory."""
        if li not in self._blocks:
            k, v = self.k[li], self.v[li]
            k_shards = {} if k is None else {sh.device: sh for sh in k.addressable_shards}
            blocks = {}
            for sh in v.addressable_shards:
                b, h = (sh.index[i].start or 0 for i in (0, 1))
                ks = k_shards.get(sh.device)
                blocks[sh.device] = LocalBlock(b, h, None if ks is None else np.asarray(ks.data), np.asarray(sh.data))
            self._blocks[li] = blocks
        return self._blocks[li]

    def arrays(self) -> tuple[jax.Array, ...]:
        """Every pinned array (to wait on, or to check its memory kind)."""
        return tuple(a for a in (*self.k, *self.v) if a is not None)

    def head_bytes(self, li: int) -> int:
        """Host K+V bytes of one head of layer ``li`` (the whole batch)."""
        return sum(a.nbytes // a.shape[1] for a in (self.k[li], self.v[li]) if a is not None)

    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays()))


@dataclasses.dataclass(frozen=True)
class LocalBlock:
    """One device's shard of a layer's host copy, as this process holds it: k, v [b, h, T, D] numpy views (k
    None in a values-only store) of batch rows b0.. and store heads h0.."""

    b0: int
    h0: int
    k: np.ndarray | None
    v: np.ndarray


def _on_several_devices(x) -> bool:
    """Whether ``x`` (a jax.Array) is placed over more than one device (a mesh, in one process or several)."""
    sharding = getattr(x, "sharding", None)
    return isinstance(sharding, jax.sharding.NamedSharding) and len(sharding.device_set) > 1


def on_devices(pool: KVPool) -> jax.sharding.NamedSharding | None:
    """The pool's placement when it is split over several devices (a mesh: the host rows then go to each
    device from its own shard of the store, ``send_host_rows``), else None."""
    return pool.k.sharding if _on_several_devices(pool.k) else None


def _heads_split(x: jax.Array) -> bool:
    """Whether the devices holding ``x`` [B, H, ...] each hold only some of its heads (axis 1)."""
    sharding = getattr(x, "sharding", None)
    return sharding is not None and sharding.shard_shape(x.shape)[1] < x.shape[1]


def checked_rows(shape: tuple, b, h, positions) -> np.ndarray:
    """Flat row numbers (b * H + h) * T + positions (int64, the indices' broadcast shape) of a [B, H, T, D] store;
    IndexError naming the axis of an index out of range (``np.take(mode="clip")`` would not say)."""
    B, H, T = shape[:3]
    b, h, positions = (np.asarray(x, np.int64) for x in (b, h, positions))
    for x, size, name in ((b, B, "batch"), (h, H, "head"), (positions, T, "position")):
        # one pass: a negative index read as unsigned is above any size
        if x.size and x.view(np.uint64).max() >= size:
            raise _out_of_range(name, shape)
    return (b * H + h) * T + positions


def _out_of_range(axis: str, shape: tuple) -> IndexError:
    return IndexError(f"{axis} index out of range for a [{', '.join(map(str, shape[:4]))}] store")


def take_rows(a: np.ndarray, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Rows ``rows`` (flat row numbers in range, :func:`checked_rows`) of a [B, H, T, D] host array written into
    ``out`` [n, D] (C-contiguous, ``a``'s dtype), which is returned.

    Each row is copied whole: by the native gather (:func:`_native_gather`) where it is built, else as one
    item of 8-byte words (``np.take`` on a [B*H*T, row words] view) rather than D elements of ``a``'s dtype:
    numpy's fancy indexing of bfloat16 (an ml_dtypes type) goes element by element (1.4 GB/s in the H200
    run, RESULTS.md ``offload-gpu``; 4.8x slower than this on the CPU for a 32K-row gather)."""
    B, H, T, D = a.shape
    rows = rows.reshape(-1)
    if a.flags.c_contiguous and _native_gather([(a, rows, out)]):
        return out
    if D * a.itemsize % 8 or not a.flags.c_contiguous:   # odd row sizes or a strided view: plain indexing
        out[...] = a[np.unravel_index(rows, (B, H, T))]
        return out
    # mode="clip": the indices are in range, and mode="raise" with ``out`` would gather into a buffer first
    np.take(a.reshape(B * H * T, D).view(np.uint64), rows, axis=0, out=out.view(np.uint64), mode="clip")
    return out


def gather_rows(a: np.ndarray, b: np.ndarray, h: np.ndarray, positions: np.ndarray,
                out: np.ndarray | None = None) -> np.ndarray:
    """``a[b, h, positions]`` for a [B, H, T, D] host array (indices of one shape): [..., D], a new array,
    or written into ``out`` [n, D] (n indices; C-contiguous, ``a``'s dtype), which is returned
    (:func:`take_rows`; IndexError for an index out of range)."""
    rows = checked_rows(a.shape, b, h, positions)
    if out is not None and (out.shape != (rows.size, a.shape[-1]) or out.dtype != a.dtype
                            or not out.flags.c_contiguous):
        raise ValueError(f"out must be a C-contiguous [{rows.size}, {a.shape[-1]}] {a.dtype} array, got {out.shape} "
                         f"{out.dtype}")
    if out is None:
        return take_rows(a, rows, aligned_empty((rows.size, a.shape[-1]), a.dtype)).reshape(*rows.shape, a.shape[-1])
    return take_rows(a, rows, out)


def _scatter_rows(pool: KVPool, ints, k_rows, v_rows) -> tuple[KVPool, jax.Array]:
    """Rows into the pool: ints [4, n] = (b, shard, slot, position) of each row (split here: an eager slice
    would compile per row bucket); a padding row carries slot == P, out of range, and is dropped. Also returns
    a scalar, ready (as every output of an execution) once this executable has run: it read the rows
    (``Staging``), and unlike the pool it is never donated to a later step."""
    b_idx, s_idx, slots, pos_rows = ints
    pool = pool.replace(
        k=pool.k.at[b_idx, s_idx, slots].set(k_rows.astype(pool.k.dtype), mode="drop"),
        v=pool.v.at[b_idx, s_idx, slots].set(v_rows.astype(pool.v.dtype), mode="drop"),
        positions=pool.positions.at[b_idx, s_idx, slots].set(pos_rows, mode="drop"),
    )
    return pool, ints[0, 0]


_scatter = jax.jit(_scatter_rows, donate_argnums=(0,))


def kv_rows_nbytes(n: int, like: np.ndarray) -> int:
    """Bytes of n K rows and n V rows shaped like ``like`` [..., D]: what a recall moves, its padding not counted."""
    return 2 * int(n) * like.shape[-1] * like.itemsize


def row_bucket(n: int) -> int:
    """Rows per scatter call, rounded up to a power of two (>= 8): one executable per bucket, not per count."""
    return max(8, 1 << max(0, n - 1).bit_length())


def _padded_ints(width: int, rows: int) -> np.ndarray:
    """[4, width] int32 (b, shard, slot, position) rows of a scatter, every one padding until written: slot
    ``rows`` (the pool's P, out of range) is dropped by the scatter."""
    ints = np.empty((4, width), np.int32)
    ints[:2], ints[2], ints[3] = 0, rows, -1
    return ints


def _send(ints: np.ndarray, parts: list["StagedPart"], chunk: int) -> list[tuple]:
    """Device copies of the staged rows, one (ints, k, v) per part (asynchronous): ints [4, N], ``chunk`` rows a
    part. On a CPU device a pageable part may be the host rows themselves (jax does not copy a numpy view)."""
    target = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
    return [(jax.device_put(ints[:, i * chunk : (i + 1) * chunk]), *(
        jax.device_put(src) if isinstance(src, np.ndarray) else jax.device_put(src, target)
        for src in (p.k_src, p.v_src))) for i, p in enumerate(parts)]


def _writable_view(x: jax.Array) -> np.ndarray | None:
    """A writable numpy view of the pinned host buffer of ``x`` (one device's array), or None where the
    runtime hands out a copy (``np.asarray`` would then not show a write): checked with a written value."""
    try:
        ptr = x.unsafe_buffer_pointer()
    except (RuntimeError, NotImplementedError, ValueError):
        return None
    flat = np.ctypeslib.as_array((ctypes.c_uint8 * x.nbytes).from_address(ptr))
    view = flat.view(x.dtype).reshape(x.shape)
    view.reshape(-1).view(np.uint8)[:1] = 0xA5
    seen = np.asarray(x).reshape(-1).view(np.uint8)[0]
    return view if seen == 0xA5 else None


@dataclasses.dataclass
class StagedPart:
    """One part's host rows: numpy views [chunk, D] to gather into (``k``, ``v``) and what ``jax.device_put``
    sends (``k_src``, ``v_src``): the views themselves (pageable memory), or the pinned host arrays they view,
    which the device reads by DMA with no bounce copy through the runtime's own pinned buffers."""

    k: np.ndarray
    v: np.ndarray
    k_src: np.ndarray | jax.Array
    v_src: np.ndarray | jax.Array


class Staging:
    """The host rows a store's transfers are sent from (``send_host_rows``), kept between recalls: a fresh
    buffer costs a page fault per 4 KiB while it is filled, and a fresh pinned one a driver allocation.

    Rows are held in parts of ``chunk`` rows (one scatter executable per part). On a GPU (``pinned``, the
    default where the first device is not a CPU) each part is a pinned host array written in place, so
    its transfer is a DMA; elsewhere the parts are slices of one pageable numpy buffer. Holds, until it goes,
    the most parts a send needed (pinned: of each part size; pageable: the largest send's rows). ``take``
    waits until the previous rows were read: their transfers (``sent``, set by ``send_host_rows``), or the
    scatter that wrote them (set by ``scatter_rows``: on a CPU device the transferred arrays can be views of
    these rows, read only when the scatter runs). One user at a time: a caller sends every row of a recall
    with one ``send_host_rows``."""

    def __init__(self, pinned: bool | None = None):
        self.pinned = jax.devices()[0].platform != "cpu" if pinned is None else pinned
        self.k: np.ndarray | None = None  # pageable rows [cap, D] (not ``pinned``)
        self.v: np.ndarray | None = None
        # pinned parts by (chunk, D, K dtype, V dtype): callers whose part size varies (the copy window,
        # SyncKV) each keep theirs, instead of a driver allocation whenever the size changes
        self.held: dict[tuple, list[StagedPart]] = {}
        self.sent: list = []  # the device arrays of the last transfers from these rows

    def take(self, n_parts: int, chunk: int, k_like: np.ndarray, v_like: np.ndarray) -> list[StagedPart]:
        """``n_parts`` parts of ``chunk`` rows [chunk, D] for K and V with the dtypes of ``k_like``, ``v_like``
        [..., D] (contents undefined)."""
        jax.block_until_ready(self.sent)
        self.sent = []
        D = k_like.shape[-1]
        if self.pinned:
            parts = self.held.setdefault((chunk, D, k_like.dtype, v_like.dtype), [])
            while len(parts) < n_parts and self.pinned:
                self._add_pinned_part(parts, chunk, k_like, v_like)
            if self.pinned:
                return parts[:n_parts]
        n = n_parts * chunk
        if (self.k is None or self.k.shape[0] < n or self.k.shape[1:] != (D,)
                or self.k.dtype != k_like.dtype or self.v.dtype != v_like.dtype):
            cap = row_bucket(n)
            self.k, self.v = (aligned_empty((cap, x.shape[-1]), x.dtype) for x in (k_like, v_like))
        return [StagedPart(k, v, k, v) for k, v in ((self.k[i : i + chunk], self.v[i : i + chunk])
                                                    for i in range(0, n, chunk))]

    def _add_pinned_part(self, parts: list, chunk: int, k_like: np.ndarray, v_like: np.ndarray) -> None:
        arrays = [jax.device_put(np.zeros((chunk, x.shape[-1]), x.dtype), pinned_host()) for x in (k_like, v_like)]
        # the zeros land asynchronously on a GPU: a write before they have would be overwritten
        jax.block_until_ready(arrays)
        views = [_writable_view(a) for a in arrays]
        if any(v is None for v in views):  # this runtime copies pinned arrays out: send pageable rows instead
            self.pinned, self.held = False, {}
            return
        parts.append(StagedPart(*views, *arrays))

    def nbytes(self) -> int:
        pageable = 0 if self.k is None else self.k.nbytes + self.v.nbytes
        return pageable + sum(p.k.nbytes + p.v.nbytes for parts in self.held.values() for p in parts)


# A recall's rows are random rows of a store of hundreds of MiB: each row is a TLB and cache miss. The native
# gather (pallas_kernels/native/host_gather.cc) splits them over GATHER_THREADS threads and prefetches ahead;
# without it, numpy's take on a thread pool (it releases the GIL): one thread reached a third of a memcpy's
# bandwidth on a 2-core machine, two 0.6-0.8. Pieces of GATHER_PIECE rows; a gather of fewer rows than that
# stays on the caller. A thread is only started for every NATIVE_BYTES_PER_THREAD bytes (starting one costs
# tens of microseconds).
GATHER_PIECE = 8192
GATHER_THREADS = min(8, os.cpu_count() or 1)
NATIVE_BYTES_PER_THREAD = 1 << 20
_pool_lock = threading.Lock()
_gather_pool: list = []


def _native_gather(pieces: list[tuple]) -> bool:
    """Each (source [B, H, T, D] C-contiguous, flat rows, destination [n, D]) gathered by the native gather in
    one call; False (nothing written) where the native library is not available."""
    from pallas_kernels import native

    if not native.available():
        return False
    flat = [(src.reshape(-1, src.shape[-1]), rows, out) for src, rows, out in pieces]
    native.gather_rows_native(flat, threads=_native_threads(sum(out.nbytes for _, _, out in pieces)))
    return True


def _native_threads(nbytes: int) -> int:
    return min(GATHER_THREADS, max(1, nbytes // NATIVE_BYTES_PER_THREAD))


def _native_send_gather(store: "HostKVStore", requests: list[tuple], n: int, staged: list["StagedPart"],
                        ints: np.ndarray) -> bool:
    """:func:`send_host_rows`' gather of its ``n`` rows in one native call (``native.gather_requests_native``:
    the indices checked, then each row's K and V copied into ``staged`` and its ints written, the Python side
    doing no per-row work); False (nothing written) where the library is not available or a layer's host arrays
    are not C-contiguous. IndexError naming the axis of an index out of range, before anything is written."""
    from pallas_kernels import native

    views = [store.view(r[0]) for r in requests]
    if not native.available() or not all(k.flags.c_contiguous and v.flags.c_contiguous for k, v in views):
        return False
    k0, v0 = views[0]
    nbytes = n * (k0.itemsize * k0.shape[-1] + v0.itemsize * v0.shape[-1])
    bad = native.gather_requests_native(
        [(k, v, b, h, positions, shard, pool_rows)
         for (k, v), (_, b, h, positions, shard, pool_rows) in zip(views, requests)],
        [p.k for p in staged], [p.v for p in staged], ints, threads=_native_threads(nbytes))
    if bad is not None:
        raise _out_of_range(("batch", "head", "position")[bad[1]], views[bad[0]][0].shape)
    return True


def _gather_pieces(pieces: list[tuple]) -> None:
    """Each (source, rows, destination) gathered (``take_rows``; rows checked by the caller, once for a K and V
    pair): in one native call where every source is C-contiguous, else on threads when there are several:
    the pieces are dealt into one task per thread, balanced by rows (a recall of many small layers' rows would
    otherwise spend more on submitting tasks than on copying)."""
    if pieces and all(src.flags.c_contiguous for src, _, _ in pieces) and _native_gather(pieces):
        return
    if len(pieces) <= 2 or GATHER_THREADS == 1:
        _gather_all(pieces)
        return
    with _pool_lock:
        if not _gather_pool:
            _gather_pool.append(concurrent.futures.ThreadPoolExecutor(GATHER_THREADS, thread_name_prefix="gather"))
    tasks: list[list] = [[] for _ in range(min(GATHER_THREADS, len(pieces)))]
    load = [0] * len(tasks)
    for piece in sorted(pieces, key=lambda x: -len(x[1])):  # largest first onto the least loaded task
        i = load.index(min(load))
        tasks[i].append(piece)
        load[i] += len(piece[1])
    for f in [_gather_pool[0].submit(_gather_all, t) for t in tasks]:
        f.result()  # re-raises a piece's error


def _gather_all(pieces: list[tuple]) -> None:
    for src, rows, out in pieces:
        take_rows(src, rows, out)


def _pieces_send_gather(store: "HostKVStore", requests: list[tuple], chunk: int, staged: list["StagedPart"],
                        ints: np.ndarray) -> None:
    """:func:`send_host_rows`' gather where :func:`_native_send_gather` cannot: each request's flat rows
    checked (:func:`checked_rows`) and cut into pieces at part ends, its ints written here, the pieces gathered
    by :func:`_gather_pieces`."""
    at = 0
    pieces = []  # (source [B, H, T, D], rows, destination rows): gathered on GATHER_THREADS threads
    for li, b, h, positions, shard, pool_rows in requests:
        m = len(positions)
        k, v = store.view(li)
        rows = np.broadcast_to(checked_rows(k.shape, b, h, positions), (m,))  # once for K and V
        for lo in range(0, m, GATHER_PIECE):
            hi = min(m, lo + GATHER_PIECE)
            for a, z in _part_spans(at + lo, at + hi, chunk):  # a piece never crosses a part
                part, r = staged[a // chunk], a % chunk
                sel = rows[a - at : z - at]
                pieces += [(k, sel, part.k[r : r + z - a]), (v, sel, part.v[r : r + z - a])]
        for i, x in enumerate((b, shard, pool_rows, positions)):
            ints[i, at : at + m] = x
        at += m
    _gather_pieces(pieces)


def _part_spans(lo: int, hi: int, chunk: int) -> list[tuple[int, int]]:
    """[lo, hi) split where it crosses a multiple of ``chunk`` (a staging part's end)."""
    cuts = list(range((lo // chunk + 1) * chunk, hi, chunk))
    return list(zip([lo, *cuts], [*cuts, hi]))


def send_host_rows(store: "HostKVStore", requests: list[tuple], rows: int, chunk: int | None = None,
                   timings: dict | None = None, staging: "Staging | None" = None,
                   pool: KVPool | None = None) -> tuple[list[tuple], int]:
    """Start the host -> device copies of the store rows that ``requests`` name, bound for the pool.

    requests: (layer, b, store head, prompt positions, pool shard, pool row), each but the layer [n] ints;
    ``rows``: the pool's P (a padding row's target, dropped by the scatter). Every row is gathered straight
    into the ``Staging`` parts (``chunk`` rows per part, default one part of ``row_bucket(n)``; the last
    padded), which are sent as they are: one host copy of each row before its transfer (on a GPU the parts
    are pinned, so the transfer is a DMA from them). Returns (the parts for :func:`scatter_rows`, rows sent);
    ``timings`` (a dict) gets the host seconds of the gather ("gather") and of starting the transfers
    ("send"). ``staging``: the rows to gather into (default the store's own; a caller that sends from another
    thread brings its own, so that two sends never fill one buffer). ``pool``: the pool the rows go to; where
    it is split over devices (``on_devices``) each device is sent the rows of its own shard, gathered from
    its own shard of the store (:func:`_send_by_device`). Raises whatever ``jax.device_put`` raises, before
    anything is written."""
    if pool is not None and on_devices(pool) is not None:
        return _send_by_device(store, requests, pool, chunk, timings)
    t0 = time.perf_counter()
    n = sum(len(r[3]) for r in requests)
    if not n:
        return [], 0
    chunk = chunk or row_bucket(n)
    n_parts = max(1, -(-n // chunk))
    ints = _padded_ints(n_parts * chunk, rows)
    k0, v0 = store.view(requests[0][0])
    staging = store.staging if staging is None else staging
    staged = staging.take(n_parts, chunk, k0, v0)
    for i in range(n // chunk, n_parts):  # the padding rows of the last part
        staged[i].k[n - i * chunk :] = 0
        staged[i].v[n - i * chunk :] = 0
    if not _native_send_gather(store, requests, n, staged, ints):
        _pieces_send_gather(store, requests, chunk, staged, ints)
    t1 = time.perf_counter()
    parts = _send(ints, staged, chunk)
    staging.sent = parts
    if timings is not None:
        timings["gather"] = timings.get("gather", 0.0) + t1 - t0
        timings["send"] = timings.get("send", 0.0) + time.perf_counter() - t1
    return parts, n


def _send_by_device(store: "HostKVStore", requests: list[tuple], pool: KVPool, chunk: int | None,
                    timings: dict | None) -> tuple[list[tuple], int]:
    """:func:`send_host_rows` into a pool split over the devices of a mesh: each device of this process is sent
    the rows bound for its block of the pool (by batch row and pool shard), gathered from its own shard of the
    store (``HostKVStore.local_blocks``), so that no process reads another's host memory. Every process runs
    this with the same requests and finds the same row count per device (the largest, bucketed, is each
    part's row count: one executable for every device). Parts are (ints, k, v) global arrays [*mesh, 4, chunk]
    and [*mesh, chunk, D], one block per device, with (b, shard) relative to the device's block."""
    t0 = time.perf_counter()
    placement = on_devices(pool)
    mesh, B, S = placement.mesh, pool.k.shape[0], pool.k.shape[1]
    blocks = placement.devices_indices_map(pool.k.shape)
    devices = list(mesh.devices.flat)
    rows_of = {d: [] for d in devices}  # per device: (layer, b, store head, positions, shard, pool row) of its block
    n = 0
    for li, b, h, positions, shard, pool_rows in requests:
        b, h, positions, shard, pool_rows = np.broadcast_arrays(*(np.asarray(x, np.int64).reshape(-1) for x in
                                                                  (b, h, positions, shard, pool_rows)))
        n += len(positions)
        for d in devices:
            sb, ss = blocks[d][0], blocks[d][1]
            mine = ((b >= (sb.start or 0)) & (b < (sb.stop or B)) & (shard >= (ss.start or 0))
                    & (shard < (ss.stop or S)))
            if mine.any():
                rows_of[d].append((li, b[mine], h[mine], positions[mine], shard[mine], pool_rows[mine]))
    if not n:
        return [], 0
    most = max(sum(len(r[3]) for r in rs) for rs in rows_of.values())
    chunk = chunk or row_bucket(most)
    width = max(1, -(-most // chunk)) * chunk
    first = store.v[requests[0][0]]
    D = first.shape[-1]
    k_dtype = (store.k[requests[0][0]] if store.k[requests[0][0]] is not None else first).dtype
    staged, pieces = {}, []  # pieces: (source, rows, destination rows), gathered on GATHER_THREADS
    for d in devices:
        if d.process_index != jax.process_index():
            continue
        sb, ss = blocks[d][0], blocks[d][1]
        ints = _padded_ints(width, pool.num_rows)
        k_rows, v_rows = aligned_empty((width, D), k_dtype), aligned_empty((width, D), first.dtype)
        at = 0
        for li, b, h, positions, shard, pool_rows in rows_of[d]:
            block = store.local_blocks(li)[d]
            m = len(positions)
            bl, hl = b - block.b0, h - block.h0
            if bl.min() < 0 or bl.max() >= block.v.shape[0] or hl.min() < 0 or hl.max() >= block.v.shape[1]:
                raise ValueError(f"layer {li}'s host rows for {d} are not in that device's shard of the store")
            rows = checked_rows(block.v.shape, bl, hl, positions)
            pieces += [(block.k, rows, k_rows[at : at + m]), (block.v, rows, v_rows[at : at + m])]
            ints[:, at : at + m] = (b - (sb.start or 0), shard - (ss.start or 0), pool_rows, positions)
            at += m
        k_rows[at:] = 0  # the padding rows (dropped by the scatter)
        v_rows[at:] = 0
        staged[d] = (ints, k_rows, v_rows)
    _gather_pieces(pieces)
    t1 = time.perf_counter()
    lead = (1,) * mesh.devices.ndim
    on_grid = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*mesh.axis_names))
    parts = []
    for lo in range(0, width, chunk):
        part = []
        for i, tail in enumerate(((4, chunk), (chunk, D), (chunk, D))):
            pieces = [jax.device_put((x[:, lo : lo + chunk] if i == 0 else x[lo : lo + chunk]).reshape(lead + tail), d)
                      for d, x in ((d, staged[d][i]) for d in staged)]
            part.append(jax.make_array_from_single_device_arrays(mesh.devices.shape + tail, on_grid, pieces))
        parts.append(tuple(part))
    if timings is not None:
        timings["gather"] = timings.get("gather", 0.0) + t1 - t0
        timings["send"] = timings.get("send", 0.0) + time.perf_counter() - t1
    return parts, n


@functools.partial(jax.jit, donate_argnums=(0,), static_argnames=("mesh", "pool_specs"))
def _scatter_by_device(pool: KVPool, ints, k_rows, v_rows, *, mesh, pool_specs) -> tuple[KVPool, jax.Array]:
    """:func:`_scatter` on every device of ``mesh`` at once, each into its own block of the pool from its own
    block of the rows (``_send_by_device``'s parts)."""
    grid = jax.sharding.PartitionSpec(*mesh.axis_names)
    lead = mesh.devices.ndim

    def local(pool, ints, k, v):
        ints, k, v = (x.reshape(x.shape[lead:]) for x in (ints, k, v))
        pool, done = _scatter_rows(pool, ints, k, v)
        return pool, done.reshape((1,) * lead)

    return jax.shard_map(local, mesh=mesh, in_specs=(pool_specs, grid, grid, grid), out_specs=(pool_specs, grid),
                         check_vma=False)(pool, ints, k_rows, v_rows)


def write_host_rows(pool: KVPool, store: "HostKVStore", requests: list[tuple], compile_fn=None,
                    chunk: int | None = None, timings: dict | None = None,
                    staging: "Staging | None" = None) -> tuple[KVPool, int, int]:
    """``pool`` (donated) with the store rows that ``requests`` name written in place: every transfer started
    (:func:`send_host_rows`, its arguments) before anything is written, so a failed one leaves the pool as it
    was, then one scatter executable per part (:func:`scatter_rows`), which releases the staging rows
    (``staging``, default the store's own). Returns (the pool, rows written, K/V bytes moved: rows x 2 x D x
    itemsize, padding not counted)."""
    staging = store.staging if staging is None else staging
    parts, n = send_host_rows(store, requests, pool.num_rows, chunk=chunk, timings=timings, staging=staging,
                              pool=pool)
    if not n:
        return pool, 0, 0
    pool = scatter_rows(pool, parts, compile_fn, staging=staging)
    return pool, n, kv_rows_nbytes(n, store.v[requests[0][0]])


def head_row_requests(store: "HostKVStore", offsets, num_shards: int, requests: list[tuple]) -> list[tuple]:
    """:func:`send_host_rows`'s requests for rows named by layout head, the same on one device and on a mesh:
    the pool shard that holds each head (the pool splits the layout's heads into ``num_shards`` consecutive
    groups), its index in the store (``HostKVStore.head_index``) and its pool row are found here.

    requests: (layer, b, layout head, prompt positions, slots within the head's region), each but the layer
    [n] ints; offsets: per layer [B, H] each head's first pool row. Returns (layer, b, store head, positions,
    pool shard, pool row) per request."""
    rows = []
    for li, b, h, positions, slots in requests:
        b, h = np.asarray(b, np.int64), np.asarray(h, np.int64)
        n_local = offsets[li].shape[1] // num_shards
        rows.append((li, b, store.head_index(li, h), positions, h // n_local,
                     offsets[li][b, h] + np.asarray(slots, np.int64)))
    return rows


def write_head_rows(pool: KVPool, store: "HostKVStore", offsets, requests: list[tuple], compile_fn=None,
                    chunk: int | None = None, staging: "Staging | None" = None) -> tuple[KVPool, int, int]:
    """``pool`` (donated) with store rows written into heads' regions (requests and offsets as in
    :func:`head_row_requests`, which translates them). Returns what :func:`write_host_rows` returns (every
    transfer starts before anything is written); ``staging`` as there."""
    rows = head_row_requests(store, offsets, pool.num_shards, requests)
    return write_host_rows(pool, store, rows, compile_fn, chunk=chunk, staging=staging)


def scatter_rows(pool: KVPool, parts: list[tuple], compile_fn=None, staging: "Staging | None" = None) -> KVPool:
    """``pool`` (donated) with the rows of :func:`send_host_rows` written in place: only the new rows cross to the
    device (bytes moved = rows x 2 x D x itemsize). ``staging``: the store's ``Staging`` the rows were sent from,
    told when they have been read (a CPU device may use the staging rows themselves as its copy)."""
    read = []
    for op in parts:
        args, static, fn = (pool, *op), {}, _scatter
        if op[0].ndim > 2:  # one block per device (``_send_by_device``)
            mesh = op[0].sharding.mesh
            fn, static = _scatter_by_device, dict(mesh=mesh, pool_specs=tree_specs(pool, mesh))
        pool, done = (functools.partial(fn, **static) if compile_fn is None else compile_fn(fn, *args, **static))(*args)
        read.append(done)
    if staging is not None:
        staging.sent = read
    return pool


def host_gather(handle: jax.Array, li: int, idx: jax.Array, like: jax.Array, mesh=None) -> tuple[jax.Array, jax.Array]:
    """Traced: K and V of layer ``li`` of the store ``handle`` at token positions ``idx`` [B, H, S].

    Returns two [B, H, S, D] arrays with the head dim and dtype of ``like`` (the group they fill). Runs
    as a host callback with numpy only (the store's views must exist: ``HostKVStore.materialize``
    before the step); on a GPU the rows, not the store, cross to the device. On a ``mesh`` every device runs
    its own callback on its block of ``idx`` from its own shard of the store (:func:`_per_device`).
    """
    B, H, S = idx.shape
    dtype, D = like.dtype, like.shape[-1]

    def gather(h, origin, positions):
        k, v = _block_of(int(h), li, origin)
        b, hh, p = np.broadcast_arrays(np.arange(positions.shape[0])[:, None, None],
                                       np.arange(positions.shape[1])[None, :, None], positions)
        return gather_rows(k, b, hh, p).astype(dtype), gather_rows(v, b, hh, p).astype(dtype)

    def call(h, origin, positions):
        out = jax.ShapeDtypeStruct(positions.shape + (D,), dtype)
        return jax.pure_callback(gather, (out, out), h, origin, positions)

    return _per_device(call, mesh, handle, idx, 2)


def _block_of(handle: int, li: int, origin) -> tuple[np.ndarray | None, np.ndarray]:
    """(k, v) numpy of layer ``li`` in the store ``handle``, starting at ``origin`` (batch row, head): the
    whole views where they were made (one device), else this process's block that holds that origin."""
    store = _STORES[handle]
    b0, h0 = (int(x) for x in np.asarray(origin)[:2])
    if li in store._views:
        k, v = store._views[li]
        return None if k is None else k[b0:, h0:], v[b0:, h0:]
    for block in store._blocks[li].values():
        if block.b0 <= b0 < block.b0 + block.v.shape[0] and block.h0 <= h0 < block.h0 + block.v.shape[1]:
            sl = (slice(b0 - block.b0, None), slice(h0 - block.h0, None))
            return None if block.k is None else block.k[sl], block.v[sl]
    raise ValueError(f"no shard of layer {li}'s host store in this process starts at batch row {b0}, head {h0}")


def _per_device(call, mesh, handle: jax.Array, x: jax.Array, n_out: int):
    """Traced: ``call(handle, origin, x)`` (a host callback over x [B, H, ...]) on one device with origin (0, 0, 1),
    or on a ``mesh`` by every device on its own block of x (batch on "data", heads on "model", where they
    divide), given the block's origin (its first batch row and head) and 1 on the first device that holds that
    block (0 on the others, whose block repeats it along an axis that does not split x): each device's callback
    runs in the process that holds the device, and reads that process's shard of the store
    (``HostKVStore.local_blocks``). Returns ``call``'s ``n_out`` outputs [B, H, ...] (split as x)."""
    if mesh is None:
        return call(handle, jnp.array([0, 0, 1], jnp.int32), x)
    spec = partition_spec(("batch", "kv_heads"), x.shape[:2], mesh)
    axes = tuple(spec) + (None,) * (2 - len(tuple(spec)))
    repeats = [a for a in mesh.axis_names if a not in axes]

    def local(h, xl):
        first_copy = jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in repeats])) if repeats else True
        origin = jnp.stack([jnp.int32(0) if a is None else jax.lax.axis_index(a) * xl.shape[i]
                            for i, a in enumerate(axes)] + [jnp.int32(first_copy)]).astype(jnp.int32)
        return call(h, origin, xl)

    outs = spec if n_out == 1 else (spec,) * n_out
    return jax.shard_map(local, mesh=mesh, in_specs=(jax.sharding.PartitionSpec(), spec), out_specs=outs,
                         check_vma=False)(handle, x)


def attend_chunk_over_host_prompt(li: int, q: jax.Array, step, handle: jax.Array, prompt_lens: jax.Array,
                                  n_slots: int) -> jax.Array:
    """Traced: a session turn's chunk (q [B, H, G, C, D]) attends layer ``li``'s whole prompt, gathered from
    the store ``handle`` (dense, as prefill did), and each head's tail rows in the pool (``step``, a
    ``model.pool.LayerStep``: causal). Returns [B, H, G, C, D].

    ``n_slots`` >= the longest prompt (static); slots past a sequence's length repeat its last token and
    are masked by the lengths. prompt_lens: [B] each sequence's prompt length.
    """
    import pallas_kernels

    B, H, G, C, D = q.shape
    slots = jnp.arange(n_slots, dtype=jnp.int32)
    idx = jnp.broadcast_to(jnp.minimum(slots[None, :], prompt_lens[:, None] - 1)[:, None, :], (B, H, n_slots))
    k, v = host_gather(handle, li, idx, step.pool.k, mesh=step.mesh)
    lengths = jnp.broadcast_to(prompt_lens[:, None], (B, H)).astype(jnp.int32)
    out_p, lse_p = pallas_kernels.decode_attention(q.reshape(B, H, G * C, D), k, v, lengths, finite_padding=True)
    out_t, lse_t = step.attend_tail(q.transpose(0, 1, 3, 2, 4))  # [B, H, C, G, D], [B, H, C, G]
    out, _ = pallas_kernels.merge_attention(out_p, lse_p, out_t.transpose(0, 1, 3, 2, 4).reshape(B, H, G * C, D),
                                            lse_t.transpose(0, 1, 3, 2).reshape(B, H, G * C))
    return out.reshape(B, H, G, C, D)


_BLAS_CONTROLLER: list = [None]


def _blas_threads():
    """threadpoolctl's controller of the loaded BLAS libraries, found once (milliseconds; a limit is then ~20 us),
    found again while it holds none."""
    from threadpoolctl import ThreadpoolController

    c = _BLAS_CONTROLLER[0]
    if c is None:  # kept once it holds a BLAS library: a callback then pays no search
        c = ThreadpoolController()
        if c.select(user_api="blas").lib_controllers:
            _BLAS_CONTROLLER[0] = c
    return c


_BLAS_LOCK = threading.Lock()
_BLAS_LIMIT: list = [0, None]  # callbacks inside the limit now, and the limiter that restores BLAS's own count


@contextlib.contextmanager
def _one_blas_thread():
    """A context in which numpy's BLAS runs on the calling thread only. The limit is process-wide: callbacks of
    several devices (a mesh) may overlap, so the first one in sets it and the last one out restores it."""
    with _BLAS_LOCK:
        if _BLAS_LIMIT[0] == 0:
            _BLAS_LIMIT[1] = _blas_threads().limit(limits=1, user_api="blas")
        _BLAS_LIMIT[0] += 1
    try:
        yield
    finally:
        with _BLAS_LOCK:
            _BLAS_LIMIT[0] -= 1
            if _BLAS_LIMIT[0] == 0:
                _BLAS_LIMIT[1].restore_original_limits()


def sums_in_step() -> bool:
    """Whether a step reads host-memory values in its own graph (:func:`weighted_sum_in_step`) rather than
    through a callback (:func:`host_weighted_sum`): on a CPU backend, whose device memory is the host's, so the
    graph reads the pinned arrays where they lie; on a GPU the values stay behind PCIe and only the host sums
    them."""
    return jax.default_backend() == "cpu"


def in_step_operand(a: jax.Array) -> jax.Array:
    """Traced: a store's pinned-host array, passed to the step as an operand, as device memory for the step's
    graph to read where it lies (a CPU backend only, :func:`sums_in_step`: there both are the host's RAM and the
    move is no copy)."""
    return jax.device_put(a, jax.memory.Space.Device)


def weighted_sum_in_step(values: jax.Array, w: jax.Array) -> jax.Array:
    """Traced: sum_t w[b, h, q, t] * values[b, h, t] (Eq. 5 of HCAttention) inside the step, for a CPU backend.

    values: [B, H, T', D] a store's pinned-host array (T' >= T), passed to the step as an operand and never
    donated (the store owns it); w: [B, H, Q, T] float32, zero off each query row's mass set. Returns
    [B, H, Q, D] float32. One product over every row: on a CPU the move to device memory is no copy (both are
    the host's RAM), and one pass over the values costs less than a gather of the kept rows would cost XLA."""
    v = in_step_operand(values)[:, :, : w.shape[-1]]
    return jnp.einsum("bhqt,bhtd->bhqd", w, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def host_weighted_sum(handle: jax.Array, li: int, w: jax.Array, head_dim: int, kind: str = "decode",
                      mesh=None) -> jax.Array:
    """Traced: sum_t w[b, h, q, t] * V[b, h, t] of layer ``li``'s values in the store ``handle``.

    w: [B, H, Q, T] float32, zero off each query row's mass set (T: the store's prompt axis). Returns
    [B, H, Q, head_dim] float32. A host callback, numpy only (views made by ``HostKVStore.materialize``
    before the step): per KV head only the rows any of its Q queries weighs are read (all of them, as one
    product, when they are most of the prompt: one pass over memory costs less than a gather), so a step
    moves w to the host and Q x D floats back, never the values. On a ``mesh`` each device sums its own
    heads from its process's shard of the store (:func:`_per_device`). Counts in ``store.counters[kind]`` what
    one device counts: calls and seconds of the block at (0, 0), rows read by every block once (a block that
    another device repeats, the batch over "data" unsplit, counts on the first).
    """

    import pallas_kernels

    # On a CPU backend the callback runs on one of XLA's busy threads, and BLAS threads of its own would fight
    # XLA's for the same cores; on a GPU backend the host's cores are free for them.
    blas = _one_blas_thread if not pallas_kernels.traced_for_gpu() else contextlib.nullcontext

    def weighted_sum(h, origin, weights):
        t0 = time.perf_counter()
        store = _STORES[int(h)]
        _, v = _block_of(int(h), li, origin)
        weights = np.asarray(weights)  # a callback may get jax arrays: index numpy, never dispatch per head
        B, H, Q, T = weights.shape
        y = np.empty((B, H, Q, head_dim), np.float32)
        rows = 0
        with blas():
            for b in range(B):
                for hh in range(H):
                    wb, vb = weights[b, hh], v[b, hh, :T]
                    used = np.flatnonzero(wb.any(axis=0))  # the union of the Q queries' kept rows
                    if 4 * len(used) > T:
                        rows += T
                        y[b, hh] = wb @ vb.astype(np.float32, copy=False)
                    else:
                        rows += len(used)
                        y[b, hh] = wb[:, used] @ vb[used].astype(np.float32, copy=False)
        b0, h0, first_copy = (int(x) for x in np.asarray(origin))
        c = store.counters.setdefault(kind, [0, 0.0, 0])
        if first_copy and b0 == h0 == 0:
            c[0] += 1
            c[1] += time.perf_counter() - t0
        c[2] += rows if first_copy else 0
        return y

    def call(h, origin, weights):
        out = jax.ShapeDtypeStruct(weights.shape[:3] + (head_dim,), jnp.float32)
        return jax.pure_callback(weighted_sum, out, h, origin, weights)

    return _per_device(call, mesh, handle, w, 1)
