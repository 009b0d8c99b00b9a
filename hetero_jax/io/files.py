"""Output files, for every command and writer: :func:`check_outputs` refuses, before any work, an output that
would replace one of the command's inputs, another of its outputs or a file it did not write (a user's file:
:mod:`hetero_jax.io.own_outputs`), or that cannot be written, and
:func:`atomic_path` / :func:`write_text` / :func:`write_bytes` write an output whole or not at all (a temporary
sibling renamed into place), so a failed or killed write never leaves a truncated file over a good one. The
data is fsynced before the rename and the directory after it (:func:`sync_file`, :func:`sync_dir`,
:func:`sync_tree`), so a power loss or kernel crash cannot leave the rename on disk without the data.

Only the standard library, ``hetero_jax.errors`` and ``hetero_jax.io.own_outputs`` are imported: every layer
may use this module.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from typing import Iterator, Mapping, Sequence, Union

from hetero_jax.errors import OutputError
from hetero_jax.io.own_outputs import output_kind

PathLike = Union[str, os.PathLike]


def _paths(value) -> list[str]:
    """An input flag's value (None, a path, or a list of paths) as a list of path strings."""
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [os.fspath(value)]
    return [os.fspath(v) for v in value if v is not None]


def same_file(a: PathLike, b: PathLike) -> bool:
    """Whether ``a`` and ``b`` name one file: the same path once symlinks are resolved, or (both existing) the
    same inode, which also catches hard links and bind mounts."""
    try:
        if os.path.realpath(a) == os.path.realpath(b):
            return True
        return os.path.samefile(a, b)
    except (OSError, ValueError):  # a missing file; a path with a NUL byte
        return False


def path_inside(path: PathLike, folder: PathLike) -> bool:
    """Whether ``path`` lies (after resolving symlinks) under the directory ``folder``."""
    real, root = os.path.realpath(path), os.path.realpath(folder)
    return real != root and os.path.commonpath([real, root]) == root


def check_output_path(path: PathLike, flag: str = "output", *, parents: bool = False,
                      updating: bool = False, kind: str | None = None) -> str:
    """The resolved path ``path`` will be written to, after refusing (OutputError, naming ``flag``) a directory,
    a missing or unwritable parent directory, an existing file that is not writable (the rename of an atomic
    write would otherwise replace a file its owner made read-only), and an existing file that is not an output
    of ours (:func:`hetero_jax.io.own_outputs.is_own_output`: a command replaces only what it wrote). A symlink
    is followed: its target is what gets written. ``parents``: the writer creates a missing parent, which then
    only has to be creatable. ``updating``: the caller rewrites a file it read, keeping what is not its own
    (a section of RESULTS.md), so the file need not be an output of ours. ``kind``: what the command writes
    there (``own_outputs.output_kind``: a JSON format, a figure); an output of ours of another kind (a codebook
    where a profile is to go) is refused too."""
    shown = os.fspath(path)
    if not shown:  # "" resolves to the current directory
        raise OutputError(f"{flag} is empty; give the path of a file to write")
    if os.path.isdir(shown):
        raise OutputError(f"{flag} {shown} is a directory; give the path of a file to write (inside it or "
                          "elsewhere)")
    real = os.path.realpath(shown)
    parent = os.path.dirname(real)
    if parents and not os.path.lexists(parent):
        problem = dir_problem(parent)
        if problem:
            raise OutputError(f"{flag} {shown}: its directory {parent} cannot be created ({problem}); choose "
                              f"another {flag}")
        return real
    if not os.path.isdir(parent):
        if os.path.lexists(parent):
            raise OutputError(f"{flag} {shown}: {parent} is not a directory; choose another {flag}")
        raise OutputError(f"{flag} {shown}: the directory {parent} does not exist; create it first "
                          "(nothing was written)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {shown}: the directory {parent} is not writable; choose another {flag} "
                          "or make the directory writable")
    if os.path.isfile(real) and not os.access(real, os.W_OK):
        raise OutputError(f"{flag} {shown} exists and is read-only; choose another {flag} or make it writable "
                          f"(chmod u+w {shown})")
    if not updating and os.path.isfile(real):
        found = output_kind(real)
        if found is None:
            raise OutputError(f"{flag} {shown} exists and is not a file hetero-jax wrote, so it was not replaced; "
                              f"choose another {flag}, or move {shown} away first")
        if kind is not None and found not in ("", kind):
            raise OutputError(f"{flag} {shown} exists and is another kind of hetero-jax output ({found}, where "
                              f"this command writes a {kind}), so it was not replaced; choose another {flag}, or "
                              f"move {shown} away first")
    return real


def check_outputs(outputs: Mapping[str, PathLike | None],
                  inputs: Mapping[str, PathLike | Sequence[PathLike] | None] | None = None, *,
                  parents: bool = False, updated: Sequence[str] = (), kinds: Mapping[str, str] | None = None) -> None:
    """Refuse (OutputError), before anything is computed or written, any output of ``outputs`` ({flag: path or
    None}) that is the same file as an input of ``inputs`` ({flag: path, list of paths or None}) or as another
    output, that is an existing file inside an input directory (a checkpoint the command reads), or that cannot
    be written (:func:`check_output_path`, ``parents`` passed on; ``updating`` for the flags in ``updated``,
    files the command edits rather than replaces; ``kind`` from ``kinds`` {flag: kind}). Symlinks and hard links
    are seen through."""
    inputs = inputs or {}
    seen: list[tuple[str, str]] = []
    for flag, value in outputs.items():
        if value is None:
            continue
        path = os.fspath(value)
        for in_flag, in_value in inputs.items():
            for src in _paths(in_value):
                if same_file(path, src):
                    raise OutputError(f"{flag} {path} is also the {in_flag} input; writing it would overwrite "
                                      f"your input. Choose another {flag}")
                if os.path.isdir(src) and os.path.lexists(path) and path_inside(path, src):
                    raise OutputError(f"{flag} {path} is a file of the {in_flag} input {src}; writing it would "
                                      f"overwrite part of your input. Choose another {flag}")
        for other_flag, other in seen:
            if same_file(path, other):
                raise OutputError(f"{flag} {path} is the same file as {other_flag} {other}; the second write "
                                  f"would replace the first. Choose different paths for {other_flag} and {flag}")
        check_output_path(path, flag, parents=parents, updating=flag in updated, kind=(kinds or {}).get(flag))
        seen.append((flag, path))


