#!/usr/bin/env python
"""Host offload: the recall path the policies call, its gather and transfer speed, and its overlap with compute.

A HeteroCache recall (and SyncKV's and FreeKV's fetches) gathers rows of the pinned-host store straight into
the store's staging rows (pinned host arrays on a GPU), starts their host -> device copies and writes them into
the device row pool (``host_store.write_host_rows``). This script times that function, at
Llama-3.1-8B head shapes (8 KV heads of 128, bfloat16), for 8K to 128K rows (``--rows`` per head, x 8 heads
x ``--recall-layers``) from a store of ``--prompt`` tokens per head:

- **gather**: the host seconds it spends gathering, as GB/s, beside a plain memcpy
  (``np.copyto``) of the same bytes on this machine, in a loop over one buffer, and from the store itself
  (a contiguous span at a random page each time: the memory the gather reads, in order);
- **transfer**: starting the copies, the scatter and waiting for it, as GB/s, beside one contiguous
  ``jax.device_put`` of the same bytes;
- **recall**: both, end to end;
- **prefill's offload**: one layer's K and V to pinned host memory (``HostKVStore.put``), device -> host
  GB/s at ``--d2h-tokens`` per head, and the first put of each size apart (the one that may allocate fresh
  pinned memory: HeteroCache's prefill puts every layer once);
- with ``--overlap`` (meant for a GPU): a decode-shaped device workload (the 32 layers' MLP weights applied
  to one token) dispatched first, the largest recall on the host thread meanwhile; overlap = (compute +
  recall - both) / min(compute, recall) (1: hidden, 0: serialised).

Medians of ``--iters`` repeats after warm-up, each recall fetching other rows than the last (its layer's draw
turned by a random shift per head: the same rows every time would be served from the caches where they fit).
On a CPU "pinned host" and device are the same memory: the transfer column is a copy inside RAM, not a PCIe link.
Writes JSON and the markdown; ``--write-results`` rewrites the ``offload`` section of ``--results-file`` (RESULTS.md;
``offload-gpu`` on a GPU; ``--section NAME`` another; a ``--small`` run only with ``--section`` or another file).

    python benchmarks/bench_offload.py --write-results                     # this machine
    python benchmarks/bench_offload.py --overlap --write-results           # on a GPU
    python benchmarks/bench_offload.py --small                             # smoke test
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402  (benchmarks/common.py)

SECTION = "offload"
LLAMA = dict(layers=32, hidden=4096, inter=14336, kv_heads=8, head_dim=128)
SMALL = dict(layers=2, hidden=256, inter=512, kv_heads=2, head_dim=64)
GiB = 2**30


def _wall_times(fn, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _median_time(fn, iters: int) -> float:
    return statistics.median(_wall_times(fn, iters))


def _store_spans(store, n_layers: int, nbytes: int, rng, count: int) -> list[tuple]:
    """``count`` pairs of contiguous byte spans of the store itself, each ``nbytes // 2`` long at a page picked at
    random, the first of a pair in a K layer and the second in a V layer: the memory a recall's gather reads
    (beyond the caches where the store is larger than they are), to copy in order. Views, no copy."""
    import numpy as np

    half, pairs = nbytes // 2, []
    for _ in range(count):
        pair = []
        for j, li in enumerate(rng.integers(0, n_layers, 2)):
            k, v = store.view(int(li))
            span = (v if j or k is None else k).reshape(-1).view(np.uint8)  # holds half: main checks --prompt
            at = int(rng.integers(0, (span.size - half) // 4096 + 1)) * 4096
            pair.append(span[at : at + half])
        pairs.append(tuple(pair))
    return pairs


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hetero_jax.model.cache import new_pool
    from hetero_jax.model.host_store import HostKVStore, pinned_host, write_host_rows

    shp = SMALL if args.small else LLAMA
    H, D, T = shp["kv_heads"], shp["head_dim"], args.prompt
    n_rec = args.recall_layers
    dt = jnp.dtype(args.dtype)
    key = jax.random.key(0)

    @functools.partial(jax.jit, static_argnums=(1,))
    def draw(k, shape):
        return (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dt)

    ks = iter(jax.random.split(key, 3 * shp["layers"] + 8 + n_rec))
    store = HostKVStore(n_rec)
    for li in range(n_rec):
        k = draw(next(ks), (1, H, T, D))
        store.put(li, k, k + 1)
    jax.block_until_ready(store.arrays())
    store.materialize()
    rng = np.random.default_rng(0)
    rows = []
    pool = None
    def positions(kind, R):
        """[H, R] sorted prompt positions per head: uniform at random, or a top set as a recall takes it (the
        top-R of 5-tap pooled scores, here of random logits), whose rows come in runs."""
        if kind == "uniform":
            return np.sort(rng.choice(T, size=(H, R), replace=False), axis=1)
        logits = rng.standard_normal((H, T)).astype(np.float32)
        pooled = sum(np.roll(logits, s, axis=1) for s in range(-2, 3)) / 5
        return np.sort(np.argpartition(-pooled, R - 1, axis=1)[:, :R], axis=1)

    for R, kind in [(R, kind) for kind in ("pooled", "uniform") for R in args.rows]:
        # each head's recalled rows: R prompt positions (sorted, as a top set is) into its own pool region
        cap = max(R, 8)
        pool = new_pool(1, 1, n_rec * H * cap, D, dt)
        # fresh rows for every recall, as decode's recalls fetch rows the last one did not: the same rows each
        # time would come from the caches (where they fit), not from the memory a recall reads. Each recall's
        # set is one draw per layer turned by a random shift per head (the same runs, other rows): a new draw
        # per recall costs time the GPU script's offload stage lacks (RESULTS offload-cpu-fresh-rows)
        base = [positions(kind, R) for _ in range(n_rec)]
        pos_sets = [[np.sort((p_ + rng.integers(0, T, (H, 1))) % T, axis=1) for p_ in base]
                    for _ in range(args.warmup + args.iters)]
        h_idx = np.repeat(np.arange(H), R)
        zeros = np.zeros(H * R, np.int64)
        pool_rows = [(li * H + h_idx) * cap + np.tile(np.arange(R), H) for li in range(n_rec)]
        next_sets = itertools.cycle(pos_sets)
        last = []  # the positions of the latest recall
        timings = {}

        def recall(timings=timings):
            nonlocal pool
            last[:] = next(next_sets)
            requests = [(li, zeros, h_idx, last[li].reshape(-1), zeros, pool_rows[li]) for li in range(n_rec)]
            pool, _, _ = write_host_rows(pool, store, requests, timings=timings)
            return pool

        for _ in range(args.warmup):
            jax.block_until_ready(recall())
        total, gather = [], []
        for _ in range(args.iters):
            timings.clear()
            t0 = time.perf_counter()
            jax.block_until_ready(recall())
            total.append(time.perf_counter() - t0)
            gather.append(timings["gather"])
        # correctness (independent: numpy indexing of the host arrays): the last recall's layer-0 rows in its regions
        kh = np.asarray(store.k[0])
        rows0 = (np.arange(H)[:, None] * cap + np.arange(R)[None, :])
        ok = bool(np.array_equal(np.asarray(pool.k[0, 0].astype(jnp.float32))[rows0],
                                 kh[0, np.arange(H)[:, None], last[0]].astype(np.float32)))
        nbytes = n_rec * H * R * 2 * D * dt.itemsize  # K and V rows
        src = np.ones(nbytes // 8, np.uint64)
        dst = np.empty_like(src)
        memcpy = _median_time(lambda: np.copyto(dst, src), args.iters)
        halves = (dst.view(np.uint8)[: nbytes // 2], dst.view(np.uint8)[nbytes // 2 :])
        spans = iter(_store_spans(store, n_rec, nbytes, rng, args.iters))
        memcpy_store = _median_time(lambda: [np.copyto(o, a) for o, a in zip(halves, next(spans))], args.iters)
        # a copy whatever the buffer: on a CPU device jax may take a numpy buffer in place (no copy to time)
        h2d = _median_time(lambda: jax.block_until_ready(jax.device_put(src, may_alias=False)), args.iters)
        # the bound a recall's transfer can reach: one contiguous DMA of the same bytes from pinned host memory
        src_pinned = jax.block_until_ready(jax.device_put(src, pinned_host()))
        on_device = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
        h2d_pinned = _median_time(lambda: jax.block_until_ready(jax.device_put(src_pinned, on_device)), args.iters)
        t_all, t_gather = statistics.median(total), statistics.median(gather)
        runs = float(np.mean([1 + np.count_nonzero(np.diff(p_, axis=1) != 1, axis=1)
                             for pos in pos_sets for p_ in pos])) / R
        rows.append(dict(rows_per_head=R, rows=n_rec * H * R, positions=kind, runs_per_row=runs, bytes=nbytes,
                         rows_correct=ok,
                         recall_seconds=t_all, gather_seconds=t_gather, transfer_seconds=t_all - t_gather,
                         memcpy_seconds=memcpy, memcpy_store_seconds=memcpy_store, contiguous_h2d_seconds=h2d,
                         pinned_h2d_seconds=h2d_pinned, gather_gbps=nbytes / t_gather / 1e9,
                         memcpy_gbps=nbytes / memcpy / 1e9, memcpy_store_gbps=nbytes / memcpy_store / 1e9,
                         transfer_gbps=nbytes / (t_all - t_gather) / 1e9, h2d_gbps=nbytes / h2d / 1e9,
                         pinned_h2d_gbps=nbytes / h2d_pinned / 1e9,
                         recall_gbps=nbytes / t_all / 1e9, samples=total))
    # prefill's offload: one layer's K and V [1, H, T, D] to pinned host memory (``HostKVStore.put``, as
    # HeteroCache's prefill calls it for every layer), device -> host GB/s
    d2h = []
    for n_tok in args.d2h_tokens:
        kd = draw(next(ks), (1, H, n_tok, D))
        vd = kd + 1
        jax.block_until_ready((kd, vd))
        sink = HostKVStore(1)

        def put(sink=sink, kd=kd, vd=vd):
            sink.put(0, kd, vd)
            jax.block_until_ready(sink.arrays())

        # the first put of a size is timed apart: it is the one that may have to allocate fresh pinned memory
        # (each later put replaces the last one's arrays, whose memory the runtime may hand back)
        (first,) = _wall_times(put, 1)
        for _ in range(args.warmup):
            put()
        t = _median_time(put, args.iters)
        d2h.append(dict(tokens=n_tok, bytes=2 * kd.nbytes, seconds=t, gbps=2 * kd.nbytes / t / 1e9,
                        first_seconds=first, memory_kind=str(sink.v[0].sharding.memory_kind)))
        del kd, vd, sink
    out = dict(shapes=shp, prompt_tokens=T, recall_layers=n_rec, dtype=args.dtype, device=str(jax.devices()[0]),
               host_store_bytes=store.nbytes(), staging_pinned=store.staging.pinned,
               pinned_memory_kind=str(store.k[0].sharding.memory_kind),
               rows=rows, d2h=d2h, overlap=None)
    if args.overlap:
        out["overlap"] = measure_overlap(args, shp, draw, ks, recall)
    return out


def measure_overlap(args, shp, draw, ks, recall) -> dict:
    """A decode-shaped compute (every layer's MLP weights applied to one token) beside the last recall."""
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(args.dtype)
    weights = [(draw(next(ks), (shp["hidden"], shp["inter"])), draw(next(ks), (shp["hidden"], shp["inter"])),
                draw(next(ks), (shp["inter"], shp["hidden"]))) for _ in range(shp["layers"])]

    @jax.jit
    def compute(x, ws):
        for w1, w3, w2 in ws:
            h = jnp.dot(x, w1, preferred_element_type=jnp.float32)
            g = jnp.dot(x, w3, preferred_element_type=jnp.float32)
            x = x + jnp.dot((jax.nn.silu(h) * g).astype(dt), w2, preferred_element_type=jnp.float32).astype(dt)
        return x

    x = draw(next(ks), (1, shp["hidden"]))
    fns = {"compute": lambda: jax.block_until_ready(compute(x, weights)),
           "recall": lambda: jax.block_until_ready(recall()),
           "both": lambda: jax.block_until_ready((compute(x, weights), recall()))}
    for f in fns.values():
        for _ in range(args.warmup):
            f()
    samples = {k: [] for k in fns}
    for _ in range(args.iters):
        for k, f in fns.items():
            samples[k] += _wall_times(f, 1)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return dict(seconds=med, overlap=(med["compute"] + med["recall"] - med["both"]) / min(med["compute"], med["recall"]),
                weight_bytes=sum(w.nbytes for ws in weights for w in ws))


def markdown(payload: dict) -> str:
    r = payload["result"]
    shp = r["shapes"]
    lines = [
        common.section_header("Host offload: the recall path's gather and transfer (bench_offload.py)", payload), "",
        f"Device {r['device']}; store memory kind `{r['pinned_memory_kind']}`, {r['prompt_tokens']:,} tokens per "
        f"head x {shp['kv_heads']} KV heads (D {shp['head_dim']}, {r['dtype']}, K and V) x {r['recall_layers']} layers "
        f"({r['host_store_bytes'] / GiB:.2f} GiB). Each recall: `write_host_rows` (gather into the store's staging "
        f"rows, {'pinned' if r.get('staging_pinned') else 'pageable'} here, start the copies, scatter into the row "
        "pool), waited on. Each head's rows: "
        "'pooled' = the top-R positions of 5-tap pooled random logits (a recall's top set: rows in runs), "
        "'uniform' = R positions at random; each recall fetches other rows (its layer's draw turned by a random "
        "shift per head); 'runs / row' = contiguous runs per recalled row. Medians of "
        f"{payload['config']['iters']} repeats. 'gather' = the gather's host time, beside `np.copyto` of the same "
        "bytes ('memcpy': a loop over one source and destination, warm in the caches where they fit; 'memcpy from "
        "store': each time from a span of the store at a random page, the memory the gather reads, in order); "
        "'transfer' = the rest of the recall (copies started, scatter, wait), beside one contiguous "
        "`jax.device_put` of the same bytes from a numpy array ('contiguous'); 'recall / pinned' = the whole "
        "recall's GB/s over one contiguous copy of the same bytes from pinned host memory ('pinned H2D').", "",
        "| positions | runs / row | rows | MiB (K+V) | recall ms | gather GB/s | memcpy GB/s | gather / memcpy | "
        "memcpy from store GB/s | transfer GB/s | contiguous GB/s | transfer / contiguous | pinned H2D GB/s | "
        "recall / pinned | rows correct |",
        "| :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |",
    ]
    for x in r["rows"]:
        lines.append(f"| {x['positions']} | {x['runs_per_row']:.2f} | {x['rows']:,} | {x['bytes'] / 2**20:,.1f} | "
                     f"{x['recall_seconds'] * 1e3:,.2f} | "
                     f"{x['gather_gbps']:.2f} | {x['memcpy_gbps']:.2f} | {x['gather_gbps'] / x['memcpy_gbps']:.2f} | "
                     f"{x['memcpy_store_gbps']:.2f} | "
                     f"{x['transfer_gbps']:.2f} | {x['h2d_gbps']:.2f} | {x['transfer_gbps'] / x['h2d_gbps']:.2f} | "
                     f"{x['pinned_h2d_gbps']:.2f} | {x['recall_gbps'] / x['pinned_h2d_gbps']:.2f} | "
                     f"{'yes' if x['rows_correct'] else 'NO'} |")
    if r.get("d2h"):
        lines += ["", f"Prefill's offload: one layer's K and V ({shp['kv_heads']} KV heads x D {shp['head_dim']}, "
                      f"{r['dtype']}) to pinned host memory with `HostKVStore.put`, waited on (device -> host):", "",
                      "| tokens per head | MiB | ms | GB/s | first put, ms |", "| ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {x['tokens']:,} | {x['bytes'] / 2**20:,.0f} | {x['seconds'] * 1e3:.2f} | {x['gbps']:.2f} | "
                  f"{x['first_seconds'] * 1e3:.2f} |" for x in r["d2h"]]
    ov = r.get("overlap")
    if ov:
        s = ov["seconds"]
        lines += ["", f"Beside compute (the largest recall; {shp['layers']} layers' MLP weights, "
                      f"{ov['weight_bytes'] / GiB:.2f} GiB, applied to one token): compute {s['compute'] * 1e3:.2f} "
                      f"ms, recall {s['recall'] * 1e3:.2f} ms, both {s['both'] * 1e3:.2f} ms, overlap "
                      f"{ov['overlap']:.2f} ((compute + recall - both) / min; 1 = hidden)."]
    return "\n".join(lines)


# --prompt, --rows and --d2h-tokens where not given: the full sizes, or --small's (explicit flags win)
DEFAULTS = dict(prompt=131072, rows=[256, 1024, 4096], d2h_tokens=[8192, 16384, 32768])
SMALL_DEFAULTS = dict(prompt=1024, rows=[16, 64], d2h_tokens=[256])


def parse_args(argv=None):
    p = common.argument_parser(__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=argparse.SUPPRESS,
                   help="tokens per head in the pinned-host store (default 131072; --small: 1024)")
    p.add_argument("--rows", type=int, nargs="+", default=argparse.SUPPRESS,
                   help="rows recalled per head and layer (x 8 heads x --recall-layers; default 256 1024 4096: 8K, "
                        "32K, 128K rows; --small: 16 64)")
    p.add_argument("--recall-layers", type=int, default=4, help="layers recalled at once")
    p.add_argument("--d2h-tokens", type=int, nargs="*", default=argparse.SUPPRESS,
                   help="tokens per head of the layers offloaded to pinned host memory (prefill's copy; default 8192 "
                        "16384 32768; --small: 256; none: no such timing)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--overlap", action="store_true",
                   help="also time the largest recall beside a decode-shaped compute (11 GiB of weights: a GPU)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="K/V dtype (bfloat16: Llama's on a GPU; on a CPU XLA widens a bfloat16 scatter to float32 and "
                        "copies the whole pool, so the CPU's transfer column means the float32 run)")
    p.add_argument("--small", action="store_true", help="tiny shapes (smoke test; numbers mean nothing)")
    p.add_argument("--out", type=Path, default=common.OUT_DIR / "offload.json", help="JSON output")
    # the section: 'offload' ('offload-gpu' on a GPU) unless --section names another
    common.add_results_arguments(p, SECTION, presets=False, named=True)
    args = p.parse_args(argv)
    for key, value in (SMALL_DEFAULTS if args.small else DEFAULTS).items():
        if not hasattr(args, key):
            setattr(args, key, list(value) if isinstance(value, list) else value)
    # every count before any work (a zero or negative one fails deep in the run, or never ends its loop)
    if min(args.prompt, args.recall_layers, args.iters, *args.rows, *args.d2h_tokens) < 1 or args.warmup < 0:
        p.error("--prompt, --rows, --recall-layers, --d2h-tokens and --iters must be >= 1 and --warmup >= 0")
    if args.prompt < args.recall_layers * max(args.rows):
        # the memcpy from the store copies a recall's bytes as one span of a K layer and one of a V layer
        p.error(f"--prompt {args.prompt} is below --recall-layers x the largest --rows "
                f"({args.recall_layers * max(args.rows)}): a layer must hold a recall's bytes as one span")
    if args.small and args.write_results and args.section is None and args.results_file.resolve() == \
            common.RESULTS_MD.resolve():  # a smoke test never replaces the measured section
        p.error(f"--small numbers mean nothing: --write-results would replace the '{SECTION}' section of "
                f"{common.RESULTS_MD.name} with them; give --section {SECTION}-NAME or another --results-file "
                "(or drop --small)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    # the header (commit, time, machine) as the run starts: the code that ran, not the tree at its end
    payload = common.report_header(SECTION, {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    t0 = time.perf_counter()
    result = run(args)
    payload["result"] = result
    payload["total_seconds"] = time.perf_counter() - t0
    md = markdown(payload)
    payload["markdown"] = md
    common.write_json(args.out, payload)
    print(md)
    if args.write_results:
        section = args.section or SECTION + ("-gpu" if jax.default_backend() == "gpu" else "")
        print(f"updated section '{section}' of {common.update_results_section(section, md, args.results_file)}")
    return 0 if all(x["rows_correct"] for x in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
