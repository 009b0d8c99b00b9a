"""Native CPU kernels: C++ XLA FFI custom calls (the ``.cc`` sources here, one library).

- ``pool_attention.cc``: the pool attention of ``pallas_kernels.pool_attention``. On the CPU, XLA cannot read
  a head's sub-range of a row pool without copying it (a slice before a dot, a gather, or a masked matmul over
  every row all cost more than the attention itself). It computes what ``pool_attention_reference``
  documents, reading each head's rows in place, on XLA's intra-op thread pool. A second entry point returns,
  instead of the scored heads' logits, their drift statistics, computed by the thread that merges each
  scored head (``pool_attention_statistics_native``).
- ``pivot_statistics.cc``: HeteroCache's per-step drift statistics of a pivot layer (pooled scores and the
  normalised overlap with K_base, ``pallas_kernels.pivot_statistics_reference``), which XLA:CPU runs as dozens
  of small fusions and a 32-pass bisection a layer; and the drift check's top-k sets
  (``pallas_kernels.topk_sets``), two bisections and scatters on XLA:CPU.
- ``page_select.cc``: Quest's and FreeKV's page selection of a decode step (``pallas_kernels.page_select``),
  a handful of small fusions and a top_k a layer on XLA:CPU.
- ``page_recall.cc``: their recall on a CPU backend (``pallas_kernels.page_recall``): the pages a step's slots
  should hold moved from the host store into the pool in place, only those that changed (XLA can only
  scatter every slot).
- ``host_gather.cc``: not custom calls but plain C functions (through ctypes): the host recall's row gather
  from the host store into its staging rows, on threads, each row prefetched ahead of its copy (numpy's take
  waits on one cache miss at a time): :func:`gather_rows_native` from flat row numbers, and
  :func:`gather_requests_native` a whole recall from its (b, h, position) indices, the scatter's index rows
  included.

The library is compiled on first use (or by ``python -m pallas_kernels.native build``, which ``make install``
runs) into ``$HETERO_JAX_CACHE/native`` (default ``~/.cache/hetero_jax/native``), one file per hash of the
sources, the compiler and its flags, the jaxlib version and the CPU's features. With no C++ compiler, or a
failed build or load, :func:`available` is False and :func:`unavailable_reason` says why; callers then use
the jnp references.

Environment: ``CXX`` picks the compiler (default: the first of g++, c++, clang++ on PATH);
``HETERO_JAX_NATIVE_THREADS`` caps the threads one pool attention or page selection call uses (default: XLA's
intra-op pool, which a call only uses when it is long enough to gain from it).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["available", "unavailable_reason", "build", "cache_dir", "library_path", "pool_attention_native",
           "pool_attention_statistics_native", "pivot_statistics_native", "topk_sets_native", "page_select_native",
           "page_recall_native", "gather_rows_native", "gather_requests_native",
           "TARGET", "ATTENTION_STATISTICS_TARGET", "STATISTICS_TARGET", "TOPK_SETS_TARGET", "PAGE_SELECT_TARGET",
           "PAGE_RECALL_TARGET", "PAGE_SELECT_RULES"]

TARGET = "hetero_jax_pool_attention"
STATISTICS_TARGET = "hetero_jax_pivot_statistics"
TOPK_SETS_TARGET = "hetero_jax_topk_sets"
ATTENTION_STATISTICS_TARGET = "hetero_jax_pool_attention_statistics"
PAGE_SELECT_TARGET = "hetero_jax_page_select"
PAGE_RECALL_TARGET = "hetero_jax_page_recall"
# page_select.cc's rule codes, in order; pallas_kernels.page_select takes its RULES from here so that this module
# imports nothing of the package (pallas_kernels._util imports it to resolve the backend).
PAGE_SELECT_RULES = ("max", "mean_softmax")
_SYMBOLS = {TARGET: "HeteroJaxPoolAttention", STATISTICS_TARGET: "HeteroJaxPivotStatistics",
            TOPK_SETS_TARGET: "HeteroJaxTopkSets", ATTENTION_STATISTICS_TARGET: "HeteroJaxPoolAttentionStatistics",
            PAGE_SELECT_TARGET: "HeteroJaxPageSelect", PAGE_RECALL_TARGET: "HeteroJaxPageRecall"}
_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = [os.path.join(_HERE, name) for name in ("pool_attention.cc", "pivot_statistics.cc", "page_select.cc",
                                                   "page_recall.cc", "host_gather.cc")]
_HEADERS = [os.path.join(_HERE, name) for name in ("simd.h", "statistics.h", "threads.h")]
_PREFIX = "kernels-"
_ARCH_FLAGS = ["-march=native"]
_BASE_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fvisibility=hidden", "-fno-strict-aliasing"]
_MASK_VALUE = -1.0e30  # pallas_kernels._util.MASK_VALUE

_lock = threading.Lock()       # one build at a time in this process
_load_lock = threading.Lock()  # one load / registration
_state: dict = {}  # "path" once loaded and registered, or "error" with the reason


def cache_dir() -> str:
  root = os.environ.get("HETERO_JAX_CACHE") or "~/.cache/hetero_jax"
  return os.path.join(os.path.abspath(os.path.expanduser(root)), "native")


def _compiler() -> str | None:
  cxx = os.environ.get("CXX")
  if cxx:
    return shutil.which(cxx) or (cxx if os.path.isfile(cxx) else None)
  for name in ("g++", "c++", "clang++"):
    path = shutil.which(name)
    if path:
      return path
  return None


@functools.lru_cache(maxsize=None)
def _cpu_features() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith(("flags", "Features")):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.machine() + " " + platform.processor()


@functools.lru_cache(maxsize=None)
def _compiler_version(cxx: str) -> str:
  try:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
  except (OSError, subprocess.SubprocessError) as e:
    return f"? {e}"


def _key(cxx: str) -> str:
  import jaxlib
  h = hashlib.sha256()
  for path in _SOURCES + _HEADERS:
    with open(path, "rb") as f:
      h.update(f.read() + b"\0")
  for part in (" ".join(_BASE_FLAGS + _ARCH_FLAGS), cxx, _compiler_version(cxx), jaxlib.__version__,
               _cpu_features()):
    h.update(b"\0" + part.encode())
  return h.hexdigest()[:20]


def library_path() -> str | None:
  """Where the library for this source, compiler, jaxlib and CPU is (or will be) built; None: no compiler."""
  cxx = _compiler()
  return None if cxx is None else os.path.join(cache_dir(), f"{_PREFIX}{_key(cxx)}.so")


def _compile(cxx: str, out: str) -> None:
  """Compiles into a temporary file beside ``out`` and renames it; -march=native is dropped if the compiler
  refuses it. Raises RuntimeError with the compiler's message."""
  include = jax.ffi.include_dir()
  fd, tmp = tempfile.mkstemp(prefix="." + _PREFIX, suffix=".so.tmp", dir=os.path.dirname(out))
  os.close(fd)
  try:
    errors = []
    for arch in (_ARCH_FLAGS, []):
      cmd = [cxx, *_BASE_FLAGS, *arch, "-I", include, "-I", _HERE, *_SOURCES, "-o", tmp]
      try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
      except (OSError, subprocess.SubprocessError) as e:
        errors.append(f"{' '.join(cmd)}: {e}")
        continue
      if proc.returncode == 0:
        os.replace(tmp, out)
        return
      errors.append(f"{' '.join(cmd)} exited {proc.returncode}:\n{(proc.stderr or proc.stdout)[-3000:]}")
    raise RuntimeError("compiling the native CPU kernels failed:\n" + "\n".join(errors))
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


