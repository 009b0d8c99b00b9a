"""Which existing files a command may replace: its own earlier outputs, recognised by a mark every writer puts
where the file's format has a field for it, and empty files. Anything else (a user's notes, another tool's
output) is refused by :func:`hetero_jax.io.files.check_output_path`. Only the mark is checked, not the content:
a file of ours edited since it was written is still replaced while it keeps its mark.

The mark, by format:

- JSON: a top-level ``"format"`` of ``"hetero-jax-..."`` (profiles, rankings, benchmark results);
- ``.npz``: the same ``"format"`` in the JSON of its ``meta`` array (HCAttention codebooks);
- figures: the creator field matplotlib writes from ``savefig(metadata=figure_metadata(fmt))``: PNG's
  ``Software`` text chunk, PDF's and SVG's ``Creator``, PostScript's ``%%Creator`` comment. JPEG, TIFF, WebP and
  raw images have no such field, so an existing one is never replaced;
- plain text: a first line starting with :data:`TEXT_MARK` (compiled-HLO dumps).

Only the standard library is imported at load (numpy when an ``.npz`` is looked into).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import struct
import zipfile

OUTPUT_MARK = "hetero-jax"
FORMAT_PREFIX = OUTPUT_MARK + "-"  # of every JSON document's "format"
TEXT_MARK = f"// written by {OUTPUT_MARK}"

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Larger files are not read to look for the mark: none of our outputs comes near it.
_MAX_SNIFF_BYTES = 256 << 20
_SVG_CREATOR = re.compile(rb"<dc:creator>\s*<cc:Agent>\s*<dc:title>" + re.escape(OUTPUT_MARK.encode()) + rb"<")


def figure_metadata(fmt: str) -> dict | None:
    """``savefig(metadata=...)`` marking a figure of format ``fmt`` ("png", "pdf", ...) as ours; None for a format
    with no creator field."""
    key = {"png": "Software", "pdf": "Creator", "svg": "Creator", "svgz": "Creator", "eps": "Creator",
           "ps": "Creator"}.get(fmt)
    return None if key is None else {key: OUTPUT_MARK}


FIGURE = "figure"  # the kind of every figure of ours (the formats above that have a creator field)
TEXT = "text"  # the kind of a plain-text output of ours (TEXT_MARK)


def output_kind(path: str | os.PathLike) -> str | None:
    """What output of ours the existing regular file ``path`` is (module docstring): its JSON ``"format"``
    (``"hetero-jax-head-profile"``, ...; an ``.npz``'s from its ``meta``), :data:`FIGURE`, :data:`TEXT`, or ""
    for an empty file (anything may replace it); None when it is not ours or cannot be read."""
    try:
        size = os.path.getsize(path)
        if size == 0:
            return ""
        if size > _MAX_SNIFF_BYTES:
            return None
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        return _kind(data)
    except Exception:  # noqa: BLE001 - a damaged or foreign file is simply not one of ours
        return None


def is_own_output(path: str | os.PathLike, kind: str | None = None) -> bool:
    """Whether the existing file ``path`` is empty or an output of ours of ``kind`` (None: of any kind), so a
    command writing a ``kind`` may replace it: a profile run never replaces a codebook or a benchmark's result."""
    found = output_kind(path)
    return found is not None and (kind is None or found in ("", kind))


def _kind(data: bytes) -> str | None:
    head = data[:16].lstrip()
    if head.startswith(b"{"):
        return _format_of(json.loads(data.decode("utf-8")))
    if data.startswith(b"PK"):
        return _npz_format(data)
    if data.startswith(_PNG_MAGIC):
        ours = _png_software(data) == OUTPUT_MARK
    elif data.startswith(b"%PDF"):
        ours = f"/Creator ({OUTPUT_MARK})".encode() in data
    elif data.startswith(b"%!PS"):
        ours = f"%%Creator: {OUTPUT_MARK}\n".encode() in data[:4096]
    elif data.startswith(b"\x1f\x8b"):  # svgz
        ours = bool(_SVG_CREATOR.search(gzip.decompress(data)))
    elif head.startswith(b"<"):
        ours = bool(_SVG_CREATOR.search(data))
    else:
        return TEXT if data.startswith(TEXT_MARK.encode()) else None
    return FIGURE if ours else None


def _format_of(doc) -> str | None:
    ours = isinstance(doc, dict) and isinstance(doc.get("format"), str) and doc["format"].startswith(FORMAT_PREFIX)
    return doc["format"] if ours else None


def _npz_format(data: bytes) -> str | None:
    """The ``"format"`` of the ``meta`` array's JSON in the .npz archive ``data`` (read already), if ours."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        if "meta.npy" not in z.namelist():
            return None
    import numpy as np  # only here: every layer may import this module

    with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
        return _format_of(json.loads(str(arrays["meta"])))


def _png_software(data: bytes) -> str | None:
    """The text of a PNG's ``Software`` tEXt chunk (before the image data), or None."""
    at = len(_PNG_MAGIC)
    while at + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        if kind in (b"IDAT", b"IEND"):
            return None
        if kind == b"tEXt":
            key, _, text = data[at + 8:at + 8 + length].partition(b"\0")
            if key == b"Software":
                return text.decode("latin-1")
        at += 12 + length
    return None
