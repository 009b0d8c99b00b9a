"""What a refused command must leave alone, for the tests of outputs and inputs: a folder's whole contents, and
a folder that ``os.access`` calls read-only (the tests may run as root, who may write anywhere)."""

from __future__ import annotations

import os
from pathlib import Path


def snapshot(folder) -> dict:
    """{path relative to ``folder``: bytes (None for a directory)} of everything under it."""
    folder = Path(folder)
    return {p.relative_to(folder): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def deny_write(monkeypatch, *paths) -> None:
    """``os.access`` says ``paths`` are not writable, as it would for a user without write permission."""
    denied = {os.path.realpath(p) for p in paths}
    real_access = os.access

    def access(path, mode, *a, **k):
        if mode & os.W_OK and os.path.realpath(path) in denied:
            return False
        return real_access(path, mode, *a, **k)
    monkeypatch.setattr(os, "access", access)
