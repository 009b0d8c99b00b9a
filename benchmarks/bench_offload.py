#!/usr/bin/env python
"""Host offload: does a recall from pinned host memory overlap the decode compute it runs beside?

A HeteroCache recall (and Quest / FreeKV / SyncKV fetches) reads rows from numpy views of the
pinned-host store (``HostKVStore.rows``), starts their host -> device copies (``put_rows``) and
writes them into the device row pool (``scatter_rows``), all dispatched from the host thread while
the device runs the step. This script times, at Llama-3.1-8B shapes (8 KV heads of 128, bfloat16):

- **compute**: a decode-shaped device workload, the 32 layers' MLP weights (3 x 4096 x 14336 each,
  bf16, 11 GiB) applied to one token: the weight bytes a decode step streams;
- **recall**: ``rows`` + ``put_rows`` + ``scatter_rows`` of R rows per head for every head of
  ``--recall-layers`` layers, from a pinned-host store of ``--prompt`` tokens per head;
- **both**: the compute dispatched first (asynchronous), then the recall on the host thread, then
  waiting for both; overlap = (compute + recall - both) / min(compute, recall) (1: fully hidden,
  0: serialised);
- the plain host -> device bandwidth of one pinned layer's K (``jax.device_put``).

Medians of ``--iters`` repeats after warm-up, the three variants alternating. Meant for a GPU (on a CPU
"pinned host" and device are the same memory and the numbers say nothing about a PCIe link); the
``--small`` sizes smoke-test it anywhere. Writes JSON and the markdown; ``--write-results`` rewrites
the ``offload-gpu`` section of RESULTS.md (``offload`` without a GPU).

    python benchmarks/bench_offload.py --write-results            # on a GPU
    python benchmarks/bench_offload.py --small                    # smoke test (CPU)
"""

from __future__ import annotations

