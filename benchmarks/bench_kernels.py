"""Benchmark: the Pallas kernels of pallas_kernels (decode attention, pooled scores, drift check).

What it measures depends on the machine:

- Always (no GPU needed):
  1. CUDA lowering through Triton of every kernel (sparse_decode_attention,
     pooled_scores gqa=max/mean, drift_check, pool_attention) at SmolLM2-135M shapes
     (Hkv 3, G 3, D 64, S 8192) and Llama-3.1-8B shapes (Hkv 8, G 4, D 128;
     S 8K/32K/128K for decode, T 8K/32K for scoring), bf16 and f32:
     lowered yes/no, Triton custom call present, Triton module verified,
     lowering wall time. This is `jax.jit(f).trace(*abstract_args)
     .lower(lowering_platforms=("cuda",))`; nothing is compiled or run.
  2. Interpret-mode numerics (Pallas interpreter on CPU) vs the plain-JAX
     references at small shapes with ragged lengths (1, 17, ..., full).
  3. The bytes each decode kernel call must read at Llama-3.1-8B shapes for
     S = 8K/32K/128K and rho = 1, 0.5, 0.3, and the time that takes at an
     H100's nominal HBM bandwidth: a computed lower bound, not a measurement.
- Only when jax sees a GPU: times the kernel vs the reference at the
  Llama-3.1-8B decode shapes and reports achieved bandwidth against a
  measured copy bandwidth (`x + 0` over a large array), and the two GPU
  targets (>= 70 % of copy bandwidth from S = 32K; time falling with rho).
  Then times `pool_attention` (one launch per layer over a row pool) at
  Llama-3.1-8B shapes, contexts 32K and 128K, two full KV heads and six at
  about 0.1x the context, against the bytes of the heads' lengths, the copy
  bandwidth and one `sparse_decode_attention` launch per head group.
  Without a GPU that path is skipped and the output says so.

Writes JSON (config, commit, machine, every row) to benchmarks/out/kernels.json
and prints the markdown; `--write-results` also rewrites the `kernels` section
of benchmarks/RESULTS.md (other sections untouched).

    python benchmarks/bench_kernels.py [--write-results] [--no-progress] [--out PATH]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import common  # noqa: E402  (benchmarks/common.py)

SECTION = "kernels"
TRITON_CALL = "__gpu$xla.gpu.triton"   # custom-call target of a Pallas/Triton kernel (jax 0.10.x)

# H100 SXM5 80 GB nominal HBM3 bandwidth (NVIDIA datasheet), bytes/s.
H100_NOMINAL_BW = 3.35e12

KIB = 1024
# name, B, Hkv, G, D, decode capacities S, scoring prompt lengths T
MODELS = {
    "smollm2-135m": dict(B=1, Hkv=3, G=3, D=64, S=(8192,), T=(8192,)),
    "llama-3.1-8b": dict(B=1, Hkv=8, G=4, D=128, S=(8 * KIB, 32 * KIB, 128 * KIB), T=(8 * KIB, 32 * KIB)),
}
LLAMA = MODELS["llama-3.1-8b"]
LLAMA_LAYERS = 32
RHOS = (1.0, 0.5, 0.3)
SCORE_W = 5          # buffered query steps for pooled scores / drift check
DRIFT_L_BASE = 64
DRIFT_TAU = 0.5
BLOCK_K = 64         # sparse_decode_attention default block_k

# Interpret-mode numerics cases (small shapes; each distinct shape compiles once in the interpreter).
# decode: B, Hkv, G, D, S, dtype, block_k, num_splits
DECODE_NUMERICS = [
    (1, 3, 3, 64, 256, "float32", 64, None),
    (1, 3, 3, 64, 256, "bfloat16", 64, None),
    (1, 3, 4, 128, 256, "float32", 32, 4),
    (1, 3, 4, 128, 256, "bfloat16", 32, 4),
    (2, 2, 1, 64, 256, "float32", 16, 3),
    (1, 2, 8, 128, 200, "bfloat16", 64, 2),
]
# pooled: B, Hkv, W, G, D, T, dtype, block_t, gqa
POOLED_NUMERICS = [
    (1, 2, 2, 3, 64, 256, "float32", 64, "max"),
    (1, 2, 2, 3, 64, 256, "float32", 64, "mean"),
    (1, 2, 2, 4, 128, 256, "bfloat16", 32, "max"),
    (1, 2, 2, 4, 128, 256, "bfloat16", 32, "mean"),
]
# drift: B, Hp, W, G, D, T, dtype, L_base
DRIFT_NUMERICS = [
    (1, 3, 5, 3, 64, 256, "float32", 16),
    (1, 2, 5, 4, 128, 256, "bfloat16", 16),
]
# Compiled on a GPU, also at Llama-3.1-8B sizes (long ragged heads, several splits, the default blocks).
DECODE_NUMERICS_GPU = [
    (1, 8, 4, 128, 32 * 1024, "bfloat16", 64, None),
    (1, 8, 4, 128, 32 * 1024, "float32", 64, None),
    (2, 8, 4, 128, 8 * 1024, "bfloat16", 64, 8),
]
POOLED_NUMERICS_GPU = [
    (1, 8, 5, 4, 128, 8 * 1024, "bfloat16", 64, "max"),
    (1, 8, 5, 4, 128, 8 * 1024, "float32", 64, "mean"),
]
DRIFT_NUMERICS_GPU = [
    (1, 4, 5, 4, 128, 8 * 1024, "bfloat16", 512),
    (1, 4, 5, 4, 128, 8 * 1024, "float32", 512),
]
# Tolerances (abs) — the same as tests/test_kernels.py: the reference does float32 math on the same
# low-precision inputs, the bf16 kernel feeds p to the p@v dot in bf16.
DECODE_TOL = {"float32": dict(out=2e-5, lse=2e-5), "bfloat16": dict(out=3e-2, lse=1e-3)}
POOLED_TOL = {"float32": 1e-6, "bfloat16": 1e-5}     # scores are probabilities <= 1 (plus rtol 1e-4)
POOLED_RTOL = 1e-4


# ------------------------------------------------------------------ helpers
def _fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{n:,.0f} B"


def _len(n: int) -> str:
    return f"{n // KIB}K" if n % KIB == 0 else str(n)


def _fmt_us(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e6:,.1f}"


def _ragged_lengths(rng, B: int, H: int, S: int):
    """[B, H] int32 lengths in [1, S] that include 1, 17 (past a 16-key block) and S."""
    import numpy as np

    lens = rng.integers(1, S + 1, size=(B, H))
    flat = lens.reshape(-1)
    flat[0] = 1
    flat[-1] = S
    if flat.size > 2:
        flat[1] = min(S, 17)
    return lens.astype(np.int32)


def gpu_present() -> bool:
    import jax

    return any(d.platform == "gpu" for d in jax.devices())


class _TritonVerifier:
    """Runs the MLIR verifier on every Triton module the CUDA lowering builds (as the tests do)."""

    def __init__(self):
        self.results: list[bool] = []
        self._reg = None
        self._orig = None

    def __enter__(self):
        try:
            from jax._src.pallas.triton import pallas_call_registration as reg

            self._reg, self._orig = reg, reg.lowering.lower_jaxpr_to_triton_module
        except (ImportError, AttributeError):
            return self   # private API moved: lowering is still checked, just not verified

        def wrapped(*args, **kwargs):
            res = self._orig(*args, **kwargs)
            self.results.append(bool(res.module.operation.verify()))
            return res

        self._reg.lowering.lower_jaxpr_to_triton_module = wrapped
        return self

    def __exit__(self, *exc):
        if self._reg is not None:
            self._reg.lowering.lower_jaxpr_to_triton_module = self._orig
        return False

    @property
    def available(self) -> bool:
        return self._reg is not None


# ---------------------------------------------------------------- lowering
def lowering_jobs() -> list[dict[str, Any]]:
    jobs = []
    for model, m in MODELS.items():
        for S in m["S"]:
            for dtype in ("bfloat16", "float32"):
                jobs.append(dict(kernel="sparse_decode_attention", model=model, B=m["B"], Hkv=m["Hkv"], G=m["G"],
                                 D=m["D"], S=S, dtype=dtype))
        for T in m["T"]:
            for dtype in ("bfloat16", "float32"):
                for gqa in ("max", "mean"):
                    jobs.append(dict(kernel=f"pooled_scores[{gqa}]", model=model, B=m["B"], Hkv=m["Hkv"], G=m["G"],
                                     D=m["D"], S=T, W=SCORE_W, dtype=dtype, gqa=gqa))
                jobs.append(dict(kernel="drift_check", model=model, B=m["B"], Hkv=m["Hkv"], G=m["G"], D=m["D"], S=T,
                                 W=SCORE_W, dtype=dtype, L_base=DRIFT_L_BASE))
        # pool_attention: decode with the logits of every head over the prompt, and a 64-token chunk.
        S = m["S"][-1]
        for T, score_len in ((1, S), (64, 0)):
            jobs.append(dict(kernel="pool_attention" + ("[logits]" if score_len else f"[T={T}]"), model=model,
                             B=m["B"], Hkv=m["Hkv"], G=m["G"], D=m["D"], S=S, T=T, score_len=score_len,
                             dtype="bfloat16"))
    return jobs


def run_lowering(job: dict[str, Any]) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    import pallas_kernels as pk

    sds = jax.ShapeDtypeStruct
    dt = jnp.dtype(job["dtype"])
    B, H, G, D, S = job["B"], job["Hkv"], job["G"], job["D"], job["S"]
    lens = sds((B, H), jnp.int32)
    if job["kernel"] == "sparse_decode_attention":
        args = (sds((B, H, G, D), dt), sds((B, H, S, D), dt), sds((B, H, S, D), dt), lens)
        f: Callable = lambda q, k, v, l: pk.sparse_decode_attention(q, k, v, l)  # noqa: E731
    elif job["kernel"].startswith("pooled_scores"):
        gqa = job["gqa"]
        args = (sds((B, H, job["W"], G, D), dt), sds((B, H, S, D), dt), lens)
        f = lambda q, k, l: pk.pooled_scores(q, k, l, gqa=gqa)  # noqa: E731
    elif job["kernel"].startswith("pool_attention"):
        from pallas_kernels.pool_attention import pool_attention

        P = H * S // 3 + POOL_TAIL * H          # a compressed layer's pool
        T, score_len = job["T"], job["score_len"]
        args = (sds((B, H, T, G, D), dt), sds((B, P, D), dt), sds((B, P, D), dt), lens, lens, sds((H,), jnp.int32))
        f = lambda *a: pool_attention(*a, max_len=S, score_len=score_len)  # noqa: E731
    else:
        args = (sds((B, H, job["W"], G, D), dt), sds((B, H, S, D), dt), sds((B, H, job["L_base"]), jnp.int32), lens)
        f = lambda q, k, kb, l: pk.drift_check(q, k, kb, DRIFT_L_BASE, DRIFT_TAU, l, backend="pallas")  # noqa: E731

    jax.clear_caches()   # every lowering from scratch (inner jits included), so the time is comparable
    row = dict(job)
    with _TritonVerifier() as ver:
        t0 = time.perf_counter()
        try:
            text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            row["lowered"] = True
            row["error"] = None
        except Exception as e:  # noqa: BLE001 - reported, not raised
            text = ""
            row["lowered"] = False
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["lower_seconds"] = time.perf_counter() - t0
    row["triton_calls"] = text.count(TRITON_CALL)
    row["triton_call_present"] = row["triton_calls"] > 0
    row["triton_modules_verified"] = (all(ver.results) and bool(ver.results)) if ver.available else None
    row["stablehlo_chars"] = len(text)
    return row


# ---------------------------------------------------------------- numerics
def numerics_jobs(gpu: bool = False) -> list[tuple[str, tuple]]:
    """The numerics cases; on a GPU (compiled kernels) the small cases plus the Llama-sized ones."""
    jobs = ([("decode", c) for c in DECODE_NUMERICS] + [("pooled", c) for c in POOLED_NUMERICS]
            + [("drift", c) for c in DRIFT_NUMERICS])
    if gpu:
        jobs += ([("decode", c) for c in DECODE_NUMERICS_GPU] + [("pooled", c) for c in POOLED_NUMERICS_GPU]
                 + [("drift", c) for c in DRIFT_NUMERICS_GPU])
    return jobs


def run_numerics(kind: str, case: tuple, seed: int, compiled: bool = False) -> dict[str, Any]:
    """One numerics case: the kernel (Pallas interpreter, or compiled through Triton with ``compiled``) vs
    its plain-JAX reference on the same random inputs."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels as pk

    rng = np.random.default_rng([seed, 7])

    def rand(shape, dtype, scale=1.0):
        return jnp.asarray((scale * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)

    t0 = time.perf_counter()
    if kind == "decode":
        B, H, G, D, S, dtype, block_k, ns = case
        q, k, v = rand((B, H, G, D), dtype, 2.0), rand((B, H, S, D), dtype), rand((B, H, S, D), dtype)
        lens = _ragged_lengths(rng, B, H, S)
        # Garbage (NaN) beyond each head's length: the kernel must never read it.
        valid = np.arange(S)[None, None, :] < lens[..., None]
        kn = jnp.where(jnp.asarray(valid)[..., None], k, jnp.nan)
        vn = jnp.where(jnp.asarray(valid)[..., None], v, jnp.nan)
        got_o, got_l = pk.sparse_decode_attention(q, kn, vn, jnp.asarray(lens), block_k=block_k, num_splits=ns,
                                                  interpret=not compiled)
        want_o, want_l = pk.sparse_decode_attention_reference(q, k, v, jnp.asarray(lens))
        got_o, want_o = np.asarray(got_o, np.float32), np.asarray(want_o, np.float32)
        err_o = float(np.max(np.abs(got_o - want_o)))
        err_l = float(np.max(np.abs(np.asarray(got_l) - np.asarray(want_l))))
        tol = DECODE_TOL[dtype]
        finite = bool(np.isfinite(got_o).all() and np.isfinite(np.asarray(got_l)).all())
        row = dict(kernel="sparse_decode_attention", shape=f"B{B} Hkv{H} G{G} D{D} S{S}", dtype=dtype,
                   params=f"block_k={block_k}, num_splits={ns if ns is not None else 'default'}",
                   lengths=sorted({int(x) for x in lens.reshape(-1)}), nan_padding=True,
                   max_abs_err={"out": err_o, "lse": err_l}, tol={"out": tol["out"], "lse": tol["lse"]},
                   ok=finite and err_o <= tol["out"] and err_l <= tol["lse"])
    elif kind == "pooled":
        B, H, W, G, D, T, dtype, block_t, gqa = case
        q, k = rand((B, H, W, G, D), dtype, 3.0), rand((B, H, T, D), dtype)
        lens = _ragged_lengths(rng, B, H, T)
        got = np.asarray(pk.pooled_scores(q, k, jnp.asarray(lens), gqa=gqa, block_t=block_t,
                                          interpret=not compiled))
        want = np.asarray(pk.pooled_scores_reference(q, k, jnp.asarray(lens), gqa=gqa))
        valid = np.broadcast_to(np.arange(T)[None, None, None, :] < lens[:, :, None, None], got.shape)
        err = float(np.max(np.abs(got[valid] - want[valid])))
        tol = POOLED_TOL[dtype]
        within = bool(np.all(np.abs(got[valid] - want[valid]) <= tol + POOLED_RTOL * np.abs(want[valid])))
        invalid_ok = bool(np.all(got[~valid] == np.float32(pk.MASK_VALUE)))
        row = dict(kernel=f"pooled_scores[{gqa}]", shape=f"B{B} Hkv{H} W{W} G{G} D{D} T{T}", dtype=dtype,
                   params=f"block_t={block_t}", lengths=sorted({int(x) for x in lens.reshape(-1)}),
                   max_abs_err={"scores": err}, tol={"scores": f"{tol:g} + {POOLED_RTOL:g}*|ref|"},
                   invalid_filled=invalid_ok, ok=within and invalid_ok)
    else:
        B, H, W, G, D, T, dtype, L_base = case
        q, k = rand((B, H, W, G, D), dtype, 3.0), rand((B, H, T, D), dtype)
        lens = _ragged_lengths(rng, B, H, T)
        lens = np.maximum(lens, L_base).astype(np.int32)          # keep top-L_base well defined
        base_scores = pk.pooled_scores_reference(q[:, :, :1], k, jnp.asarray(lens))
        k_base = jax.lax.top_k(base_scores[:, :, 0], L_base)[1].astype(jnp.int32)
        ref = pk.drift_check(q, k, k_base, L_base, DRIFT_TAU, jnp.asarray(lens), backend="reference")
        got = pk.drift_check(q, k, k_base, L_base, DRIFT_TAU, jnp.asarray(lens),
                             backend="pallas" if compiled else "interpret")
        valid = np.arange(T)[None, None, :] < lens[..., None]
        gs, rs = np.asarray(got[2]), np.asarray(ref[2])
        err = float(np.max(np.abs(gs[valid] - rs[valid])))
        flags_equal = bool(np.array_equal(np.asarray(got[0]), np.asarray(ref[0])))
        # The normalised overlaps can differ only where the kernel's rounding reorders near-ties.
        ov_err = float(np.max(np.abs(np.asarray(got[1]) - np.asarray(ref[1]))))
        tol = POOLED_TOL[dtype]
        row = dict(kernel="drift_check", shape=f"B{B} Hp{H} W{W} G{G} D{D} T{T}", dtype=dtype,
                   params=f"L_base={L_base}, tau={DRIFT_TAU}", lengths=sorted({int(x) for x in lens.reshape(-1)}),
                   max_abs_err={"scores": err, "overlap": ov_err},
                   tol={"scores": f"{tol:g} + {POOLED_RTOL:g}*|ref|"},
                   drift_flags_equal=flags_equal,
                   ok=flags_equal and bool(np.all(np.abs(gs[valid] - rs[valid])
                                                  <= tol + POOLED_RTOL * np.abs(rs[valid]))))
    row["seconds"] = time.perf_counter() - t0
    row["mode"] = "compiled (Triton)" if compiled else "interpret"
    return row


# ------------------------------------------------------------ bytes (model)
def decode_bytes(S: int, rho: float, *, Hkv: int = LLAMA["Hkv"], G: int = LLAMA["G"], D: int = LLAMA["D"],
                 B: int = LLAMA["B"], itemsize: int = 2, block_k: int = BLOCK_K) -> dict[str, Any]:
    """Bytes one sparse_decode_attention call reads, each head keeping L = round(rho * S) slots.

    K and V: exactly L rows per head must be read (the kernel fetches ceil(L / block_k) * block_k rows at
    most, masked). Split partials: the kernel writes float32 (o, m, l) per (head, split, padded query row)
    and the XLA combine reads them back — the same for every rho (splits beyond L write empty partials).
    The dense reference reads all S rows of K and V whatever rho is.
    """
    from pallas_kernels import default_num_splits

    L = int(round(rho * S))
    rows = math.ceil(L / block_k) * block_k
    kv_exact = B * Hkv * 2 * L * D * itemsize
    kv_blocks = B * Hkv * 2 * min(rows, S) * D * itemsize
    dense = B * Hkv * 2 * S * D * itemsize
    ns = default_num_splits(S, block_k)
    split_len = math.ceil(math.ceil(S / ns) / block_k) * block_k
    ns = math.ceil(S / split_len)
    block_h = max(16, 1 << (G - 1).bit_length())
    partials = 2 * B * Hkv * ns * block_h * (D + 2) * 4           # written by the kernel + read by the combine
    total = kv_exact + partials
    return dict(S=S, rho=rho, L=L, num_splits=ns, kv_bytes=kv_exact, kv_bytes_block_rounded=kv_blocks,
                split_partial_bytes=partials, total_bytes=total, dense_kv_bytes=dense,
                h100_lower_bound_s=kv_exact / H100_NOMINAL_BW,
                h100_lower_bound_s_with_partials=total / H100_NOMINAL_BW,
                h100_lower_bound_s_32_layers=LLAMA_LAYERS * kv_exact / H100_NOMINAL_BW)


# ------------------------------------------------------------ GPU timing path
def _time_fn(fn, args, iters: int, warmup: int = 3, repeats: int = 5) -> float:
    """Seconds per call of fn(*args) after warm-up (compile excluded): ``iters`` calls dispatched back to back
    and waited for once, the median over ``repeats`` such runs.

    Back to back, the device runs one call while the host dispatches the next, so a call that takes the
    device longer than its dispatch is timed by the device; timing each call to its own wait (as this
    script did until commit a7c95bc) timed ~90 µs of dispatch and wait for any kernel under that on an
    H200 (RESULTS.md, kernels-gpu: 8K keys at rho 1, 0.5 and 0.3 all took 95-99 µs).
    """
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def _decode_inputs(rng, B: int, H: int, G: int, D: int, S: int):
    """Random bf16 q [B, H, G, D], k and v [B, H, S, D] for the GPU timings."""
    import jax.numpy as jnp
    import numpy as np

    return tuple(jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(jnp.bfloat16)
                 for shape in ((B, H, G, D), (B, H, S, D), (B, H, S, D)))


def measure_copy_bandwidth(nbytes: int = 1 << 30, iters: int = 20) -> dict[str, Any]:
    """Device copy bandwidth from a jitted `x + 0` over a large bf16 array: (read + write) / time."""
    import jax
    import jax.numpy as jnp

    n = nbytes // 2
    x = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda a: a + 0)
    t = _time_fn(f, (x,), iters)
    return dict(array_bytes=n * 2, seconds=t, bytes_moved=2 * n * 2, bandwidth=2 * n * 2 / t)


