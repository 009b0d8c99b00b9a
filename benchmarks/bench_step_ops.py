#!/usr/bin/env python
"""Kernels per decode step, per policy, in the executable XLA compiles for an H100, on a machine without a GPU.

Why: CPU timings hid a 5x GPU loss. HeteroCache's decode step launched one attention call per head group, and
on an H200 a Llama-3.1-8B step at 32K took 62.6 ms against full KV's 12.5 (RESULTS.md ``latency-llama8b-gpu``)
while the CPU showed a small gap. The number of kernels a step launches is visible without a GPU: jax with the
CUDA plugin compiles a jitted function for an H100 *topology* (``jax.experimental.topologies``; no device, no
driver) and the compiled executable's text lists every kernel (docs/architecture.md, "Compiling for a GPU
without one").

What is compiled, per policy: ONE decode step exactly as the engine jits it (``runtime.engine.decode_step_jit``:
``model.transformer.decode_step`` with the policy's ``attend`` in every layer, the cache donated, greedy
sampling), Llama-3.1-8B shapes (``bench_latency.SYNTHETIC_SHAPES["llama-3.1-8b"]``), bfloat16, batch 1, the
Pallas kernels (Triton lowering), for one H100 SXM (``H100_TARGET_CONFIG``). The 8B weights are
``jax.ShapeDtypeStruct``s: nothing is allocated.

Where the cache comes from (the "synthetic prefill", :func:`synthetic_prefill`): the decode step takes a
post-prefill cache whose structure depends on the policy's prefill. A real 32K prefill is far too slow on a
CPU, so for every layer the policy's prefill plan (``policy.make_prefill``) gets random inputs
(``build_layer(li, layer, x_in [B, T, hidden], k_buf [B, Hkv, T, D], v_buf, lens)``) with the layer params of a
NARROW twin of the model (``llama-3.1-8b-narrow``: the same layers, heads and head_dim, hidden 256, MLP 512,
vocab 1024, bfloat16), the layers are wrapped as ``model.transformer.prefill`` wraps them, ``plan.finish``
runs, and the finished cache becomes ShapeDtypeStruct leaves. Only the plan protocol is used
(``make_prefill`` / ``build_layer`` / ``finish``); ``tests/test_step_ops.py`` checks that the synthetic cache
has the same structure as a real prefill's, so a change of the cache layout shows there. Random weights and
inputs make *what* is kept meaningless; the *shapes* the step compiles for are the policy's own (budgets,
groups, pages, codes), except where a policy sizes its cache from the data (CAKE's layer budgets follow the
attention of the random inputs).

Peers that need a model-specific calibration file get a stand-in derived for Llama-3.1-8B (:func:`make_policy`):

- SyncKV: the HeteroCache authors' profile's clusters as SyncKV groups (each pivot an R-head with its
  satellites as NR-heads; volatile and anchor heads are clusters of one: SyncKV's "volatile", full KV);
- ContextKeeper: a fixed ranking: the authors' full-KV heads (pivots, volatiles) first, then the others by
  their allocation weight (the heads the authors give more context first);
- HCAttention: a random per-layer key codebook of the paper's g = 32 shape for 128-dim heads (d = 4, c = 512,
  the size this project ships; seed 0), besides its exact-keys point (rho 0.5) that needs no codebook.

Counting (:func:`count_step_ops`, on ``compiled.as_text()``): see ``COUNTING_RULE``. The compile does not run
the step: the counts are evidence about the GPU step's launches; times still need a GPU. Without a GPU XLA
cannot autotune, so the GEMM backend (cuBLAS or a Triton GEMM fusion) is XLA's untuned default; each GEMM is
one kernel either way.

Targets (the project's): HeteroCache at most 1.2x full KV's kernels per step; no compressed policy above 1.5x.

Environment: the CUDA plugin must not go into the project's .venv (it changes how jax starts). ``make step-ops``
builds ``/work/venv-gpucompile`` (or ``$GPUCOMPILE_VENV``) with ``pip install -e ".[gpu-compile]"`` and runs

    CUDA_VISIBLE_DEVICES=-1 JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 HETERO_JAX_KERNELS=pallas \\
        $VENV/bin/python benchmarks/bench_step_ops.py --lengths 32768 2048 --write-results

Output: ``--out`` JSON (config, commit, jax versions, target, per policy: fusions, custom calls by kind, copies,
kernels per step, ratios to full KV, compile seconds), a markdown table on stdout and, with
``--write-results``, the ``step-ops`` section of benchmarks/RESULTS.md. ``--target cpu`` compiles for this
machine's XLA:CPU instead (no plugin needed; what the tests use).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (benchmarks/common.py)

SECTION = "step-ops"
SHAPE = "llama-3.1-8b"
NARROW = "llama-3.1-8b-narrow"
DEFAULT_LENGTHS = (32768,)
DEFAULT_RHO = 0.3
# Registry specs in table order; full KV first (the reference). HCAttention has byte-based operating points, not
# rho 0.3 (README): its exact-keys point (0.5) and the g = 32 codebook point (0.125 in bfloat16).
DEFAULT_POLICIES = ("full", "snapkv", "pyramidkv", "h2o", "streamingllm", "cake", "heterocache",
                    "synckv", "contextkeeper", "quest", "quest:offload=true", "freekv",
                    "hcattention@0.5", "hcattention@0.125")
HETERO_TARGET = 1.2  # HeteroCache kernels per step / full KV's, at most
POLICY_TARGET = 1.5  # any compressed policy's, at most
# Policies whose prefill scoring is quadratic in the prompt (H2O: every prompt query's attention, 8.8 TFLOP
# per layer at 32K): above this length their synthetic prefill would take hours on a 2-core CPU, so they are
# measured at --fallback-length instead (marked in the table). --no-fallback runs them anyway.
QUADRATIC_MAX_LENGTH = {"h2o": 4096}
TAIL_CAPACITY = 128  # runtime.compile_cache.TAIL_QUANTUM: the engine's first tail bucket
HCATTENTION_SUB_DIM, HCATTENTION_CODES = 4, 512  # g = 128 / 4 = 32 codes per key (the paper's g for D = 128)

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

COUNTING_RULE = (
    "Counted in the optimized HLO of the compiled executable (`compiled.as_text()`). Only computations that run "
    "as control flow are walked: ENTRY and, transitively, the bodies/conditions of `while`, the branches of "
    "`conditional`, the `to_apply` of `call` (command buffers) and the computation an `async-start` wraps; "
    "fused computations and reducers (referenced by `calls=` of a fusion or `to_apply=` of a reduce/sort/"
    "scatter) are inside a kernel and are not walked. In a walked computation: each `fusion` is one kernel "
    "(by kind: kLoop/kInput/kOutput, kCustom by its backend kind, e.g. Triton GEMM); each `custom-call` is one "
    "launch, by `custom_call_target` (`__cublas$*`: cuBLAS GEMM; `__gpu$xla.gpu.triton`: a Pallas kernel; "
    "`*callback*`: a host callback, counted apart and not as a kernel); each `copy` and each `copy-start` "
    "(asynchronous, e.g. host<->device) one copy; every other op that is not free (parameter, constant, "
    "get-tuple-element, tuple, bitcast, after-all, the *-done/*-update halves of async pairs, ...) one kernel "
    "under 'other'. A `while` body's launches count once per trip when XLA knows the trip count "
    "(`known_trip_count`; the condition then never runs), else body and condition once each (flagged); a "
    "`conditional` counts its largest branch. A `conditional` (and each trip of a `while` without a known trip "
    "count) also waits for its predicate on the host: loops, trips and conditionals are listed apart. "
    "Kernels per step = fusions + custom calls other than host callbacks + copies + other, loops expanded. "
    "'fusion( in text' is the plain substring count, for comparison with the XLA:CPU numbers quoted before.")


# ==================================================================== HLO text
_FREE_OPS = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "add-dependency",
    "opt-barrier", "domain", "copy-done", "async-done", "async-update", "send-done", "recv-done",
    "all-reduce-done", "all-gather-done", "collective-permute-done", "get-dimension-size",
})
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-$]+)\s*(\(.*\))?\s*->.*\{\s*$")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-$]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-_]*)\(")


@dataclasses.dataclass
class HloInstruction:
    name: str
    opcode: str
    text: str  # the whole line

    def attr(self, key: str) -> str | None:
        """The value of ``key=`` (a %name, a {list} or a "string"), or None."""
        m = re.search(r"[\s,]" + re.escape(key) + r"=(\{[^}]*\}|\"[^\"]*\"|%?[\w.\-$]+)", self.text)
        return None if m is None else m.group(1).strip('"')

    def called(self, key: str) -> list[str]:
        v = self.attr(key)
        if v is None:
            return []
        return [x.strip().lstrip("%") for x in v.strip("{}").split(",") if x.strip()]


def _split_type(rest: str) -> str:
    """``rest`` after 'name = ' with the result type removed (a tuple type may hold spaces and parentheses)."""
    rest = rest.lstrip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[i + 1:]
        return ""
    parts = rest.split(" ", 1)
    return parts[1] if len(parts) > 1 else ""


def parse_hlo(text: str) -> tuple[dict[str, list[HloInstruction]], str | None]:
    """The computations of an HLO module's text: ({name: instructions}, the ENTRY computation's name)."""
    comps: dict[str, list[HloInstruction]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _NAME.match(line)
        if not m:
            continue
        op = _OPCODE.match(_split_type(line[m.end():]))
        if op:
            comps[current].append(HloInstruction(m.group(1), op.group(1), line))
    return comps, entry


def _trip_count(ins: HloInstruction) -> int | None:
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', ins.text)
    return int(m.group(1)) if m else None


def _fusion_kind(ins: HloInstruction) -> str:
    kind = ins.attr("kind") or "?"
    if kind == "kCustom":
        m = re.search(r'"fusion_backend_config"\s*:\s*\{\s*"kind"\s*:\s*"([^"]+)"', ins.text)
        return f"kCustom:{m.group(1)}" if m else "kCustom"
    return kind


def custom_call_kind(target: str) -> str:
    """cublas | pallas_triton | host_callback | cudnn | other, for a ``custom_call_target``."""
    t = target.lower()
    if t.startswith("__cublas"):
        return "cublas"
    if t == "__gpu$xla.gpu.triton":
        return "pallas_triton"
    if "callback" in t:
        return "host_callback"
    if t.startswith("__cudnn"):
        return "cudnn"
    return "other"


def is_gemm_fusion(kind: str) -> bool:
    return kind.startswith("kCustom:") and ("gemm" in kind or "cublas" in kind)


def count_step_ops(text: str) -> dict:
    """Launches of one run of the module in ``text`` (``COUNTING_RULE``)."""
    comps, entry = parse_hlo(text)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    fusions: Counter = Counter()
    custom: Counter = Counter()
    other: Counter = Counter()
    c = {"copies": 0, "async_copies": 0, "while_loops": 0, "unknown_trip_loops": 0, "loop_trips": 0, "conditionals": 0}

    in_loops = [0]
    by_source: Counter = Counter()

    def walk(name: str, times: int, stack: tuple, looped: bool = False, source: str | None = None) -> None:
        if name in stack:
            raise ValueError(f"recursive HLO computation {name}")
        for ins in comps.get(name, ()):
            op = ins.opcode
            src = source or op_source(ins)
            if op not in _FREE_OPS and op not in ("while", "conditional", "call", "async-start") and not (
                    op == "custom-call" and custom_call_kind(ins.attr("custom_call_target") or "") == "host_callback"):
                by_source[src] += times
                if looped:
                    in_loops[0] += times
            if op == "fusion":
                fusions[_fusion_kind(ins)] += times
            elif op == "custom-call":
                custom[ins.attr("custom_call_target") or "?"] += times
            elif op == "copy":
                c["copies"] += times
            elif op == "copy-start":
                c["async_copies"] += times
            elif op == "while":
                c["while_loops"] += 1
                n = _trip_count(ins)
                if n is None:
                    c["unknown_trip_loops"] += 1
                c["loop_trips"] += times * (n or 1)
                for body in ins.called("body"):
                    walk(body, times * (n or 1), stack + (name,), True, src)
                if n is None:  # with a known trip count XLA runs the body n times without the condition
                    for cond in ins.called("condition"):
                        walk(cond, times, stack + (name,), True, src)
            elif op == "conditional":
                c["conditionals"] += 1
                branches = ins.called("branch_computations") or (
                    ins.called("true_computation") + ins.called("false_computation"))
                sizes = [(count_step_ops_in(comps, b), b) for b in branches]
                if sizes:
                    walk(max(sizes)[1], times, stack + (name,), looped, src)
            elif op == "call":
                for sub in ins.called("to_apply"):
                    walk(sub, times, stack + (name,), looped, source)
            elif op == "async-start":
                for sub in ins.called("calls"):
                    walk(sub, times, stack + (name,), looped, source)
            elif op not in _FREE_OPS:
                other[op] += times

    walk(entry, 1, ())
    by_kind = Counter()
    for target, n in custom.items():
        by_kind[custom_call_kind(target)] += n
    n_fusion = sum(fusions.values())
    gemm_fusions = sum(n for k, n in fusions.items() if is_gemm_fusion(k))
    host_callbacks = by_kind.get("host_callback", 0)
    n_custom = sum(custom.values())
    kernels = n_fusion + (n_custom - host_callbacks) + c["copies"] + c["async_copies"] + sum(other.values())
    return {
        "fusions": n_fusion,
        "fusions_by_kind": dict(sorted(fusions.items())),
        "custom_calls": n_custom,
        "custom_calls_by_target": dict(sorted(custom.items())),
        "custom_calls_by_kind": dict(sorted(by_kind.items())),
        "gemms": by_kind.get("cublas", 0) + gemm_fusions,
        "gemm_fusions": gemm_fusions,
        "pallas_calls": by_kind.get("pallas_triton", 0),
        "host_callbacks": host_callbacks,
        "copies": c["copies"],
        "async_copies": c["async_copies"],
        "other_ops": dict(sorted(other.items())),
        "while_loops": c["while_loops"],
        "unknown_trip_loops": c["unknown_trip_loops"],
        "loop_trips": c["loop_trips"],
        "kernels_in_loops": in_loops[0],
        "kernels_by_source": dict(by_source.most_common()),
        "conditionals": c["conditionals"],
        "kernels_per_step": kernels,
        "fusion_substrings": text.count(" fusion("),
        "computations": len(comps),
        "hlo_chars": len(text),
    }


def op_source(ins: HloInstruction) -> str:
    """Where an instruction comes from, for the launch breakdown: the first function jitted inside the step in its
    ``op_name`` metadata (``jit(decode_step_jit)/jit(topk_membership)/...`` -> ``topk_membership``), else the jax
    primitive (``jit(decode_step_jit)/slice`` -> ``slice``), else the opcode."""
    m = re.search(r'op_name="([^"]*)"', ins.text)
    if not m:
        return f"({ins.opcode})"
    parts = [p for p in m.group(1).split("/") if p]
    jits = [p[4:-1] for p in parts if p.startswith("jit(") and p.endswith(")")]
    if len(jits) >= 2:
        return jits[1]
    rest = [p for p in parts if not p.startswith("jit(")]
    return rest[-1] if rest else (jits[0] if jits else f"({ins.opcode})")


def count_step_ops_in(comps: dict, name: str) -> int:
    """Rough size of one computation (its non-free instructions), to pick a conditional's largest branch."""
    return sum(1 for ins in comps.get(name, ()) if ins.opcode not in _FREE_OPS)


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
            lowered = decode_step_jit.lower(params_abs, cache_abs, tokens, key, cfg=cfg, policy=policy,
                                        temperature=0.0, top_p=1.0)
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


