"""The compile target and the cache ``bench_step_ops.py`` compiles a decode step over: an H100 topology (the CUDA
plugin, no GPU needed) or this machine's XLA:CPU, abstract params and cache, the compile of the engine's decode step
and of HeteroCache's drift check, and the synthetic prefill (random layer inputs through the policy's prefill
plan, layer params of a narrow twin of the model)."""

from __future__ import annotations

import contextlib
import time

NARROW = "llama-3.1-8b-narrow"
TAIL_CAPACITY = 128  # runtime.compile_cache.TAIL_QUANTUM: the engine's first tail bucket


# One H100 SXM (80 GB HBM3), as a text GpuTargetConfig (docs/architecture.md, "Compiling for a GPU without one").
H100_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 85899345920
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
H100_DESCRIPTION = ("NVIDIA H100 80GB HBM3 (SXM): 132 SMs, compute capability 9.0, 50 MiB L2, 3.35 TB/s, 80 GiB, "
                    "1.98 GHz, 228 KiB shared memory per SM (227 KiB opt-in per block); CUDA 12.8, cuDNN 9.8")


# ==================================================================== the target
def gpu_mesh():
    """A one-device mesh of an H100 topology (CUDA plugin, no GPU needed)."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", target_config=H100_TARGET_CONFIG, topology="1x1x1")
    return topologies.make_mesh(topo, (1,), ("x",))


def cpu_mesh():
    import jax

    return jax.sharding.Mesh([jax.devices("cpu")[0]], ("x",))


def abstract(tree, mesh):
    """``tree`` with every array leaf a ShapeDtypeStruct replicated on ``mesh`` (its memory kind kept)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    def leaf(x):
        kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
        sharding = NamedSharding(mesh, PartitionSpec(), **({"memory_kind": kind} if kind not in (None, "device")
                                                           else {}))
        return jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x), sharding=sharding)

    return jax.tree.map(leaf, tree)


def abstract_params(cfg, dtype, mesh):
    """The model's params (``spec.param_shapes``) as ShapeDtypeStructs of ``dtype``: nothing allocated."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from hetero_jax.model import spec

    s = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda shp: jax.ShapeDtypeStruct(tuple(shp), jnp.dtype(dtype), sharding=s),
                        spec.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))


def compile_step(params_abs, cache_abs, cfg, policy, mesh, kernels: str):
    """The engine's decode step (``engine.decode_step_jit``, cache donated, greedy) compiled for ``mesh``'s device
    with ``kernels`` (pallas / reference) traced in: (compiled executable, lower seconds, compile seconds)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    import pallas_kernels
    from hetero_jax.runtime.engine import decode_step_jit

    s = NamedSharding(mesh, PartitionSpec())
    batch = _batch_of(cache_abs)
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=s)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=s)
    # the kernel choice is read at trace time and jax's trace caches do not key on it: drop what the synthetic
    # prefill traced (reference kernels, for the CPU) before, and what this trace made after
    jax.clear_caches()
    try:
        with pallas_kernels.use_kernels(kernels), callbacks_without_a_device():
            t0 = time.perf_counter()
            # no host operands: a GPU backend's policies read the host through callbacks (host_store.sums_in_step)
            lowered = decode_step_jit.lower(params_abs, cache_abs, tokens, key, (), cfg=cfg, policy=policy,
                                            mode="greedy")
            t1 = time.perf_counter()
            exe = lowered.compile()
            t2 = time.perf_counter()
    finally:
        jax.clear_caches()
    return exe, t1 - t0, t2 - t1