class _FileLock:
  """An exclusive advisory lock on ``path`` (fcntl; a no-op where fcntl is missing)."""

  def __init__(self, path: str):
    self.path, self.fd = path, None

  def __enter__(self):
    try:
      import fcntl
    except ImportError:
      return self
    try:
      self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      fcntl.flock(self.fd, fcntl.LOCK_EX)
    except OSError:  # a file system without locks: the rename alone keeps the library whole
      if self.fd is not None:
        os.close(self.fd)
        self.fd = None
    return self

  def __exit__(self, *exc):
    if self.fd is not None:
      import fcntl
      fcntl.flock(self.fd, fcntl.LOCK_UN)
      os.close(self.fd)
      self.fd = None


def build(force: bool = False) -> str:
  """Builds the library if missing (always with ``force``) and returns its path. Raises RuntimeError when
  there is no compiler or the build fails. Safe across processes (a file lock) and threads."""
  cxx = _compiler()
  if cxx is None:
    raise RuntimeError("no C++ compiler found (set CXX, or install g++ or clang++)")
  out = library_path()
  folder = os.path.dirname(out)
  problem = _folder_problem(folder)
  if problem and not (os.path.isfile(out) and not force):  # a read-only cache holding the library is fine
    folder = _private_folder(f"the native kernel cache {folder} cannot be used ({problem})")
    out = os.path.join(folder, os.path.basename(out))
  try:
    os.makedirs(folder, exist_ok=True)
    with _lock, _FileLock(os.path.join(folder, ".build.lock")):
      if force or not os.path.exists(out):
        _remove_stale_temporaries(folder)
        _compile(cxx, out)
  except OSError as e:
    raise RuntimeError(f"cannot build into {folder}: {e}") from e
  return out