# ==================================================================== policies and stand-ins
def authors_profile(path: Path | None = None):
    """The HeteroCache authors' Llama-3.1-8B-Instruct profile (weights fingerprint dropped)."""
    import bench_latency

    if path is None and bench_latency.reference_dir() is None:
        # a git worktree sits deeper than the main checkout: look for shared/reference above it too
        for parent in common.REPO_ROOT.parents:
            cand = parent / "shared" / "reference" / bench_latency.OFFICIAL_PROFILES[SHAPE]
            if cand.is_file():
                path = cand
                break
    return bench_latency.synthetic_profile(SHAPE, path)


def synckv_profile_from(profile):
    """A SyncKV grouping from a HeteroCache profile: each cluster's pivot an R-head with its satellites as NR-heads;
    volatile and anchor heads clusters of one (SyncKV's volatile: full KV). Satellites weight 1, others NaN."""
    import numpy as np

    from hetero_jax.profile.clustering import Role
    from hetero_jax.profile import HeadProfile, ProfileSettings

    roles = np.asarray(profile.roles).copy()
    roles[roles == Role.ANCHOR] = Role.VOLATILE
    weights = np.where(roles == Role.SATELLITE, 1.0, np.nan)
    settings = ProfileSettings(method="synckv", n_clusters=None, tau_stable=None, tau_sim=None)
    return HeadProfile(roles=roles, clusters=profile.clusters, weights=weights, settings=settings,
                       architecture=profile.architecture, head_dim=profile.head_dim,
                       model_name=f"{profile.model_name} (SyncKV groups from the HeteroCache authors' clusters)")