def gpu_timing(shapes: dict[str, Any] = LLAMA, capacities=None, rhos=RHOS, *, iters: int = 50,
               interpret: bool = False, copy_bytes: int = 1 << 30, progress=None) -> dict[str, Any]:
    """Time the kernel vs the reference at the decode shapes, bandwidth vs a measured copy.

    Runs only when a GPU is present (``interpret=True`` exists to smoke-test this code path on CPU at
    tiny shapes; its numbers mean nothing).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels as pk

    capacities = tuple(capacities or shapes["S"])
    B, H, G, D = shapes["B"], shapes["Hkv"], shapes["G"], shapes["D"]
    copy = measure_copy_bandwidth(copy_bytes, iters=max(3, iters // 2))
    kernel = jax.jit(lambda q, k, v, l: pk.sparse_decode_attention(q, k, v, l, interpret=interpret))
    ref = jax.jit(lambda q, k, v, l: pk.sparse_decode_attention_reference(q, k, v, l, finite_padding=True))
    rows = []
    rng = np.random.default_rng(0)
    for S in capacities:
        q, k, v = _decode_inputs(rng, B, H, G, D, S)
        for rho in rhos:
            L = int(round(rho * S))
            lens = jnp.full((B, H), L, jnp.int32)
            got, want = kernel(q, k, v, lens)[0], ref(q, k, v, lens)[0]
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
            t_k = _time_fn(kernel, (q, k, v, lens), iters)
            t_r = _time_fn(ref, (q, k, v, lens), iters)
            nb = decode_bytes(S, rho, Hkv=H, G=G, D=D, B=B)
            bw = nb["kv_bytes"] / t_k
            rows.append(dict(S=S, rho=rho, L=L, kernel_s=t_k, reference_s=t_r, speedup=t_r / t_k, max_abs_err_out=err,
                             kv_bytes=nb["kv_bytes"], achieved_bandwidth=bw,
                             fraction_of_copy_bandwidth=bw / copy["bandwidth"]))
            if progress is not None:
                progress.update(1)
        del q, k, v
    # Targets: bandwidth fraction >= 70 % from S = 32K (rho = 1), time falling with rho at each S.
    big = [r for r in rows if r["S"] >= 32 * KIB and r["rho"] == 1.0]
    frac_ok = all(r["fraction_of_copy_bandwidth"] >= 0.70 for r in big) if big else None  # None: no such shape
    falls = {}
    for S in capacities:
        ts = [r["kernel_s"] for r in sorted((r for r in rows if r["S"] == S), key=lambda r: -r["rho"])]
        falls[S] = all(b < a for a, b in zip(ts, ts[1:]))
    return dict(device=str(jax.devices()[0]), interpret=interpret, iters=iters, copy=copy, rows=rows,
                target_bandwidth_fraction_ge_70pct_from_32k=frac_ok, target_time_falls_with_rho=falls)


# pool_attention (one launch per layer over a row pool) at Llama-3.1-8B shapes, HeteroCache-like lengths.
POOL_CONTEXTS = (32 * KIB, 128 * KIB)
POOL_FULL_HEADS = (0, 5)        # KV heads of the layer that keep the full context (the rest are compressed)
POOL_COMPRESSED = 0.1           # a compressed head keeps about 0.1 x the context (0.08x .. 0.12x, per head)
POOL_TAIL = 256                 # rows of each head's region past its kept rows (room for generated tokens)
POOL_SPLITS = (None, 16, 128)   # num_splits timed (None: default_pool_num_splits)


def pool_layout(S: int, H: int = LLAMA["Hkv"], B: int = LLAMA["B"]):
    """HeteroCache-like per-head lengths at context S and the pool layout: (lengths [B, H], offsets [B, H],
    P). Heads POOL_FULL_HEADS keep S rows, the others about POOL_COMPRESSED * S (spread 0.08x-0.12x);
    each head's region has POOL_TAIL spare rows after its kept ones; regions are contiguous in head order."""
    import numpy as np

    frac = np.linspace(0.8, 1.2, H - len(POOL_FULL_HEADS)) * POOL_COMPRESSED
    lens, it = [], iter(frac)
    for h in range(H):
        lens.append(S if h in POOL_FULL_HEADS else max(1, int(round(next(it) * S))))
    lens = np.asarray(lens, np.int32)
    cap = lens + POOL_TAIL
    offs = np.concatenate([[0], np.cumsum(cap)[:-1]]).astype(np.int32)
    return np.tile(lens, (B, 1)), np.tile(offs, (B, 1)), int(cap.sum())


