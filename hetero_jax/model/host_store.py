"""Pinned-host KV store, and the device row scatter that decode-time policies write through.

A policy that offloads (HeteroCache's compressed heads, Quest offloaded, FreeKV)
puts a layer's full prompt K/V in pinned host memory at prefill
(``HostKVStore.put``: asynchronous, never waited on while prefill dispatches),
reads rows from numpy views of it on the host thread, moves only those rows to
the device (``jax.device_put``, asynchronous, :func:`put_rows`) and writes them
into the row pool with :func:`scatter_rows`, a jitted, donating update: the pool
is never read back or re-uploaded whole, and one executable serves every layer.

A policy that must fetch inside the jitted decode step (Quest offloaded, FreeKV's
correction: the rows depend on this step's query) calls :func:`host_gather`, a
``jax.pure_callback`` that finds the store by its ``handle`` (an int32 carried in
the cache, so one compiled step serves every request) and gathers with numpy only.
"""

from __future__ import annotations

import functools
import itertools
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.model.cache import KVPool


def pinned_host(device=None) -> jax.sharding.Sharding:
    """Pinned host memory of ``device`` (default: the first device)."""
    return jax.sharding.SingleDeviceSharding(device or jax.devices()[0], memory_kind="pinned_host")


def pinned_like(x: jax.Array) -> jax.Sharding:
    """Pinned host memory laid out as ``x`` is on the devices: on a mesh each device's shard goes to the
    memory of that device's host, so a host copy never gathers the heads of other devices."""
    sharding = getattr(x, "sharding", None)
    return pinned_host() if sharding is None else sharding.with_memory_kind("pinned_host")


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
        self._views: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.handle = next(_HANDLES)  # what a traced step carries to find this store (host_gather)
        _STORES[self.handle] = self
        # host_weighted_sum's counters, per kind of call ("decode", "turn"): calls, seconds, rows read
        self.counters: dict[str, list] = {}

    def handle_array(self) -> jax.Array:
        """The handle as an int32 scalar on the device (a cache leaf, never a compile-time constant)."""
        return jnp.asarray(self.handle, jnp.int32)

    def materialize(self) -> None:
        """Make every layer's numpy views now (host side, outside any traced step)."""
        for li in range(len(self.k)):
            if self.has(li):
                self.view(li)

    def put(self, li: int, k: jax.Array | None, v: jax.Array) -> None:
        """Copy layer ``li``'s k, v [B, H, T, D] to pinned host memory (asynchronous); k None: values only."""
        self.k[li] = None if k is None else jax.device_put(k, pinned_like(k))
        self.v[li] = jax.device_put(v, pinned_like(v))
        self._views.pop(li, None)

    def has(self, li: int) -> bool:
        return self.v[li] is not None

    def view(self, li: int) -> tuple[np.ndarray | None, np.ndarray]:
        """Numpy (k, v) [B, H, T, D] of layer ``li`` (read-only views of the pinned arrays; k None if not kept)."""
        if li not in self._views:
            k = self.k[li]
            self._views[li] = (None if k is None else np.asarray(k), np.asarray(self.v[li]))
        return self._views[li]

    def rows(self, li: int, b: np.ndarray, h: np.ndarray, positions: np.ndarray,
             total: int | None = None) -> tuple[np.ndarray | None, np.ndarray]:
        """K and V rows of layer ``li`` at (b, h, positions) (broadcast together): [..., D] each, new arrays.

        ``total``: the indices must be 1-D (n rows); the result has ``total`` >= n rows, zero past n (the
        padded operands of :func:`put_rows`, without a second copy). K is None in a values-only store.
        """
        k, v = self.view(li)
        idx = np.broadcast_arrays(np.asarray(b), np.asarray(h), np.asarray(positions))
        return (None if k is None else gather_rows(k, *idx, total=total)), gather_rows(v, *idx, total=total)

    def arrays(self) -> tuple[jax.Array, ...]:
        """Every pinned array (to wait on, or to check its memory kind)."""
        return tuple(a for a in (*self.k, *self.v) if a is not None)

    def head_bytes(self, li: int) -> int:
        """Host K+V bytes of one head of layer ``li`` (the whole batch)."""
        return sum(a.nbytes // a.shape[1] for a in (self.k[li], self.v[li]) if a is not None)

    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays()))