def contextkeeper_ranking_from(profile):
    """A fixed ContextKeeper ranking: the profile's full-KV heads (pivots, volatiles) first, then by allocation
    weight (larger first), then (layer, head)."""
    import numpy as np

    from hetero_jax.profile.clustering import Role
    from hetero_jax.policies.contextkeeper.ranking import CARanking

    roles = np.asarray(profile.roles)
    full = (roles == Role.PIVOT) | (roles == Role.VOLATILE)
    w = np.nan_to_num(np.asarray(profile.weights, np.float64), nan=0.0)
    scores = np.where(full, 10.0 + w, w)
    return CARanking(scores=scores, votes=np.zeros(roles.shape, np.int64), model="llama-3.1-8b (stand-in ranking)",
                     architecture="llama", head_dim=profile.head_dim,
                     settings={"stand_in": "full-KV heads of the HeteroCache authors' profile first, then by "
                                            "allocation weight"})


def random_codebook(cfg, sub_dim: int = HCATTENTION_SUB_DIM, size: int = HCATTENTION_CODES, seed: int = 0):
    """A random key codebook [layers, c, d] of the shape HCAttention needs (N(0, 1) float32, seed ``seed``)."""
    import numpy as np

    from hetero_jax.policies.hcattention.codebook import KeyCodebook

    cents = np.random.default_rng(seed).standard_normal((cfg.num_layers, size, sub_dim)).astype(np.float32)
    return KeyCodebook(centroids=cents, model="llama-3.1-8b (random stand-in codebook)", architecture="llama",
                       head_dim=cfg.head_dim, num_kv_heads=cfg.num_kv_heads, settings={"stand_in": f"random, seed {seed}"})


