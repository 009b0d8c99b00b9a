"""The head profile's file: its JSON document, settings, error, and the rules a valid profile keeps.

Our file (``"format": "hetero-jax-head-profile"``, ``schema_version`` 2; version 1,
which had no copy score, still reads) is plain JSON: [L][H] nested lists, NaN written as ``null``, floats written with
Python's shortest round-trip repr, so ``to_json`` -> ``from_json`` is exact. ``to_document`` writes a profile's
fields as that document and ``from_document`` reads them back (``HeadProfile``, ``head_profile.py``, builds
and checks the record); ``check_clusters``, ``grid_mismatch`` and ``check_fits`` are the checks the record runs.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

import numpy as np

from hetero_jax.errors import HeteroJaxError, read_json
from hetero_jax.profile.clustering import ROLE_NAMES, Cluster, Role
from hetero_jax.runtime.prompts import is_int, is_real

FORMAT_NAME = "hetero-jax-head-profile"
SCHEMA_VERSION = 2
# Version 1 lacks copy_score and settings.copy_steps / tau_copy (read as unknown).
READABLE_SCHEMA_VERSIONS = (1, 2)
CALIBRATE_HINT = "calibrate a profile for this model with `hetero-jax profile`"


class ProfileError(HeteroJaxError, ValueError):
    """A head profile that is malformed, unreadable or for another model."""


# ------------------------------------------------------------ typed reads of file entries
# One place for the checks every loader (profiles, the authors' files, codebooks, rankings) applies to what it
# reads: a wrong type or range is a ProfileError naming the file (``where``), the entry, the value and the fix,
# before anything is computed from it. ``where=None``: an argument of the Python API (no file).
EDIT_HINT = "the file was edited by hand or damaged; " + CALIBRATE_HINT


def entry_error(where, entry: str, value, want: str, fix: str | None = EDIT_HINT) -> ProfileError:
    """ProfileError "<where>: <entry> = <value> is not <want>; <fix>"."""
    text = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return ProfileError(f"{where + ': ' if where else ''}{entry} = {text} is not {want}"
                        + (f"; {fix}" if fix else ""))


def read_int(value, entry: str, *, where=None, minimum: int | None = None, optional: bool = True,
             fix: str | None = EDIT_HINT) -> int | None:
    """``value`` as an int (a JSON integer: not a float, string or bool), >= ``minimum``; None allowed when
    ``optional``."""
    if value is None and optional:
        return None
    if not is_int(value) or (minimum is not None and value < minimum):
        raise entry_error(where, entry, value, "an integer" + (f" >= {minimum}" if minimum is not None else ""), fix)
    return int(value)


def read_fraction(value, entry: str, *, where=None, optional: bool = True,
                  fix: str | None = EDIT_HINT) -> float | None:
    """``value`` as a finite number in [0, 1] (thresholds, shares); None allowed when ``optional``."""
    if value is None and optional:
        return None
    if not is_real(value) or not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise entry_error(where, entry, value, "a finite number in [0, 1]", fix)
    return float(value)


def read_str(value, entry: str, *, where=None, optional: bool = True, fix: str | None = EDIT_HINT) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise entry_error(where, entry, value, "a string", fix)
    return value


def read_mapping(value, entry: str, *, where=None, optional: bool = False, fix: str | None = EDIT_HINT):
    """``value`` as a JSON object (a Mapping); ``{}`` for None when ``optional``."""
    if value is None and optional:
        return {}
    if not isinstance(value, Mapping):
        raise entry_error(where, entry, value, "a JSON object", fix)
    return value


# what an overlap or share entry must be: read_grid(unit=True) on a file, check_unit on an array
_UNIT = "a number in [0, 1] or null"


def read_grid(value, entry: str, ndim: int, *, where=None, integer: bool = False, unit: bool = False,
              fix: str | None = EDIT_HINT) -> np.ndarray:
    """A rectangular ``ndim``-deep nested list: int64 of JSON integers (``integer``), else float64 of numbers,
    with null read as NaN; ``unit``: every number in [0, 1] (overlaps and shares)."""
    def walk(x, depth, at):
        if depth < ndim:
            if not isinstance(x, (list, tuple)):
                raise entry_error(where, f"{entry}{at}", x, f"a list ({ndim}-deep nested lists expected)", fix)
            return [walk(y, depth + 1, f"{at}[{i}]") for i, y in enumerate(x)]
        if integer:
            if not is_int(x):
                raise entry_error(where, f"{entry}{at}", x, "an integer", fix)
        elif x is not None and (not is_real(x) or (unit and not (math.isfinite(x) and 0 <= x <= 1))):
            raise entry_error(where, f"{entry}{at}", x, _UNIT if unit else "a number or null", fix)
        return x
    rows = walk(value, 0, "")
    try:
        a = np.array(rows, dtype=np.int64 if integer else np.float64)
    except ValueError:  # ragged
        a = None
    if a is None or a.ndim != ndim:
        raise ProfileError(f"{where + ': ' if where else ''}{entry} is not a rectangular {ndim}-dimensional grid "
                           f"(rows of different lengths)" + (f"; {fix}" if fix else ""))
    return a


def check_unit(a: np.ndarray, entry: str, *, where=None, fix: str | None = EDIT_HINT) -> None:
    """``read_grid``'s ``unit`` check on a float array ``a`` (``HeadProfile``'s statistics): ProfileError naming the
    first entry that is neither NaN (null: unknown) nor a number in [0, 1]."""
    bad = ~np.isnan(a) & ~((a >= 0.0) & (a <= 1.0))
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise entry_error(where, entry + "".join(f"[{i}]" for i in at), float(a[at]), _UNIT, fix)


@dataclasses.dataclass(frozen=True)
class ProfileSettings:
    """How the profile was calibrated (None = not recorded)."""

    top_k: int | None = None  # |K| of each top-k set
    decode_steps: int | None = None  # T of Eq. 2
    tau_stable: float | None = None
    tau_sim: float | None = None
    seed: int | None = None
    calibration_data: str | None = None  # free text: source, selection
    samples: int | None = None  # calibration texts
    tokens_per_sample: int | None = None  # prompt length of each text
    method: str | None = None  # "synckv" for a SyncKV grouping (k-means); None: HeteroCache's taxonomy
    n_clusters: int | None = None  # SyncKV: clusters (R-heads) asked for per layer
    copy_steps: int | None = None  # teacher-forced steps of the copy phase (0: none)
    tau_copy: float | None = None  # copy score from which a compressed head is kept whole

    def __post_init__(self):
        check_settings(dataclasses.asdict(self), where=None, prefix="", fix=None)


# ProfileSettings field -> its reader (``check_settings``)
_SETTING_READERS = {
    "top_k": lambda v, e, w, f: read_int(v, e, where=w, minimum=1, fix=f),
    "decode_steps": lambda v, e, w, f: read_int(v, e, where=w, minimum=0, fix=f),
    "tau_stable": lambda v, e, w, f: read_fraction(v, e, where=w, fix=f),
    "tau_sim": lambda v, e, w, f: read_fraction(v, e, where=w, fix=f),
    "seed": lambda v, e, w, f: read_int(v, e, where=w, fix=f),
    "calibration_data": lambda v, e, w, f: read_str(v, e, where=w, fix=f),
    "samples": lambda v, e, w, f: read_int(v, e, where=w, minimum=1, fix=f),
    "tokens_per_sample": lambda v, e, w, f: read_int(v, e, where=w, minimum=2, fix=f),
    "method": lambda v, e, w, f: read_str(v, e, where=w, fix=f),
    "n_clusters": lambda v, e, w, f: read_int(v, e, where=w, minimum=1, fix=f),
    "copy_steps": lambda v, e, w, f: read_int(v, e, where=w, minimum=0, fix=f),
    "tau_copy": lambda v, e, w, f: read_fraction(v, e, where=w, fix=f),
}


def check_settings(d: Mapping, *, where=None, prefix: str = "settings.", fix: str | None = EDIT_HINT) -> dict:
    """The ``ProfileSettings`` fields of ``d``, each type- and range-checked (ProfileError naming the entry):
    unknown keys are refused, and a recorded top_k must be below tokens_per_sample (the chance level
    top_k / tokens_per_sample of HeteroCache's drift threshold)."""
    unknown = sorted(set(d) - set(_SETTING_READERS), key=str)
    if unknown:
        raise ProfileError(f"{where + ': ' if where else ''}unknown {prefix.rstrip('.') or 'settings'} "
                           f"entr{'y' if len(unknown) == 1 else 'ies'} {unknown} (known: {sorted(_SETTING_READERS)})"
                           + (f"; {fix}" if fix else ""))
    out = {k: _SETTING_READERS[k](v, prefix + k, where, fix) for k, v in d.items()}
    k, t = out.get("top_k"), out.get("tokens_per_sample")
    if k is not None and t is not None and k >= t:
        raise ProfileError(f"{where + ': ' if where else ''}{prefix}top_k = {k} is not below {prefix}"
                           f"tokens_per_sample = {t} (every top-k set would be the whole sample)"
                           + (f"; {fix}" if fix else ""))
    return out


def to_document(p) -> dict:
    """Our JSON document of a ``HeadProfile`` ``p``."""
    return {
        "format": FORMAT_NAME,
        "schema_version": p.schema_version,
        "source": p.source,
        "model": {
            "name": p.model_name,
            "architecture": p.architecture,
            "num_layers": p.num_layers,
            "num_kv_heads": p.num_kv_heads,
            "head_dim": p.head_dim,
            "weights_fingerprint": p.weights_fingerprint,
        },
        "settings": dataclasses.asdict(p.settings),
        "role_codes": {ROLE_NAMES[r]: int(r) for r in Role},
        "roles": p.roles.tolist(),
        "stability": _floats_out(p.stability),
        "similarity": _floats_out(p.similarity),
        "similarity_matrix": None if p.similarity_matrix is None else _floats_out(p.similarity_matrix),
        "copy_score": _floats_out(p.copy_score),
        "allocation_weights": _floats_out(p.weights),
        "clusters": [[{"pivot": c.pivot, "satellites": list(c.satellites)} for c in layer]
                     for layer in p.clusters],
    }


def from_document(d: Mapping, make, where: str | None = None):
    """``make(**fields)`` (``HeadProfile``) of the fields our document ``d`` holds; ProfileError for another
    format, version or role coding, a malformed document, or a model entry whose shape is not the roles'.
    Every entry is type-checked before use; ``where`` (the file) prefixes each message."""
    at = f"{where}: " if where else ""
    if d.get("format") != FORMAT_NAME:
        raise ProfileError(f"{at}not a {FORMAT_NAME} document (format={d.get('format')!r})")
    version = d.get("schema_version")
    if isinstance(version, bool) or version not in READABLE_SCHEMA_VERSIONS:
        raise ProfileError(f"{at}profile schema_version {version!r} is not supported by this "
                           f"hetero-jax (it reads versions {', '.join(map(str, READABLE_SCHEMA_VERSIONS))}); "
                           "re-calibrate or upgrade")
    codes = {ROLE_NAMES[r]: int(r) for r in Role}
    if d.get("role_codes") != codes:
        raise ProfileError(f"{at}profile role codes {d.get('role_codes')} differ from ours {codes}")
    missing = [k for k in ("model", "roles", "clusters", "allocation_weights", "stability", "similarity")
               + (("copy_score",) if version >= 2 else ()) if k not in d]
    if missing:
        raise ProfileError(f"{at}malformed {FORMAT_NAME} document: missing {missing}; {EDIT_HINT}")
    m = read_mapping(d["model"], "model", where=where)
    n_layers = read_int(m.get("num_layers"), "model.num_layers", where=where, minimum=1, optional=False)
    n_kv = read_int(m.get("num_kv_heads"), "model.num_kv_heads", where=where, minimum=1, optional=False)
    head_dim = read_int(m.get("head_dim"), "model.head_dim", where=where, minimum=1)
    ident = {k: read_str(m.get(e), f"model.{e}", where=where)
             for k, e in (("architecture", "architecture"), ("model_name", "name"),
                          ("weights_fingerprint", "weights_fingerprint"))}
    settings = check_settings(read_mapping(d.get("settings", {}), "settings", where=where), where=where)
    source = read_str(d.get("source", "hetero-jax"), "source", where=where, optional=False)
    roles = read_grid(d["roles"], "roles", 2, where=where, integer=True)
    if (n_layers, n_kv) != roles.shape:
        raise ProfileError(f"{at}model says {n_layers} layers x {n_kv} KV heads but the role grid is "
                           f"{roles.shape}; {EDIT_HINT}")
    if not isinstance(d["clusters"], list):
        raise entry_error(where, "clusters", d["clusters"], "a list with one list of clusters per layer")
    clusters = []
    for li, layer in enumerate(d["clusters"]):
        if not isinstance(layer, list):
            raise entry_error(where, f"clusters[{li}]", layer,
                              'a list of {"pivot": head, "satellites": [heads]} (one per cluster of the layer)')
        row = []
        for ci, c in enumerate(layer):
            e = f"clusters[{li}][{ci}]"
            c = read_mapping(c, e, where=where)
            sats = c.get("satellites")
            if not isinstance(sats, list):
                raise entry_error(where, f"{e}.satellites", sats, "a list of head indices")
            row.append(Cluster(read_int(c.get("pivot"), f"{e}.pivot", where=where, minimum=0, optional=False),
                               tuple(read_int(s, f"{e}.satellites[{si}]", where=where, minimum=0, optional=False)
                                     for si, s in enumerate(sats))))
        clusters.append(tuple(row))

    def grid(name, ndim=2, unit=True):
        return read_grid(d[name], name, ndim, where=where, unit=unit)

    try:
        return make(
            roles=roles,
            clusters=tuple(clusters),
            weights=grid("allocation_weights", unit=False),
            stability=grid("stability"),
            similarity=grid("similarity"),
            similarity_matrix=None if d.get("similarity_matrix") is None else grid("similarity_matrix", 3),
            copy_score=grid("copy_score") if version >= 2 else None,
            head_dim=head_dim,
            settings=ProfileSettings(**settings),
            source=source,
            **ident,
        )
    except ProfileError as e:
        if not where or str(e).startswith(at):
            raise
        raise ProfileError(f"{at}{e}") from None


def read_document(path) -> Any:
    """The JSON at ``path``; ProfileError (with the fix) when it is missing or not JSON."""
    path = os.fspath(path)
    return read_json(path, ProfileError, missing=f"profile file not found: {os.fspath(path)!r}; {CALIBRATE_HINT}",
                     fix=CALIBRATE_HINT)


def grid_mismatch(name: str, got: tuple, want: tuple) -> str:
    """The message for a profile field whose grid is not its roles' grid: parts of two models' profiles."""
    def text(g):
        return (f"{g[0]} layers x {g[1]} KV heads" + (f" x {g[2]}" if len(g) > 2 else "")) if len(g) >= 2 else str(g)
    return (f"this profile does not describe one model: its roles cover {text(want)} but its {name} covers "
            f"{text(got)} (a file assembled from another model's profile, or edited by hand); calibrate a profile "
            "for the model with `hetero-jax profile` instead of editing one")


def check_clusters(clusters, roles: np.ndarray) -> tuple[tuple[Cluster, ...], ...]:
    n_layers, n_heads = roles.shape
    if len(clusters) != n_layers:
        raise ProfileError(f"clusters cover {len(clusters)} layers, expected {n_layers}")
    out = []
    for layer, cl in enumerate(clusters):
        seen = np.zeros(n_heads, dtype=int)
        layer_out = []
        for c in cl:
            p, sats = int(c[0]), tuple(int(s) for s in c[1])
            heads = (p,) + sats
            if min(heads) < 0 or max(heads) >= n_heads:
                raise ProfileError(f"layer {layer}: cluster {p}->{list(sats)} names a head outside 0..{n_heads - 1}")
            if not sats:
                raise ProfileError(f"layer {layer}: pivot {p} has no satellites")
            if roles[layer, p] != Role.PIVOT or np.any(roles[layer, list(sats)] != Role.SATELLITE):
                raise ProfileError(f"layer {layer}: cluster {p}->{list(sats)} disagrees with the role grid")
            seen[list(heads)] += 1
            layer_out.append(Cluster(p, sats))
        clustered = np.isin(roles[layer], (Role.PIVOT, Role.SATELLITE))
        if np.any(seen > 1) or not np.array_equal(seen == 1, clustered):
            raise ProfileError(f"layer {layer}: every pivot and satellite must be in exactly one cluster")
        out.append(tuple(layer_out))
    return tuple(out)


def shape_text(arch, n_layers, n_kv, head_dim) -> str:
    return (f"{arch or 'unknown architecture'} {n_layers} layers x {n_kv} KV heads x "
            f"head_dim {head_dim if head_dim is not None else '?'}")


def model_shape(cfg: Any):
    if isinstance(cfg, Mapping):
        if "architectures" in cfg:  # an HF config.json dict
            from hetero_jax.model.config import ModelConfig

            cfg = ModelConfig.from_hf_dict(cfg)
        else:
            return (cfg.get("architecture"), int(cfg["num_layers"]), int(cfg["num_kv_heads"]),
                    cfg.get("head_dim"))
    try:
        return (getattr(cfg, "architecture", None), int(cfg.num_layers), int(cfg.num_kv_heads),
                getattr(cfg, "head_dim", None))
    except AttributeError:
        raise ProfileError(f"cannot read num_layers / num_kv_heads from {type(cfg).__name__}") from None


def _floats_out(a: np.ndarray) -> list:
    # float() of a float64 reprs with the shortest round-trip string: exact.
    return [_floats_out(x) for x in a] if a.ndim > 1 else [None if math.isnan(x) else float(x) for x in a]


def check_fits(p, config_like: Any, weights_fingerprint: str | None = None) -> None:
    """Raise ProfileError unless the ``HeadProfile`` ``p`` fits the model.

    ``config_like``: a ModelConfig, an object with ``num_layers``,
    ``num_kv_heads``, ``head_dim``, ``architecture``, or a mapping (ours
    or an HF ``config.json`` dict). Fields unknown on either side
    (None) are not compared. The message names both shapes.
    """
    arch, n_layers, n_kv, head_dim = model_shape(config_like)
    fp = weights_fingerprint or getattr(config_like, "weights_fingerprint", None)
    mismatch = (
        n_layers != p.num_layers
        or n_kv != p.num_kv_heads
        or (head_dim is not None and p.head_dim is not None and head_dim != p.head_dim)
        or (arch is not None and p.architecture is not None and arch != p.architecture)
    )
    who = f" ({p.model_name})" if p.model_name else ""
    if mismatch:
        raise ProfileError(
            f"profile{who} is for {p.describe_shape()}, but the model is "
            f"{shape_text(arch, n_layers, n_kv, head_dim)}; {CALIBRATE_HINT}"
        )
    if fp is not None and p.weights_fingerprint is not None and fp != p.weights_fingerprint:
        raise ProfileError(
            f"profile{who} was calibrated on weights {p.weights_fingerprint}, but the "
            f"model's weights are {fp} (same shape {p.describe_shape()}); {CALIBRATE_HINT}"
        )