def _folder_problem(folder: str) -> str | None:
  """Why ``folder`` cannot be created (where missing) or written, or None; creates nothing."""
  probe = os.path.abspath(folder)
  while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
    probe = os.path.dirname(probe)
  if not os.path.isdir(probe):
    return f"{probe} is a file, not a directory"
  if not os.access(probe, os.W_OK | os.X_OK):
    return f"{probe} is not writable"
  return None


_private: list[str] = []


def _private_folder(reason: str) -> str:
  """A folder of this process's own (removed at exit) for a build that cannot be cached: an unusable cache
  (HETERO_JAX_CACHE at a file or a read-only directory) costs a compile per process, not the kernel."""
  import atexit
  import warnings

  with _lock:
    if not _private:
      warnings.warn(f"{reason}; building it for this process only (point HETERO_JAX_CACHE at a writable "
                    "directory to keep it between runs)", RuntimeWarning, stacklevel=3)
      _private.append(tempfile.mkdtemp(prefix="hetero_jax_native-"))
      atexit.register(shutil.rmtree, _private[0], True)
    return _private[0]


def _remove_stale_temporaries(folder: str, age_s: float = 3600.0) -> None:
  """Temporary files of builds that were killed (a live build holds the lock, so these are not in use)."""
  for name in os.listdir(folder):
    path = os.path.join(folder, name)
    if name.startswith("." + _PREFIX) and name.endswith(".tmp"):
      try:
        if time.time() - os.stat(path).st_mtime > age_s:
          os.unlink(path)
      except OSError:
        pass


def _load() -> str:
  """Builds if needed, loads and registers the FFI target once per process; returns the library's path."""
  if "path" in _state:
    return _state["path"]
  with _load_lock:
    return _load_locked()


def _load_locked() -> str:
  if "path" in _state:
    return _state["path"]
  if "error" in _state:
    raise RuntimeError(_state["error"])
  try:
    path = build()
    try:
      lib = ctypes.cdll.LoadLibrary(path)
    except OSError:
      path = build(force=True)  # a truncated or stale file: build it again once
      lib = ctypes.cdll.LoadLibrary(path)
    for target, symbol in _SYMBOLS.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
  except Exception as e:  # noqa: BLE001 - any failure makes the kernel unavailable, with the reason
    _state["error"] = f"{type(e).__name__}: {e}"
    raise RuntimeError(_state["error"]) from e
  _state["lib"], _state["path"] = lib, path
  return path


def available() -> bool:
  """Whether the native kernel can run in this process (builds and registers it on the first call)."""
  try:
    _load()
    return True
  except RuntimeError:
    return False


def unavailable_reason() -> str:
  """Why :func:`available` is False ('' when it is True)."""
  return "" if available() else _state.get("error", "unknown")


def _check_attention_operands(q, k_pool, v_pool, offsets, lengths, chunk_rows, max_len, score_heads=None,
                              block_rows=None, block_size=0, score_len=0):
  """The pool attention's rules (both native entry points): ``check_pool_args`` (shared with the reference and
  the Pallas kernel), then the native kernel's dtypes and chunk_rows. ValueError naming the operand."""
  from pallas_kernels.pool_checks import check_pool_args
  check_pool_args(q, k_pool, v_pool, offsets, lengths, score_heads, block_rows, block_size=block_size,
                  max_len=max_len, score_len=score_len)
  if k_pool.dtype != v_pool.dtype:
    raise ValueError(f"k_pool and v_pool dtypes differ: {k_pool.dtype} vs {v_pool.dtype}")
  for a in (q, k_pool):
    if a.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
      raise ValueError(f"dtypes must be float32, bfloat16 or float16, got {a.dtype}")
  if chunk_rows is not None and int(chunk_rows) < 1:
    raise ValueError(f"chunk_rows must be None or >= 1, got {chunk_rows}")