def pool_timing(shapes: dict[str, Any] = LLAMA, contexts=POOL_CONTEXTS, *, iters: int = 50, copy=None,
                splits=POOL_SPLITS, interpret: bool = False, progress=None) -> dict[str, Any]:
    """Time ``pool_attention`` (decode, T = 1, bf16) at Llama-3.1-8B shapes over a row pool with
    HeteroCache-like per-head lengths (:func:`pool_layout`); achieved bandwidth = the K+V bytes it must read
    (sum of the heads' lengths x D x 2 B, K and V) / time, against the measured copy bandwidth. Also times
    the layout it replaces: one ``sparse_decode_attention`` launch per head group (the full heads, then the
    compressed heads at their capacity). Runs only on a GPU (``interpret=True`` smoke-tests the code path on
    CPU at tiny ``shapes``/``contexts``; its numbers mean nothing)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels as pk
    from pallas_kernels.pool_attention import (default_pool_num_splits, pool_attention,
                                               pool_attention_reference)

    B, H, G, D = shapes["B"], shapes["Hkv"], shapes["G"], shapes["D"]
    if copy is None:
        copy = measure_copy_bandwidth(iters=max(3, iters // 2))
    rng = np.random.default_rng(1)
    bf16 = lambda shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(jnp.bfloat16)  # noqa: E731
    rows = []
    for S in contexts:
        lens_np, offs_np, P = pool_layout(S, H, B)
        lens, offs = jnp.asarray(lens_np), jnp.asarray(offs_np)
        q, k_pool, v_pool = bf16((B, H, 1, G, D)), bf16((B, P, D)), bf16((B, P, D))
        kv_bytes = int(lens_np.sum()) * 2 * D * 2
        want = pool_attention_reference(q, k_pool, v_pool, offs, lens, max_len=S)[0].astype(jnp.float32)
        for ns in splits:
            f = jax.jit(lambda q, k, v, o, l, ns=ns: pool_attention(q, k, v, o, l, max_len=S, num_splits=ns,
                                                                     interpret=interpret)[:2])
            row = dict(S=S, lengths=sorted({int(x) for x in lens_np.reshape(-1)}), pool_rows=P,
                       num_splits=ns if ns is not None else default_pool_num_splits(S), kv_bytes=kv_bytes,
                       mean_rho=float(lens_np.mean() / S))
            try:
                err = float(jnp.max(jnp.abs(f(q, k_pool, v_pool, offs, lens)[0].astype(jnp.float32) - want)))
                t = _time_fn(f, (q, k_pool, v_pool, offs, lens), iters)
                bw = kv_bytes / t
                row.update(ok=err <= DECODE_TOL["bfloat16"]["out"], max_abs_err_out=err, kernel_s=t,
                           achieved_bandwidth=bw, fraction_of_copy_bandwidth=bw / copy["bandwidth"])
            except Exception as e:  # noqa: BLE001 - a configuration Triton refuses is a result too
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
            rows.append(row)
        # The layout it replaces: one launch per head group (full heads at S, compressed heads at their capacity).
        full = [h for h in range(H) if h in POOL_FULL_HEADS]
        comp = [h for h in range(H) if h not in POOL_FULL_HEADS]
        cap_c = int(lens_np[:, comp].max()) + POOL_TAIL
        groups = [(bf16((B, len(full), G, D)), bf16((B, len(full), S, D)), bf16((B, len(full), S, D)),
                   jnp.asarray(lens_np[:, full])),
                  (bf16((B, len(comp), G, D)), bf16((B, len(comp), cap_c, D)), bf16((B, len(comp), cap_c, D)),
                   jnp.asarray(lens_np[:, comp]))]
        per_group = jax.jit(lambda gs: [pk.sparse_decode_attention(*g, interpret=interpret) for g in gs])
        t_groups = _time_fn(per_group, (groups,), iters)
        for r in rows:
            if r["S"] == S:
                r["per_group_s"] = t_groups
        del q, k_pool, v_pool, groups
        if progress is not None:
            progress.update(1)
    return dict(device=str(jax.devices()[0]), interpret=interpret, iters=iters, copy=copy, rows=rows,
                full_heads=POOL_FULL_HEADS, compressed=POOL_COMPRESSED, tail=POOL_TAIL)


def render_pool_timing(p: dict[str, Any] | None) -> list[str]:
    lines = ["### 5. pool_attention on a GPU (one launch per layer over a row pool)", ""]
    if p is None:
        return lines + ["**Not run: no GPU present.** With a GPU, this script times `pool_attention` (decode, bf16, "
                        f"B {LLAMA['B']}, Hkv {LLAMA['Hkv']}, G {LLAMA['G']}, D {LLAMA['D']}) over one row pool "
                        f"where KV heads {', '.join(map(str, POOL_FULL_HEADS))} keep the whole context and the others "
                        f"about {POOL_COMPRESSED:g}x of it, at contexts "
                        f"{', '.join(_len(s) for s in POOL_CONTEXTS)}, and one `sparse_decode_attention` launch per "
                        "head group for the same lengths.", ""]
    lines += [f"Device: {p['device']}; copy bandwidth {p['copy']['bandwidth'] / 1e12:.2f} TB/s; heads "
              f"{', '.join(map(str, p['full_heads']))} full, the others about {p['compressed']:g}x the context, "
              f"{p['tail']} spare rows per region. Achieved = K+V bytes of the heads' lengths / kernel time. "
              "'per group' = one `sparse_decode_attention` per head group (full, compressed) on the same lengths.",
              ""]
    rows = []
    for r in p["rows"]:
        if "kernel_s" in r:
            rows.append([_len(r["S"]), f"{r['mean_rho']:.3f}", _fmt_bytes(r["kv_bytes"]), str(r["num_splits"]),
                         _fmt_us(r["kernel_s"]), f"{r['achieved_bandwidth'] / 1e12:.2f}",
                         f"{100 * r['fraction_of_copy_bandwidth']:.0f} %", _fmt_us(r.get("per_group_s")),
                         f"{r['max_abs_err_out']:.2e}", "yes" if r["ok"] else "NO"])
        else:
            rows.append([_len(r["S"]), f"{r['mean_rho']:.3f}", _fmt_bytes(r["kv_bytes"]), str(r["num_splits"]),
                         "—", "—", "—", _fmt_us(r.get("per_group_s")), "—", f"NO: {r['error']}"])
    return lines + [common.markdown_table(["context", "mean rho", "K+V bytes", "num_splits", "kernel µs",
                                           "achieved TB/s", "of copy BW", "per group µs", "max abs err", "ok"],
                                          rows, "rrrrrrrrrl"), ""]


SWEEP_S = (32 * KIB, 128 * KIB)
SWEEP = dict(num_splits=(None, 32, 64, 128), block_k=(64, 128), num_warps=(4, 8), num_stages=(2, 3, 4))


def sweep_launch(iters: int = 20, capacities=SWEEP_S, progress=None) -> dict[str, Any]:
    """Time ``sparse_decode_attention`` over launch parameters (SWEEP) at Llama-3.1-8B shapes, rho 1, bf16.

    For choosing the defaults on a GPU (the first H200 run reached 18-47 % of copy bandwidth with the
    defaults: 128 programs for 8 KV heads). Each configuration is checked against the reference first.
    """
    import itertools

    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels as pk

    B, H, G, D = LLAMA["B"], LLAMA["Hkv"], LLAMA["G"], LLAMA["D"]
    copy = measure_copy_bandwidth(1 << 30, iters=10)
    ref = jax.jit(lambda q, k, v, l: pk.sparse_decode_attention_reference(q, k, v, l, finite_padding=True))
    rows = []
    rng = np.random.default_rng(0)
    for S in capacities:
        q, k, v = _decode_inputs(rng, B, H, G, D, S)
        lens = jnp.full((B, H), S, jnp.int32)
        want = ref(q, k, v, lens)[0].astype(jnp.float32)
        nbytes = decode_bytes(S, 1.0)["kv_bytes"]
        for ns, bk, nw, st in itertools.product(*SWEEP.values()):
            f = jax.jit(lambda q, k, v, l, ns=ns, bk=bk, nw=nw, st=st: pk.sparse_decode_attention(
                q, k, v, l, num_splits=ns, block_k=bk, num_warps=nw, num_stages=st))
            row = dict(S=S, num_splits=ns if ns is not None else pk.default_num_splits(S, bk), block_k=bk,
                       num_warps=nw, num_stages=st)
            try:
                err = float(jnp.max(jnp.abs(f(q, k, v, lens)[0].astype(jnp.float32) - want)))
                t = _time_fn(f, (q, k, v, lens), iters)
                row.update(ok=err <= DECODE_TOL["bfloat16"]["out"], max_abs_err=err, seconds=t,
                           fraction_of_copy_bandwidth=nbytes / t / copy["bandwidth"])
            except Exception as e:  # a configuration Triton refuses (shared memory, registers) is a result too
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
            rows.append(row)
            if progress is not None:
                progress.update(1)
        del q, k, v
    best = {}
    for S in capacities:
        done = [r for r in rows if r["S"] == S and r.get("ok")]
        if done:
            best[S] = min(done, key=lambda r: r["seconds"])
    return dict(device=str(jax.devices()[0]), copy=copy, rows=rows, best=best, iters=iters)


def render_sweep(sw: dict[str, Any]) -> str:
    lines = [f"Device {sw['device']}; copy bandwidth {sw['copy']['bandwidth'] / 1e12:.2f} TB/s; rho 1, bf16, B 1, "
             f"Hkv {LLAMA['Hkv']}, G {LLAMA['G']}, D {LLAMA['D']}; {sw['iters']} calls back to back per timing.", "",
             "| S | num_splits | block_k | num_warps | num_stages | µs | of copy BW | max abs err | ok |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for r in sorted(sw["rows"], key=lambda r: (r["S"], r.get("seconds", float("inf")))):
        if "seconds" in r:
            lines.append(f"| {_len(r['S'])} | {r['num_splits']} | {r['block_k']} | {r['num_warps']} | "
                         f"{r['num_stages']} | {r['seconds'] * 1e6:,.1f} | {100 * r['fraction_of_copy_bandwidth']:.0f} % "
                         f"| {r['max_abs_err']:.2e} | {'yes' if r['ok'] else 'NO'} |")
        else:
            lines.append(f"| {_len(r['S'])} | {r['num_splits']} | {r['block_k']} | {r['num_warps']} | "
                         f"{r['num_stages']} | — | — | — | NO: {r['error']} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- markdown
# ------------------------------------------------------ drift-check timing
DRIFT_TIMING_T = (16 * KIB, 32 * KIB)
DRIFT_TIMING_RHOS = (0.3, 0.5)
DRIFT_TIMING_LAYERS = 30   # SmolLM2-135M: one pivot in each of its 30 layers (the shipped profile has 14)


def drift_timing(*, iters: int = 7, lengths=DRIFT_TIMING_T, rhos=DRIFT_TIMING_RHOS,
                 layers: int = DRIFT_TIMING_LAYERS) -> dict[str, Any]:
    """Old vs new drift check, one check step of ``layers`` pivot layers at SmolLM2-135M shapes.

    Per layer (the batched check, as HeteroCache dispatched it before it scored one query per decode
    step inside the step, commit 2020b90; ``drift_check`` is still its kernel): B 1, one pivot, W 5 buffered steps,
    G 3, D 64, float32, T prompt keys; L_base from the shipped profile at rho (Eq. 7). "old" is the
    definition (``drift_check_reference``: lax.top_k of every buffered step, then the bitmap overlap),
    "new" is ``drift_check`` (the L_base-th largest by bisection on the float bits, no sort); both on
    the backend jax picks (on CPU both score with the jnp reference). Also timed alone: the pooled
    scores, and the ranking each needs after a drift (one lax.top_k of the latest step, skipped by
    ``lax.cond`` otherwise); the two selections alone on precomputed scores. All alternate within each
    repeat; median of ``iters`` repeats,
    each the wall time of the ``layers`` dispatches until all are ready (compile excluded).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels as pk
    from hetero_jax.profile.clustering import base_budget
    from hetero_jax.profile import load_profile, shipped_profile_path

    prof = load_profile(shipped_profile_path("smollm2-135m"))
    n = prof.roles.size
    m = MODELS["smollm2-135m"]
    G, D, W = m["G"], m["D"], SCORE_W
    mode = "pallas" if gpu_present() else "reference"
    rows = []
    for T in lengths:
        rng = np.random.default_rng(T)
        keys = [jnp.asarray(rng.standard_normal((1, 1, T, D), np.float32)) for _ in range(layers)]
        qs = [jnp.asarray(2.0 * rng.standard_normal((1, 1, W, G, D), np.float32)) for _ in range(layers)]
        lens = jnp.full((1, 1), T, jnp.int32)
        for rho in rhos:
            l_base = int(np.floor(base_budget(rho, n, prof.n_full, prof.n_compressed, T)))
            kb = [jax.lax.top_k(pk.pooled_scores_reference(q[:, :, :1], k, lens)[:, :, 0], l_base)[1]
                  for q, k in zip(qs, keys)]
            sc = [pk.scores(q, k, lens, backend=mode) for q, k in zip(qs, keys)]   # [1, 1, W, T] per layer

            def select_old(s, b):   # what the check did after scoring: lax.top_k of every step, bitmap overlap
                vals, idx = jax.lax.top_k(s, l_base)
                return pk.overlap_bitmap(jnp.where(vals > pk.MASK_VALUE * 0.5, idx, -1), b[:, :, None, :], T)

            def select_new(s, b):   # bisection select + exact membership of K_base, no sort
                return pk.topk_membership(s, l_base, jnp.broadcast_to(b[:, :, None, :], (1, 1, W, l_base))).sum(-1)

            def before(q, k, b):   # the check as of 69e668b: keys masked before the dot, then select_old
                valid = jnp.arange(T)[None, None, :] < lens[..., None]
                kf = jnp.where(valid[..., None], k, 0.0)
                x = jnp.einsum("bhwgd,bhtd->bhwgt", q, kf, precision=jax.lax.Precision.HIGHEST) / math.sqrt(D)
                x = jnp.where(valid[:, :, None, None, :], x, pk.MASK_VALUE)
                e = jnp.exp(x - x.max(-1, keepdims=True))
                p_ = jnp.pad(e / e.sum(-1, keepdims=True), ((0, 0),) * 4 + ((2, 2),))
                pooled = (sum(p_[..., i:i + T] for i in range(5)) / 5).max(axis=3)
                return select_old(jnp.where(valid[:, :, None, :], pooled, pk.MASK_VALUE), b)

            fns = {   # name -> (jitted fn, per-layer args)
                "before": (jax.jit(before), list(zip(qs, keys, kb))),
                "old": (jax.jit(lambda q, k, b: pk.drift_check_reference(q, k, b, l_base, 0.25, lens)),
                        list(zip(qs, keys, kb))),
                "new": (jax.jit(lambda q, k, b: pk.drift_check(q, k, b, l_base, 0.25, lens, backend=mode)),
                        list(zip(qs, keys, kb))),
                "scores": (jax.jit(lambda q, k: pk.scores(q, k, lens, backend=mode)), list(zip(qs, keys))),
                "select_old": (jax.jit(select_old), list(zip(sc, kb))),
                "select_new": (jax.jit(select_new), list(zip(sc, kb))),
                "rank_latest": (jax.jit(lambda s: jax.lax.top_k(s[:, :, -1], l_base)[1]), [(x,) for x in sc]),
            }
            for f, args in fns.values():   # compile
                jax.block_until_ready([f(*a) for a in args])
            f_old, f_new = fns["old"][0], fns["new"][0]
            agree = all(bool(jnp.array_equal(f_old(q, k, b)[0], f_new(q, k, b)[0]))
                        and float(jnp.max(jnp.abs(f_old(q, k, b)[1] - f_new(q, k, b)[1]))) < 1e-6
                        for q, k, b in zip(qs, keys, kb))
            times: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(iters):
                for name, (f, args) in fns.items():
                    t0 = time.perf_counter()
                    jax.block_until_ready([f(*a) for a in args])
                    times[name].append(time.perf_counter() - t0)
            med = {name: statistics.median(v) for name, v in times.items()}
            rows.append(dict(T=T, rho=rho, l_base=l_base, layers=layers, W=W, mode=mode, agree=agree,
                             seconds=med, seconds_all=times))
    return dict(rows=rows, iters=iters, profile=prof.role_counts())


