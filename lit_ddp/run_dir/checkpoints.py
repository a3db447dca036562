"""A run directory's checkpoints: which are there, which step each holds, which are whole, in what order a resume
tries them; setting later ones aside and removing superseded preemption checkpoints.

A run directory holds ``checkpoints/*.ckpt`` (ModelCheckpoint) and, under Slurm, ``hpc_ckpt_N.ckpt``
(Lightning's requeue save) (:mod:`lit_ddp.run_dir.layout`). Headers are read without the tensors and without
running code from the file. Choosing the resume point among them, on every rank, is
:mod:`lit_ddp.resilience.resume`.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import pickle
import posixpath
import time
import zipfile
from typing import Any

import fsspec
from fsspec.core import url_to_fs
from lightning.pytorch.utilities import rank_zero_warn

from lit_ddp.run_dir import sharded, untrusted
from lit_ddp.run_dir.layout import (
    CHECKPOINTS,
    HPC_GLOB,
    HPC_NAME,
    SET_ASIDE,
    checkpoint_kind,
    is_checkpoint_name,
    is_hpc_name,
)


def _join(fs: fsspec.AbstractFileSystem, root: str, *parts: str) -> str:
    return fs.sep.join([root.rstrip(fs.sep), *parts])


def is_valid_checkpoint(path: str) -> bool:
    """Whether ``path`` is a complete ``torch.save`` archive (zip with intact CRCs), or a sharded checkpoint's
    directory with such a ``meta.pt`` and every shard its DCP metadata names (:mod:`lit_ddp.run_dir.sharded`).

    Reads the whole file once (bytes), not the tensors into memory. A file truncated while being written,
    or one that is not a torch checkpoint at all, is invalid.

    Raises:
        UntrustedFileError: a sharded checkpoint's metadata names classes a checkpoint never holds (a planted
            pickle: :func:`lit_ddp.run_dir.untrusted.read_dcp_metadata`).
    """
    if sharded.is_sharded(path) and not sharded.shards_complete(path):
        return False
    try:
        with fsspec.open(sharded.meta_path(path), "rb") as f, zipfile.ZipFile(f) as zf:
            names = zf.namelist()
            if not any(n.endswith("/data.pkl") or n == "data.pkl" for n in names):
                return False
            return zf.testzip() is None
    except (OSError, zipfile.BadZipFile, EOFError, ValueError, RuntimeError):
        return False


class _HeaderUnpickler(pickle.Unpickler):
    """Unpickles a checkpoint's ``data.pkl`` without its tensors and without running any code: every class
    but ``OrderedDict`` becomes an inert placeholder, every tensor storage ``None``."""

    class _Opaque:
        def __init__(self, *args: Any, **kwargs: Any) -> None: ...

        def __setstate__(self, state: Any) -> None: ...

    def find_class(self, module: str, name: str) -> Any:
        return collections.OrderedDict if (module, name) == ("collections", "OrderedDict") else self._Opaque

    def persistent_load(self, pid: Any) -> None:
        return None


HEADERS_KEPT = 64
"""How many checkpoint headers a process keeps (a few KB each): a resume reads every one of the run directory's
several times (ranking, choosing, the hyperparameter check)."""
_headers: collections.OrderedDict[tuple[str, str], dict[str, Any]] = collections.OrderedDict()


def checkpoint_header(path: str) -> dict[str, Any]:
    """A checkpoint's dictionary without its tensors (they are ``None``), reading only its ``data.pkl`` record (a few
    KB), locally or through fsspec, and running no code from the file. For a sharded checkpoint's directory, that of
    its ``meta.pt`` (all but the parameters and optimizer states).

    Each file is read once per process while it stays the same: a later call returns a copy of the first read unless
    fsspec's ``ukey`` of the file (its size, times and inode locally, its ETag on an object store) has changed, as an
    atomic replace (a new inode) or a rewrite changes it. A rewrite in place that keeps the size and ends within the
    same tick of the file system's clock as the previous write, a few ms, would not be seen: lit-ddp's writes are
    atomic replaces.

    Raises:
        ValueError: not a readable torch checkpoint.
    """
    meta = sharded.meta_path(path)
    try:
        fs, local = url_to_fs(meta)
        key = (meta, fs.ukey(local))
        if key in _headers:
            _headers.move_to_end(key)
            return copy.deepcopy(_headers[key])
        with fs.open(local, "rb") as f, zipfile.ZipFile(f) as zf:
            name = next((n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if name is None:
                raise ValueError(f"{path} has no data.pkl")
            with zf.open(name) as pkl:
                data = _HeaderUnpickler(pkl).load()
    except (OSError, zipfile.BadZipFile, EOFError, pickle.UnpicklingError, RuntimeError) as e:
        raise ValueError(f"{path} is not a readable checkpoint: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a checkpoint dictionary")
    _headers[key] = copy.deepcopy(data)
    while len(_headers) > HEADERS_KEPT:
        _headers.popitem(last=False)
    return data


def checkpoint_step(path: str) -> int:
    """The ``global_step`` recorded in a checkpoint (:func:`checkpoint_header`: the tensors are not read).

    Raises:
        ValueError: not a readable torch checkpoint with a ``global_step``.
    """
    step = checkpoint_header(path).get("global_step")
    if not isinstance(step, int):
        raise ValueError(f"{path} records no global_step")
    return step


_KIND_ORDER = {"last": 0, "hpc": 1, "step": 2}  # equal steps are the same point; prefer last.ckpt, then hpc


def checkpoint_candidates(root_dir: str, checkpoint_dir: str | None = None) -> list[str]:
    """All ``*.ckpt`` files of a run, highest recorded step first (see :func:`ranked_checkpoints`)."""
    return [path for _, path in ranked_checkpoints(root_dir, checkpoint_dir)]


def ranked_checkpoints(root_dir: str, checkpoint_dir: str | None = None) -> list[tuple[int, str]]:
    """All ``*.ckpt`` files of a run as ``(global_step, path)``, highest step first; for equal steps
    ``last.ckpt``, then ``hpc_ckpt_N.ckpt``, then by name. File times play no part (a copied run directory or
    an object store with 1-second times reorders them). A file whose step cannot be read gets step -1, so it
    comes last (and fails validation there).

    Args:
        root_dir: the run directory (``trainer.default_root_dir``); ``hpc_ckpt_*.ckpt`` are looked for here.
        checkpoint_dir: the ModelCheckpoint directory; defaults to ``<root_dir>/checkpoints``.

    Raises:
        UntrustedFileError: a checkpoint there is a symbolic link (lit-ddp writes none).
    """
    root_dir = str(root_dir)
    fs, _ = url_to_fs(root_dir)
    ckpt_dir = str(checkpoint_dir) if checkpoint_dir is not None else _join(fs, root_dir, CHECKPOINTS)
    # Paths are spelled as the run directory was given (relative stays relative): every rank resolves the
    # chosen one itself, and messages name what the user wrote.
    names = [_join(fs, ckpt_dir, n) for n in _names(fs, ckpt_dir) if is_checkpoint_name(n)]
    names += [_join(fs, root_dir, n) for n in _names(fs, root_dir) if is_hpc_name(n)]
    found: dict[str, tuple[int, int, str]] = {}
    for name in names:
        untrusted.refuse_symlink(name, "checkpoint")  # lit-ddp writes none: someone planted it
        try:
            step = checkpoint_step(name)
        except ValueError:
            step = -1
        found[name] = (step, _KIND_ORDER[checkpoint_kind(name.rsplit("/", 1)[-1])], name)
    ordered = sorted(found.values(), key=lambda t: (-t[0], t[1], t[2]))
    return [(step, name) for step, _, name in ordered]


def _names(fs: fsspec.AbstractFileSystem, directory: str) -> list[str]:
    """The entry names (files and directories) of ``directory``, local or through fsspec; none if it is missing.
    Listed afresh: an object store's filesystem (s3fs) keeps each listing, and other processes write here."""
    path = url_to_fs(directory)[1]
    fs.invalidate_cache(path)
    try:
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
    except FileNotFoundError:
        return []


