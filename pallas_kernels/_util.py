"""Small helpers shared by the Pallas kernels (no kernel code here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# Finite stand-in for -inf. Every mask in the kernels and references uses this
# value (never -inf), so `exp(MASK_VALUE - m)` underflows to exactly 0 and no
# `-inf - -inf = NaN` can appear. Real logits are never anywhere near it.
MASK_VALUE: float = -1.0e30

# Minimum number of rows of an operand of a Triton `dot` (tensor-core tile).
MIN_DOT_ROWS: int = 16


def next_pow2(n: int) -> int:
  """Smallest power of two >= n (n >= 1)."""
  n = int(n)
  if n < 1:
    raise ValueError(f"expected n >= 1, got {n}")
  return 1 << (n - 1).bit_length()


def is_pow2(n: int) -> bool:
  return n >= 1 and (n & (n - 1)) == 0


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def dot_precision(dtype) -> lax.Precision | None:
  """Precision of an in-kernel `pl.dot` for inputs of `dtype`.

  float32 inputs ask for full IEEE float32 (Triton `input_precision="ieee"`):
  TF32 would cost ~3 decimal digits, enough to reorder near-tied top-k scores.
  bf16 / f16 inputs use the default (tensor cores, float32 accumulation).
  """
  if jnp.dtype(dtype) == jnp.float32:
    return lax.Precision.HIGHEST
  return None


def gpu_available() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


# ---------------------------------------------------------------------------
# Backend switch (documented in pallas_kernels/__init__.py).

import contextlib
import os

ENV_VAR = "HETERO_JAX_KERNELS"
BACKENDS = ("auto", "pallas", "native", "reference", "interpret")
_override: list[str | None] = [None]


class KernelBackendError(ValueError):
  """A kernel backend name that is not one of BACKENDS (from an argument or HETERO_JAX_KERNELS)."""


def _check_backend(mode: str, source: str = "kernel backend") -> str:
  name = str(mode).strip().lower()
  if name not in BACKENDS:
    raise KernelBackendError(f"{source} must be one of {', '.join(BACKENDS)}, got {mode!r}"
                             + (f"; unset {ENV_VAR} to let auto choose" if source == ENV_VAR else ""))
  return name


def requested_backend() -> str:
  """The requested mode: override from `use_kernels`, else env var, else auto."""
  if _override[0] is not None:
    return _override[0]
  return _check_backend(os.environ.get(ENV_VAR, "auto") or "auto", ENV_VAR)


def kernel_head_dim_ok(head_dim: int) -> bool:
  """Whether the Pallas kernels take this head_dim (a power of two >= 16: Triton's tile sizes)."""
  return head_dim >= 16 and head_dim & (head_dim - 1) == 0


_warned_head_dims: set[int] = set()


def resolve_backend(backend: str | None = None, native: bool = False, head_dim: int | None = None) -> str:
  """Concrete backend: 'pallas', 'native', 'reference' or 'interpret'.

  `backend` (if given) wins over `use_kernels(...)`, which wins over the
  HETERO_JAX_KERNELS env var. 'auto' is 'pallas' when a GPU is visible to
  jax; otherwise, for a kernel with a native CPU version (``native=True``:
  the pool attention) that version when it is built, else 'reference'.
  'native' asks for the native CPU kernel: kernels without one use their
  reference, and the pool attention raises when it cannot be built.
  A ``head_dim`` the Pallas kernels do not take turns 'pallas' and
  'interpret' into 'reference' (with a warning, once per head_dim).
  """
  mode = _check_backend(backend) if backend is not None else requested_backend()
  if mode == "auto":
    if gpu_available():
      mode = "pallas"
    elif native:
      from pallas_kernels import native as native_kernels
      mode = "native" if native_kernels.available() else "reference"
    else:
      mode = "reference"
  elif mode == "native" and not native:
    mode = "reference"
  if mode in ("pallas", "interpret") and head_dim is not None and not kernel_head_dim_ok(head_dim):
    if head_dim not in _warned_head_dims:
      import warnings
      _warned_head_dims.add(head_dim)
      warnings.warn(f"head_dim {head_dim} is not a power of two >= 16, which the Pallas kernels need: the "
                    "plain-JAX reference attention runs instead (correct, slower on a GPU)", RuntimeWarning,
                    stacklevel=2)
    mode = "reference"
  return mode


def traced_for_gpu() -> bool:
  """Whether the computation being traced targets a GPU: the Pallas kernels are what ``resolve_backend``
  picks (auto on a GPU, or ``use_kernels('pallas')`` when lowering for CUDA on a machine without one)."""
  return resolve_backend(native=True) == "pallas"


class _Restore(contextlib.AbstractContextManager):

  def __init__(self, previous):
    self._previous = previous

  def __exit__(self, *exc):
    _override[0] = self._previous
    return False


def use_kernels(mode: str | None = None):
  """Get or set the kernel backend for this process.

  use_kernels()            -> the concrete backend now in force (str)
  use_kernels("pallas")    -> sets it process-wide; the return value is also
                              a context manager that restores the previous
                              setting on exit: `with use_kernels("reference"):`
  use_kernels("env")       -> drop the override, follow HETERO_JAX_KERNELS.

  The choice is read when a function is traced: a jitted caller that was
  already traced keeps the backend it was traced with.
  """
  if mode is None:
    return resolve_backend()
  previous = _override[0]
  _override[0] = None if mode == "env" else _check_backend(mode)
  return _Restore(previous)
