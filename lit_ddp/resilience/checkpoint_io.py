"""Lightning's checkpoint IO, writing checkpoints that appear whole or not at all (:mod:`lit_ddp.run_dir.atomic`),
synchronously or in a background thread."""

from __future__ import annotations

import errno
import io
import os
from typing import Any

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from typing_extensions import override

from lit_ddp import compat
from lit_ddp.errors import RunDirectoryNotWritable
from lit_ddp.run_dir import untrusted
from lit_ddp.run_dir.atomic import atomic_local_file, write_atomic
from lit_ddp.run_dir.checkpoints import ranked_checkpoints, remove_checkpoint


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` checkpoints that appear whole or not at all, locally and in object stores.

    Lightning's own save (``_atomic_save``) goes through an fsspec transaction. For a local path that
    transaction writes to ``tempfile.mkstemp()`` (in ``$TMPDIR``, not beside the target) and then
    ``shutil.move``s it: a rename when ``$TMPDIR`` is on the target's filesystem, but a plain copy onto the
    target when it is not (``/tmp`` on tmpfs, a network run directory), and a process killed during that
    copy leaves a truncated checkpoint in place of the previous one (``tests/system/test_fault_tolerance_atomic.py``
    shows it). It also never fsyncs, and a killed writer leaks its temporary file in ``$TMPDIR``.

    Here a local file is serialized straight into a hidden temporary file in the target's own directory
    (``.NAME.XXXX.tmp``, which no ``*.ckpt`` glob matches; no second copy of the checkpoint in memory: at
    most a few MB above the state, docs/fault_tolerance.md, "Atomic saves"), fsynced, and renamed over the target with
    ``os.replace`` (atomic on POSIX); the directory is fsynced too. Temporary files left by killed writers of
    the same target are removed by the next successful save. An object store (``s3://``, ``gs://``, ...) gets
    one ``pipe`` (a single or multipart upload, which only becomes visible once complete); any other remote
    filesystem a write to ``NAME.tmp`` followed by a move.

    Loading is weights-only, whatever Lightning asks (:func:`lit_ddp.run_dir.untrusted.load`): a checkpoint
    holding more than tensors and plain data, or declaring more than ``model`` can hold, stops with one line, and a
    URL is refused. Removing (``ModelCheckpoint``'s superseded files) removes only what lies in ``root`` and has a
    checkpoint's form: a regular file, or a sharded checkpoint's directory of lit-ddp's files
    (:func:`lit_ddp.run_dir.sharded.written_here`).

    Args:
        root: the run directory: no path outside it is removed (None: any path of a checkpoint's form).
        model: the module the checkpoints are of: a checkpoint declaring more tensors than it can hold is refused
            (:func:`lit_ddp.run_dir.untrusted.bounded_by`). ``lit-ddp`` sets both (:func:`confine`).
    """

    def __init__(self, root: str | None = None, model: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.root = root
        self.model = model

    @override
    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any = "cpu", weights_only: bool | None = None
    ) -> dict[str, Any]:
        with untrusted.bounded_by(self.model):
            return untrusted.load(path, map_location=map_location)

    @override
    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Removes the checkpoint at ``path`` (:func:`lit_ddp.run_dir.checkpoints.remove_checkpoint`: inside ``root``,
        a file or a sharded checkpoint's directory of lit-ddp's files).

        Raises:
            UntrustedFileError: it lies outside the run directory, is a link, or a directory lit-ddp did not write.
        """
        remove_checkpoint(str(path), self.root)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        """Writes ``checkpoint`` to ``path`` (a local path or an fsspec URL) whole or not at all.

        Raises:
            TypeError: ``storage_options`` given (Lightning's fsspec options are not taken).
            RunDirectoryNotWritable: the file system refused a local write (read-only, full, no permission);
                the checkpoints saved before are named and left as they were.
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not accept storage_options")
        fs, fs_path = url_to_fs(str(path))
        if isinstance(fs, LocalFileSystem):
            try:
                with atomic_local_file(fs_path) as f:
                    torch.save(checkpoint, f)
            except (OSError, RuntimeError) as e:  # torch's writer reports a full disk as a RuntimeError
                if (refused := refused_write(e)) is None:
                    raise
                directory = os.path.dirname(os.path.abspath(fs_path))
                raise not_writable_error(refused, str(path), directory, directory, "checkpoint directory") from e
            return
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        write_atomic(str(path), buffer.getbuffer())


NOT_WRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT})
"""The ``errno`` of a write a file system refused: read-only, no permission, no space, over quota."""


def refused_write(error: BaseException) -> OSError | None:
    """The OSError of :data:`NOT_WRITABLE` that ``error`` is or was raised from (its cause or context), or None."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError) and current.errno in NOT_WRITABLE:
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def is_inside(path: str | os.PathLike | None, directory: str) -> bool:
    """Whether a local ``path`` lies in ``directory`` (both made absolute, links not followed)."""
    if path is None:
        return False
    path, directory = os.path.abspath(os.fsdecode(path)), os.path.abspath(directory)
    return os.path.commonpath([path, directory]) == directory


def not_writable_error(
    error: OSError, path: str, directory: str, checkpoint_dir: str | None = None, kind: str = "run directory"
) -> RunDirectoryNotWritable:
    """The one-line error for a write at ``path`` in ``directory`` (a run directory, or its ``checkpoint_dir``)
    that the file system refused, with what the run saved before, which it leaves as it was: lit-ddp replaces each
    file whole (:mod:`lit_ddp.run_dir.atomic`), and a refused write leaves no partial file behind."""
    try:
        ranked = ranked_checkpoints(directory, checkpoint_dir)
    except (OSError, ValueError):
        ranked = []
    if not ranked:
        kept = "it held no checkpoint yet"
    else:
        step, newest = ranked[0]
        older = f" and {len(ranked) - 1} older one(s) are" if len(ranked) > 1 else " is"
        kept = f"its newest checkpoint, {newest} (global_step {step}),{older} kept as saved"
    return RunDirectoryNotWritable(
        f"the {kind} {directory} cannot be written: {error.strerror or error}: {path}; {kept}. Free space "
        "there or make it writable, or give another --trainer.default_root_dir, then run the same command again"
    )


class AsyncAtomicCheckpointIO(AsyncCheckpointIO):
    """:class:`AtomicCheckpointIO` in a background thread (Lightning's ``AsyncCheckpointIO``).

    The checkpoint's tensors are cloned on the training thread (a point-in-time copy, so RNG, dataloader and
    optimizer states stay consistent); serialization and the write happen in the thread while training goes
    on. docs/fault_tolerance.md ("Asynchronous saves") says when not to use it.

    Args:
        checkpoint_io: the IO that does the writing; defaults to :class:`AtomicCheckpointIO`.
    """

    def __init__(self, checkpoint_io: CheckpointIO | None = None) -> None:
        super().__init__(checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO())


def confine(checkpoint_io: Any, root: str, model: torch.nn.Module | None) -> None:
    """Tells every :class:`AtomicCheckpointIO` in ``checkpoint_io`` (wrapped ones too: :class:`AsyncAtomicCheckpointIO`)
    the run directory it may remove in and the model its checkpoints are of."""
    while checkpoint_io is not None:
        if isinstance(checkpoint_io, AtomicCheckpointIO):
            checkpoint_io.root, checkpoint_io.model = root, model
        checkpoint_io = getattr(checkpoint_io, "checkpoint_io", None)


def wait_for_checkpoint_writes(strategy: Any) -> None:
    """Blocks until an asynchronous checkpoint write in flight is on disk (a no-op for synchronous IO): the
    strategy's own (``FSDP2Strategy(async_save=True)``: every rank, a barrier), else its ``checkpoint_io``'s.

    Raises:
        BaseException: the error of a failed asynchronous write.
    """
    if (finish := getattr(strategy, "finish_checkpoint_writes", None)) is not None:
        finish()
    checkpoint_io = getattr(strategy, "checkpoint_io", None)
    while checkpoint_io is not None and not isinstance(checkpoint_io, AsyncCheckpointIO):
        checkpoint_io = getattr(checkpoint_io, "checkpoint_io", None)
    if checkpoint_io is not None:
        compat.wait_for_async_writes(checkpoint_io)
