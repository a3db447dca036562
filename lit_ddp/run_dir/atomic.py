"""Files that appear whole or not at all, locally and through fsspec: what every write into a run directory
goes through (checkpoints, sharded checkpoint directories, the lock's holder record)."""

from __future__ import annotations

import contextlib
import glob
import os
import posixpath
import tempfile
from collections.abc import Iterator
from typing import BinaryIO

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from lit_ddp import compat


def write_atomic(path: str, data: bytes | memoryview) -> None:
    """Writes ``data`` to ``path`` (a local path or an fsspec URL) so that readers see the old or the new
    content, never a part of it, even when the writing process is killed.

    Raises:
        OSError: the write failed; the previous content of ``path`` is intact.
    """
    fs, fs_path = url_to_fs(path)
    if isinstance(fs, LocalFileSystem):
        with atomic_local_file(fs_path) as f:
            f.write(data)
        return
    parent = posixpath.dirname(fs_path.rstrip("/"))
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if compat.is_object_storage(fs):
        fs.pipe_file(fs_path, bytes(data))
    else:
        tmp = fs_path + ".tmp"
        fs.pipe_file(tmp, bytes(data))
        fs.mv(tmp, fs_path)


@contextlib.contextmanager
def atomic_local_file(path: str) -> Iterator[BinaryIO]:
    """A binary file whose content replaces ``path`` atomically once the block ends without an error."""
    directory, name = os.path.split(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp makes it 0600; a checkpoint gets the usual file mode
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync(directory)
    # Leftovers of writers of the same file that were killed mid-write (only one process writes a path).
    for stale in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(name)}.*.tmp")):
        with contextlib.suppress(OSError):
            os.remove(stale)


def umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it, racing other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def fsync(path: str | os.PathLike) -> None:
    """Flushes a file's or a directory's entries to disk (a directory: so that a rename in it survives a crash);
    errors are ignored, as on filesystems that cannot fsync a directory."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