def set_aside_later_checkpoints(root_dir: str, checkpoint_dir: str, given: str) -> list[str]:
    """Moves every checkpoint of the run directory of a later step than ``given``'s into
    ``<root_dir>/set_aside/<UTC time>/``: resuming from an older checkpoint abandons them, and a later automatic
    resume (a restart, a requeue) must not jump forward onto them. ``given`` itself, however it is spelled, and
    its step's other files (``last.ckpt`` beside ``epoch=N-step=S.ckpt``) stay. Nothing is deleted. Returns the
    moved paths. Rank zero only, before anything of the run is written."""
    step = checkpoint_step(given)
    later = [p for s, p in ranked_checkpoints(root_dir, checkpoint_dir) if s > step]
    if not later:
        return []
    fs, _ = url_to_fs(str(root_dir))
    target = _join(fs, str(root_dir), SET_ASIDE, time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    fs.makedirs(url_to_fs(target)[1], exist_ok=True)
    for path in later:
        fs.mv(url_to_fs(path)[1], url_to_fs(_join(fs, target, path.rsplit("/", 1)[-1]))[1])
    rank_zero_warn(
        f"Resuming from {given} (step {step}): its run directory's {len(later)} checkpoint(s) of later steps "
        f"belong to the abandoned continuation and are moved to {target}, so that no automatic resume "
        f"returns to them: {', '.join(later)}"
    )
    return later


def remove_older_hpc_checkpoints(path: str) -> None:
    """Deletes the run directory's ``hpc_ckpt_M.ckpt`` for every ``M`` below ``path``'s ``N`` (a local path or
    an fsspec URL): each holds a whole state at an earlier step than the one just written, atomically, so
    keeping them would only fill the disk, one checkpoint per preemption. (A rollback with ``--ckpt_path``
    first sets the later ones aside.)"""
    fs, fs_path = url_to_fs(path)
    directory, name = posixpath.split(fs_path)
    this = HPC_NAME.fullmatch(name)
    if this is None:
        return
    for other in fs.glob(posixpath.join(directory, HPC_GLOB)):
        older = HPC_NAME.fullmatch(posixpath.basename(other))
        if older is not None and int(older.group(1)) < int(this.group(1)):
            with contextlib.suppress(OSError):
                fs.rm(other, recursive=True)  # a sharded checkpoint is a directory