def pool_attention_native(
    q,                 # [B, H, T, G, D]  float32 / bfloat16 / float16
    k_pool,            # [B, P, D]
    v_pool,            # [B, P, D]        same dtype as k_pool
    offsets,           # [B, H] int32
    lengths,           # [B, H] int32
    score_heads=None,  # [H] int32 flags (None: every head)
    block_rows=None,   # [B, H, NB] int32 first region row of each logical block (None: contiguous heads)
    *,
    max_len: int | None = None,  # static bound of n = clip(lengths + t, 0, max_len), >= 1; None: no bound
    score_len: int = 0,
    sm_scale: float | None = None,
    block_size: int = 0,  # static: rows of a block of ``block_rows`` (a power of two)
    chunk_rows: int | None = None,
):
  """``pool_attention_reference``'s computation in the native CPU kernel: returns (out [B, H, T, G, D] in
  q.dtype, lse [B, H, T, G] float32, logits [B, H, G, score_len] float32 or None). Logits past a head's
  visible rows and those of unflagged heads are MASK_VALUE. ``max_len`` clips the visible rows as the reference
  does (None, this function only: no bound); arguments are checked as the reference checks them. Raises
  RuntimeError when the kernel is not available (:func:`unavailable_reason`). Works under jit, vmap (one call
  over the batched axes) and shard_map (each shard's local arrays).

  ``block_rows``: paged heads, read in place: logical row j of head h is region row
  block_rows[b, h, j // block_size] + j % block_size, each row clipped into [0, P) as the reference clips it.

  ``chunk_rows`` (tests): cut every head into work items of that many rows (rounded up to the kernel's
  block), merged by log-sum-exp, on several threads where the pool has them; None: the kernel's own split
  (long heads are cut only when a call is big enough for threads to pay)."""
  _load()
  q, k_pool, v_pool = jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool)
  _check_attention_operands(q, k_pool, v_pool, offsets, lengths, chunk_rows, max_len, score_heads, block_rows,
                            block_size, score_len)
  B, H, T, G, D = q.shape
  if block_rows is None:
    block_size, block_rows = 0, jnp.zeros((B, H, 1), jnp.int32)
  else:
    block_size = int(block_size)
    if block_size & (block_size - 1):
      raise ValueError(f"block_size must be a power of two for paged heads, got {block_size}")
  score_len = int(score_len)
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(D)
  if score_heads is None:
    flags = jnp.ones((B, H), jnp.int32)
  else:
    flags = jnp.broadcast_to(jnp.asarray(score_heads).astype(jnp.int32)[None, :], (B, H))
  result = (jax.ShapeDtypeStruct((B, H, T, G, D), q.dtype),
            jax.ShapeDtypeStruct((B, H, T, G), jnp.float32),
            jax.ShapeDtypeStruct((B, H, G, score_len), jnp.float32))
  # broadcast_all: the kernel flattens leading batch axes into B, so a vmapped call is one call
  call = jax.ffi.ffi_call(TARGET, result, vmap_method="broadcast_all")
  out, lse, logits = call(q, k_pool, v_pool, jnp.asarray(offsets).astype(jnp.int32),
                          jnp.asarray(lengths).astype(jnp.int32), flags, jnp.asarray(block_rows).astype(jnp.int32),
                          sm_scale=np.float32(sm_scale), score_len=np.int64(score_len),
                          chunk_rows=np.int64(chunk_rows or 0), block_size=np.int64(block_size),
                          max_len=_max_len(max_len))
  return out, lse, (logits if score_len else None)


def _max_len(max_len) -> np.int64:
  """The kernel's max_len attribute: the bound, or one no int32 lengths + t reaches (None)."""
  return np.int64(2**40 if max_len is None else max_len)