def gather_rows(a: np.ndarray, b: np.ndarray, h: np.ndarray, positions: np.ndarray,
                total: int | None = None) -> np.ndarray:
    """``a[b, h, positions]`` for a [B, H, T, D] host array (indices of one shape): [..., D], a new array.

    Each row is moved as one item of 8-byte words (``np.take`` on a [B*H*T, row words] view) rather than
    D elements of ``a``'s dtype: numpy's fancy indexing of bfloat16 (an ml_dtypes type) goes element by
    element (1.4 GB/s in the H200 run, RESULTS.md ``offload-gpu``; 4.8x slower than this on the CPU for a
    32K-row gather, padding included). With ``total`` (1-D indices, n <= total): ``total`` rows, zero past n.
    """
    B, H, T, D = a.shape
    row_bytes = D * a.itemsize
    word = np.uint64 if row_bytes % 8 == 0 and a.flags.c_contiguous else None
    b, h, positions = (np.asarray(x, np.int64) for x in (b, h, positions))
    for x, size, name in ((b, B, "batch"), (h, H, "head"), (positions, T, "position")):
        if x.size and (x.min() < 0 or x.max() >= size):   # np.take(mode="clip") below would not say
            raise IndexError(f"{name} index out of range for a [{B}, {H}, {T}, {D}] store")
    if word is None:   # odd row sizes or a strided view: plain indexing
        out = a[b, h, positions]
        if total is not None:
            out = np.concatenate([out, np.zeros((total - len(out), D), a.dtype)])
        return out
    flat = (b * H + h) * T + positions
    rows = a.reshape(B * H * T, D).view(word)
    if total is None:
        return np.take(rows, flat.reshape(-1), axis=0).view(a.dtype).reshape(*flat.shape, D)
    n = flat.size
    if flat.ndim != 1 or total < n:
        raise ValueError(f"total needs 1-D indices and total >= n rows (n {n}, total {total}, shape {flat.shape})")
    out = np.empty((total, rows.shape[1]), word)
    # mode="clip": the indices are in range, and mode="raise" with ``out`` would gather into a buffer first
    np.take(rows, flat, axis=0, out=out[:n], mode="clip")
    out[n:] = 0
    return out.view(a.dtype)


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter(pool: KVPool, ints, k_rows, v_rows) -> KVPool:
    """Rows into the pool: ints [4, n] = (b, shard, slot, position) of each row (split here: an eager slice
    would compile per row bucket); a padding row carries slot == P, out of range, and is dropped."""
    b_idx, s_idx, slots, pos_rows = ints
    return pool.replace(
        k=pool.k.at[b_idx, s_idx, slots].set(k_rows.astype(pool.k.dtype), mode="drop"),
        v=pool.v.at[b_idx, s_idx, slots].set(v_rows.astype(pool.v.dtype), mode="drop"),
        positions=pool.positions.at[b_idx, s_idx, slots].set(pos_rows, mode="drop"),
    )


def kv_rows_nbytes(n: int, like: np.ndarray) -> int:
    """Bytes of n K rows and n V rows shaped like ``like`` [..., D]: what a recall moves, its padding not counted."""
    return 2 * int(n) * like.shape[-1] * like.itemsize


def row_bucket(n: int) -> int:
    """Rows per scatter call, rounded up to a power of two (>= 8): one executable per bucket, not per count."""
    return max(8, 1 << max(0, n - 1).bit_length())