def render_drift_timing(t: dict[str, Any]) -> str:
    lines = ["| prompt T | rho | L_base | before ms | old selection ms | new check ms | new / before | "
             "new / old selection | scores alone ms | selection alone, old: lax.top_k ms | selection alone, new: "
             "bisection ms | after a drift only: top-L_base of the latest step ms | same flags and overlaps |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for r in t["rows"]:
        s = r["seconds"]
        ms = lambda x: f"{x * 1e3:,.1f}"  # noqa: E731
        lines.append(f"| {_len(r['T'])} | {r['rho']} | {r['l_base']:,} | {ms(s['before'])} | {ms(s['old'])} | "
                     f"{ms(s['new'])} | {s['new'] / s['before']:.2f} | {s['new'] / s['old']:.2f} | "
                     f"{ms(s['scores'])} | {ms(s['select_old'])} | "
                     f"{ms(s['select_new'])} | {ms(s['rank_latest'])} | {'yes' if r['agree'] else 'NO'} |")
    return "\n".join(lines)


def render_markdown(report: dict[str, Any]) -> str:
    has_gpu = report["gpu_present"]
    title = "Pallas kernels on a GPU (bench_kernels.py)" if has_gpu else "Pallas kernels (bench_kernels.py)"
    lines = [common.section_header(title, report), ""]
    if not has_gpu:
        lines += [
            "**No GPU was available for this run** (`jax.devices()`: "
            + ", ".join(report["machine"]["jax"]["devices"]) + "). The GPU targets — decode kernel bandwidth "
            ">= 70 % of copy bandwidth from S = 32K, and decode time falling with rho — are **NOT measured** here. "
            "The script's GPU timing path (kernel vs reference at the Llama-3.1-8B decode shapes, achieved "
            "bandwidth vs a measured `x + 0` copy bandwidth) exists but **was not run**. What follows is what can "
            "be checked without a GPU: CUDA lowering through Triton, interpret-mode numerics, and a computed "
            "bytes/bandwidth lower bound.",
            "",
        ]
    # 1. lowering
    low = report["lowering"]
    n_ok = sum(r["lowered"] and r["triton_call_present"] for r in low)
    lines += [
        "### 1. CUDA lowering through Triton (no GPU needed)",
        "",
        "`jax.jit(f).trace(*ShapeDtypeStructs).lower(lowering_platforms=(\"cuda\",))` of each public entry point "
        "at model shapes (B = 1); \"Triton call\" = the `" + TRITON_CALL + "` custom call in the StableHLO; "
        "\"verified\" = MLIR verifier passed on every Triton module built. Nothing is compiled to PTX or run. "
        f"Scoring kernels use W = {SCORE_W} query steps; drift_check uses L_base = {DRIFT_L_BASE}. "
        f"Lowering time is wall time from a cleared JAX cache. **{n_ok}/{len(low)} lowered with the Triton call.**",
        "",
    ]
    rows = []
    for r in low:
        ver = {True: "yes", False: "NO", None: "n/a"}[r["triton_modules_verified"]]
        rows.append([r["kernel"], r["model"], f"Hkv {r['Hkv']}, G {r['G']}, D {r['D']}",
                     ("S " if r["kernel"].startswith(("sparse_decode_attention", "pool_attention")) else "T ")
                     + _len(r["S"]),
                     r["dtype"], "yes" if r["lowered"] else f"NO ({r['error']})",
                     f"yes ({r['triton_calls']})" if r["triton_call_present"] else "NO", ver,
                     f"{r['lower_seconds']:.2f}"])
    lines += [common.markdown_table(["kernel", "model", "heads", "length", "dtype", "lowered", "Triton call",
                                     "verified", "lower s"], rows, "lllrlllcr"), ""]
    # 2. numerics
    num = report["numerics"]
    n_ok = sum(r["ok"] for r in num)
    compiled = bool(num) and num[0].get("mode", "interpret") != "interpret"
    lines += [
        "### 2. Compiled (Triton) numerics on the GPU vs the plain-JAX reference" if compiled else
        "### 2. Interpret-mode numerics vs the plain-JAX reference (CPU)",
        "",
        ("The kernels compiled through Triton and run on the GPU (`interpret=False`; drift_check with backend "
         "'pallas'), at the interpret cases' small shapes and at Llama-3.1-8B sizes (32K / 8K keys), " if compiled
         else "Pallas interpreter (`interpret=True`) ")
        + "vs `*_reference` on the same inputs (the reference does float32 "
        "math). Lengths are ragged per head and include 1 and the full length; decode inputs hold NaN beyond each "
        "head's length (the kernel must never read them). Tolerances are those of tests/test_kernels.py. "
        f"**{n_ok}/{len(num)} within tolerance.**",
        "",
    ]
    rows = []
    for r in num:
        err = ", ".join(f"{k} {v:.2e}" for k, v in r["max_abs_err"].items())
        tol = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in r["tol"].items())
        extra = ""
        if "drift_flags_equal" in r:
            extra = f"; drift flags equal: {'yes' if r['drift_flags_equal'] else 'NO'}, " \
                    f"max overlap difference {r['max_abs_err']['overlap']:.3g}"
        if "invalid_filled" in r:
            extra = f"; t >= L = MASK_VALUE: {'yes' if r['invalid_filled'] else 'NO'}"
        lens = r["lengths"]
        lens_s = ", ".join(map(str, lens)) if len(lens) <= 6 else ", ".join(map(str, lens[:5])) + ", …"
        rows.append([r["kernel"], r["shape"], r["dtype"], r["params"], lens_s, err + extra, tol,
                     "yes" if r["ok"] else "NO"])
    lines += [common.markdown_table(["kernel", "shape", "dtype", "params", "lengths", "max abs error", "tolerance",
                                     "ok"], rows, "llllllll"), ""]
    if compiled:
        lines += ["(The drift check's scores are compared at valid positions; its flags must be equal.)", ""]
    # 3. bytes
    lines += [
        "### 3. Bytes read per decode kernel call at Llama-3.1-8B shapes — computed lower bound, NOT a measurement",
        "",
        f"One `sparse_decode_attention` call = one layer, B = 1, Hkv = {LLAMA['Hkv']}, D = {LLAMA['D']}, bf16; every "
        "KV head keeps L = rho * S slots (uniform across heads); K+V bytes = Hkv * 2 * L * D * 2 B, what any "
        "kernel must read (the kernel's block rounding to "
        f"{BLOCK_K} keys adds at most {BLOCK_K} rows per head). \"+ partials\" adds the float32 split partials "
        "(o, m, l) the kernel writes and the XLA combine reads back (independent of rho; q and the output are "
        f"negligible). Time = bytes / {H100_NOMINAL_BW / 1e12:.2f} TB/s, the nominal HBM3 bandwidth of an H100 SXM5: "
        "no kernel can be faster, a real one reaches a fraction of it (the GPU target is >= 70 % of *measured* "
        "copy bandwidth). The per-token column is the K+V bound times 32 layers (attention reads only). The dense "
        "reference reads at least all S slots of K and V whatever rho is.",
        "",
    ]
    rows = []
    for r in report["decode_bytes"]:
        rows.append([_len(r["S"]), f"{r['rho']:g}", f"{r['L']:,}", f"{r['kv_bytes']:,}",
                     _fmt_bytes(r["kv_bytes"]), f"{r['num_splits']}: {_fmt_bytes(r['split_partial_bytes'])}",
                     _fmt_us(r["h100_lower_bound_s"]), _fmt_us(r["h100_lower_bound_s_with_partials"]),
                     _fmt_us(r["h100_lower_bound_s_32_layers"]), _fmt_bytes(r["dense_kv_bytes"])])
    lines += [common.markdown_table(["S", "rho", "L per head", "K+V bytes / call", "(binary units)",
                                     "splits: partials", "H100 bound µs (K+V)", "µs (+ partials)",
                                     f"µs / token, K+V x {LLAMA_LAYERS} layers", "dense reference reads"], rows,
                                    "rrrrrrrrrr"), ""]
    # 4. GPU timing
    lines += ["### 4. GPU timing (kernel vs reference, achieved vs copy bandwidth)", ""]
    g = report["gpu_timing"]
    if g is None:
        lines += ["**Not run: no GPU present.** With a GPU, this script times `sparse_decode_attention` and the "
                  "reference at the shapes of section 3 (median of N calls after warm-up), measures copy bandwidth "
                  "with a jitted `x + 0` over a 1 GiB bf16 array, and reports achieved bandwidth, its fraction of "
                  "copy bandwidth and both GPU targets. No number in this section exists for this run.", ""]
    else:
        c = g["copy"]
        lines += [f"Device: {g['device']}; {g['iters']} timed calls each (median); copy bandwidth "
                  f"(`x + 0`, {_fmt_bytes(c['array_bytes'])}): **{c['bandwidth'] / 1e12:.2f} TB/s**.", ""]
        rows = [[_len(r["S"]), f"{r['rho']:g}", _fmt_us(r["kernel_s"]), _fmt_us(r["reference_s"]),
                 f"{r['speedup']:.2f}x", f"{r['achieved_bandwidth'] / 1e12:.2f}",
                 f"{100 * r['fraction_of_copy_bandwidth']:.0f} %", f"{r.get('max_abs_err_out', float('nan')):.2e}"]
                for r in g["rows"]]
        lines += [common.markdown_table(["S", "rho", "kernel µs", "reference µs", "speedup", "achieved TB/s",
                                         "of copy BW", "max abs err vs reference (out)"], rows, "rrrrrrrr"), ""]
        falls = ", ".join(f"{_len(int(S))} {'yes' if ok else 'NO'}" for S, ok in g["target_time_falls_with_rho"].items())
        lines += [f"- Target bandwidth >= 70 % of copy from S = 32K (rho 1): "
                  f"**{ {True: 'met', False: 'NOT met', None: 'no shape >= 32K timed'}[g['target_bandwidth_fraction_ge_70pct_from_32k']]}**",
                  f"- Target time falling with rho: {falls}", ""]
    lines += render_pool_timing(report.get("pool_timing"))
    lines.append(f"Wall time of the whole run: {report['wall_seconds']:.1f} s. JSON: `{report['json_path']}`.")
    return "\n".join(lines)


