"""Keep the garbage collector's full passes out of decoding.

Tracing and compiling leave a few hundred thousand long-lived Python objects (jaxprs, executables,
modules, the loaded model's wrappers). CPython's full (generation 2) collection scans all of them; as
decode steps promote short-lived objects, one such pass comes every hundred steps or so and stalls the
step it lands in: 140 to 230 ms on a 2-core CPU at 16K (SmolLM2 shape), against a 60 ms step.

While an engine is alive, every new compile (:func:`compiled` calls :func:`after_compile`) freezes
the heap (``gc.freeze``): what exists then leaves the collector's scans. Frozen objects are still freed
by reference counting (engines, caches and decode states hold no reference cycles); only cyclic
garbage among them waits, until the last engine is gone and the heap is unfrozen (``gc.unfreeze``).
Set ``HETERO_JAX_GC_FREEZE=0`` (or false/no/off) to leave the collector alone; a value that is not a
boolean is refused by the first engine, before any compute (``flags``; the command line checks them first).

When the last engine is gone, the C heap's free memory goes back to the system (glibc's ``malloc_trim``):
XLA's CPU buffers of a few MiB come from glibc's heap once its adaptive mmap threshold has risen, and freed
ones stay in the process. A benchmark grid that builds and drops 13-16 caches of 7.9K tokens per case grew by
about 2 GB a case without it, flat with it (docs/tasks.md). ``HETERO_JAX_MALLOC_TRIM=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import weakref

from hetero_jax.errors import env_flag

_FLAGS = {"freeze": ("HETERO_JAX_GC_FREEZE", True), "trim": ("HETERO_JAX_MALLOC_TRIM", True)}
_flags: dict[str, bool] = {}
_live = [0]  # engines alive
_frozen = [False]  # whether this module froze the heap: a freeze of the user's own is never undone here


def flags() -> dict[str, bool]:
    """{"freeze": ..., "trim": ...} from the environment, read once. A value that is not a boolean is a
    ConfigError (read here, not at import, so that a typo is one error line of the command, not a traceback
    from importing hetero_jax)."""
    if not _flags:
        _flags.update({k: env_flag(var, default) for k, (var, default) in _FLAGS.items()})
    return _flags


def engine_started(engine) -> None:
    """Count ``engine`` as alive until it is collected."""
    _live[0] += 1
    weakref.finalize(engine, _engine_gone)


def _engine_gone() -> None:
    _live[0] -= 1
    if _live[0] == 0:
        unfreeze()
        if flags()["trim"]:
            release_free_memory()


def _glibc():
    """The C library's handle where it is glibc (it has ``malloc_trim``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC: list = []


def release_free_memory() -> bool:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim(0)``); False where there is no
    glibc (macOS, musl) or nothing was released."""
    if not _LIBC:
        _LIBC.append(_glibc())
    return bool(_LIBC[0] is not None and _LIBC[0].malloc_trim(0))


def after_compile() -> None:
    """Freeze the heap if an engine is alive (a compile adds most of the long-lived objects)."""
    if _live[0] and flags()["freeze"]:
        gc.freeze()
        _frozen[0] = True


def unfreeze() -> None:
    """Return what this module froze to the collector (the last engine gone, or executables released)."""
    if _frozen[0]:
        gc.unfreeze()
        _frozen[0] = False


def live_engines() -> int:
    return _live[0]