def parse_spec(spec: str, rho: float) -> tuple[str, float]:
    """'name[:opts][@rho]' -> (registry spec, rho)."""
    name, _, r = spec.partition("@")
    return name, (float(r) if r else rho)


def label(spec: str, rho: float) -> str:
    name, r = parse_spec(spec, rho)
    return "full" if name == "full" else f"{name}@{r:g}"


def make_policy(spec: str, rho: float, profile, cfg, ranking=None, codebook=None):
    """A policy for ``spec`` ('name[:opts][@rho]') with the stand-ins this shape needs; (policy, stand-in note)."""
    from hetero_jax.policies import make_policy as registry_policy

    name, r = parse_spec(spec, rho)
    base = name.split(":")[0]
    if base == "full":
        return registry_policy("full"), ""
    if base == "heterocache":
        return registry_policy(name, r, profile=profile), "the HeteroCache authors' published profile"
    if base == "synckv":
        return (registry_policy(name, r, profile=synckv_profile_from(profile)),
                "groups = the authors' HeteroCache clusters (pivot = R-head, satellites = NR-heads; volatile and "
                "anchor heads singleton clusters, full KV)")
    if base == "contextkeeper":
        return (registry_policy(name, r, ranking=ranking or contextkeeper_ranking_from(profile)),
                "fixed ranking: the authors' pivots and volatiles first, then by allocation weight")
    if base == "hcattention":
        cb = codebook or random_codebook(cfg)
        note = ("exact keys on the device, values on the host (no codebook needed)" if abs(r - 0.5) < 0.05 else
                f"random codebook, g={cfg.head_dim // cb.sub_dim} (d={cb.sub_dim}, c={cb.size}), seed 0")
        return registry_policy(name, r, codebook=cb), note
    return registry_policy(name, r), ""


