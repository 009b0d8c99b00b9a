"""The process-wide compile cache and the shape buckets that keep recompiles rare.

Prefill, decode, session extension and profile calibration all compile through :func:`compiled`, so
compile time is kept out of every timing and reported on its own (:func:`compile_seconds`).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from hetero_jax.runtime import heap

# Prefill chunk sizes: a prompt is padded to a multiple of its bucket, so a new
# prompt length recompiles only when it crosses into a new bucket.
MAX_CHUNK = 512
MIN_CHUNK = 16
# The tail (tokens added after prefill) is allocated in multiples of this many
# tokens, so decode recompiles only when a request crosses into a new bucket.
TAIL_QUANTUM = 128

_COMPILE_TIME = [0.0]


def compile_seconds() -> float:
    """XLA compile seconds spent through :func:`compiled` in this process so far."""
    return _COMPILE_TIME[0]


def chunk_bucket(prompt_len: int) -> int:
    """Chunk size for a prompt: the next power of two, between MIN_CHUNK and MAX_CHUNK."""
    c = MIN_CHUNK
    while c < prompt_len and c < MAX_CHUNK:
        c *= 2
    return c


def round_up(x: int, q: int) -> int:
    return -(-x // q) * q


_COMPILED: dict = {}

# Share of the kernel's per-process limit on memory mappings (vm.max_map_count, usually 65530) above
# which compiled executables are let go before the next compile. XLA's CPU runtime maps three regions
# (code, read-only data, data) for every kernel of an executable and keeps them while any cache holds
# the executable; jax's caches hold up to 2048 executables, ours holds all. At 60 to 300 kernels per
# prefill or decode executable, a process that meets many prompt lengths (a server, a benchmark grid)
# would otherwise die in LLVM ("Unable to allocate section memory") after a few dozen of them.
MAP_BUDGET_FRACTION = 0.5


def mapping_count() -> int | None:
    """Memory mappings this process holds now (Linux), else None."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def mapping_budget() -> int | None:
    """Mappings above which :func:`compiled` releases executables (None where the limit is unknown)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(int(f.read()) * MAP_BUDGET_FRACTION)
    except (OSError, ValueError):
        return None


def cached_executables() -> int:
    """How many executables :func:`compiled` holds now."""
    return len(_COMPILED)


def release_executables() -> None:
    """Drop every cached executable (ours and jax's); those still referenced (live engines) stay valid."""
    heap.unfreeze()  # frozen, the released ones would outlive this if any sits in a reference cycle
    _COMPILED.clear()
    jax.clear_caches()


def compiled(jitted, *args, **static):
    """AOT-compile ``jitted`` for these argument shapes once and reuse it.

    Keeps compile time out of the timed prefill and decode steps; it is
    reported separately as ``compile_seconds``. Before a compile, if the
    process holds more memory mappings than :func:`mapping_budget`, cached
    executables are released (:func:`release_executables`) and recompiled
    when next needed.
    """
    leaves, treedef = jax.tree.flatten(args)
    # Shardings are part of the key: an executable compiled for one placement rejects another.
    key = (jitted, treedef, tuple((jnp.shape(x), jnp.result_type(x), getattr(x, "sharding", None)) for x in leaves),
           tuple(sorted(static.items())))
    fn = _COMPILED.get(key)
    if fn is None:
        t0 = time.perf_counter()  # the mapping check is part of the compile's cost, kept out of timings too
        budget, held = mapping_budget(), mapping_count()
        if budget is not None and held is not None and held > budget:
            release_executables()
        fn = jitted.lower(*args, **static).compile()
        heap.after_compile()
        _COMPILE_TIME[0] += time.perf_counter() - t0
        _COMPILED[key] = fn
    return fn


# the tail a generate call starts with, at most (tokens): it doubles while a longer answer runs, each size a
# decode executable of its own, so up to 512 tokens (the default max_new_tokens is 256) compile once
TAIL_START = 512


def tail_capacity_for(n_tokens: int) -> int:
    """The tail allocation for ``n_tokens`` tokens after the prompt (at least one): a TAIL_QUANTUM multiple."""
    return round_up(max(n_tokens, 1), TAIL_QUANTUM)