def put_rows(b_idx, s_idx, slots, k_rows, v_rows, pos_rows, rows: int, chunk: int | None = None) -> list[tuple]:
    """Start the host -> device copies of n rows bound for the pool (``rows`` = its P): b_idx, s_idx (the
    head's shard), slots (pool row), pos_rows: [n] ints; k_rows, v_rows: [n, D] numpy. The rows are padded to
    ``row_bucket(n)`` and sent as one part, or with ``chunk`` to a multiple of it and sent ``chunk`` rows per
    part (a caller whose row counts vary widely compiles, and warms, one scatter executable). Returns the
    parts' device operands for :func:`scatter_rows`; raises whatever ``jax.device_put`` raises, before
    anything is written."""
    n = len(slots)
    chunk = chunk or row_bucket(n)
    pad = max(1, -(-n // chunk)) * chunk - n
    ints = np.stack([np.pad(np.asarray(a, np.int32), (0, pad), constant_values=fill)
                     for a, fill in ((b_idx, 0), (s_idx, 0), (slots, rows), (pos_rows, -1))])
    k_pad, v_pad = (np.pad(np.asarray(a), ((0, pad), (0, 0))) for a in (k_rows, v_rows))
    return [(jax.device_put(ints[:, i : i + chunk]), jax.device_put(k_pad[i : i + chunk]),
             jax.device_put(v_pad[i : i + chunk])) for i in range(0, n + pad, chunk)]


def scatter_rows(pool: KVPool, parts: list[tuple], compile_fn=None) -> KVPool:
    """``pool`` (donated) with the rows of :func:`put_rows` written in place: only the new rows cross to the
    device (bytes moved = rows x 2 x D x itemsize)."""
    for op in parts:
        args = (pool, *op)
        pool = (_scatter if compile_fn is None else compile_fn(_scatter, *args))(*args)
    return pool


def host_gather(handle: jax.Array, li: int, idx: jax.Array, like: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Traced: K and V of layer ``li`` of the store ``handle`` at token positions ``idx`` [B, H, S].

    Returns two [B, H, S, D] arrays with the head dim and dtype of ``like`` (the group they fill). Runs
    as a host callback with numpy only (the store's views must exist: ``HostKVStore.materialize``
    before the step); on a GPU the rows, not the store, cross to the device.
    """
    B, H, S = idx.shape
    out = jax.ShapeDtypeStruct((B, H, S, like.shape[-1]), like.dtype)

    def gather(h, positions):
        k, v = _STORES[int(h)]._views[li]
        b, hh, p = np.broadcast_arrays(np.arange(B)[:, None, None], np.arange(H)[None, :, None], positions)
        return gather_rows(k, b, hh, p).astype(out.dtype), gather_rows(v, b, hh, p).astype(out.dtype)

    return jax.pure_callback(gather, (out, out), handle, idx)


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
    k, v = host_gather(handle, li, idx, step.pool.k)
    lengths = jnp.broadcast_to(prompt_lens[:, None], (B, H)).astype(jnp.int32)
    out_p, lse_p = pallas_kernels.decode_attention(q.reshape(B, H, G * C, D), k, v, lengths, finite_padding=True)
    out_t, lse_t = step.attend_tail(q.transpose(0, 1, 3, 2, 4))  # [B, H, C, G, D], [B, H, C, G]
    out, _ = pallas_kernels.merge_attention(out_p, lse_p, out_t.transpose(0, 1, 3, 2, 4).reshape(B, H, G * C, D),
                                            lse_t.transpose(0, 1, 3, 2).reshape(B, H, G * C))
    return out.reshape(B, H, G, C, D)


def host_weighted_sum(handle: jax.Array, li: int, idx: jax.Array, w: jax.Array, head_dim: int,
                      kind: str = "decode") -> jax.Array:
    """Traced: sum_k w[b, h, q, k] * V[b, h, idx[b, h, q, k]] of layer ``li``'s values in the store ``handle``.

    idx, w: [B, H, Q, K] (a query row's K token positions, distinct, and their weights; a weight of 0 adds
    nothing). Returns [B, H, Q, head_dim] float32. A host callback, numpy only (views made by
    ``HostKVStore.materialize`` before the step): per KV head the rows any of its Q queries selected are
    read once, so a step moves idx and w to the host and Q x D floats back, never the values. Counts
    calls, seconds and rows read in ``store.counters[kind]``.
    """
    B, H, Q, K = idx.shape
    out = jax.ShapeDtypeStruct((B, H, Q, head_dim), jnp.float32)

    def weighted_sum(h, positions, weights):
        t0 = time.perf_counter()
        store = _STORES[int(h)]
        _, v = store._views[li]
        y = np.zeros(out.shape, np.float32)
        rows = 0
        for b in range(B):
            for hh in range(H):
                dense = np.zeros((Q, v.shape[2]), np.float32)
                np.put_along_axis(dense, positions[b, hh], weights[b, hh], axis=1)
                used = np.flatnonzero(dense.any(axis=0))  # the union of the Q queries' kept rows
                rows += len(used)
                y[b, hh] = dense[:, used] @ v[b, hh, used].astype(np.float32)
        c = store.counters.setdefault(kind, [0, 0.0, 0])
        c[0] += 1
        c[1] += time.perf_counter() - t0
        c[2] += rows
        return y

    return jax.pure_callback(weighted_sum, out, handle, idx, w)