# ==================================================================== the run
def hlo_filename(policy_label: str, length: int) -> str:
    return f"{policy_label.replace(':', '_').replace('=', '-')}-{length}.hlo.txt"


def recount(payload: dict, hlo_dir: Path) -> int:
    """Count again, from the HLO texts a run dumped (--dump-hlo), every row whose text is in ``hlo_dir`` (the
    counting rule changed, not the compile); ratios and targets follow. Returns how many rows were recounted."""
    n = 0
    for r in payload["rows"]:
        f = hlo_dir / hlo_filename(r["policy"], r["length"])
        if f.is_file():
            r.update(count_step_ops(f.read_text()))
            n += 1
    add_ratios(payload["rows"])
    payload["targets"] = target_check(payload["rows"])
    payload["config"]["counting_rule"] = COUNTING_RULE
    return n


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def measure(spec: str, rho: float, length: int, *, model, params_abs, cfg, mesh, kernels: str, profile,
            dump_dir: Path | None = None, seed: int = 0) -> dict:
    """Synthetic prefill, abstract cache, compile, count: one row."""
    policy, note = make_policy(spec, rho, profile, model.config)
    policy = policy.bind(model)
    t0 = time.perf_counter()
    last = [t0]

    def progress(li):
        now = time.perf_counter()
        if now - last[0] > 20 or li == model.config.num_layers - 1:
            log(f"  {label(spec, rho)} @ {length}: synthetic prefill layer {li + 1}/{model.config.num_layers} "
                f"({now - t0:.0f} s)")
            last[0] = now

    import pallas_kernels

    with pallas_kernels.use_kernels("reference"):  # the synthetic prefill runs here, on the CPU
        cache, state = synthetic_prefill(policy, model, length, seed=seed, progress=progress)
    prefill_s = time.perf_counter() - t0
    summary = cache_summary(cache, state, model.config)
    cache_abs = abstract(cache, mesh)
    check = compile_check(state, cache, mesh, kernels, model.config.group_size)
    if check is not None:  # work the decode state dispatches between steps: counted apart from the step's
        summary["check_kernels"] = count_step_ops(check[0].as_text())["kernels_per_step"]
        summary["check_every"] = check[1]
    del cache, state, check
    gc.collect()
    log(f"  {label(spec, rho)} @ {length}: compiling the step ({summary.get('head_groups', '?')} head groups)")
    exe, lower_s, compile_s = compile_step(params_abs, cache_abs, cfg, policy, mesh, kernels)
    text = exe.as_text()
    counts = count_step_ops(text)
    if dump_dir is not None:
        dump_dir.mkdir(parents=True, exist_ok=True)
        (dump_dir / hlo_filename(label(spec, rho), length)).write_text(text)
    row = {"policy": label(spec, rho), "spec": spec, "rho": None if spec == "full" else parse_spec(spec, rho)[1],
           "length": length, "policy_repr": repr(policy), "stand_in": note,
           "prefill_seconds": prefill_s, "lower_seconds": lower_s, "compile_seconds": compile_s, **summary, **counts}
    try:
        mem = exe.memory_analysis()
        row["temp_bytes"] = int(getattr(mem, "temp_size_in_bytes", 0))
    except Exception:  # noqa: BLE001 - informational
        pass
    del exe, text
    gc.collect()
    log(f"  {row['policy']} @ {length}: {row['kernels_per_step']} kernels/step, {row['fusions']} fusions, "
        f"{row['pallas_calls']} Pallas, {row['gemms']} GEMMs, {row['copies'] + row['async_copies']} copies "
        f"(prefill {prefill_s:.0f} s, compile {lower_s + compile_s:.0f} s)")
    return row