def pool_attention_statistics_native(
    q,             # [B, H, 1, G, D]  float32 / bfloat16 / float16
    k_pool,        # [B, P, D]
    v_pool,        # [B, P, D]        same dtype as k_pool
    offsets,       # [B, H] int32
    lengths,       # [B, H] int32     rows the query sees
    score_slots,   # static tuple of Hs distinct heads in [0, H) whose statistics are returned, in this order
    stat_lengths,  # [B, Hs] int32    the rows each statistic is over (a pivot's prompt rows)
    k_base,        # [B, Hs, K] int32 each scored head's K_base positions, -1 past its own L_base
    *,
    score_len: int,
    sm_scale: float | None = None,
    chunk_rows: int | None = None,
    max_len: int | None = None,  # static bound of the rows the query sees, >= 1; None: no bound
):
  """:func:`pool_attention_native` with ``score_len`` for the heads ``score_slots``, and
  :func:`pivot_statistics_native` on their logits, in one native call (``pallas_kernels.pool_attention_statistics``
  documents the contract): returns (out [B, H, 1, G, D], lse [B, H, 1, G] float32, scores [B, Hs, score_len]
  float32, o'_t [B, Hs] float32). The logits stay in a buffer of the kernel: the thread that merges a scored
  head computes its statistics while the other threads go on with the call's other heads."""
  _load()
  q, k_pool, v_pool = jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool)
  if q.ndim != 5 or q.shape[2] != 1:
    raise ValueError(f"q must be [B, H, 1, G, D], got {q.shape}")
  B, H, _, G, D = q.shape
  slots = tuple(int(h) for h in score_slots)
  if not slots or len(set(slots)) != len(slots) or not all(0 <= h < H for h in slots):
    raise ValueError(f"score_slots must be distinct heads in [0, {H}), at least one, got {score_slots!r}")
  Hs = len(slots)
  if jnp.shape(stat_lengths) != (B, Hs) or jnp.ndim(k_base) != 3 or jnp.shape(k_base)[:2] != (B, Hs):
    raise ValueError(f"stat_lengths must be [B, Hs] = {(B, Hs)} and k_base [B, Hs, K], got "
                     f"{jnp.shape(stat_lengths)} and {jnp.shape(k_base)}")
  score_len = int(score_len)
  if score_len < 1:
    raise ValueError(f"score_len must be >= 1, got {score_len}")
  _check_attention_operands(q, k_pool, v_pool, offsets, lengths, chunk_rows, max_len, score_len=score_len)
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(D)
  rows = np.full((H,), -1, np.int32)
  rows[list(slots)] = np.arange(Hs, dtype=np.int32)
  flags = jnp.broadcast_to(jnp.asarray(rows)[None, :], (B, H))
  result = (jax.ShapeDtypeStruct((B, H, 1, G, D), q.dtype), jax.ShapeDtypeStruct((B, H, 1, G), jnp.float32),
            jax.ShapeDtypeStruct((B, Hs, score_len), jnp.float32), jax.ShapeDtypeStruct((B, Hs), jnp.float32))
  call = jax.ffi.ffi_call(ATTENTION_STATISTICS_TARGET, result, vmap_method="broadcast_all")
  return call(q, k_pool, v_pool, jnp.asarray(offsets).astype(jnp.int32), jnp.asarray(lengths).astype(jnp.int32),
              flags, jnp.zeros((B, H, 1), jnp.int32), jnp.asarray(stat_lengths).astype(jnp.int32),
              jnp.asarray(k_base).astype(jnp.int32), sm_scale=np.float32(sm_scale), score_len=np.int64(score_len),
              chunk_rows=np.int64(chunk_rows or 0), block_size=np.int64(0), max_len=_max_len(max_len))


def pivot_statistics_native(
    logits,   # [B, Hp, G, T] float32  scaled logits of the pivots over their prompt rows
    lengths,  # [B, Hp] int32          prompt rows of each
    k_base,   # [B, Hp, K] int32       each pivot's K_base positions, -1 past its own L_base
):
  """``pallas_kernels.pivot_statistics_reference``'s computation in the native CPU kernel: (scores
  [B, Hp, T] float32, o'_t [B, Hp] float32). Raises RuntimeError when the kernel is not available. Works
  under jit, vmap and shard_map like :func:`pool_attention_native`."""
  _load()
  logits = jnp.asarray(logits, jnp.float32)
  if logits.ndim != 4:
    raise ValueError(f"logits must be [B, Hp, G, T], got {logits.shape}")
  B, Hp, _, T = logits.shape
  if jnp.shape(lengths) != (B, Hp) or jnp.ndim(k_base) != 3 or jnp.shape(k_base)[:2] != (B, Hp):
    raise ValueError(f"lengths must be [B, Hp] = {(B, Hp)} and k_base [B, Hp, K], got {jnp.shape(lengths)} and "
                     f"{jnp.shape(k_base)}")
  result = (jax.ShapeDtypeStruct((B, Hp, T), jnp.float32), jax.ShapeDtypeStruct((B, Hp), jnp.float32))
  call = jax.ffi.ffi_call(STATISTICS_TARGET, result, vmap_method="broadcast_all")
  return call(logits, jnp.asarray(lengths).astype(jnp.int32), jnp.asarray(k_base).astype(jnp.int32))


