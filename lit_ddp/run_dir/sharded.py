"""Sharded checkpoints (a directory of torch Distributed Checkpoint shards) that appear whole or not at all.

Under ``FSDP2Strategy(save_distributed_checkpoint=True)`` a checkpoint is a directory named like the file it
replaces (``last.ckpt/``, ``epoch=0-step=50.ckpt/``): DCP's ``.metadata`` and one ``__R_0.distcp`` per rank hold
the parameters and optimizer state, each rank writing its own shards; Lightning's ``meta.pt`` holds the rest
(global_step, loops, schedulers, the exact-resume state). Neither DCP nor Lightning makes that directory appear
atomically: Lightning writes into the target itself, so a process killed mid-save leaves a torn ``last.ckpt/``
in place of the previous one. Here every rank writes into a hidden sibling directory (``.NAME.XXXX.tmp``, which no
``*.ckpt`` glob matches), and rank zero swaps it into place once every rank is done (``renameat2(RENAME_EXCHANGE)``
on Linux), after writing the digest record of its ``.metadata`` into it (:mod:`lit_ddp.run_dir.integrity`: the
record and the shards are of one save). Listing checkpoints (:mod:`lit_ddp.run_dir.checkpoints`) reads such a
directory's step from ``meta.pt`` and checks that every shard file its ``.metadata`` names is there in full; a resume
verifies every entry of the one it chooses (:func:`verify`), and each rank the entries it reads.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import io
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from lit_ddp import compat
from lit_ddp.errors import DamagedCheckpointError
from lit_ddp.run_dir import integrity, untrusted
from lit_ddp.run_dir.atomic import fsync, umask

META = "meta.pt"
"""Lightning's file of a sharded checkpoint's non-tensor state (``lightning.fabric...._METADATA_FILENAME``)."""
OWN_FILES = frozenset({".metadata", META, integrity.DIGEST_RECORD})
"""The files of a sharded checkpoint beside its shards: DCP's metadata, Lightning's ``meta.pt`` and lit-ddp's digest
record (:mod:`lit_ddp.run_dir.integrity`)."""


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a sharded checkpoint's directory (a local path: DCP writes through the OS). A symbolic
    link is not followed (:func:`lit_ddp.run_dir.untrusted.refuse_symlink` refuses it where it is read)."""
    return os.path.isdir(path) and not os.path.islink(path)


SHARD_NAME = re.compile(r"__\d+_\d+\.distcp")
"""The shard files DCP's file system writer names (``__<rank>_<index>.distcp``)."""


def written_here(path: str | os.PathLike) -> bool:
    """Whether the directory ``path`` holds what a sharded checkpoint lit-ddp writes holds and nothing else: regular
    files named ``.metadata``, ``meta.pt``, a digest record or ``__R_I.distcp`` (no subdirectory, link or special
    file), so that removing it recursively removes nothing else."""
    try:
        entries = list(os.scandir(os.fspath(path)))
    except OSError:
        return False
    return all(
        entry.is_file(follow_symlinks=False) and (entry.name in OWN_FILES or SHARD_NAME.fullmatch(entry.name))
        for entry in entries
    )


def meta_path(path: str) -> str:
    """The file that holds a checkpoint's header: ``path`` itself, or a sharded checkpoint's ``meta.pt``."""
    return os.path.join(path, META) if is_sharded(path) else path


def shards_complete(path: str | os.PathLike) -> bool:
    """Whether every shard file the directory's DCP ``.metadata`` names is there, as long as the metadata says
    (the metadata read without running code from it: :func:`lit_ddp.run_dir.untrusted.read_dcp_metadata`).
    An unreadable ``.metadata`` (a directory cut short or not a checkpoint) is incomplete.

    Raises:
        UntrustedFileError: the ``.metadata`` names classes a checkpoint's metadata never holds (a planted pickle).
    """
    try:
        metadata = untrusted.read_dcp_metadata(path)
        for name, end in compat.dcp_storage_extents(metadata).items():
            if os.path.getsize(os.path.join(path, os.path.basename(name))) < end:
                return False
    except (untrusted.UntrustedFileError, DamagedCheckpointError):
        raise
    except (ValueError, OSError, AttributeError, TypeError):
        return False
    return True