def run(args) -> dict:
    import jax
    import jaxlib

    import bench_latency

    t_start = time.perf_counter()
    if args.target == "h100":
        mesh = gpu_mesh()
        target = H100_DESCRIPTION
    else:
        mesh = cpu_mesh()
        target = f"XLA:CPU ({common.machine_info(with_jax=False)['cpu_model']})"
    cfg = bench_latency.synthetic_config(None, args.shape, max(args.lengths) + TAIL_CAPACITY)
    narrow_shape = args.narrow_shape
    model = narrow_twin(narrow_shape, args.dtype, args.seed, max(args.lengths) + TAIL_CAPACITY)
    ncfg = model.config
    same = (ncfg.num_layers, ncfg.num_heads, ncfg.num_kv_heads, ncfg.head_dim) == (
        cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    if not same:
        raise SystemExit(f"{narrow_shape} does not have {args.shape}'s layers / heads / head_dim")
    params_abs = abstract_params(cfg, args.dtype, mesh)
    profile = authors_profile(args.profile) if args.shape == SHAPE else None
    kernels = args.kernels or ("pallas" if args.target == "h100" else "reference")
    rows, errors = [], []
    jobs = []  # (spec, length run, [lengths it stands for])
    for spec in args.policies:
        base = parse_spec(spec, args.rho)[0].split(":")[0]
        runs: dict[int, list[int]] = {}
        for length in args.lengths:
            cap = QUADRATIC_MAX_LENGTH.get(base)
            if cap is not None and length > cap and not args.no_fallback:
                runs.setdefault(args.fallback_length, []).append(length)
            else:
                runs.setdefault(length, [])
        jobs += [(spec, length, instead) for length, instead in runs.items()]
    fallback_used = any(instead for _, _, instead in jobs)
    if fallback_used and ("full", args.fallback_length, []) not in jobs:  # the reference of the fallback rows
        jobs.insert(len(args.lengths), ("full", args.fallback_length, []))
    log(f"{len(jobs)} compiles for {target}; kernels: {kernels}; policies: {', '.join(args.policies)}")
    for i, (spec, length, instead_of) in enumerate(jobs):
        log(f"[{i + 1}/{len(jobs)}] {label(spec, args.rho)} at {length} tokens"
            + (f" (also for {', '.join(map(str, instead_of))}: its prefill scoring is quadratic)" if instead_of else ""))
        try:
            row = measure(spec, args.rho, length, model=model, params_abs=params_abs, cfg=cfg, mesh=mesh,
                          kernels=kernels, profile=profile, dump_dir=args.dump_hlo, seed=args.seed)
            row["instead_of"] = instead_of
            rows.append(row)
        except Exception as e:  # noqa: BLE001 - one policy's failure is recorded, the others still run
            import traceback

            traceback.print_exc()
            errors.append({"policy": label(spec, args.rho), "length": length, "error": f"{type(e).__name__}: {e}"})
            log(f"  FAILED: {type(e).__name__}: {str(e)[:300]}")
        gc.collect()
    add_ratios(rows)
    payload = common.report_header("bench_step_ops", {
        "shape": args.shape, "narrow_shape": narrow_shape, "dtype": args.dtype, "batch": 1,
        "lengths": list(args.lengths), "fallback_length": args.fallback_length, "rho": args.rho,
        "policies": list(args.policies), "target": args.target, "target_description": target,
        "kernels": kernels, "tail_capacity": TAIL_CAPACITY, "seed": args.seed,
        "jax": jax.__version__, "jaxlib": getattr(jaxlib, "__version__", None), "cuda_plugin": _plugin_versions(),
        "counting_rule": COUNTING_RULE, "targets": {"heterocache": HETERO_TARGET, "any_policy": POLICY_TARGET},
    }, machine=common.machine_info(with_jax=False))
    payload.update(rows=rows, errors=errors, targets=target_check(rows),
                   total_seconds=time.perf_counter() - t_start, peak_rss_bytes=common.peak_rss_bytes())
    return payload


def _plugin_versions() -> dict:
    from importlib import metadata

    out = {}
    for pkg in ("jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cuda-nvcc-cu12", "nvidia-cuda-runtime-cu12"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def add_ratios(rows: list[dict]) -> None:
    """Each row's kernels / fusions over full KV's at the same length (None where full KV is missing)."""
    full = {r["length"]: r for r in rows if r["policy"] == "full"}
    for r in rows:
        f = full.get(r["length"])
        r["kernels_vs_full"] = r["kernels_per_step"] / f["kernels_per_step"] if f else None
        r["fusions_vs_full"] = r["fusions"] / f["fusions"] if f and f["fusions"] else None


def target_check(rows: list[dict]) -> dict:
    """HeteroCache <= 1.2x full KV's kernels per step and every compressed policy <= 1.5x, at each length."""
    out = {}
    for r in rows:
        if r["policy"] == "full" or r["kernels_vs_full"] is None:
            continue
        key = f"{r['policy']}@{r['length']}"
        limit = HETERO_TARGET if r["policy"].startswith("heterocache") else POLICY_TARGET
        out[key] = {"ratio": r["kernels_vs_full"], "limit": limit, "met": r["kernels_vs_full"] <= limit}
    return out


# ==================================================================== report
def fmt_int(x) -> str:
    return "—" if x is None else f"{int(x):,}"


def _other_kernels(r: dict) -> int:
    return int(sum(r["other_ops"].values()))


def table_rows(rows: list[dict], lengths=None) -> list[dict]:
    """Rows in table order: per context (``lengths``, default every row's), full KV first, then the policies in run
    order; a row measured at a fallback length also stands in the blocks of the lengths it was run for."""
    lengths = sorted({r["length"] for r in rows} if lengths is None else set(lengths), reverse=True)
    out = []
    for length in lengths:
        block = [r for r in rows if r["length"] == length or length in (r.get("instead_of") or [])]
        block.sort(key=lambda r: 0 if r["policy"] == "full" else 1)
        out += [dict(r, shown_for=length) for r in block]
    return out


def table(rows: list[dict], lengths=None) -> str:
    headers = ["context", "policy", "kernels / step", "vs full", "fusions", "vs full", "GEMMs (cuBLAS + Triton)",
               "Pallas (Triton) calls", "other custom calls", "host callbacks", "copies (+ async)", "other ops",
               "while loops (trips) / conditionals", "head groups", "`fusion(` in text", "compile s",
               "synthetic prefill s", "between steps: kernels (every n steps)"]
    out = []
    for r in table_rows(rows, lengths):
        kinds = r["custom_calls_by_kind"]
        other_cc = sum(n for k, n in kinds.items() if k not in ("cublas", "pallas_triton", "host_callback"))
        ctx = f"{r['length']:,}" if r["shown_for"] == r["length"] else f"{r['length']:,} (for {r['shown_for']:,})"
        out.append([
            ctx, r["policy"], fmt_int(r["kernels_per_step"]),
            common.fmt_num(r["kernels_vs_full"], 2) if r["kernels_vs_full"] is not None else "—",
            fmt_int(r["fusions"]), common.fmt_num(r["fusions_vs_full"], 2) if r["fusions_vs_full"] is not None else "—",
            f"{r['gemms']:,} ({kinds.get('cublas', 0)} + {r['gemm_fusions']})", fmt_int(r["pallas_calls"]),
            fmt_int(other_cc), fmt_int(r["host_callbacks"]), f"{r['copies']:,} (+{r['async_copies']})",
            fmt_int(_other_kernels(r)),
            f"{r['while_loops']} ({r['loop_trips']:,}" + (f", {r['unknown_trip_loops']} unknown" if r["unknown_trip_loops"]
                                                        else "") + f") / {r['conditionals']}",
            fmt_int(r.get("head_groups")), fmt_int(r["fusion_substrings"]),
            f"{r['lower_seconds'] + r['compile_seconds']:.0f}", f"{r['prefill_seconds']:.0f}",
            f"{r['check_kernels']:,} ({r['check_every']})" if r.get("check_kernels") is not None else "—",
        ])
    return common.markdown_table(headers, out, align="rl" + "r" * (len(headers) - 2))


def extra_sources(row: dict, full: dict | None, top: int = 4) -> str:
    """The sources (``op_source``) of the launches a policy adds over full KV at the same length, largest first."""
    if full is None or "kernels_by_source" not in row:
        return "—"
    base = full.get("kernels_by_source", {})
    diff = {k: v - base.get(k, 0) for k, v in row["kernels_by_source"].items()}
    diff.update({k: -v for k, v in base.items() if k not in diff})
    parts = [f"`{k}` {v:+,}" for k, v in sorted(diff.items(), key=lambda kv: -kv[1])[:top] if v > 0]
    return ", ".join(parts) or "none"


def sources_table(rows: list[dict], lengths=None) -> str:
    """Per policy: launches inside loops and the sources of its launches beyond full KV's."""
    full = {r["length"]: r for r in rows if r["policy"] == "full"}
    out = []
    for r in table_rows(rows, lengths):
        if r["policy"] == "full":
            continue
        ctx = f"{r['length']:,}" if r["shown_for"] == r["length"] else f"{r['length']:,} (for {r['shown_for']:,})"
        out.append([ctx, r["policy"], fmt_int(r["kernels_per_step"]), fmt_int(r.get("kernels_in_loops")),
                    extra_sources(r, full.get(r["length"]))])
    return common.markdown_table(["context", "policy", "kernels / step", "in while loops",
                                  "largest additions over full KV, by source (op_name)"], out, align="rlrrl")


def targets_text(payload: dict) -> str:
    """One line per policy: its ratio at each length measured, its limit, MET only when met at every length."""
    by_policy: dict[str, list] = {}
    for key, t in payload["targets"].items():
        policy, _, length = key.rpartition("@")
        by_policy.setdefault(policy, []).append((int(length), t))
    lines = []
    for policy, items in by_policy.items():
        items.sort(key=lambda it: -it[0])
        ratios = ", ".join(f"{t['ratio']:.2f}x at {length:,}" for length, t in items)
        met = all(t["met"] for _, t in items)
        lines.append(f"- {policy}: {ratios} (at most {items[0][1]['limit']:g}x) — " + ("**MET**" if met else "**NOT MET**"))
    return "\n".join(lines) or "- (no compressed policy measured beside full KV)"


def results_section(payload: dict) -> str:
    cfg = payload["config"]
    rows = payload["rows"]
    plugin = ", ".join(f"{k} {v}" for k, v in cfg["cuda_plugin"].items()) or "none"
    notes = [r for r in rows if r.get("stand_in")]
    seen = set()
    stand_ins = []
    for r in notes:
        if r["policy"] not in seen:
            seen.add(r["policy"])
            stand_ins.append(f"- {r['policy']}: {r['stand_in']}")
    errors = "\n".join(f"- {e['policy']} at {e['length']:,}: {e['error']}" for e in payload["errors"])
    parts = [
        common.section_header("Decode-step kernels per policy (compiled for an H100, no GPU)", payload),
        "- Reproduce: `make step-ops` (its own venv with the `gpu-compile` extra; `CUDA_VISIBLE_DEVICES=-1 "
        "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 HETERO_JAX_KERNELS=pallas`)",
        "",
        f"Target: {cfg['target_description']}. jax {cfg['jax']}, jaxlib {cfg['jaxlib']}; {plugin}. "
        f"One decode step as the engine jits it (`engine.decode_step_jit`: `decode_step` with the policy's `attend`, "
        f"cache donated, greedy), {cfg['shape']} shapes, {cfg['dtype']}, batch 1, kernels: {cfg['kernels']}, "
        f"rho {cfg['rho']:g} (HCAttention at its own byte-based points), tail {cfg['tail_capacity']} slots. "
        f"Weights are ShapeDtypeStructs; the cache is the policy's own post-prefill structure from a synthetic "
        f"prefill (random layer inputs through the policy's `build_layer`, layer params of `{cfg['narrow_shape']}`, "
        f"then `finish`). Compiled, not run: launches, not times. Without a GPU XLA does not autotune, so its GEMMs "
        f"are its untuned choice (a Triton GEMM fusion or a cuBLAS call: one kernel each).",
        "",
        table(rows),
        "",
    ]
    fallback = sorted({(r["policy"], r["length"]) for r in rows if r.get("instead_of")})
    if fallback:
        parts += ["Rows marked '(for N)': " + "; ".join(f"{p} measured at {n:,} tokens" for p, n in fallback)
                  + ": its prefill scores every prompt query (quadratic), hours per policy at 32K on this CPU; "
                  "full KV's own count moves 4 % from 2K to 32K.", ""]
    parts += [
        "Where the launches go: the step's kernels inside `while` loops (per trip) and the sources of the "
        "launches each policy adds over full KV (the innermost function jitted inside the step, else the jax "
        "primitive, from the HLO's `op_name`; negative changes not shown):",
        "",
        sources_table(rows),
        "",
        "Targets (kernels per step, ratio to full KV at the same context; the project's: HeteroCache at most "
        f"{HETERO_TARGET:g}x, every compressed policy at most {POLICY_TARGET:g}x):",
        "",
        targets_text(payload),
        "",
        "Stand-ins for calibration files this shape has none of:",
        "",
        "\n".join(stand_ins) or "- none",
        "",
        f"Counting rule: {cfg['counting_rule']}",
    ]
    if errors:
        parts += ["", "Not measured:", "", errors]
    parts += ["", common.wall_and_memory_line(payload)]
    return "\n".join(parts)


def parse_args(argv=None):
    p = common.argument_parser(__doc__.split("\n\n")[0])
    p.add_argument("--lengths", "--length", type=int, nargs="+", default=list(DEFAULT_LENGTHS),
                   help="prompt lengths (tokens) of the synthetic prefill")
    p.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES),
                   help="registry specs, optionally with options and @rho (hcattention@0.125); full KV always runs")
    p.add_argument("--rho", type=float, default=DEFAULT_RHO, help="budget of the compressed policies")
    p.add_argument("--fallback-length", type=int, default=2048,
                   help="length for policies whose prefill scoring is quadratic, above their limit "
                        f"({QUADRATIC_MAX_LENGTH})")
    p.add_argument("--no-fallback", action="store_true", help="run quadratic policies at every length anyway")
    p.add_argument("--target", choices=["h100", "cpu"], default="h100",
                   help="h100: the CUDA plugin's H100 topology (needs the gpu-compile venv); cpu: this machine")
    p.add_argument("--kernels", choices=["pallas", "reference"], default=None,
                   help="kernels traced into the step (default: pallas for h100, reference for cpu)")
    p.add_argument("--shape", default=SHAPE, help=argparse.SUPPRESS)
    p.add_argument("--narrow-shape", default=NARROW, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--profile", type=Path, default=None,
                   help="HeteroCache authors' profile JSON (default: ../shared/reference)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dump-hlo", type=Path, default=None, help="write each compiled HLO text into this folder")
    p.add_argument("--out", type=Path, default=common.OUT_DIR / "step-ops.json", help="JSON output")
    p.add_argument("--render", type=Path, default=None, metavar="JSON",
                   help="compile nothing: print (and with --write-results, write) the tables of a saved run's JSON")
    p.add_argument("--recount", type=Path, default=None, metavar="DIR",
                   help="with --render: count again from the HLO texts that run dumped into DIR (--dump-hlo)")
    common.add_results_arguments(p, SECTION, presets=False)
    p.not_written_with("out", "render")  # --render only reads its JSON
    args = p.parse_args(argv)
    if "full" not in args.policies:
        args.policies = ["full", *args.policies]
    args.lengths = list(dict.fromkeys(args.lengths))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render is not None:
        payload = json.loads(args.render.read_text())
        if args.recount is not None:
            print(f"recounted {recount(payload, args.recount)} rows from {args.recount}")
    else:
        payload = run(args)
        out = common.write_json(args.out, payload)
        print(f"wrote {out}")
    print(table(payload["rows"]))
    print()
    print(sources_table(payload["rows"]))
    print()
    print(targets_text(payload))
    for e in payload["errors"]:
        print(f"not measured: {e['policy']} at {e['length']}: {e['error']}")
    print(f"total {payload['total_seconds'] / 60:.1f} min")
    if args.write_results:
        common.write_results_section(SECTION, lambda _plot: results_section(payload), None, args.results_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