def topk_sets_native(
    scores,    # [..., T] float32
    sizes,     # [..., K] int32  set sizes, each in [0, min(cap, T)]
    cap: int,  # static, >= every size
):
  """``pallas_kernels.topk_sets``'s computation in the native CPU kernel: int32 [..., K, cap], for each size k
  the positions ``lax.top_k(scores, k)`` picks, ascending, -1 past k."""
  _load()
  scores = jnp.asarray(scores, jnp.float32)
  cap = int(cap)
  if scores.ndim < 1 or jnp.ndim(sizes) != scores.ndim or jnp.shape(sizes)[:-1] != scores.shape[:-1] or cap < 1:
    raise ValueError(f"scores must be [..., T] and sizes [..., K] with the same leading shape, cap >= 1; got "
                     f"{scores.shape}, {jnp.shape(sizes)}, cap {cap}")
  out = jax.ShapeDtypeStruct(tuple(jnp.shape(sizes)) + (cap,), jnp.int32)
  call = jax.ffi.ffi_call(TOPK_SETS_TARGET, out, vmap_method="broadcast_all")
  return call(scores, jnp.asarray(sizes).astype(jnp.int32), cap=np.int64(cap))


def page_select_native(
    q,              # [B, H, G, D]  queries of each KV head's group
    kmin,           # [B, H, P, D]  per-channel min key of each page
    kmax,           # [B, H, P, D]
    n_pages,        # [B] int32     selectable pages of each sequence
    n_select: int,  # static, in [1, P]
    counts=None,    # [B] int32 or None (every slot)
    how: str = "max",
):
  """``pallas_kernels.page_select_reference``'s computation in the native CPU kernel: (pages [B, H, n_select]
  int32, valid [B, H, n_select] bool). Works under jit and vmap (leading axes are looped by XLA)."""
  _load()
  if jnp.ndim(q) != 4 or jnp.ndim(kmin) != 4 or jnp.shape(kmin) != jnp.shape(kmax):
    raise ValueError(f"q must be [B, H, G, D] and kmin / kmax [B, H, P, D], got {jnp.shape(q)}, {jnp.shape(kmin)}, "
                     f"{jnp.shape(kmax)}")
  B, H, _, D = jnp.shape(q)
  P = jnp.shape(kmin)[2]
  if jnp.shape(kmin)[:2] != (B, H) or jnp.shape(kmin)[3] != D:
    raise ValueError(f"kmin / kmax must be [B, H, P, D] = [{B}, {H}, P, {D}], got {jnp.shape(kmin)}")
  if not 0 < n_select <= P:
    raise ValueError(f"n_select must be in [1, {P}] (the page axis), got {n_select}")
  if how not in PAGE_SELECT_RULES:
    raise ValueError(f"group page rule must be one of {PAGE_SELECT_RULES}, got {how!r}")
  counts = jnp.full((B,), n_select, jnp.int32) if counts is None else jnp.asarray(counts).astype(jnp.int32)
  result = (jax.ShapeDtypeStruct((B, H, n_select), jnp.int32), jax.ShapeDtypeStruct((B, H, n_select), jnp.bool_))
  call = jax.ffi.ffi_call(PAGE_SELECT_TARGET, result, vmap_method="sequential")
  f32 = lambda x: jnp.asarray(x).astype(jnp.float32)  # noqa: E731
  return call(f32(q), f32(kmin), f32(kmax), jnp.asarray(n_pages).astype(jnp.int32), counts,
              rule=np.int64(PAGE_SELECT_RULES.index(how)))