def compile_check(state, cache, mesh, kernels: str, group_size: int):
    """HeteroCache's drift check (``heterocache.decode.drift_check``: every pivot of the model, on the buffered
    steps' logits), compiled for ``mesh``'s device as the decode state dispatches it every ``window`` steps:
    (compiled executable, window), or None for a state without pivots."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    import pallas_kernels
    from hetero_jax.policies.heterocache.decode import drift_check

    layers = getattr(state, "pivot_layers", None)
    if not layers:
        return None
    s = NamedSharding(mesh, PartitionSpec())
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=s)  # noqa: E731
    policy, roles = state.policy, state.prefilled.roles
    B = int(cache.batch_size)
    T = {li: cache.layers[li].capacity for li in layers}
    args = (tuple(tuple(sds((B, len(roles[li].pivots), group_size, T[li]), jnp.float32)
                        for _ in range(policy.window)) for li in layers),
            tuple(sds((B, cache.layers[li].num_heads), jnp.int32) for li in layers),
            tuple(sds(cache.layers[li].state.k_base.shape, jnp.int32) for li in layers),
            tuple(sds(state.set_sizes[li][0].shape, jnp.int32) for li in layers))
    cap = max(1, max(state.set_sizes[li][1] for li in layers))
    jax.clear_caches()
    try:
        with pallas_kernels.use_kernels(kernels):
            exe = drift_check.lower(*args, pivot_slots=tuple(tuple(roles[li].pivot_slots()) for li in layers),
                                    l_base=int(state.prefilled.l_base.max()), tau=policy.drift_threshold,
                                    cap=min(cap, min(T.values()))).compile()
    finally:
        jax.clear_caches()
    return exe, policy.window


@contextlib.contextmanager
def callbacks_without_a_device():
    """Let host callbacks (``jax.pure_callback``: HCAttention's value sums) lower and compile for a GPU
    that this process has no client for. Two jax internals are patched for one lowering and compile (the
    executable is only read, never run):

    - the callback lowering asks the module context for the platform's backend (``ModuleContext.get_backend``),
      which raises without a GPU client, and then uses it on TPU only: for CUDA the custom call
      (``xla_ffi_python_gpu_callback``, which names its callback by index) needs no client;
    - a compile-only client (the topology's) takes no Python host callbacks, so they are dropped from its
      compile (``compiler.backend_compile_and_load``): they are what the run would call, not part of the code.
    """
    from jax._src import compiler
    from jax._src.interpreters import mlir

    original = mlir.ModuleContext.get_backend
    original_compile = compiler.backend_compile_and_load

    def compile_and_load(backend, module, executable_devices, options, host_callbacks):
        if type(backend).__name__ == "CompileOnlyPyClient":
            host_callbacks = ()
        return original_compile(backend, module, executable_devices, options, host_callbacks)

    def get_backend(self, optional: bool = False):
        try:
            return original(self, optional)
        except RuntimeError:
            if tuple(self.platforms) in (("cuda",), ("rocm",)):
                return None
            raise

    mlir.ModuleContext.get_backend = get_backend
    compiler.backend_compile_and_load = compile_and_load
    try:
        yield
    finally:
        mlir.ModuleContext.get_backend = original
        compiler.backend_compile_and_load = original_compile


def _batch_of(cache_abs) -> int:
    seq = getattr(cache_abs, "seq_lens", None)
    if seq is not None:
        return int(seq.shape[0])
    import jax

    return int(jax.tree.leaves(cache_abs)[0].shape[0])


# ==================================================================== synthetic prefill
def narrow_twin(shape: str = NARROW, dtype: str = "bfloat16", seed: int = 0, max_positions: int = 0):
    """Random weights of the narrow twin (``bench_latency.synthetic_model``): layers, heads, head_dim of the
    full shape, small hidden/MLP/vocab."""
    import bench_latency

    return bench_latency.synthetic_model(None, max_positions, seed, shape=shape, dtype=dtype)


def synthetic_prefill(policy, model, length: int, *, tail_capacity: int = TAIL_CAPACITY, seed: int = 0,
                      batch: int = 1, progress=None):
    """The post-prefill (cache, DecodeState) of ``policy`` (bound to ``model``) for a ``length``-token prompt,
    with random layer inputs instead of the model's forward pass.

    Per layer, the policy's plan gets ``build_layer(li, layer, x_in, k_buf, v_buf, lens)`` with random
    x_in [B, Tp, hidden], k_buf / v_buf [B, Hkv, Tp, D] (model dtype) and ``model``'s layer params; its output
    goes into the row pool as ``model.transformer.prefill`` puts it there (``cache.PoolBuilder``), then
    ``plan.finish``. Only the plan protocol is used. ``progress(li)`` is called after each layer.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hetero_jax.model.cache import PoolBuilder
    from hetero_jax.runtime.compile_cache import chunk_bucket, compiled, round_up

    cfg = model.config
    dtype = model.params["embed"].dtype
    lens_np = np.full(batch, length, np.int32)
    Tp = round_up(length, chunk_bucket(length))  # the engine pads the prompt to its chunk bucket
    plan = policy.make_prefill(cfg, lens_np.tolist(), compile_fn=compiled)
    lens = jnp.asarray(lens_np)
    kv_shape = (batch, cfg.num_kv_heads, Tp, cfg.head_dim)
    x_shape = (batch, Tp, cfg.hidden_size)

    @jax.jit
    def draw(key):
        kx, kk, kv = jax.random.split(key, 3)
        x = jax.random.normal(kx, x_shape, jnp.float32).astype(dtype)
        k = jax.random.normal(kk, kv_shape, jnp.float32).astype(dtype)
        v = jax.random.normal(kv, kv_shape, jnp.float32).astype(dtype)
        return x, k, v

    base = jax.random.key(seed)
    builder = PoolBuilder(plan, lens_np, cfg, tail_capacity, dtype, compile_fn=compiled)
    for li, layer in enumerate(model.params["layers"]):
        x_in, k_buf, v_buf = draw(jax.random.fold_in(base, li))
        jax.block_until_ready(builder.add(li, plan.build_layer(li, layer, x_in, k_buf, v_buf, lens)))
        del x_in, k_buf, v_buf
        if progress is not None:
            progress(li)
    return plan.finish(builder.cache(lens))


def cache_summary(cache, state, cfg) -> dict:
    """What the step compiles over: head groups per layer (where the cache has them: before the row pool),
    leaves, device bytes."""
    import jax
    import numpy as np

    groups = [len(getattr(l, "groups", ())) for l in getattr(cache, "layers", ())]
    leaves = jax.tree.leaves(cache)
    out = {"cache_leaves": len(leaves), "cache_bytes": int(sum(np.prod(x.shape) * x.dtype.itemsize for x in leaves))}
    if groups and any(groups):
        out.update(head_groups=int(sum(groups)), max_groups_per_layer=int(max(groups)))
    try:
        out["achieved_rho"] = float(np.asarray(state.achieved_rho(cache, cfg))[0])
    except Exception:  # noqa: BLE001 - informational
        pass
    return out

