"""Our checkpoint directory: write atomically, load with shape checks.

Layout::

    OUT_DIR/
      config.json            HF-style config
      params/                Orbax checkpoint of the params pytree (spec.py layout, linears [in, out])
      tokenizer.json         HF tokenizers file
      tokenizer_config.json  chat_template, bos_token, eos_token, ...
      hetero_jax.json        {"format_version": 1, "dtype": ..., "source": {...}, "hetero_jax_version": ...,
                              "entries": [...], "params_sha256": {...}}

``entries`` lists what the converter wrote (all that --force may delete); ``params_sha256`` the size and digest
of every file under params/, checked before a load restores them (:mod:`hetero_jax.io.params_store`).

Everything is written into a hidden temporary sibling of OUT_DIR that is
renamed into place at the very end, so a failed or killed write never leaves a
half-written OUT_DIR behind. Every file and directory of it is fsynced before
the rename and OUT_DIR's parent after, so the rename cannot outlive its data in
a power loss or kernel crash.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
import warnings
from typing import Any, Mapping

import numpy as np

from hetero_jax.model.config import ModelConfig
from hetero_jax.errors import CheckpointError, ConfigError, OutputError, read_json
from hetero_jax.io.files import dir_problem, path_inside, sync_dir, sync_tree
from hetero_jax.io.params_store import DIGESTS_KEY, check_digests, digest_record, restore_tree, save_tree

FORMAT_VERSION = 1
META_FILE = "hetero_jax.json"
PARAMS_DIR = "params"
# Tokenizer-side files copied from an HF directory when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json")
DTYPES = ("float32", "bfloat16")
RECONVERT = "re-convert it with hetero-jax-convert --force"  # the fix for a damaged checkpoint, by default
# What save_checkpoint may write at a checkpoint's top level: --force replaces a checkpoint only when it holds
# nothing else than what META_FILE's "entries" lists, or (a checkpoint written before that list) than these.
CHECKPOINT_ENTRIES = frozenset({"config.json", META_FILE, PARAMS_DIR, *TOKENIZER_FILES})


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("hetero-jax")
    except Exception:
        return "0.1.0"


def np_dtype(name: str):
    """numpy dtype for ``"float32"`` / ``"bfloat16"`` (ml_dtypes)."""
    if name == "float32":
        return np.dtype(np.float32)
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    raise CheckpointError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")


def is_checkpoint(path: str | os.PathLike) -> bool:
    """True if ``path`` is a complete converted checkpoint directory."""
    path = os.fspath(path)
    return os.path.isfile(os.path.join(path, META_FILE)) and os.path.isdir(os.path.join(path, PARAMS_DIR))


def _out_path(out_dir: str | os.PathLike) -> str:
    """``out_dir`` made absolute, after refusing an empty one."""
    raw = os.fspath(out_dir)
    if raw == "":  # abspath("") is the current directory, which --force would then replace
        raise OutputError("the output directory is an empty string; give the path of the directory to write "
                          "the checkpoint to (OUT_DIR)")
    return os.path.abspath(raw)


def _target(out_dir: str) -> str:
    """The directory actually written for ``out_dir``: a symlink's target (so --force replaces the checkpoint the
    link points at and keeps the link, instead of renaming the link aside), else ``out_dir`` itself."""
    if not os.path.islink(out_dir):
        return out_dir
    real = os.path.realpath(out_dir)
    if not os.path.exists(real):
        raise OutputError(f"output directory {out_dir} is a symlink to {real}, which does not exist; remove the "
                          "link or point it at a directory, or choose another OUT_DIR")
    return real


def _written_entries(path: str) -> frozenset[str]:
    """The top-level entries the converter wrote into the checkpoint at ``path``: META_FILE's list, or
    CHECKPOINT_ENTRIES (all it may write) when META_FILE has no list (written before it had one) or cannot be
    read."""
    try:
        with open(os.path.join(path, META_FILE), encoding="utf-8") as f:
            names = json.load(f).get("entries")
    except (OSError, ValueError, AttributeError):
        return CHECKPOINT_ENTRIES
    if not isinstance(names, list):
        return CHECKPOINT_ENTRIES
    return frozenset(n for n in names if isinstance(n, str))


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _check_existing(shown: str, target: str, force: bool) -> None:
    """Refuse the existing ``target`` unless ``force`` and it is ours to replace: a converted checkpoint or an
    empty directory. Anything else may be a user's files, which we never delete."""
    where = shown if target == shown else f"{shown} (a symlink to {target})"
    if not os.path.isdir(target):
        raise CheckpointError(f"output path {where} exists and is not a directory; choose another OUT_DIR or "
                              "remove it yourself")
    try:
        entries = sorted(os.listdir(target))
    except OSError as e:
        raise CheckpointError(f"output directory {where} exists and cannot be listed ({e.strerror or e}); "
                              "choose another OUT_DIR or remove it yourself") from None
    if is_checkpoint(target):
        if not force:
            raise CheckpointError(f"output directory {where} already holds a converted checkpoint; pass --force "
                                  "(force=True) to replace it, or choose another OUT_DIR")
        ours = _written_entries(target)
        theirs = [e for e in entries if e not in ours]
        if theirs:  # e.g. a profile written next to the weights: replacing the directory would delete it
            raise CheckpointError(
                f"output directory {where} holds a converted checkpoint and also {_listed(theirs)}, which the "
                f"converter did not write; --force would delete them with the checkpoint. Move them out of "
                f"{shown} first, or choose another OUT_DIR")
        return
    if not entries:
        if not force:
            raise CheckpointError(f"output directory {where} already exists (empty); pass --force (force=True) "
                                  "to replace it, or choose another OUT_DIR")
        return
    raise CheckpointError(
        f"output directory {where} already exists and is not a hetero-jax checkpoint (it holds {_listed(entries)}); "
        "--force only replaces a converted checkpoint or an empty directory, never files the converter did not "
        f"write. Choose another OUT_DIR, or remove {shown} yourself")