def page_recall_native(
    pool_k,          # [B, 1, R, D]  one device's pool (one shard)
    pool_v,          # [B, 1, R, D]
    pool_pos,        # [B, 1, R] int32  the original position of each pool row
    store_k,         # [B, H, T, D]  the layer's host store, the pool's dtype
    store_v,         # [B, H, T, D]
    offsets,         # [B, H] int32  each head's first pool row
    pending,         # [B, H, n] int32  the pages the slots should hold
    resident,        # [B, H, n] int32  the pages they hold
    start,           # [B] int32  rows before the first page slot of a region (FreeKV's sinks)
    k_sel,           # [B] int32  slots of each sequence (<= n)
    page_size: int,  # static
):
  """``pallas_kernels.page_recall_reference``'s computation in the native CPU kernel, the pool written in place
  (only the moved pages' rows): (pool_k, pool_v, pool_pos, resident' [B, H, n] int32, moved [B] int32). Under
  jit the pool should be donated, or XLA copies it first."""
  _load()
  if jnp.ndim(pool_k) != 4 or jnp.shape(pool_k)[1] != 1 or jnp.shape(pool_v) != jnp.shape(pool_k):
    raise ValueError(f"page_recall_native reads one device's pool [B, 1, R, D], got {jnp.shape(pool_k)}")
  if (jnp.ndim(store_k) != 4 or jnp.shape(store_v) != jnp.shape(store_k)
      or store_k.dtype != pool_k.dtype or store_v.dtype != pool_k.dtype):
    raise ValueError(f"the store must be [B, H, T, D] in the pool's dtype {pool_k.dtype}, got "
                     f"{jnp.shape(store_k)} {store_k.dtype}")
  if jnp.ndim(pending) != 3 or jnp.shape(resident) != jnp.shape(pending):
    raise ValueError(f"pending / resident must be [B, H, n], got {jnp.shape(pending)}, {jnp.shape(resident)}")
  if page_size < 1:
    raise ValueError(f"page_size must be >= 1, got {page_size}")
  i32 = lambda x: jnp.asarray(x).astype(jnp.int32)  # noqa: E731
  B = jnp.shape(pool_k)[0]
  result = (jax.ShapeDtypeStruct(jnp.shape(pool_k), pool_k.dtype), jax.ShapeDtypeStruct(jnp.shape(pool_v), pool_v.dtype),
            jax.ShapeDtypeStruct(jnp.shape(pool_pos), jnp.int32), jax.ShapeDtypeStruct(jnp.shape(pending), jnp.int32),
            jax.ShapeDtypeStruct((B,), jnp.int32))
  call = jax.ffi.ffi_call(PAGE_RECALL_TARGET, result, vmap_method="sequential",
                          input_output_aliases={0: 0, 1: 1, 2: 2})
  return call(pool_k, pool_v, i32(pool_pos), store_k, store_v, i32(offsets), i32(pending), i32(resident), i32(start),
              i32(k_sel), page_size=np.int64(page_size))


def gather_rows_native(
    pieces,           # [(src [rows, ...] C-contiguous, rows [n] int64 C-contiguous, dst [n, ...] C-contiguous)]
    threads: int = 1,  # threads to split the rows over (the caller's thread is one of them)
) -> None:
  """``dst[j] = src[rows[j]]`` for each piece, every row whole (``src[0]``'s bytes, the same dtype and row shape
  in ``dst``), on up to ``threads`` threads (rows split by count over all pieces). The GIL is released for the
  copy. ValueError for a piece whose layout the copy cannot take, IndexError for a row out of range (after the
  copy stopped: ``dst`` is then partly written). RuntimeError when the library is not available."""
  _load()
  n = len(pieces)
  if not n:
    return
  lib = _state["lib"]
  fn = lib.HeteroJaxGatherRows
  if fn.restype is not ctypes.c_int64:
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
  fields = []  # per piece: src address, src rows, rows address, row count, dst address, row bytes
  # id(rows) -> (int64 rows, address), alive until the call returns; ids stay unique while ``pieces`` holds
  # them. A recall's K and V pieces share their rows.
  made = {}
  for src, rows, dst in pieces:
    if not (src.flags.c_contiguous and dst.flags.c_contiguous and dst.flags.writeable) or src.ndim < 1:
      raise ValueError("gather_rows_native needs C-contiguous arrays (dst writable), got src "
                       f"{src.shape} and dst {dst.shape}")
    if id(rows) not in made:
      flat = np.ascontiguousarray(rows, np.int64).reshape(-1)
      made[id(rows)] = (flat, flat.ctypes.data)
    flat, at = made[id(rows)]
    if dst.dtype != src.dtype or dst.shape != (flat.size, *src.shape[1:]):
      raise ValueError(f"dst must be [{flat.size}, {', '.join(map(str, src.shape[1:]))}] {src.dtype}, got "
                       f"{dst.shape} {dst.dtype}")
    fields.append((src.ctypes.data, src.shape[0], at, flat.size, dst.ctypes.data,
                   src.itemsize * math.prod(src.shape[1:])))
  table = np.array(fields, np.int64).T.copy()  # [6, n]: one array, each field a row the call reads from
  at, step = table.ctypes.data, 8 * n
  bad = fn(n, *(at + i * step for i in range(6)), max(1, int(threads)))
  if bad >= 0:
    rows = made[id(pieces[bad][1])][0]
    src_n = int(table[1, bad])
    raise IndexError(f"row {int(rows[(rows < 0) | (rows >= src_n)][0])} is out of range for a source of {src_n} rows")


