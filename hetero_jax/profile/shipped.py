"""The profiles shipped as package data (``hetero_jax/data/``) and how a model finds its own: by name, shape and
a cheap fingerprint of its weights (``weights_fingerprint``)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from hetero_jax.profile.head_profile import HeadProfile
from hetero_jax.profile.official import load_profile
from hetero_jax.profile.schema import ProfileError

_FINGERPRINT_SAMPLES = 64  # values hashed per parameter array (start and middle of it)


# fingerprints of params whose leaves are all jax arrays (immutable), keyed by the leaves' ids and checked by
# weak references: a profiled policy's every ``bind`` asks again, and the slices cost a dispatch per leaf
_FINGERPRINTS: dict[tuple[int, ...], tuple[list, str]] = {}


def weights_fingerprint(params: Any) -> str:
    """A cheap identity of a params pytree: ``"sha256:<16 hex>"``.

    Hashes each leaf's tree path and shape plus ``2 x 64`` values (the first
    ones and those from the middle of the flattened array), rounded to
    bfloat16 first so that the same checkpoint loaded in float32 or bfloat16
    gives the same fingerprint. Reads a few KB, not the weights: it tells
    checkpoints apart, it is not a checksum of every value. Remembered for
    params made of jax arrays while those arrays live.
    """
    import weakref

    import jax

    leaves = jax.tree_util.tree_leaves(params)
    key = tuple(id(x) for x in leaves)
    hit = _FINGERPRINTS.get(key)
    if hit is not None and all(ref() is x for ref, x in zip(hit[0], leaves)):
        return hit[1]
    fp = _fingerprint(params)
    if leaves and all(isinstance(x, jax.Array) for x in leaves):
        for k in [k for k, (refs, _) in _FINGERPRINTS.items() if any(r() is None for r in refs)]:
            del _FINGERPRINTS[k]
        _FINGERPRINTS[key] = ([weakref.ref(x) for x in leaves], fp)
    return fp


def _fingerprint(params: Any) -> str:
    import hashlib

    import jax
    import ml_dtypes

    h = hashlib.sha256()
    n = _FINGERPRINT_SAMPLES
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        shape = tuple(int(s) for s in np.shape(leaf))
        size = int(np.prod(shape)) if shape else 1
        flat = leaf.reshape(-1) if hasattr(leaf, "reshape") else np.reshape(leaf, -1)
        mid = max(0, size // 2 - n // 2)
        parts = [np.asarray(flat[:n]), np.asarray(flat[mid:mid + n])]
        vals = np.concatenate([p.astype(np.float32) for p in parts]).astype(ml_dtypes.bfloat16)
        h.update(f"{jax.tree_util.keystr(path)}{shape};".encode())
        h.update(vals.view(np.uint16).tobytes())
    return "sha256:" + h.hexdigest()[:16]


# Profiles shipped as package data (hetero_jax/data/), by known model name.
SHIPPED_PROFILES = {"smollm2-135m": "smollm2-135m.profile.json"}
# SyncKV groupings (``hetero-jax profile --method synckv``), same format.
SHIPPED_SYNCKV_PROFILES = {"smollm2-135m": "smollm2-135m.synckv.json"}


def shipped_data_path(table: dict[str, str], model_name: str) -> str | None:
    """Path of the package-data file (hetero_jax/data/) that ``table`` names for ``model_name``, or None."""
    fname = table.get(model_name)
    if fname is None:
        return None
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", fname)
    return path if os.path.isfile(path) else None


def shipped_fitting(paths, load, config, fingerprint: str | None) -> list:
    """What ``load`` reads from each shipped file in ``paths`` (None: not shipped, skipped) that fits the model
    (its ``check_compatible(config, fingerprint)`` passes), in order: a peer's rankings or codebooks."""
    found = []
    for path in paths:
        if path is None:
            continue
        x = load(path)
        try:
            x.check_compatible(config, fingerprint)
        except ProfileError:
            continue
        found.append(x)
    return found


def shipped_profile_path(model_name: str) -> str | None:
    """Path of the profile shipped for known model ``model_name``, or None."""
    return shipped_data_path(SHIPPED_PROFILES, model_name)


def default_profile(model_or_config: Any, fingerprint: str | None = None,
                    table: dict[str, str] | None = None) -> HeadProfile | None:
    """The shipped HeadProfile that fits this model, or None (``table``: which shipped files to search,
    default ``SHIPPED_PROFILES``, HeteroCache's; ``SHIPPED_SYNCKV_PROFILES`` for SyncKV's).

    ``model_or_config``: a ``hetero_jax.io.hub.Model`` (its params are
    fingerprinted) or a ModelConfig-like object. A shipped profile fits when
    architecture, layers, KV heads and head_dim agree and, when a fingerprint
    is known (a Model, or ``fingerprint=``), the fingerprints agree.
    With a bare config and no fingerprint only the shape is compared.
    """
    cfg = getattr(model_or_config, "config", model_or_config)
    params = getattr(model_or_config, "params", None)
    fp = fingerprint
    table = SHIPPED_PROFILES if table is None else table
    for name in table:
        path = shipped_data_path(table, name)
        if path is None:
            continue
        prof = load_profile(path)
        try:
            prof.check_compatible(cfg)
        except ProfileError:
            continue
        if fp is None and params is not None:
            fp = weights_fingerprint(params)
        if fp is not None and prof.weights_fingerprint is not None and fp != prof.weights_fingerprint:
            continue
        return prof
    return None