def check_output_dir(out_dir: str | os.PathLike, force: bool) -> str:
    """Refuse, before any expensive work, an OUT_DIR that cannot be created or written, or that exists and
    may not be replaced (see :func:`_check_existing`); returns it absolute."""
    out_dir = _out_path(out_dir)
    target = _target(out_dir)
    exists = os.path.lexists(target)
    if exists:
        _check_existing(out_dir, target, force)
    # Replacing renames the old directory aside in its parent; creating makes the missing parents.
    problem = dir_problem(os.path.dirname(target) if exists else target)
    if problem:
        raise OutputError(f"output directory {out_dir} cannot be {'replaced' if exists else 'created'} "
                          f"({problem}); choose another OUT_DIR")
    return out_dir


def check_output_apart(source: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Refuse an OUT_DIR that is, contains or is inside the conversion's input (before anything is read
    or written): replacing OUT_DIR (--force) would delete the input, and writing inside it would mix a
    checkpoint into the model files. Symlinks are resolved, so an alias of the input is caught too."""
    shown = _out_path(out_dir)
    src, out = os.path.realpath(os.fspath(source)), os.path.realpath(shown)
    if out == src:
        raise CheckpointError(f"output directory {shown} is the input {src}; converting in place would delete the "
                              "input weights. Choose an OUT_DIR outside the input")
    if path_inside(out, src):
        raise CheckpointError(f"output directory {shown} is inside the input directory {src}; the checkpoint "
                              "would be mixed into the model files. Choose an OUT_DIR outside the input")
    if path_inside(src, out):
        raise CheckpointError(f"output directory {shown} contains the input {src}; replacing it would delete the "
                              "input. Choose an OUT_DIR outside the input")


def _write_tokenizer(tmp: str, source: Any) -> None:
    """``source``: a directory, a sequence of file paths, or a mapping name -> str | bytes | dict."""
    if isinstance(source, Mapping):
        for name, content in source.items():
            dst = os.path.join(tmp, os.path.basename(name))
            if isinstance(content, (dict, list)):
                with open(dst, "w", encoding="utf-8") as f:
                    json.dump(content, f, indent=2, ensure_ascii=False)
            elif isinstance(content, bytes):
                with open(dst, "wb") as f:
                    f.write(content)
            else:
                with open(dst, "w", encoding="utf-8") as f:
                    f.write(str(content))
    else:
        if isinstance(source, (str, os.PathLike)):
            d = os.fspath(source)
            files = [os.path.join(d, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(d, n))]
        else:
            files = [os.fspath(p) for p in source]
        for p in files:
            shutil.copyfile(p, os.path.join(tmp, os.path.basename(p)))
    if not os.path.isfile(os.path.join(tmp, "tokenizer.json")):
        raise CheckpointError("no tokenizer.json was given; a checkpoint needs the HF tokenizers file")


def _to_numpy_tree(params: dict) -> dict:
    out = {k: np.asarray(v) for k, v in params.items() if k != "layers"}
    out["layers"] = [{k: np.asarray(v) for k, v in layer.items()} for layer in params["layers"]]
    return out


def _tree_dtype(params: dict) -> str:
    dtypes = {str(np.asarray(v).dtype) for k, v in params.items() if k != "layers"}
    dtypes |= {str(np.asarray(v).dtype) for layer in params["layers"] for v in layer.values()}
    if len(dtypes) != 1:
        raise CheckpointError(f"params mix dtypes {sorted(dtypes)}; cast them to one dtype before saving")
    return dtypes.pop()


def save_checkpoint(out_dir: str | os.PathLike, config: ModelConfig, params: dict, *,
                    tokenizer_dir_or_files: Any, meta: Mapping[str, Any] | None = None,
                    force: bool = False, hf_config: Mapping[str, Any] | None = None) -> str:
    """Write a checkpoint atomically; returns the absolute OUT_DIR.

    ``params``: spec.py pytree (numpy or jax arrays, one dtype: float32 or bfloat16).
    ``hf_config``: config.json content to write verbatim (default ``config.to_hf_dict()``).
    ``meta``: extra entries for hetero_jax.json (e.g. ``{"source": {...}}``).
    """
    from hetero_jax.model.spec import check_params

    out_dir = check_output_dir(out_dir, force)
    params = _to_numpy_tree(params)
    check_params(config, params)
    dtype = _tree_dtype(params)
    if dtype not in DTYPES:
        raise CheckpointError(f"params have dtype {dtype}; checkpoints store one of {', '.join(DTYPES)}")

    target = _target(out_dir)  # a symlink's target is written; the link stays
    parent, name = os.path.split(target)
    # Create missing parents, remembering the top-most one so a failure can remove it again.
    created_top = None
    probe = parent
    while not os.path.isdir(probe):
        created_top = probe
        probe = os.path.dirname(probe)
    tmp = old = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; a checkpoint is an ordinary directory
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(dict(hf_config) if hf_config is not None else config.to_hf_dict(), f, indent=2)
        _write_tokenizer(tmp, tokenizer_dir_or_files)

        save_tree(os.path.join(tmp, PARAMS_DIR), params)

        info = {"format_version": FORMAT_VERSION, "dtype": dtype, "source": {},
                "hetero_jax_version": _version()}
        info.update(dict(meta or {}))
        info["format_version"], info["dtype"] = FORMAT_VERSION, dtype
        info["entries"] = sorted({*os.listdir(tmp), META_FILE})
        info[DIGESTS_KEY] = digest_record(os.path.join(tmp, PARAMS_DIR))
        # Written last: its presence marks a complete checkpoint (see is_checkpoint).
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(info, f, indent=2)
        # The whole tree, params/ included: one fsync per file (nothing is read again), then the directories.
        sync_tree(tmp)

        if os.path.lexists(target):
            # Checked again: it may have appeared or been filled while we were converting.
            _check_existing(out_dir, target, force)
            old = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(target, old)
        try:
            os.rename(tmp, target)
        except OSError:
            if old is not None:  # put the previous checkpoint back
                os.rename(old, target)
                old = None
            elif os.path.lexists(target):  # a concurrent writer got there first
                _check_existing(out_dir, target, False)
            raise
    except BaseException as e:
        # Interrupted (Ctrl-C) between or just after the renames: undone, so OUT_DIR is as it was (the
        # converter says nothing was written). tmp is gone only once the new tree took OUT_DIR's place.
        if tmp is not None and not os.path.lexists(tmp) and os.path.lexists(target):
            os.rename(target, tmp)
        if old is not None and not os.path.lexists(target):
            os.rename(old, target)
            old = None
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if created_top is not None:
            shutil.rmtree(created_top, ignore_errors=True)
        if isinstance(e, OSError):  # a full disk, a permission changed meanwhile: name OUT_DIR, not a traceback
            kept = (f"the previous checkpoint was moved to {old}; move it back to {target}" if old is not None
                    else "nothing was written or replaced")
            raise OutputError(f"output directory {out_dir}: writing the checkpoint failed ({e.strerror or e}); "
                              f"{kept}. Free space or choose another OUT_DIR") from e
        raise
    # The rename's directory, and each parent this call created in the one above it.
    folders = [parent]
    while created_top is not None and folders[-1] != os.path.dirname(created_top):
        folders.append(os.path.dirname(folders[-1]))
    try:
        for folder in folders:
            sync_dir(folder, f"output directory {out_dir}")
    except OutputError as e:  # the renames may not survive a crash: the replaced checkpoint is the only sure copy
        if old is None:
            raise
        raise OutputError(f"{e}; the checkpoint it replaced is kept in {old} (delete it once the new one is known "
                          "to be on disk)") from e.__cause__
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
        if os.path.lexists(old):
            warnings.warn(f"the new checkpoint is in {out_dir}, but the one it replaced could not be deleted "
                          f"from {old}; delete it yourself", RuntimeWarning, stacklevel=2)
    return out_dir


def _as_list(x):
    """Orbax may hand lists back as {"0": ..., "1": ...}; restore the list."""
    if isinstance(x, Mapping) and x and all(str(k).isdigit() for k in x):
        return [x[k] for k in sorted(x, key=lambda k: int(k))]
    return list(x)


def load_params(path: str | os.PathLike, *, verify: bool = True, fix: str = RECONVERT,
                meta: dict | None = None) -> dict:
    """Restore the params pytree (numpy arrays) from ``path/params``.

    ``verify``: first check every file under params/ against the sizes and digests hetero_jax.json recorded at
    save (a checkpoint written before they were recorded has none to check); False skips the check, which reads
    every file once more. ``fix``: what a CheckpointError for a damaged checkpoint tells the user to do.
    ``meta``: hetero_jax.json's object when the caller already read it (:func:`read_meta`), else it is read."""
    path = os.path.abspath(os.fspath(path))
    pdir = os.path.join(path, PARAMS_DIR)
    if verify:
        if meta is None:
            meta = read_meta(path, fix=fix)
        check_digests(pdir, meta, os.path.join(path, META_FILE), fix)
    try:
        tree = restore_tree(pdir)
    except Exception as e:
        raise CheckpointError(
            f"cannot restore params from {pdir} ({type(e).__name__}: {e}); the checkpoint is corrupt, {fix}") from None
    tree = dict(tree)
    tree["layers"] = [dict(layer) for layer in _as_list(tree.get("layers", []))]
    return tree


