"""Reading a head profile file, ours or the HeteroCache authors' published format (``load_profile``).

The authors' files (``official_profile_<model>.json``) hold ``meta.type_map``
(role name -> code), ``meta.counts``, ``classification_matrix`` [L][H] codes,
``allocation_matrix`` [L][H] (mean-1 weights, -1 for full heads) and
``leader_member_relations`` (per layer {"pivot": [satellites]}). Their role
names differ between files (anchor/volatile/pivot/satellite vs
Stable_Unique/Decaying_Unique/Similar_Leader/Similar_Member); they record no
stability, similarity, head_dim or architecture.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping

import numpy as np

from hetero_jax.profile.clustering import COMPRESSED_ROLES, Cluster, Role
from hetero_jax.profile.head_profile import HeadProfile
from hetero_jax.profile.schema import FORMAT_NAME, ProfileError, ProfileSettings, read_document

# Role names used in the authors' files -> our roles (compared lower-case).
_OFFICIAL_ROLE_NAMES = {
    "anchor": Role.ANCHOR,
    "stable_unique": Role.ANCHOR,
    "volatile": Role.VOLATILE,
    "decaying_unique": Role.VOLATILE,
    "pivot": Role.PIVOT,
    "similar_leader": Role.PIVOT,
    "satellite": Role.SATELLITE,
    "similar_member": Role.SATELLITE,
}

_PAPER_DATA = "Wikipedia, 50 samples x 10K tokens (paper App. B.1; not recorded in the file)"

# Identity and settings the authors' files do not carry, keyed by a pattern on
# the file name; applied only when the grid shape agrees. From the public HF
# configs (head_dim = hidden / heads) and the paper (Sec. 3, App. B-C).
_KNOWN_MODELS = (
    (re.compile(r"llama-?3\.1-8b", re.I),
     dict(model_name="meta-llama/Llama-3.1-8B-Instruct", architecture="llama", shape=(32, 8), head_dim=128,
          settings=ProfileSettings(top_k=1024, decode_steps=100, tau_stable=0.5, tau_sim=0.5,
                                   calibration_data=_PAPER_DATA, samples=50, tokens_per_sample=10_000))),
    (re.compile(r"qwen2\.5-14b", re.I),
     dict(model_name="Qwen/Qwen2.5-14B-Instruct", architecture="qwen2", shape=(48, 8), head_dim=128,
          settings=ProfileSettings(decode_steps=100, tau_stable=0.4, tau_sim=0.5,
                                   calibration_data=_PAPER_DATA, samples=50, tokens_per_sample=10_000))),
)
_ARCH_PATTERNS = ((re.compile(r"qwen3", re.I), "qwen3"), (re.compile(r"qwen2", re.I), "qwen2"),
                  (re.compile(r"llama", re.I), "llama"))


def load_profile(
    path: str | os.PathLike,
    *,
    architecture: str | None = None,
    head_dim: int | None = None,
    model_name: str | None = None,
    weights_fingerprint: str | None = None,
    settings: ProfileSettings | None = None,
) -> HeadProfile:
    """Read a profile: ours, or the HeteroCache authors' published format.

    The format is detected from the contents. For the authors' files, roles
    are mapped by their ``type_map`` names (either naming), clusters and
    allocation values are kept as published (-1 -> NaN for full heads), and
    identity fields they lack are inferred from the file name where known.
    Keyword arguments override the corresponding fields (both formats).
    """
    data = read_document(path)
    if isinstance(data, Mapping) and data.get("format") == FORMAT_NAME:
        prof = HeadProfile.from_dict(data)
    elif isinstance(data, Mapping) and "classification_matrix" in data:
        prof = _from_official(data, os.path.basename(os.fspath(path)))
    else:
        raise ProfileError(f"{path}: not a head profile (neither {FORMAT_NAME} nor the "
                           "HeteroCache release format with 'classification_matrix')")
    overrides = {k: v for k, v in dict(architecture=architecture, head_dim=head_dim, model_name=model_name,
                                       weights_fingerprint=weights_fingerprint, settings=settings).items()
                 if v is not None}
    return dataclasses.replace(prof, **overrides) if overrides else prof


def _from_official(d: Mapping, filename: str) -> HeadProfile:
    try:
        type_map = d["meta"]["type_map"]
        codes = np.array(d["classification_matrix"], dtype=np.int64)
        alloc = np.array(d["allocation_matrix"], dtype=np.float64)
        relations = d["leader_member_relations"]
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"{filename}: malformed HeteroCache release profile: {e!r}") from None
    # Their code -> our role, through the role NAME (codes need not match ours).
    code_to_role = {}
    for name, code in type_map.items():
        role = _OFFICIAL_ROLE_NAMES.get(str(name).lower())
        if role is None:
            raise ProfileError(f"{filename}: unknown role name {name!r} in meta.type_map; "
                               f"known: {sorted(_OFFICIAL_ROLE_NAMES)}")
        code_to_role[int(code)] = role
    if sorted(code_to_role.values()) != sorted(Role):
        raise ProfileError(f"{filename}: meta.type_map {type_map} does not name all four roles")
    if codes.ndim != 2 or alloc.shape != codes.shape or len(relations) != codes.shape[0]:
        raise ProfileError(f"{filename}: classification {codes.shape}, allocation {alloc.shape} and "
                           f"{len(relations)} cluster layers disagree")
    unknown = set(np.unique(codes).tolist()) - set(code_to_role)
    if unknown:
        raise ProfileError(f"{filename}: role codes {sorted(unknown)} not in meta.type_map")
    roles = np.vectorize(code_to_role.__getitem__, otypes=[np.int8])(codes)
    # Their meta.counts must agree with their matrix; a mismatch means a damaged file.
    for name, n in (d["meta"].get("counts") or {}).items():
        role = _OFFICIAL_ROLE_NAMES.get(str(name).lower())
        if role is not None and int((roles == role).sum()) != int(n):
            raise ProfileError(f"{filename}: meta.counts says {n} {name} heads, matrix has "
                               f"{int((roles == role).sum())}")
    weights = np.where(np.isin(roles, COMPRESSED_ROLES), alloc, np.nan)
    clusters = tuple(
        tuple(Cluster(int(p), tuple(int(s) for s in sats)) for p, sats in layer.items())
        for layer in relations
    )
    ident: dict[str, Any] = {}
    for pattern, info in _KNOWN_MODELS:
        if pattern.search(filename) and info["shape"] == codes.shape:
            ident = {k: v for k, v in info.items() if k != "shape"}
            break
    else:
        for pattern, arch in _ARCH_PATTERNS:
            if pattern.search(filename):
                ident = {"architecture": arch}
                break
    return HeadProfile(roles=roles, clusters=clusters, weights=weights,
                       source=f"heterocache-release:{filename}", **ident)
