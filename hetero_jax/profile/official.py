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
import warnings
from typing import Any, Mapping

import numpy as np

from hetero_jax.profile.clustering import COMPRESSED_ROLES, Cluster, Role
from hetero_jax.profile.head_profile import HeadProfile
from hetero_jax.profile.schema import (FORMAT_NAME, ProfileError, ProfileSettings, entry_error, read_document,
                                       read_fraction, read_grid, read_int, read_mapping)

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

_NAMES_SHORT = frozenset({"anchor", "volatile", "pivot", "satellite"})
_NAMES_LONG = frozenset({"stable_unique", "decaying_unique", "similar_leader", "similar_member"})

# Identity and settings the authors' files do not carry, for the two published files. A file is recognised by
# its content: the role grid's shape (layers x KV heads) together with the role naming of its meta.type_map
# (the Llama file uses anchor/volatile/..., the Qwen file Stable_Unique/...), unless its file name names another
# model (the release publishes a DeepSeek-R1-Distill-Llama-8B file of the Llama file's shape and naming). A file
# whose shape is a known model's but whose naming is not (content ambiguous) is matched by the file-name pattern
# instead. From the public HF configs (head_dim = hidden / heads) and the paper (Sec. 3, App. B-C): both
# calibrated on 10K-token samples with top-1K sets, which sets the chance level tau_drift is carried from (Qwen
# had none recorded, so its 0.4 applied raw where Llama's 0.5 became 0.443).
_KNOWN_MODELS = (
    (re.compile(r"llama-?3\.1-8b", re.I), _NAMES_SHORT,
     dict(model_name="meta-llama/Llama-3.1-8B-Instruct", architecture="llama", shape=(32, 8), head_dim=128,
          settings=ProfileSettings(top_k=1024, decode_steps=100, tau_stable=0.5, tau_sim=0.5,
                                   calibration_data=_PAPER_DATA, samples=50, tokens_per_sample=10_000))),
    (re.compile(r"qwen2\.5-14b", re.I), _NAMES_LONG,
     dict(model_name="Qwen/Qwen2.5-14B-Instruct", architecture="qwen2", shape=(48, 8), head_dim=128,
          settings=ProfileSettings(top_k=1024, decode_steps=100, tau_stable=0.4, tau_sim=0.5,
                                   calibration_data=_PAPER_DATA, samples=50, tokens_per_sample=10_000))),
)
_ARCH_PATTERNS = ((re.compile(r"qwen3", re.I), "qwen3"), (re.compile(r"qwen2", re.I), "qwen2"),
                  (re.compile(r"llama", re.I), "llama"))
# The model a file name names: the release's own name (tools/get_cluster.py writes
# Head_Analysis_<model>_topk<k>_th<tau_stable>_sim<tau_sim>_step<decode_step>.json, the step being the key length
# of its similarity graph), or ours for the published files (official_profile_<model>.json).
_RELEASE_NAME = re.compile(r"Head_Analysis_(?P<model>.+?)_topk(?P<topk>[0-9]+)_th(?P<th>[0-9]*\.?[0-9]+)"
                           r"_sim(?P<sim>[0-9]*\.?[0-9]+)_step(?P<step>[0-9]+)", re.I)