def read_meta(path: str | os.PathLike, *, fix: str = RECONVERT) -> dict:
    """hetero_jax.json's object, after refusing a missing, unreadable or other-format one."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    mp = os.path.join(path, META_FILE)
    meta = read_json(mp, CheckpointError,
                     missing=f"{path} is not a hetero-jax checkpoint (no {META_FILE}); convert the model first "
                     "with hetero-jax-convert HF_DIR OUT_DIR (or --gguf FILE OUT_DIR)",
                     fix=f"the checkpoint is corrupt, {fix}")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{mp} holds a JSON {type(meta).__name__}, not an object; the checkpoint is corrupt, "
                              f"{fix}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format_version {meta.get('format_version')!r}, this hetero-jax reads "
            f"{FORMAT_VERSION}; {fix}")
    return meta


def load_checkpoint(path: str | os.PathLike, dtype: str | None = None, *, verify: bool = True,
                    fix: str = RECONVERT):
    """Load ``(ModelConfig, params, Tokenizer)``; params as jax arrays, cast to ``dtype`` if given.

    The config and the tokenizer are read first, so a problem with either is reported before any weight is
    restored. ``verify`` and ``fix``: as :func:`load_params`."""
    import jax.numpy as jnp

    from hetero_jax.model.spec import check_params
    from hetero_jax.io.tokenizer import Tokenizer

    path = os.path.abspath(os.fspath(path))
    meta = read_meta(path, fix=fix)
    cfg_path = os.path.join(path, "config.json")
    config = ModelConfig.from_hf_dict(read_json(cfg_path, ConfigError, missing=f"no config.json in {path}; {fix}",
                                                fix=f"the checkpoint is corrupt, {fix}"))
    tokenizer = Tokenizer.from_dir(path, fix=f"the checkpoint is corrupt, {fix}")
    params = load_params(path, verify=verify, fix=fix, meta=meta)
    check_params(config, params)
    target = np_dtype(dtype) if dtype is not None else None

    def conv(a):
        a = np.asarray(a)
        if target is not None and a.dtype != target:
            a = a.astype(target)
        return jnp.asarray(a)

    out = {k: conv(v) for k, v in params.items() if k != "layers"}
    out["layers"] = [{k: conv(v) for k, v in layer.items()} for layer in params["layers"]]
    return config, out, tokenizer