def verify(path: str | os.PathLike) -> None:
    """Verifies the whole sharded checkpoint ``path``: its ``.metadata`` against its digest record (one line where it
    has none), every entry of every shard and its ``meta.pt`` against their CRC-32s
    (:mod:`lit_ddp.run_dir.integrity`). Each shard is then known to this process as verified: a load reads it without
    verifying it again.

    Raises:
        DamagedCheckpointError: anything of it differs from its digest (the file and the tensor or record named).
        UntrustedFileError: its metadata or ``meta.pt`` is a planted file.
        ValueError: it is cut short or not a sharded checkpoint.
        OSError: a file of it cannot be read.
    """
    metadata = untrusted.read_dcp_metadata(path)
    integrity.verify_entries(path, untrusted.shard_entries(metadata.storage_data), whole=True)
    meta = os.path.join(path, META)
    with untrusted.open_regular(meta) as f:
        untrusted.verify(f, meta)


def temporary_directory(path: str | os.PathLike) -> str:
    """A new hidden directory beside ``path`` for a sharded checkpoint to be written into (rank zero makes it)."""
    target = Path(path).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    written = tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.chmod(written, 0o777 & ~umask())  # mkdtemp makes it 0700; a checkpoint gets the usual directory mode
    return written


def commit(written: str | os.PathLike, path: str | os.PathLike) -> None:
    """Writes the digest record of the sharded checkpoint written into ``written``
    (:func:`lit_ddp.run_dir.integrity.write_digest_record`) and puts it in place of ``path`` (a file, a directory or
    nothing) so that readers of ``path`` see the old or the new checkpoint, never a mix; then removes the old one and
    the temporary directories of writers of ``path`` that were killed. Rank zero, after every rank has written.

    Raises:
        OSError: the swap failed; ``path`` is as it was.
    """
    written, target = Path(written).absolute(), Path(path).absolute()
    integrity.write_digest_record(written)
    fsync(written / META)
    fsync(written)
    if not os.path.lexists(target):
        os.replace(written, target)
    elif not _exchange(written, target):
        # No atomic exchange on this filesystem: two renames, with the old checkpoint kept under a hidden name in
        # between (a kill there leaves no ``path``, and resume falls back to the next newest checkpoint).
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        os.replace(target, old / "old")
        os.replace(written, target)
    fsync(target.parent)
    for stale in glob.glob(os.path.join(glob.escape(str(target.parent)), f".{glob.escape(target.name)}.*.tmp")):
        _remove(stale)


def full_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A sharded checkpoint as the dictionary a single-file one holds: ``meta.pt``'s entries plus ``state_dict``
    and ``optimizer_states`` consolidated from the shards (full tensors, in memory), running no code from the files
    (:func:`lit_ddp.run_dir.untrusted.read_sharded`).

    Raises:
        ValueError: ``path`` is not a complete sharded checkpoint.
        UntrustedFileError: a file of it holds more than the checkpoint's own classes and plain data.
    """
    if not (os.path.isfile(os.path.join(path, META)) and shards_complete(path)):
        raise ValueError(f"{path} is not a complete sharded checkpoint (meta.pt and DCP shards)")
    checkpoint = untrusted.load(os.path.join(path, META))
    tensors = untrusted.read_sharded(path)
    checkpoint["state_dict"] = tensors.pop("state_dict")
    optimizers = sorted(
        (int(key.split("_")[1]), state) for key, state in tensors.items() if key.startswith("optimizer_")
    )
    checkpoint["optimizer_states"] = [state for _, state in optimizers]
    return checkpoint


def read_whole(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint, single-file or sharded (:func:`full_checkpoint`), as a single-file one's dictionary with its
    tensors on the CPU, read weights-only (:func:`lit_ddp.run_dir.untrusted.load`).

    Raises:
        UntrustedFileError: it holds more than tensors and plain data, or is a URL.
        ValueError: a sharded checkpoint that is not complete.
    """
    return full_checkpoint(path) if is_sharded(path) else untrusted.load(path)


def as_file(path: str | os.PathLike) -> io.BytesIO:
    """A sharded checkpoint as an in-memory single-file checkpoint (:func:`full_checkpoint`), for readers that take
    a file, such as ``LightningModule.load_from_checkpoint``."""
    buffer = io.BytesIO()
    torch.save(full_checkpoint(path), buffer)
    buffer.seek(0)
    return buffer


def _exchange(a: Path, b: Path) -> bool:
    """Swaps two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``, glibc >= 2.28); False where unsupported."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        _remove(str(a))  # now the old checkpoint
        return True
    return False


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
