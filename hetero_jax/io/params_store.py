"""A checkpoint's ``params/`` directory: the Orbax save and restore of the params pytree, and the digests of its
files that a load checks before restoring.

Orbax (OCDBT) stores the tensors uncompressed and without checksums, so bytes changed in place (disk or copy
damage, an edit) restore without error as different weights. :func:`digest_record` is written into
``hetero_jax.json`` at save; :func:`check_digests` refuses, before any tensor is restored, a file whose size or
digest differs from it. A file's digest is the sha256 of the concatenated sha256 digests of its ``piece_bytes``
pieces: the pieces of every file are hashed in a thread pool (hashlib releases the GIL), so one large data file
is hashed on every core.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

from hetero_jax.errors import CheckpointError

DIGESTS_KEY = "params_sha256"  # hetero_jax.json's entry: {"piece_bytes": int, "files": {path: [bytes, hex]}}
PIECE_BYTES = 64 << 20  # bytes one hashing task reads
_READ_BYTES = 8 << 20
_DRAIN_S = 60.0  # longest wait for a failed restore's other reads before its event loop closes anyway


def _piece_digest(path: str, offset: int, length: int) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        while length > 0:
            block = f.read(min(length, _READ_BYTES))
            if not block:
                break
            h.update(block)
            length -= len(block)
    return h.digest()


def _digests(files: list[tuple[str, int]], piece_bytes: int) -> list[str]:
    """The digest (module docstring) of each ``(path, size)``, reading ``size`` bytes of it."""
    tasks = [(i, path, off, min(piece_bytes, size - off))
             for i, (path, size) in enumerate(files) for off in range(0, size, piece_bytes)]
    with ThreadPoolExecutor(max_workers=max(1, min(32, os.cpu_count() or 1))) as pool:
        pieces = list(pool.map(lambda t: _piece_digest(*t[1:]), tasks))
    out = [hashlib.sha256() for _ in files]
    for (i, *_), d in zip(tasks, pieces):
        out[i].update(d)
    return [h.hexdigest() for h in out]


def digest_record(pdir: str) -> dict:
    """``{"piece_bytes": ..., "files": {path under params/ ("/"-separated): [size, digest]}}`` of every file
    under ``pdir``."""
    files = []
    for root, _, names in os.walk(pdir):
        for n in names:
            full = os.path.join(root, n)
            files.append((os.path.relpath(full, pdir).replace(os.sep, "/"), full, os.path.getsize(full)))
    files.sort()
    digests = _digests([(full, size) for _, full, size in files], PIECE_BYTES)
    return {"piece_bytes": PIECE_BYTES, "files": {rel: [size, d] for (rel, _, size), d in zip(files, digests)}}


def _record_entries(record: Any) -> tuple[int, dict[str, tuple[int, str]]] | None:
    """``(piece_bytes, {path: (size, digest)})`` of a well-formed record, else None."""
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        return None
    piece = record.get("piece_bytes")
    if not isinstance(piece, int) or isinstance(piece, bool) or piece <= 0:
        return None
    entries = {}
    for rel, v in record["files"].items():
        parts = rel.split("/")
        if (not rel or rel.startswith("/") or ".." in parts or not isinstance(v, list) or len(v) != 2
                or not isinstance(v[0], int) or isinstance(v[0], bool) or v[0] < 0 or not isinstance(v[1], str)):
            return None
        entries[rel] = (v[0], v[1])
    return piece, entries


def check_digests(pdir: str, meta: dict, meta_path: str, fix: str) -> None:
    """Refuse (CheckpointError naming the file and ``fix``) a file under ``pdir`` that is missing or whose size or
    digest differs from ``meta``'s record (:func:`digest_record`). A checkpoint written before digests were
    recorded has none, and passes."""
    if DIGESTS_KEY not in meta:
        return
    parsed = _record_entries(meta[DIGESTS_KEY])
    if parsed is None:
        raise CheckpointError(f"{meta_path}: its {DIGESTS_KEY} entry is malformed, so the weights cannot be "
                              f"checked; the checkpoint is corrupt, {fix}")
    piece, entries = parsed
    files = []
    for rel, (size, _) in sorted(entries.items()):
        full = os.path.join(pdir, *rel.split("/"))
        try:
            actual = os.path.getsize(full)
        except OSError:
            raise CheckpointError(f"{full} is missing (hetero_jax.json lists it among the weights' files); the "
                                  f"checkpoint is corrupt, {fix}") from None
        if actual != size:
            raise CheckpointError(f"{full} is {actual:,} bytes where {size:,} were written (truncated or "
                                  f"overwritten); the checkpoint is corrupt, {fix}")
        files.append((rel, full, size))
    try:
        digests = _digests([(full, size) for _, full, size in files], piece)
    except OSError as e:
        raise CheckpointError(f"cannot read {e.filename or pdir} to check it ({e.strerror or e}); "
                              f"the checkpoint is unreadable, {fix}") from None
    for (rel, full, _), d in zip(files, digests):
        if d != entries[rel][1]:
            raise CheckpointError(f"{full} does not match the sha256 digest hetero_jax.json recorded when the "
                                  "checkpoint was written: its bytes changed since (disk or copy damage, or an "
                                  f"edit), so its weights are wrong; the checkpoint is corrupt, {fix}")


# ----------------------------------------------------------------- Orbax calls whose failure leaves no stray reads
class _FinishingPolicy(asyncio.AbstractEventLoopPolicy):
    """The policy it wraps, except that the loops it makes finish their pending tasks before closing.

    Orbax runs a restore in a fresh event loop and closes it as soon as one read fails, while tensorstore is still
    completing the others; each completion then wakes the closed loop from a tensorstore thread, which prints a
    "RuntimeError: Event loop is closed" traceback after our error. Waiting for those reads keeps them quiet."""

    def __init__(self, base: asyncio.AbstractEventLoopPolicy):
        self.base = base

    def get_event_loop(self):
        return self.base.get_event_loop()

    def set_event_loop(self, loop) -> None:
        self.base.set_event_loop(loop)

    def new_event_loop(self):
        loop = self.base.new_event_loop()
        close = loop.close

        def finish_then_close() -> None:
            if not loop.is_closed() and not loop.is_running():
                pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
                if pending:
                    loop.run_until_complete(asyncio.wait(pending, timeout=_DRAIN_S))
                    for t in pending:  # retrieved, so asyncio logs no "exception was never retrieved"
                        if t.done() and not t.cancelled():
                            t.exception()
            close()

        with contextlib.suppress(AttributeError):  # a compiled loop class (uvloop) takes no attribute
            loop.close = finish_then_close
        return loop

    def __getattr__(self, name: str):  # the rest of the policy API (child watchers on older Pythons)
        return getattr(self.base, name)


_POLICY_LOCK = threading.Lock()
_policy_users = 0
_saved_policy: asyncio.AbstractEventLoopPolicy | None = None


@contextlib.contextmanager
def _reads_finish_before_loops_close() -> Iterator[None]:
    """Within the block, event loops are made by :class:`_FinishingPolicy` (shared by concurrent blocks)."""
    global _policy_users, _saved_policy
    with _POLICY_LOCK:
        if _policy_users == 0:
            _saved_policy = asyncio.get_event_loop_policy()
            asyncio.set_event_loop_policy(_FinishingPolicy(_saved_policy))
        _policy_users += 1
    try:
        yield
    finally:
        with _POLICY_LOCK:
            _policy_users -= 1
            if _policy_users == 0:
                if isinstance(asyncio.get_event_loop_policy(), _FinishingPolicy):  # nobody replaced it meanwhile
                    asyncio.set_event_loop_policy(_saved_policy)
                _saved_policy = None


def _with_checkpointer(fn: Callable[[Any], Any]) -> Any:
    import orbax.checkpoint as ocp

    with _reads_finish_before_loops_close(), ocp.StandardCheckpointer() as ckptr:
        return fn(ckptr)


def save_tree(pdir: str, tree: dict) -> None:
    """Write the pytree ``tree`` (numpy arrays) to the new directory ``pdir``."""
    def save(ckptr):
        ckptr.save(pdir, tree)
        ckptr.wait_until_finished()

    _with_checkpointer(save)


def restore_tree(pdir: str) -> Any:
    """The pytree restored from ``pdir`` (numpy arrays); Orbax's exception when it fails."""
    return _with_checkpointer(lambda ckptr: ckptr.restore(pdir))