# -------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = common.argument_parser(__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(common.OUT_DIR / "kernels.json"), help="JSON output path "
                    "(default: benchmarks/out/kernels.json)")
    ap.add_argument("--write-results", action="store_true",
                    help=f"rewrite the '{SECTION}' section of benchmarks/RESULTS.md (created if missing)")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    ap.add_argument("--skip-lowering", action="store_true", help="skip the CUDA lowering checks")
    ap.add_argument("--skip-numerics", action="store_true", help="skip the interpret-mode numerics")
    ap.add_argument("--gpu-iters", type=int, default=50, help="timed calls per configuration on a GPU (default 50)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the numerics inputs (default 0)")
    ap.add_argument("--drift-timing", action="store_true",
                    help="only time the drift check, old (lax.top_k) vs new (bisection select), at SmolLM2 shapes; "
                         "--write-results rewrites the 'kernels-drift-check' section")
    ap.add_argument("--drift-iters", type=int, default=7, help="repeats of each drift-check timing (default 7)")
    ap.add_argument("--sweep", action="store_true",
                    help="only time the decode kernel over launch parameters (num_splits, block_k, num_warps, "
                         "num_stages) at Llama-3.1-8B shapes, 32K and 128K (needs a GPU); writes kernels-sweep.json "
                         "beside --out and, with --write-results, the 'kernels-gpu-sweep' section")
    args = ap.parse_args(argv)
    if args.drift_timing:
        return drift_timing_main(args, argv)
    if args.sweep:
        return sweep_main(args, argv)

    from tqdm import tqdm

    t_start = time.perf_counter()
    machine = common.machine_info()
    has_gpu = gpu_present()
    low_jobs = [] if args.skip_lowering else lowering_jobs()
    num_jobs = [] if args.skip_numerics else numerics_jobs(gpu=has_gpu)
    n_gpu = len(LLAMA["S"]) * len(RHOS) + len(POOL_CONTEXTS) if has_gpu else 0
    config = dict(models=MODELS, rhos=RHOS, score_W=SCORE_W, drift_L_base=DRIFT_L_BASE, drift_tau=DRIFT_TAU,
                  block_k=BLOCK_K, h100_nominal_bandwidth=H100_NOMINAL_BW, decode_numerics=DECODE_NUMERICS,
                  pooled_numerics=POOLED_NUMERICS, drift_numerics=DRIFT_NUMERICS, decode_tol=DECODE_TOL,
                  pooled_tol=POOLED_TOL, pooled_rtol=POOLED_RTOL, seed=args.seed, gpu_iters=args.gpu_iters,
                  skip_lowering=args.skip_lowering, skip_numerics=args.skip_numerics)

    lowering, numerics = [], []
    with tqdm(total=len(low_jobs) + len(num_jobs) + n_gpu, desc="kernels", unit="check",
              disable=args.no_progress, file=sys.stderr) as bar:
        for job in low_jobs:
            bar.set_postfix_str(f"lower {job['kernel']} {job['model']} {_len(job['S'])} {job['dtype']}")
            lowering.append(run_lowering(job))
            bar.update(1)
        for i, (kind, case) in enumerate(num_jobs):
            bar.set_postfix_str(f"{'compiled' if has_gpu else 'interpret'} {kind} {case}")
            numerics.append(run_numerics(kind, case, args.seed * 1000 + i, compiled=has_gpu))
            bar.update(1)
        gpu = pool = None
        if has_gpu:
            bar.set_postfix_str("GPU timing")
            gpu = gpu_timing(iters=args.gpu_iters, progress=bar)
            bar.set_postfix_str("GPU timing: pool_attention")
            pool = pool_timing(iters=args.gpu_iters, copy=gpu["copy"], progress=bar)

    out = Path(args.out)
    report = common.report_header("kernels", config, machine)
    report.update(
        gpu_present=has_gpu,
        gpu_targets_measured=has_gpu,
        note=None if has_gpu else ("No GPU available for this run: the GPU targets (bandwidth fraction >= 70% "
                                   "from 32K, time falling with rho) were NOT measured; the GPU timing path "
                                   "was not run. decode_bytes is a computed lower bound, not a measurement."),
        lowering=lowering,
        numerics=numerics,
        decode_bytes=[decode_bytes(S, rho) for S in LLAMA["S"] for rho in RHOS],
        gpu_timing=gpu,
        gpu_timing_run=gpu is not None,
        pool_timing=pool,
        json_path=os.path.relpath(out.resolve(), REPO) if str(out.resolve()).startswith(str(REPO)) else str(out),
    )
    report["wall_seconds"] = time.perf_counter() - t_start
    md = render_markdown(report)
    report["markdown"] = md
    common.write_json(out, report)
    print(md)
    print(f"\nwrote {out}")
    if args.write_results:
        # a GPU run has its own section: make bench's CPU run (interpret numerics, no timing) keeps "kernels"
        section = SECTION + "-gpu" if has_gpu else SECTION
        print(f"updated section '{section}' of {common.update_results_section(section, md)}")
    failed = [r for r in lowering if not (r["lowered"] and r["triton_call_present"])] + \
             [r for r in numerics if not r["ok"]]
    return 1 if failed else 0


