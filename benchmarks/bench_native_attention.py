"""Benchmark: the native CPU pool attention (pallas_kernels.native) against the grouped XLA attention.

One decode step's attention of one layer at SmolLM2-135M shapes (3 KV heads, G = 3, D = 64, B = 1):

- grouped: what the model runs today on the CPU, ``sparse_decode_attention_reference(finite_padding=True)``
  on separate head-group arrays, the groups' outputs joined (HeteroCache: a full group [B, 1, L, D] and a
  compressed group [B, 2, c, D]; full KV: one group [B, 3, L, D]);
- native: ``pool_attention_native`` over one row pool [B, P, D] holding every head's rows, each head at its
  own offset and length (the pool has 64 rows of slack per head, as a cache with room to grow does).

Layouts: ``hetero`` = one full head of L rows and two heads of round(0.07 L); ``full`` = 3 heads of L rows.
Both calls are jitted and timed alternately (median of --reps calls after warm-up), float32 by default.

    python benchmarks/bench_native_attention.py [--lengths 2048,8192,16384,32768] [--reps 200] [--dtype f32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels  # noqa: E402
from pallas_kernels import native  # noqa: E402

H, G, D, B = 3, 3, 64, 1
SLACK = 64
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def head_rows(layout: str, L: int) -> list[int]:
  return [L, L, L] if layout == "full" else [L, round(0.07 * L), round(0.07 * L)]


def make_case(layout: str, L: int, dtype, seed: int = 0):
  rows = head_rows(layout, L)
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((B, H, G, D)), dtype)
  ks = [jnp.asarray(rng.standard_normal((B, n, D)), dtype) for n in rows]
  vs = [jnp.asarray(rng.standard_normal((B, n, D)), dtype) for n in rows]
  # grouped: heads of one capacity share a group array
  if layout == "full":
    groups = [(jnp.stack(ks, 1), jnp.stack(vs, 1), jnp.full((B, 3), L, jnp.int32))]
  else:
    groups = [(ks[0][:, None], vs[0][:, None], jnp.full((B, 1), rows[0], jnp.int32)),
              (jnp.stack(ks[1:], 1), jnp.stack(vs[1:], 1), jnp.full((B, 2), rows[1], jnp.int32))]
  # pool: every head's rows, SLACK free rows after each
  pad = jnp.zeros((B, SLACK, D), dtype)
  k_pool = jnp.concatenate([x for k in ks for x in (k, pad)], axis=1)
  v_pool = jnp.concatenate([x for v in vs for x in (v, pad)], axis=1)
  offsets = np.cumsum([0] + [n + SLACK for n in rows[:-1]]).astype(np.int32)
  offsets = jnp.asarray(np.broadcast_to(offsets, (B, H)).copy())
  lengths = jnp.asarray(np.broadcast_to(np.asarray(rows, np.int32), (B, H)).copy())
  return q, groups, (k_pool, v_pool, offsets, lengths)


@jax.jit
def grouped(q, groups):
  outs, h = [], 0
  for k, v, lens in groups:
    n = k.shape[1]
    o, _ = pallas_kernels.sparse_decode_attention_reference(q[:, h:h + n], k, v, lens, finite_padding=True)
    outs.append(o)
    h += n
  return jnp.concatenate(outs, axis=1)


@jax.jit
def pooled(q, k_pool, v_pool, offsets, lengths):
  out, _, _ = native.pool_attention_native(q[:, :, None], k_pool, v_pool, offsets, lengths)
  return out[:, :, 0]


def time_pair(fa, fb, reps: int) -> tuple[float, float]:
  """Median microseconds of fa() and fb(), called alternately after a warm-up."""
  for _ in range(5):
    fa().block_until_ready()
    fb().block_until_ready()
  ta, tb = [], []
  for _ in range(reps):
    t0 = time.perf_counter()
    fa().block_until_ready()
    t1 = time.perf_counter()
    fb().block_until_ready()
    t2 = time.perf_counter()
    ta.append(t1 - t0)
    tb.append(t2 - t1)
  return statistics.median(ta) * 1e6, statistics.median(tb) * 1e6


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--lengths", default="2048,8192,16384,32768")
  ap.add_argument("--layouts", default="hetero,full")
  ap.add_argument("--reps", type=int, default=200)
  ap.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
  args = ap.parse_args(argv)
  if not native.available():
    print(f"native kernel unavailable: {native.unavailable_reason()}", file=sys.stderr)
    return 1
  dtype = DTYPES[args.dtype]
  print(f"native pool attention vs grouped XLA attention: B={B} H={H} G={G} D={D} {args.dtype}, "
        f"median of {args.reps} calls, jax {jax.__version__}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f} at the start")
  print("| layout | L | rows read | grouped XLA (us) | native (us) | native / grouped | max |diff| |")
  print("|---|---:|---:|---:|---:|---:|---:|")
  for layout in args.layouts.split(","):
    for L in (int(x) for x in args.lengths.split(",")):
      q, groups, pool = make_case(layout, L, dtype)
      ref = grouped(q, groups)
      out = pooled(q, *pool)
      diff = float(jnp.abs(ref.astype(jnp.float32) - out.astype(jnp.float32)).max())
      tg, tn = time_pair(lambda: grouped(q, groups), lambda: pooled(q, *pool), args.reps)
      print(f"| {layout} | {L} | {sum(head_rows(layout, L))} | {tg:.0f} | {tn:.0f} | {tn / tg:.2f} | {diff:.1e} |",
            flush=True)
  print(f"load average {os.getloadavg()[0]:.1f} at the end (the cores are shared: compare within a row)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
