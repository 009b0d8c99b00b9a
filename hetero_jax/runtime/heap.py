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
boolean is refused when hetero_jax is imported (``errors.env_flag``).
"""

from __future__ import annotations

import gc
import weakref

from hetero_jax.errors import env_flag

ENABLED = env_flag("HETERO_JAX_GC_FREEZE", True)
_live = [0]  # engines alive
_frozen = [False]  # whether this module froze the heap: a freeze of the user's own is never undone here


def engine_started(engine) -> None:
    """Count ``engine`` as alive until it is collected."""
    _live[0] += 1
    weakref.finalize(engine, _engine_gone)


def _engine_gone() -> None:
    _live[0] -= 1
    if _live[0] == 0:
        unfreeze()


def after_compile() -> None:
    """Freeze the heap if an engine is alive (a compile adds most of the long-lived objects)."""
    if ENABLED and _live[0]:
        gc.freeze()
        _frozen[0] = True


def unfreeze() -> None:
    """Return what this module froze to the collector (the last engine gone, or executables released)."""
    if _frozen[0]:
        gc.unfreeze()
        _frozen[0] = False


def live_engines() -> int:
    return _live[0]