def sweep_main(args, argv) -> int:
    from tqdm import tqdm

    if not gpu_present():
        raise SystemExit("--sweep times compiled kernels: it needs a GPU (jax.devices() has none)")
    machine, git = common.machine_info(), common.git_info()
    n = len(SWEEP_S) * math.prod(len(v) for v in SWEEP.values())
    with tqdm(total=n, desc="sweep", disable=args.no_progress, file=sys.stderr) as bar:
        sw = sweep_launch(progress=bar)
    md = "\n".join([common.results_header("Decode kernel launch parameters on a GPU (bench_kernels.py --sweep)",
                                           machine, git, common.command_line(argv)), "", render_sweep(sw)])
    out = Path(args.out).with_name("kernels-sweep.json")
    common.write_json(out, {**common.report_header("kernels-sweep", vars(args), machine), **sw, "markdown": md})
    print(md)
    print(f"\nwrote {out}")
    if args.write_results:
        print(f"updated section 'kernels-gpu-sweep' of {common.update_results_section('kernels-gpu-sweep', md)}")
    return 0


def drift_timing_main(args, argv) -> int:
    import jax

    machine, git = common.machine_info(), common.git_info()
    t = drift_timing(iters=args.drift_iters)
    md = "\n".join([
        common.results_header("Drift check: old (lax.top_k) vs new (bisection select), SmolLM2-135M shapes",
                              machine, git, common.command_line(argv)), "",
        f"One check step: {DRIFT_TIMING_LAYERS} layers x 1 pivot (B 1, W {SCORE_W} buffered steps, G 3, D 64, "
        f"float32, {t['rows'][0]['mode']} scores on {jax.default_backend()}), L_base of the shipped profile "
        f"({t['profile']}) at rho (Eq. 7). Wall ms of the {DRIFT_TIMING_LAYERS} dispatches until all are ready, "
        f"median of {t['iters']} repeats, all variants alternating (compile excluded). before = the check as "
        "of commit 69e668b (keys masked before the score dot, which kept XLA:CPU off its matmul, then lax.top_k of "
        "every buffered step + bitmap overlap); old selection = `drift_check_reference` (today's scores, then "
        "that lax.top_k selection); new = `drift_check` (L_base-th largest by a 32-pass bisection on the "
        "float32 bits, exact lax.top_k membership of K_base, no sort). 'scores alone' (today's "
        "`pooled_scores_reference` on CPU) is common to old selection and new; the selections are also timed "
        "alone on precomputed scores. "
        "The last timing column is the one top-k the new check still needs, on precomputed scores, only on a "
        "check where a pivot drifted (new K_base and recall rows; skipped by lax.cond otherwise).", "",
        render_drift_timing(t)])
    out = Path(args.out).with_name("kernels-drift-check.json")
    common.write_json(out, {**common.report_header("kernels-drift-check", vars(args), machine), **t})
    print(md)
    print(f"\nwrote {out}")
    if args.write_results:
        print(f"updated section 'kernels-drift-check' of {common.update_results_section('kernels-drift-check', md)}")
    return 0 if all(r["agree"] for r in t["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
