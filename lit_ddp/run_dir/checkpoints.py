"""A run directory's checkpoints: which are there, which step each holds, which are whole, in what order a resume
tries them; setting later ones aside and removing superseded preemption checkpoints.

A run directory holds ``checkpoints/*.ckpt`` (ModelCheckpoint) and, under Slurm, ``hpc_ckpt_N.ckpt``
(Lightning's requeue save) (:mod:`lit_ddp.run_dir.layout`). Headers are read without the tensors and without
running code from the file. Choosing the resume point among them, on every rank, is
:mod:`lit_ddp.resilience.resume`.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import time
import zipfile
from collections.abc import Iterator
from typing import IO, Any

import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from lightning.pytorch.utilities import rank_zero_warn

from lit_ddp.errors import DamagedCheckpointError
from lit_ddp.run_dir import integrity, sharded, untrusted
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
    """Whether ``path`` is a checkpoint a run may use (:func:`why_not_valid` finds nothing wrong with it).

    Raises:
        UntrustedFileError: a planted file (see :func:`why_not_valid`).
    """
    return why_not_valid(path) is None


def why_not_valid(path: str) -> str | None:
    """What is wrong with the checkpoint ``path``, in words that follow its name, or None when it is valid: a
    complete ``torch.save`` archive (its structure and tensors as :func:`lit_ddp.run_dir.untrusted.read_archive`
    checks them) whose every record matches the CRC-32 written with it, or a sharded checkpoint's directory with such a
    ``meta.pt``, every shard its DCP metadata names in full, and every entry and its ``.metadata`` matching their
    digests (:func:`lit_ddp.run_dir.sharded.verify`).

    Reads the whole file once (bytes, in parallel threads), not the tensors into memory; a file verified before by
    this process, and unchanged since, is not read again (:mod:`lit_ddp.run_dir.integrity`).

    Returns:
        ``"is truncated or unreadable (...)"`` for a file cut short by a kill or not a checkpoint at all;
        ``"is damaged: ..."`` naming the record or shard entry, and the tensor, whose bytes do not match.

    Raises:
        UntrustedFileError: a planted file: not a regular file, a compressed record, a header or sharded metadata
            that is not a checkpoint's (:mod:`lit_ddp.run_dir.untrusted`).
    """
    try:
        if sharded.is_sharded(path):
            if not sharded.shards_complete(path):
                return "is truncated or unreadable (a shard its .metadata names is missing or cut short)"
            sharded.verify(path)
            return None
        with _open(path) as f:
            untrusted.read_archive(f, path, header=False)  # the header: checkpoint_header, read once per process
            integrity.verify_archive(f, path, header=lambda: checkpoint_header(path))
    except DamagedCheckpointError as e:
        return f"is damaged: {_without(str(e), path)}"
    except untrusted.UntrustedFileError:
        raise
    except (OSError, zipfile.BadZipFile, EOFError, ValueError, RuntimeError) as e:
        return f"is truncated or unreadable ({_without(str(e), path)})"
    return None


def _without(reason: str, path: str) -> str:
    """``reason`` without a leading ``path:`` (the caller names the file already)."""
    return reason.removeprefix(f"{path}: ").removeprefix(f"{path} ") or "unreadable"


@contextlib.contextmanager
def _open(path: str) -> Iterator[IO[bytes]]:
    """A checkpoint file opened for reading: a local one only if it is a regular file
    (:func:`lit_ddp.run_dir.untrusted.open_regular`), a remote one through fsspec."""
    if "://" in path:
        with fsspec.open(path, "rb") as f:
            yield f
    else:
        with untrusted.open_regular(path) as f:
            yield f


def checkpoint_header(path: str) -> dict[str, Any]:
    """A checkpoint's dictionary without its tensors, reading only its ``data.pkl`` record (a few KB), locally or
    through fsspec, and building nothing it names (:func:`lit_ddp.run_dir.untrusted.read_archive`: tensors are
    :class:`~lit_ddp.run_dir.inert.TensorRecord`, other objects inert records). For a sharded checkpoint's
    directory, that of its ``meta.pt`` (all but the parameters and optimizer states). Read afresh at each call: a
    resume reads each candidate's once, and passes on what it read (:mod:`lit_ddp.resilience.resume`).

    Raises:
        ValueError: not a readable torch checkpoint.
        UntrustedFileError: a planted file (see :func:`is_valid_checkpoint`).
    """
    try:
        with _open(sharded.meta_path(path)) as f:
            data = untrusted.read_archive(f, path).header
    except untrusted.UntrustedFileError:
        raise
    except (OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path} is not a readable checkpoint: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a checkpoint dictionary")
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
        UntrustedFileError: the run directory, its checkpoint directory or a checkpoint there is a symbolic link
            (lit-ddp makes none), or a planted checkpoint (see :func:`checkpoint_header`).
    """
    root_dir = str(root_dir)
    fs, _ = url_to_fs(root_dir)
    ckpt_dir = str(checkpoint_dir) if checkpoint_dir is not None else _join(fs, root_dir, CHECKPOINTS)
    # Paths are spelled as the run directory was given (relative stays relative): every rank resolves the
    # chosen one itself, and messages name what the user wrote.
    untrusted.refuse_symlink(root_dir.rstrip("/"), "run directory")  # lit-ddp makes none: someone planted it
    untrusted.refuse_symlink(ckpt_dir.rstrip("/"), "checkpoint directory")
    names = [_join(fs, ckpt_dir, n) for n in _names(fs, ckpt_dir) if is_checkpoint_name(n)]
    names += [_join(fs, root_dir, n) for n in _names(fs, root_dir) if is_hpc_name(n)]
    found: dict[str, tuple[int, int, str]] = {}
    for name in names:
        untrusted.refuse_symlink(name, "checkpoint")  # lit-ddp writes none: someone planted it
        try:
            step = checkpoint_step(name)
        except untrusted.UntrustedFileError:
            raise
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