import functools
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


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hetero_jax.model.cache import new_pool
    from hetero_jax.model.host_store import HostKVStore, put_rows, scatter_rows

    shp = SMALL if args.small else LLAMA
    H, D, T, R = shp["kv_heads"], shp["head_dim"], args.prompt, args.rows
    n_rec = args.recall_layers
    dt = jnp.bfloat16
    key = jax.random.key(0)

    # --- compute: every layer's MLP weights once, one token (what a decode step streams from HBM)
    @functools.partial(jax.jit, static_argnums=(1,))
    def draw(k, shape):
        return (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dt)

    ks = iter(jax.random.split(key, 3 * shp["layers"] + 8))
    weights = [(draw(next(ks), (shp["hidden"], shp["inter"])), draw(next(ks), (shp["hidden"], shp["inter"])),
                draw(next(ks), (shp["inter"], shp["hidden"]))) for _ in range(shp["layers"])]
    weight_bytes = sum(w.nbytes for ws in weights for w in ws)

    @jax.jit
    def compute(x, ws):
        for w1, w3, w2 in ws:
            h = jnp.dot(x, w1, preferred_element_type=jnp.float32)
            g = jnp.dot(x, w3, preferred_element_type=jnp.float32)
            x = x + jnp.dot((jax.nn.silu(h) * g).astype(dt), w2, preferred_element_type=jnp.float32).astype(dt)
        return x

    x = draw(next(ks), (1, shp["hidden"]))

    # --- the pinned-host store and the device row pool the recalled rows land in: one device (one shard), each
    # head of each recalled layer a region of ``cap`` rows, layer after layer (the layout of ``cache.pool_offsets``)
    store = HostKVStore(n_rec)
    for li in range(n_rec):
        k = draw(next(ks), (1, H, T, D))
        store.put(li, k, k + 1)
    jax.block_until_ready(store.arrays())
    store.materialize()
    cap = max(R, 8)
    pool = new_pool(1, 1, n_rec * H * cap, D, dt)
    offsets = (np.arange(n_rec)[:, None] * H + np.arange(H)[None, :]) * cap  # [layers, H] first row of each region
    rng = np.random.default_rng(0)
    pos = [np.sort(rng.choice(T, size=(H, R), replace=True), axis=1) for _ in range(n_rec)]
    b_idx = np.zeros(H * R, np.int64)
    h_idx = np.repeat(np.arange(H), R)
    s_idx = np.zeros(H * R, np.int64)
    slots = np.tile(np.arange(R), H)

    def recall():
        nonlocal pool
        new = []
        for li in range(n_rec):   # every transfer started before any scatter, as the policies do
            p = pos[li].reshape(-1)
            k_rows, v_rows = store.rows(li, b_idx, h_idx, p)
            new.append(put_rows(b_idx, s_idx, offsets[li][h_idx] + slots, k_rows, v_rows, p, pool.num_rows))
        for ops in new:
            pool = scatter_rows(pool, ops)
        return pool

    def only_compute():
        jax.block_until_ready(compute(x, weights))

    def only_recall():
        jax.block_until_ready(recall())

    def both():
        y = compute(x, weights)           # dispatched, runs on the device
        gs = recall()                     # host gather + copies meanwhile
        jax.block_until_ready((y, gs))

    # correctness of the recalled rows (independent: numpy indexing of the host arrays)
    only_recall()
    kh = np.asarray(store.k[0])
    want = kh[0, np.arange(H)[:, None], pos[0]]
    rows0 = offsets[0][:, None] + np.arange(R)[None, :]  # [H, R] layer 0's recalled rows in the pool
    got = np.asarray(pool.k[0, 0].astype(jnp.float32))[rows0]
    rows_ok = bool(np.array_equal(got, want.astype(np.float32)))

    for f in (only_compute, only_recall, both):   # warm-up (compile)
        for _ in range(args.warmup):
            f()
    samples = {"compute": [], "recall": [], "both": []}
    for _ in range(args.iters):
        for name, f in (("compute", only_compute), ("recall", only_recall), ("both", both)):
            samples[name] += _wall_times(f, 1)
    med = {k: statistics.median(v) for k, v in samples.items()}
    hidden = (med["compute"] + med["recall"] - med["both"]) / min(med["compute"], med["recall"])

    # plain host -> device bandwidth of one pinned layer's K
    dev = jax.devices()[0]
    src = store.k[0]
    to_dev = src.sharding.with_memory_kind("device")
    h2d = _wall_times(lambda: jax.block_until_ready(jax.device_put(src, to_dev, may_alias=False)),
                          max(5, args.iters // 2))
    h2d_s = statistics.median(h2d)
    recall_bytes = n_rec * H * R * 2 * D * 2
    return dict(
        shapes=shp, prompt_tokens=T, rows_per_head=R, recall_layers=n_rec, dtype="bfloat16",
        weight_bytes=weight_bytes, recall_bytes=recall_bytes, host_store_bytes=store.nbytes(),
        pinned_memory_kind=str(src.sharding.memory_kind), rows_correct=rows_ok,
        seconds=med, samples=samples, overlap=hidden,
        h2d=dict(bytes=int(src.nbytes), seconds=h2d_s, bandwidth=src.nbytes / h2d_s),
        device=str(dev),
    )


def markdown(payload: dict) -> str:
    r = payload["result"]
    s = r["seconds"]
    ms = lambda x: f"{x * 1e3:,.2f}"  # noqa: E731
    shp = r["shapes"]
    lines = [
        common.section_header("Host offload: recall from pinned host memory beside decode compute", payload), "",
        f"Device {r['device']}; pinned store memory kind `{r['pinned_memory_kind']}`. Compute: {shp['layers']} "
        f"layers' MLP weights (bf16, {r['weight_bytes'] / GiB:.2f} GiB) applied to one token. Recall: "
        f"{r['rows_per_head']:,} rows per head x {shp['kv_heads']} KV heads (D {shp['head_dim']}, K and V) x "
        f"{r['recall_layers']} layers from a {r['prompt_tokens']:,}-token pinned-host store "
        f"({r['host_store_bytes'] / GiB:.2f} GiB): `HostKVStore.rows` + `put_rows` + `scatter_rows`, "
        f"{r['recall_bytes'] / 2**20:,.1f} MiB moved. 'both' dispatches the compute, then recalls on the host "
        f"thread, then waits for both. Medians of {payload['config']['iters']} alternating repeats. Recalled rows "
        f"equal to numpy indexing of the host arrays: {'yes' if r['rows_correct'] else 'NO'}.", "",
        "| compute ms | recall ms | both ms | compute + recall ms | overlap | host -> device GB/s (one layer's K, "
        f"{r['h2d']['bytes'] / 2**20:,.0f} MiB) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {ms(s['compute'])} | {ms(s['recall'])} | {ms(s['both'])} | {ms(s['compute'] + s['recall'])} | "
        f"{r['overlap']:.2f} | {r['h2d']['bandwidth'] / 1e9:,.1f} |", "",
        "overlap = (compute + recall - both) / min(compute, recall): 1 = the recall is hidden behind the compute, "
        "0 = the two run one after the other.",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = common.argument_parser(__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=131072, help="tokens per head in the pinned-host store")
    p.add_argument("--rows", type=int, default=4096, help="rows recalled per head and layer")
    p.add_argument("--recall-layers", type=int, default=4, help="layers recalled at once")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--small", action="store_true", help="tiny shapes (smoke test; numbers mean nothing)")
    p.add_argument("--out", type=Path, default=common.OUT_DIR / "offload.json")
    p.add_argument("--write-results", action="store_true",
                   help="rewrite the 'offload-gpu' section of RESULTS.md ('offload' without a GPU)")
    args = p.parse_args(argv)
    if args.small and args.prompt == 131072:
        args.prompt, args.rows = 1024, 64
    import jax

    machine = common.machine_info()
    t0 = time.perf_counter()
    result = run(args)
    payload = common.report_header(SECTION, {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                   machine)
    payload["result"] = result
    payload["total_seconds"] = time.perf_counter() - t0
    md = markdown(payload)
    payload["markdown"] = md
    common.write_json(args.out, payload)
    print(md)
    if args.write_results:
        section = SECTION + ("-gpu" if jax.default_backend() == "gpu" else "")
        print(f"updated section '{section}' of {common.update_results_section(section, md)}")
    return 0 if result["rows_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