def dir_problem(path: PathLike) -> str | None:
    """Why the directory ``path`` cannot be used for writing, or None when it can: it (or the ancestor where a
    missing one would be created) is a file, or is not writable. Nothing is created."""
    path = os.path.abspath(os.fspath(path))
    probe = path
    while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    it = "it" if probe == path else probe
    if not os.path.isdir(probe):
        return f"{it} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{it} is not writable"
    return None


def _umask() -> int:
    """The process's umask, read without changing it where Linux allows (os.umask sets it, racing threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# fsync errors meaning "this file system cannot sync" (not a failed write): nothing more can be done there
_NO_SYNC = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})


def _sync(path: str, *, folder: bool = False) -> None:
    """fsync the file or directory ``path``; a directory the OS will not open (Windows) and a file system that
    cannot sync are skipped, any other failure (EIO) raised."""
    try:
        # Windows flushes only a handle open for writing, and opens no directory
        fd = os.open(path, os.O_RDWR if os.name == "nt" and not folder else os.O_RDONLY)
    except OSError:
        if folder:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _NO_SYNC:
            raise
    finally:
        os.close(fd)


def sync_file(path: PathLike) -> None:
    """fsync the written (closed) file ``path`` before it is renamed into place, so a rename that reaches the
    disk never names data that did not (a zero-length file over a good one after a power loss)."""
    _sync(os.fspath(path))


def sync_tree(path: PathLike) -> None:
    """fsync every file under the directory ``path``, then every directory (``path`` last), before the tree is
    renamed into place. One fsync each; nothing is read."""
    for root, _, names in os.walk(os.fspath(path), topdown=False):
        for n in names:
            full = os.path.join(root, n)
            if not os.path.islink(full):
                _sync(full)
        _sync(root, folder=True)


def sync_dir(path: PathLike, shown: str) -> None:
    """fsync the directory ``path`` after a rename into it, so the rename survives a crash (skipped where the OS
    opens no directory). ``shown``: what was renamed, for the OutputError when the disk fails the sync."""
    try:
        _sync(os.fspath(path), folder=True)
    except OSError as e:
        raise OutputError(f"{shown} was written, but flushing its directory {os.fspath(path)} to disk failed "
                          f"({e.strerror or e}), so a crash or power loss may still lose it; check the disk, then "
                          "write it again") from e


@contextlib.contextmanager
def atomic_path(path: PathLike, flag: str = "output", *, updating: bool = False,
                kind: str | None = None) -> Iterator[str]:
    """Yield a temporary path beside ``path`` to write the whole output into; on leaving the block it replaces
    ``path`` in one rename, and on any error it is removed and ``path`` stays as it was.

    The temporary name keeps ``path``'s extension, so writers that infer the format from it (matplotlib) still
    do. The file gets ``path``'s permissions when it exists, else the umask's (not mkstemp's private 0600). A
    symlink's target is replaced; a device or FIFO (``/dev/null``) is yielded as is, to be written in place.
    ``path`` is checked first (:func:`check_output_path`, ``updating`` and ``kind`` passed on: a writer names
    the format it writes, so it never replaces another kind of output of ours). The written file is fsynced
    before the rename and its directory after (the writer need not sync it)."""
    real = check_output_path(path, flag, updating=updating, kind=kind)
    if os.path.exists(real) and not os.path.isfile(real):
        yield real
        return
    folder, name = os.path.split(real)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp" + os.path.splitext(name)[1], dir=folder)
    os.close(fd)
    try:
        yield tmp
        mode = stat.S_IMODE(os.stat(real).st_mode) if os.path.isfile(real) else 0o666 & ~_umask()
        sync_file(tmp)  # before the chmod: the output's mode may not let us open it for reading
        os.chmod(tmp, mode)
        os.replace(tmp, real)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):  # a full disk, a directory gone meanwhile: say which output, not a traceback
            raise OutputError(f"{flag} {os.fspath(path)}: writing it failed ({e.strerror or e}); "
                              f"{os.fspath(path)} was not changed") from e
        raise
    sync_dir(folder, f"{flag} {os.fspath(path)}")


def write_bytes(path: PathLike, data: bytes, flag: str = "output", *, updating: bool = False,
                kind: str | None = None) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_path`)."""
    with atomic_path(path, flag, updating=updating, kind=kind) as tmp, open(tmp, "wb") as f:
        f.write(data)


def write_text(path: PathLike, text: str, flag: str = "output", encoding: str = "utf-8", *,
               updating: bool = False, kind: str | None = None) -> None:
    """Write ``text`` to ``path`` atomically (:func:`atomic_path`)."""
    write_bytes(path, text.encode(encoding), flag, updating=updating, kind=kind)
