"""What ``bench_kernels.py`` times, only on a GPU (``interpret=True`` smoke-tests a path on a CPU at tiny shapes;
its numbers mean nothing there): the decode kernel against its reference and a measured copy bandwidth, the pool
kernel against one launch per head group, the decode kernel's launch parameters, and the drift check old vs new."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from kernel_cases import (DECODE_TOL, KIB, LLAMA, MODELS, POOL_COMPRESSED, POOL_CONTEXTS, POOL_FULL_HEADS, POOL_PAGE,
                          POOL_PAGED_RHO, POOL_SPLITS, POOL_TAIL, RHOS, SCORE_W, decode_bytes, gpu_present)


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


# ------------------------------------------------------------ pool_attention timing
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
    compressed heads at their capacity), and paged heads (in-device Quest's read: :func:`paged_layout`). Runs
    only on a GPU (``interpret=True`` smoke-tests the code path on CPU at tiny ``shapes``/``contexts``; its
    numbers mean nothing)."""
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
            rows.append(_pool_row(row, f, (q, k_pool, v_pool, offs, lens), want, copy, iters))
        rows.append(_paged_row(S, shapes, bf16, rng, copy, interpret, iters))
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
            if r["S"] == S and "layout" not in r:
                r["per_group_s"] = t_groups
        del q, k_pool, v_pool, groups
        if progress is not None:
            progress.update(1)
    return dict(device=str(jax.devices()[0]), interpret=interpret, iters=iters, copy=copy, rows=rows,
                full_heads=POOL_FULL_HEADS, compressed=POOL_COMPRESSED, tail=POOL_TAIL)


def paged_layout(S: int, H: int, B: int, rng, page: int = POOL_PAGE, rho: float = POOL_PAGED_RHO):
    """In-device Quest's decode read: every head's region holds the S-row context (regions back to back), and
    the head attends round(rho S / page) of its pages, drawn at random and in no order (Quest's best first).
    Returns (block_rows [B, H, NB] region rows of each attended page, lengths [B, H], offsets [B, H], P)."""
    import numpy as np

    nb = max(1, int(round(rho * S / page)))
    pages = np.stack([np.stack([rng.permutation(S // page)[:nb] for _ in range(H)]) for _ in range(B)])
    offs = np.tile(np.arange(H, dtype=np.int32) * S, (B, 1))
    return (pages * page).astype(np.int32), np.full((B, H), nb * page, np.int32), offs, H * S


def _paged_row(S: int, shapes, bf16, rng, copy, interpret: bool, iters: int) -> dict[str, Any]:
    """One timing of ``pool_attention`` over paged heads (``block_rows``: :func:`paged_layout`), against the
    reference; achieved bandwidth = the attended pages' K+V bytes / time."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.pool_attention import pool_attention, pool_attention_reference

    B, H, G, D = shapes["B"], shapes["Hkv"], shapes["G"], shapes["D"]
    blocks_np, lens_np, offs_np, P = paged_layout(S, H, B, rng)
    blocks, lens, offs = jnp.asarray(blocks_np), jnp.asarray(lens_np), jnp.asarray(offs_np)
    q, k_pool, v_pool = bf16((B, H, 1, G, D)), bf16((B, P, D)), bf16((B, P, D))
    n = int(lens_np.max())
    kv_bytes = int(lens_np.sum()) * 2 * D * 2
    row = dict(S=S, layout=f"paged, {POOL_PAGE}-row pages", lengths=[n], pool_rows=P, num_splits="default",
               kv_bytes=kv_bytes, mean_rho=float(lens_np.mean() / S))
    kw = dict(max_len=n, block_size=POOL_PAGE)
    want = pool_attention_reference(q, k_pool, v_pool, offs, lens, None, blocks, **kw)[0].astype(jnp.float32)
    f = jax.jit(lambda q, k, v, o, l, b: pool_attention(q, k, v, o, l, None, b, interpret=interpret, **kw)[:2])
    return _pool_row(row, f, (q, k_pool, v_pool, offs, lens, blocks), want, copy, iters)


def _pool_row(row: dict, f, args: tuple, want, copy, iters: int) -> dict[str, Any]:
    """``row`` with ``f(*args)``'s output checked against ``want`` (bf16 tolerance), its time and bandwidth
    (``row["kv_bytes"]`` / time, against the copy bandwidth), or the error a configuration raised."""
    import jax.numpy as jnp

    try:
        err = float(jnp.max(jnp.abs(f(*args)[0].astype(jnp.float32) - want)))
        t = _time_fn(f, args, iters)
        bw = row["kv_bytes"] / t
        row.update(ok=err <= DECODE_TOL["bfloat16"]["out"], max_abs_err_out=err, kernel_s=t,
                   achieved_bandwidth=bw, fraction_of_copy_bandwidth=bw / copy["bandwidth"])
    except Exception as e:  # noqa: BLE001 - a configuration Triton refuses is a result too
        row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
    return row


# ------------------------------------------------------------ launch-parameter sweep
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
