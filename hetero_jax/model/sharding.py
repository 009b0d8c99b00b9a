"""A device mesh for params, caches and host stores: tensor parallel over heads, data parallel over batch.

The logical axes come from :mod:`hetero_jax.model.spec` (``param_axes``; the cache's records declare theirs with
``spec.axes_field``, read by ``spec.tree_axes``); :data:`RULES` maps
them onto the mesh axes ``("data", "model")``. Computation is not rewritten: the jitted prefill and
decode functions see sharded inputs and XLA's SPMD partitioner splits them (heads and MLP columns stay
on their device; the all-reduces after ``o_proj`` and ``down_proj`` are inserted by the partitioner).

A dimension that the mesh axis does not divide stays replicated on that axis (e.g. a HeteroCache group
of 2 heads on a 3-way model axis); :func:`per_device_bytes` measures what each device really holds.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from hetero_jax.model.config import ModelConfig
from hetero_jax.errors import HeteroJaxError
from hetero_jax.model.spec import param_axes, tree_axes

DATA, MODEL = "data", "model"

# logical axis -> mesh axis (absent: replicated)
RULES: dict[str, str] = {"batch": DATA, "heads": MODEL, "kv_heads": MODEL, "mlp": MODEL, "vocab": MODEL}


class MeshError(HeteroJaxError, ValueError):
    """A mesh that cannot be built or does not fit the model."""


def make_mesh(tp: int = 1, dp: int = 1, devices=None) -> Mesh:
    """A ``("data", "model")`` mesh of ``dp x tp`` devices (the first ``dp * tp`` of ``devices``).

    Axes are ``Auto`` (sharding propagates through jitted code). On a CPU, simulate devices with
    ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` set before JAX starts.
    """
    for name, value in (("tp", tp), ("dp", dp)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise MeshError(f"{name} must be a positive integer, got {value!r}")
    # flat: another mesh's ``.devices`` is a 2-D array, whose rows list() would take for devices
    devices = list(np.ravel(np.asarray(jax.devices() if devices is None else devices, dtype=object)))
    if tp * dp > len(devices):
        raise MeshError(
            f"a mesh of tp={tp} x dp={dp} needs {tp * dp} devices but {len(devices)} are visible; lower --tp/--dp"
            " or, on a CPU, start with XLA_FLAGS=--xla_force_host_platform_device_count=" + str(tp * dp))
    return jax.make_mesh((dp, tp), (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[: tp * dp])


def check_mesh(mesh: Mesh, cfg: ModelConfig) -> None:
    """Axes ("data", "model"), both Auto; the model axis must divide the KV heads (a KV head and its query heads
    live on one device)."""
    if not isinstance(mesh, Mesh) or set(mesh.axis_names) != {DATA, MODEL}:
        raise MeshError(f"expected a jax.sharding.Mesh with axes ('data', 'model') (hetero_jax.model.sharding.make_mesh), "
                        f"got {mesh!r}")
    # jax.make_mesh's default (Explicit) axes make jitted code ask for output shardings the library never
    # gives: prefill would fail deep inside with a ShardingTypeError that names neither cause nor fix
    typed = {n: t for n, t in zip(mesh.axis_names, getattr(mesh, "axis_types", ())) if t != AxisType.Auto}
    if typed:
        axes = ", ".join(f"{n!r}: {t.name}" for n, t in typed.items())
        raise MeshError(f"the mesh's axes are not Auto ({axes}; jax.make_mesh makes Explicit axes by default): "
                        "hetero-jax shards through jitted code, which needs Auto axes. Build the mesh with "
                        "hetero_jax.make_mesh(tp=..., dp=...), or jax.make_mesh(shape, ('data', 'model'), "
                        "axis_types=(jax.sharding.AxisType.Auto,) * 2)")
    problem = tp_problem(mesh.shape[MODEL], cfg.num_kv_heads)
    if problem:
        raise MeshError(f"tensor parallelism {problem}")
    n = jax.process_count()
    held = {d.process_index for d in mesh.devices.flat}
    if len(held) < n:  # a process without a device in the mesh cannot read what the others compute
        raise MeshError(f"the mesh holds devices of process(es) {sorted(held)} only, but the job has {n} processes; "
                        f"every process must hold part of it: build it over every process's devices, "
                        f"make_mesh(tp=..., dp=...) with tp x dp = jax.device_count() = {jax.device_count()}")


def tp_problem(tp: int, num_kv_heads: int) -> str | None:
    """Why tensor parallelism ``tp`` cannot split ``num_kv_heads`` KV heads (it must divide them: a KV head and
    its query heads live on one device), naming the values that can; None when it can."""
    if num_kv_heads % tp == 0:
        return None
    ok = [d for d in range(1, num_kv_heads + 1) if num_kv_heads % d == 0]
    return f"tp={tp} does not divide the model's {num_kv_heads} KV heads; choose tp in {ok}"


def partition_spec(axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """``axes`` (logical, one per dim) as a PartitionSpec; a dim the mesh axis does not divide stays whole
    (as does every dim on a mesh axis of size 1, and every dim of an empty array, which the partitioner
    hands back replicated)."""
    if 0 in tuple(shape):
        return PartitionSpec()
    out = []
    for name, n in zip(axes, shape):
        mesh_axis = RULES.get(name)
        split = mesh_axis is not None and mesh.shape[mesh_axis] > 1 and n % mesh.shape[mesh_axis] == 0
        out.append(mesh_axis if split else None)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def param_shardings(cfg: ModelConfig, mesh: Mesh, params: dict) -> dict:
    """NamedShardings for ``params`` (spec layout), from the spec's logical axes."""
    axes = param_axes(cfg)
    out = {k: NamedSharding(mesh, partition_spec(axes[k], params[k].shape, mesh)) for k in params if k != "layers"}
    out["layers"] = [{n: NamedSharding(mesh, partition_spec(la[n], layer[n].shape, mesh)) for n in layer}
                     for layer, la in zip(params["layers"], axes["layers"])]
    return out


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """``params`` placed on ``mesh`` (tensor parallel over heads and MLP columns, replicated over data)."""
    check_mesh(mesh, cfg)
    return jax.device_put(params, param_shardings(cfg, mesh, params))


def named_sharding(mesh: Mesh, axes: tuple[str, ...], shape: tuple[int, ...]) -> NamedSharding:
    """The NamedSharding of an array of logical ``axes`` and ``shape`` on ``mesh`` (``partition_spec``)."""
    return NamedSharding(mesh, partition_spec(tuple(axes)[: len(shape)], tuple(shape), mesh))


def tree_specs(tree, mesh: Mesh):
    """PartitionSpecs for a pytree of records whose fields declare their logical axes (``spec.axes_field``),
    as :func:`tree_shardings` places them (``jax.shard_map``'s in/out specs)."""
    leaves, treedef = jax.tree.flatten(tree)
    axes = tree_axes(tree)
    return jax.tree.unflatten(treedef, [partition_spec(tuple(a), np.shape(x), mesh) for a, x in zip(axes, leaves)])


def tree_shardings(tree, mesh: Mesh):
    """NamedShardings for a pytree of records whose fields declare their logical axes (``spec.axes_field``:
    the KV cache, a policy's per-layer state): KV heads (and the pool's shards) on "model", batch on "data",
    where they divide. A leaf without a declaration is an error, never a guess."""
    leaves, treedef = jax.tree.flatten(tree)
    axes = tree_axes(tree)
    return jax.tree.unflatten(treedef, [named_sharding(mesh, a, np.shape(x)) for a, x in zip(axes, leaves)])


def cache_shardings(cache, mesh: Mesh):
    """NamedShardings for a KVCache pytree (:func:`tree_shardings`)."""
    return tree_shardings(cache, mesh)


def shard_cache(cache, mesh: Mesh):
    """``cache`` placed on ``mesh`` (a no-op for leaves already there), and marked as living there."""
    placed = jax.device_put(cache, cache_shardings(cache, mesh))
    return placed.replace(mesh=mesh) if hasattr(placed, "mesh") else placed


def keep_placed(cache):
    """Traced: ``cache`` constrained to where :func:`shard_cache` places it (a no-op off a mesh).

    A jitted step that takes the cache and hands it back ends with this, so its output sits where its input
    did: the engine reuses one compiled step, which refuses arguments placed otherwise ("compiled for input
    shardings that disagree"), and the partitioner may otherwise split a small state field that the
    declared axes keep whole (FreeKV's resident pages did)."""
    mesh = getattr(cache, "mesh", None)
    return cache if mesh is None else jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh))


def batch_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Inputs whose first dim is the batch: split over "data" where it divides."""
    return NamedSharding(mesh, partition_spec(("batch",), shape, mesh))


def per_device_bytes(tree: Any) -> dict[str, int]:
    """Bytes each device (``str(device)``) holds for the arrays of ``tree``, from each array's sharding: every
    device of the job, those of other processes included (their shards are not addressable here, but where
    they lie is known).

    Replicated arrays count on every device that holds a copy; host-memory arrays count on the device
    whose host holds them.
    """
    out: dict[str, int] = collections.Counter()
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            for device, index in x.sharding.devices_indices_map(x.shape).items():
                out[str(device)] += _slice_elements(index, x.shape) * x.dtype.itemsize
    return dict(out)


def _slice_elements(index: tuple, shape: tuple[int, ...]) -> int:
    """Elements of the block ``index`` (a tuple of slices, one per dim) selects from an array of ``shape``."""
    n = 1
    for sl, dim in zip(index, shape):
        n *= len(range(*sl.indices(dim)))
    return n


def to_host(x) -> np.ndarray:
    """``x`` as a numpy array on this host. Under ``jax.distributed`` an array split over several
    processes is gathered from all of them (a collective: every process makes the same call in the
    same order, as SPMD programs do)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def per_process(x) -> np.ndarray:
    """Each process's host values ``x`` of a ``jax.distributed`` job, stacked: [processes, *x.shape] (a
    collective: every process makes the same call); ``x[None]`` in a single process."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x))


def committed(tree):
    """``tree`` with every uncommitted device array committed where it is (``jax.device_put`` to its own
    sharding: a new handle on the same buffer, no copy). A decode step's executable is called through its
    fast path only while each argument's committedness is what it was; a computation with a committed input
    returns committed arrays, and a host array placed with ``place_like`` is committed, so an engine whose
    inputs start uncommitted would take the slow path (about 6 ms on a CPU for SmolLM2's arguments) at each
    step after one was placed or written, and again at the step after. For one device only: committing to a
    single device what a mesh computation must take on its devices (the sampling key) is an error there."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding) if isinstance(x, jax.Array) and not x.committed
                        else x, tree)


def place_like(x, like: jax.Array) -> jax.Array:
    """Host values ``x`` (the same in every process) placed as ``like`` is: on a mesh each device takes its
    block (under ``jax.distributed`` each process builds only its own devices' blocks), else where ``like`` is."""
    x = np.asarray(x)
    sharding = getattr(like, "sharding", None)
    if sharding is None or len(sharding.device_set) == 1:
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def imbalance(by_device: dict[str, int]) -> float:
    """max / mean of per-device bytes (1.0 = perfectly balanced)."""
    vals = np.asarray(list(by_device.values()), np.float64)
    return float(vals.max() / vals.mean()) if vals.size and vals.mean() > 0 else 1.0


def mesh_of(params: dict) -> Mesh | None:
    """The mesh ``params`` live on (None for single-device params)."""
    s = getattr(params.get("embed"), "sharding", None)
    return s.mesh if isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh) else None