_OUR_NAME = re.compile(r"official_profile_(?P<model>.+?)(?:\.json)?$", re.I)
_RENAME = ("a file name in the release's pattern Head_Analysis_<model>_topk<k>_th<tau_stable>_sim<tau_sim>_step<n>"
           ".json gives the calibration settings; rename the file")


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
    allocation values are kept as published (-1 -> NaN for full heads; they must average 1 over the
    compressed heads, as both published files do), and
    identity fields they lack are those of the published model the content matches (grid shape and role
    naming; the file name only where the content is ambiguous), unless the file name names another model.
    A release file name (``Head_Analysis_<model>_topk<k>_th<tau>_sim<tau>_step<n>.json``) gives top_k,
    tau_stable and tau_sim. A file matching no published model loads
    with a RuntimeWarning: head_dim and the calibration length are unknown (pass ``head_dim`` and
    ``settings`` to set them), so HeteroCache's drift threshold has no chance correction.
    Keyword arguments override the corresponding fields (both formats).
    """
    data = read_document(path)
    if isinstance(data, Mapping) and data.get("format") == FORMAT_NAME:
        prof = HeadProfile.from_dict(data, where=os.fspath(path))
    elif isinstance(data, Mapping) and "classification_matrix" in data:
        prof = _from_official(data, os.fspath(path), told=(head_dim is not None, settings is not None))
    else:
        raise ProfileError(f"{path}: not a head profile (neither {FORMAT_NAME} nor the "
                           "HeteroCache release format with 'classification_matrix')")
    overrides = {k: v for k, v in dict(architecture=architecture, head_dim=head_dim, model_name=model_name,
                                       weights_fingerprint=weights_fingerprint, settings=settings).items()
                 if v is not None}
    return dataclasses.replace(prof, **overrides) if overrides else prof


def _named_model(filename: str) -> str | None:
    """The model a file name names (the release's or our naming), or None for another name."""
    m = _RELEASE_NAME.search(filename) or _OUR_NAME.search(filename)
    return m["model"] if m else None


def _name_settings(filename: str, where: str) -> dict[str, Any]:
    """The calibration settings a release file name gives ({} for another name): top_k, tau_stable, tau_sim and,
    in calibration_data, the step of the similarity graph."""
    m = _RELEASE_NAME.search(filename)
    if not m:
        return {}
    return dict(top_k=read_int(int(m["topk"]), "the file name's topk", where=where, minimum=1, fix=_RENAME),
                tau_stable=read_fraction(float(m["th"]), "the file name's th", where=where, fix=_RENAME),
                tau_sim=read_fraction(float(m["sim"]), "the file name's sim", where=where, fix=_RENAME),
                calibration_data=f"not recorded; the release's file name gives topk {m['topk']}, th {m['th']}, "
                                 f"sim {m['sim']} and step {m['step']} (the key length of its similarity graph)")


def _identify(shape: tuple, names: frozenset, filename: str, where: str) -> tuple[dict[str, Any], str | None]:
    """Identity and settings of the published model an authors' file is for, and why none when there is none.

    By content (grid shape and role naming), unless the file name names another model; by the file name (with
    the shape) when only the shape matches. A release file name's settings (``_name_settings``) replace the
    published ones when they differ (then the calibration length is unknown)."""
    named = _named_model(filename)
    by_content = [(pattern, info) for pattern, naming, info in _KNOWN_MODELS
                  if info["shape"] == shape and names == naming]
    ident, reason = {}, None
    if len(by_content) == 1:
        pattern, info = by_content[0]
        other = [i["model_name"] for p, _n, i in _KNOWN_MODELS if p is not pattern and p.search(filename)]
        if (named is not None and not pattern.search(named)) or other:
            reason = (f"whose content ({shape[0]} layers x {shape[1]} KV heads, role names "
                      f"{', '.join(sorted(names))}) is that of the published {info['model_name']} file but whose "
                      f"file name names {named or other[0]!r}, so it is not labelled {info['model_name']}")
        else:
            ident = info
    else:  # content ambiguous or unknown: the file name, if it agrees with the shape
        by_name = [info for pattern, _naming, info in _KNOWN_MODELS
                   if info["shape"] == shape and pattern.search(filename)]
        if len(by_name) == 1:
            ident = by_name[0]
    ident = {k: v for k, v in ident.items() if k != "shape"}
    from_name = _name_settings(filename, where)
    if from_name:
        known = ident.get("settings")
        if known is None or any(getattr(known, k) != from_name[k] for k in ("top_k", "tau_stable", "tau_sim")):
            ident["settings"] = ProfileSettings(**from_name)
    return ident, reason


def _from_official(d: Mapping, path: str, told: tuple[bool, bool] = (False, False)) -> HeadProfile:
    """The profile of the authors' document ``d``; ``told``: whether the caller gives (head_dim, settings), which
    silences the warning about what the file leaves unknown."""
    filename = os.path.basename(path)
    where, what = path, "malformed HeteroCache release profile"
    missing = [k for k in ("meta", "classification_matrix", "allocation_matrix", "leader_member_relations")
               if k not in d]
    if missing:
        raise ProfileError(f"{where}: {what}: missing {missing}")
    meta = read_mapping(d["meta"], "meta", where=where, fix=what)
    type_map = read_mapping(meta.get("type_map"), "meta.type_map", where=where, fix=what)
    codes = read_grid(d["classification_matrix"], "classification_matrix", 2, where=where, integer=True, fix=what)
    alloc = read_grid(d["allocation_matrix"], "allocation_matrix", 2, where=where, fix=what)
    relations = d["leader_member_relations"]
    if not isinstance(relations, list):
        raise entry_error(where, "leader_member_relations", relations,
                          'a list with one {"pivot": [satellites]} object per layer', what)
    # Their code -> our role, through the role NAME (codes need not match ours).
    code_to_role = {}
    for name, code in type_map.items():
        role = _OFFICIAL_ROLE_NAMES.get(str(name).lower())
        if role is None:
            raise ProfileError(f"{where}: unknown role name {name!r} in meta.type_map; "
                               f"known: {sorted(_OFFICIAL_ROLE_NAMES)}")
        code_to_role[read_int(code, f"meta.type_map.{name}", where=where, optional=False, fix=what)] = role
    if sorted(code_to_role.values()) != sorted(Role):
        raise ProfileError(f"{where}: meta.type_map {type_map} does not name all four roles")
    if codes.ndim != 2 or alloc.shape != codes.shape or len(relations) != codes.shape[0]:
        raise ProfileError(f"{where}: classification {codes.shape}, allocation {alloc.shape} and "
                           f"{len(relations)} cluster layers disagree")
    unknown = set(np.unique(codes).tolist()) - set(code_to_role)
    if unknown:
        raise ProfileError(f"{where}: role codes {sorted(unknown)} not in meta.type_map")
    roles = np.vectorize(code_to_role.__getitem__, otypes=[np.int8])(codes)
    # Their meta.counts must agree with their matrix; a mismatch means a damaged file.
    counts = read_mapping(meta.get("counts"), "meta.counts", where=where, optional=True, fix=what)
    for name, n in counts.items():
        n = read_int(n, f"meta.counts.{name}", where=where, minimum=0, optional=False, fix=what)
        role = _OFFICIAL_ROLE_NAMES.get(str(name).lower())
        if role is not None and int((roles == role).sum()) != n:
            raise ProfileError(f"{where}: meta.counts says {n} {name} heads, matrix has "
                               f"{int((roles == role).sum())}")
    weights = np.where(np.isin(roles, COMPRESSED_ROLES), alloc, np.nan)
    clusters = []
    for li, layer in enumerate(relations):
        layer = read_mapping(layer, f"leader_member_relations[{li}]", where=where, fix=what)
        row = []
        for p, sats in layer.items():
            e = f"leader_member_relations[{li}][{p!r}]"
            if not re.fullmatch(r"[0-9]+", str(p)):
                raise entry_error(where, e, p, "a pivot head index (a key like \"5\")", what)
            if not isinstance(sats, list):
                raise entry_error(where, e, sats, "a list of satellite head indices", what)
            row.append(Cluster(int(p), tuple(read_int(s, f"{e}[{si}]", where=where, minimum=0, optional=False,
                                                      fix=what) for si, s in enumerate(sats))))
        clusters.append(tuple(row))
    names = frozenset(str(n).lower() for n in type_map)
    ident, reason = _identify(codes.shape, names, filename, where)
    if "architecture" not in ident:
        for pattern, arch in _ARCH_PATTERNS:
            if pattern.search(filename):
                ident["architecture"] = arch
                break
    try:
        prof = HeadProfile(roles=roles, clusters=tuple(clusters), weights=weights,
                           source=f"heterocache-release:{filename}", **ident)
    except ProfileError as e:
        raise ProfileError(f"{where}: {e}") from None
    st, dim = prof.settings, "head_dim" not in ident
    if (dim and not told[0]) or (st.tokens_per_sample is None and not told[1]):  # once the file is known good
        what = reason or (f"of {codes.shape[0]} layers x {codes.shape[1]} KV heads that matches neither published "
                          "model (Llama-3.1-8B-Instruct 32 x 8, Qwen2.5-14B-Instruct 48 x 8)" if dim else
                          f"of {prof.model_name} whose file name's settings are not the published file's")
        check = "head_dim is not checked against the model and " if dim else ""
        if st.tau_stable is None:
            unknown = (f"its {'head_dim and ' if dim else ''}calibration settings are unknown, so {check}"
                       "HeteroCache's drift threshold falls back to its default (tau 0.5, no chance correction)")
        else:
            unknown = (f"its {'head_dim and ' if dim else ''}calibration length {'are' if dim else 'is'} unknown "
                       f"(the file name gives top_k {st.top_k}, tau_stable {st.tau_stable}, tau_sim {st.tau_sim}), "
                       f"so {check}HeteroCache's drift threshold is tau_stable {st.tau_stable} with no chance "
                       "correction")
        warnings.warn(f"{path}: a HeteroCache release profile {what}: {unknown}; pass load_profile(..., "
                      f"{'head_dim=..., ' if dim else ''}settings=ProfileSettings(...)) to set them",
                      RuntimeWarning, stacklevel=3)
    return prof
