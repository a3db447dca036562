"""Lightning's checkpoint IO, writing checkpoints that appear whole or not at all (:mod:`lit_ddp.run_dir.atomic`),
synchronously or in a background thread."""

from __future__ import annotations

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
from lit_ddp.run_dir import untrusted
from lit_ddp.run_dir.atomic import atomic_local_file, write_atomic


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
    most a few MB above the state, ``make bench-save``), fsynced, and renamed over the target with
    ``os.replace`` (atomic on POSIX); the directory is fsynced too. Temporary files left by killed writers of
    the same target are removed by the next successful save. An object store (``s3://``, ``gs://``, ...) gets
    one ``pipe`` (a single or multipart upload, which only becomes visible once complete); any other remote
    filesystem a write to ``NAME.tmp`` followed by a move.

    Loading is weights-only, whatever Lightning asks (:func:`lit_ddp.run_dir.untrusted.load`): a checkpoint
    holding more than tensors and plain data stops with one line, and a URL is refused.
    """

    @override
    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any = "cpu", weights_only: bool | None = None
    ) -> dict[str, Any]:
        return untrusted.load(path, map_location=map_location)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not accept storage_options")
        fs, fs_path = url_to_fs(str(path))
        if isinstance(fs, LocalFileSystem):
            with atomic_local_file(fs_path) as f:
                torch.save(checkpoint, f)
            return
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        write_atomic(str(path), buffer.getbuffer())


class AsyncAtomicCheckpointIO(AsyncCheckpointIO):
    """:class:`AtomicCheckpointIO` in a background thread (Lightning's ``AsyncCheckpointIO``).

    The checkpoint's tensors are cloned on the training thread (a point-in-time copy, so RNG, dataloader and
    optimizer states stay consistent); serialization and the write happen in the thread while training goes
    on. See the README ("Fault tolerance") for when not to use it.

    Args:
        checkpoint_io: the IO that does the writing; defaults to :class:`AtomicCheckpointIO`.
    """

    def __init__(self, checkpoint_io: CheckpointIO | None = None) -> None:
        super().__init__(checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO())


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