def gather_requests_native(
    requests,         # [(k [B, H, T, ...] C-contiguous, v [B, H, T, ...] C-contiguous, b, h, positions, shard, pool_row)]
    k_parts,          # [[chunk, ...] C-contiguous, k's dtype and row shape]: the staging parts, filled in order
    v_parts,          # [[chunk, ...] C-contiguous, v's dtype and row shape]
    ints: np.ndarray,  # [4, width] int32 C-contiguous: (b, shard, pool row, position) of each row
    threads: int = 1,  # threads to split the rows over (the caller's thread is one of them)
) -> tuple[int, int] | None:
  """A recall's rows in one call: request i's row j is ``k[b[j], h[j], positions[j]]`` (and v's), the recall's
  row g (requests in order) going to row ``g % chunk`` of part ``g // chunk`` and column g of ``ints``. A
  request's m rows are its positions [m]; each other index is [m] ints or one value for all m rows. Every (b, h,
  position) is checked before anything is written: returns None, or (request, axis) of the first out of range
  (axis 0 batch, 1 head, 2 position), nothing written. ValueError for a layout the call cannot take;
  RuntimeError when the library is not available."""
  _load()
  fn = _state["lib"].HeteroJaxGatherRequests
  if fn.restype is not ctypes.c_int64:
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
  k_parts, v_parts = list(k_parts), list(v_parts)
  if not k_parts or len(k_parts) != len(v_parts):
    raise ValueError(f"gather_requests_native needs as many V parts as K parts (at least one), got {len(k_parts)} "
                     f"and {len(v_parts)}")
  chunk = k_parts[0].shape[0]
  kept, fields, total = [], [], 0  # kept: the int64 indices, alive until the call returns
  for k, v, *indices in requests:
    if not (k.flags.c_contiguous and v.flags.c_contiguous) or k.ndim < 3 or k.shape[:3] != v.shape[:3]:
      raise ValueError(f"gather_requests_native needs C-contiguous K and V of one [B, H, T, ...], got {k.shape} "
                       f"and {v.shape}")
    flat = [np.ascontiguousarray(x, np.int64).reshape(-1) for x in indices]
    m = flat[2].size
    if any(x.size not in (1, m) for x in flat):
      raise ValueError(f"a request's indices must each have as many values as its positions ({m}) or one, got "
                       f"sizes {[x.size for x in flat]}")
    kept += flat
    fields.append([k.ctypes.data, v.ctypes.data, *k.shape[:3], k.itemsize * math.prod(k.shape[3:]),
                   v.itemsize * math.prod(v.shape[3:]), m] + [f for x in flat for f in (x.ctypes.data, int(x.size > 1))])
    total += m
  k0, v0 = (requests[0][0], requests[0][1]) if requests else (None, None)
  for parts, src in ((k_parts, k0), (v_parts, v0)):
    for p in parts:
      if (not p.flags.c_contiguous or not p.flags.writeable or p.shape[0] != chunk
          or (src is not None and (p.dtype != src.dtype or p.shape[1:] != src.shape[3:]))):
        raise ValueError(f"staging parts must be writable C-contiguous [{chunk}, ...] arrays of the sources' dtype "
                         f"and row shape, got {p.shape} {p.dtype}")
  if any(k.dtype != k0.dtype or v.dtype != v0.dtype or k.shape[3:] != k0.shape[3:] or v.shape[3:] != v0.shape[3:]
         for k, v, *_ in requests):
    raise ValueError("every request's K and V must have the first request's dtypes and row shapes")
  width = ints.shape[-1] if ints.ndim == 2 else 0
  if (ints.dtype != np.int32 or ints.shape != (4, width) or not ints.flags.c_contiguous or not ints.flags.writeable
      or width < total or chunk * len(k_parts) < total):
    raise ValueError(f"{total} rows need [4, >= {total}] writable C-contiguous int32 ints and parts of >= {total} "
                     f"rows in all, got ints {ints.shape} {ints.dtype} and {len(k_parts)} parts of {chunk}")
  if not requests:
    return None
  table = np.array(fields, np.int64).T.copy()  # [18, n]: each field a row the call reads from
  addresses = [np.array([p.ctypes.data for p in parts], np.uintp) for parts in (k_parts, v_parts)]
  bad = fn(len(requests), table.ctypes.data, addresses[0].ctypes.data, addresses[1].ctypes.data, chunk,
           ints.ctypes.data, width, max(1, int(threads)))
  return None if bad < 0 else (int(bad) // 3, int(bad) % 3)