def set_aside_later_checkpoints(root_dir: str, checkpoint_dir: str, given: str, step: int) -> list[str]:
    """Moves every checkpoint of the run directory of a later step than ``given``'s (``step``) into
    ``<root_dir>/set_aside/<UTC time>/``: resuming from an older checkpoint abandons them, and a later automatic
    resume (a restart, a requeue) must not jump forward onto them. ``given`` itself, however it is spelled, and
    its step's other files (``last.ckpt`` beside ``epoch=N-step=S.ckpt``) stay. Nothing is deleted. Returns the
    moved paths. Rank zero only, before anything of the run is written."""
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
            with contextlib.suppress(OSError, untrusted.UntrustedFileError):  # a planted one stays where it is
                remove_checkpoint(fs.unstrip_protocol(other) if "://" in path else other, None)


def remove_checkpoint(path: str, root: str | None) -> None:
    """Removes the checkpoint at ``path`` (a local path or an fsspec URL): a file, or a sharded checkpoint's directory
    holding lit-ddp's files only (:func:`lit_ddp.run_dir.sharded.written_here`); nothing where it is missing.

    Args:
        path: the checkpoint, as ``ModelCheckpoint`` or the preemption checkpoint's pruning names it.
        root: the run directory it must lie in (:func:`lit_ddp.run_dir.untrusted.inside`); None: anywhere.

    Raises:
        UntrustedFileError: ``path`` lies outside ``root``, is a symbolic link, or is a directory that holds more
            than a sharded checkpoint lit-ddp wrote; nothing is removed.
    """
    if root is not None and not untrusted.inside(path, root):
        raise untrusted.UntrustedFileError(
            f"refused to remove {path}: it lies outside the run directory {root} (a checkpoint's callback state "
            "named it; lit-ddp's never do)"
        )
    fs, fs_path = url_to_fs(path)
    if not isinstance(fs, LocalFileSystem):
        if fs.exists(fs_path):
            fs.rm(fs_path)  # one object: lit-ddp writes sharded checkpoints locally only
        return
    if not os.path.lexists(fs_path):
        return
    link, directory = os.path.islink(fs_path), os.path.isdir(fs_path)
    if link or (directory and not sharded.written_here(fs_path)):
        raise untrusted.UntrustedFileError(
            f"refused to remove {path}: it is {'a symbolic link' if link else 'a directory'} that lit-ddp did not write"
        )
    if directory:
        shutil.rmtree(fs_path)
    else:
        os.remove(fs_path)
