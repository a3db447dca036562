"""How lit-ddp reads files that someone else may have written: one loading policy, in one place.

A checkpoint, a sharded checkpoint's directory, a run directory that others can write and a URL are untrusted
input (docs/security.md). Nothing read from them may run code, write or remove anything outside the run, hang the
command or take more memory than the run's model can use:

- checkpoint files: ``torch.load(weights_only=True)`` only (:func:`load`), after :func:`check_archive`: a regular
  file (not a FIFO or a device, which would block or never end), a ``torch.save`` zip archive whose records are
  stored uncompressed as torch writes them (a compressed record can expand to any size) and whose tensors, read
  from the header alone (:mod:`lit_ddp.run_dir.inert`: no unpickler, nothing built), lie within their storages and
  add up to no more than :func:`state_bytes_limit`, and whose bytes match the CRC-32s written with them
  (:func:`verify`: :mod:`lit_ddp.run_dir.integrity`, also for a sharded checkpoint's entries and ``.metadata``).
  Every ``lit-ddp`` process also sets torch's
  ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` (:func:`force_weights_only`), so a library's own loads in that process
  (Lightning's, torch's distributed checkpoint's ``load_bytes``) are weights-only too, whatever they ask for;
- a checkpoint's header (:func:`read_archive`): the step, hyperparameters and resume state, read without the
  tensors, before a checkpoint is chosen;
- a sharded checkpoint's DCP ``.metadata``, which torch's ``FileSystemReader.read_metadata`` reads with a plain
  ``pickle.load``: read by :func:`read_dcp_metadata` with torch's weights-only unpickler, which admits the
  metadata's own dataclasses and nothing else and sets state only on their instances (``BUILD`` on a class is
  refused), then checked: every entry's file a plain name in the checkpoint's directory, a regular file, each
  offset and length within it, the tensors it declares within :func:`state_bytes_limit`.
  :class:`SafeFileSystemReader` and :class:`SafeLoadPlanner` are torch's reader and planner with that metadata
  reader and weights-only non-tensor entries, for every ``dcp.load`` lit-ddp makes;
- a URL (``http://``, ``https://``, ``ftp://``, or any chained fsspec URL such as ``simplecache::https://...``):
  refused (:func:`refuse_url`). Lightning loads paths that start with "http" through ``torch.hub`` with
  ``weights_only=False``; paths lit-ddp hands it are absolute (:func:`local_path`), so a local directory named
  ``http_demo`` is never taken for one;
- a run directory, its ``checkpoints/`` and its lock, holder, config, hyperparameter and checkpoint files: never
  followed through a symbolic link (:func:`refuse_symlink`); every file lit-ddp writes there is an atomic replace
  (:mod:`lit_ddp.run_dir.atomic`), which replaces a planted link rather than writing through it; a path a
  checkpoint's callback state names, and every path lit-ddp removes, lies inside the run (:func:`inside`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import fcntl
import io
import math
import os
import pathlib
import pickle
import posixpath
import stat
import warnings
import zipfile
from collections.abc import Iterator, MutableMapping
from typing import IO, Any

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from lit_ddp import compat
from lit_ddp.errors import DamagedCheckpointError, UsageError
from lit_ddp.run_dir import inert, integrity

URL_SCHEMES = ("http://", "https://", "ftp://")
"""Checkpoint locations refused: Lightning would fetch them through ``torch.hub`` and unpickle them with
``weights_only=False``. Object stores (``s3://``, ``gs://``) go through fsspec and :func:`load`."""
HEADER_BYTES = 64 << 20
"""The largest header (``data.pkl``) read: lit-ddp's are a few KB to a few MB (hyperparameters, loop and loader
state, one entry per rank); the tensors are records of their own."""
METADATA_BYTES = 256 << 20
"""The largest DCP ``.metadata`` read (a few hundred bytes per tensor and shard)."""
STATE_FACTOR, STATE_SLACK = 8, 256 << 20
"""A checkpoint of a model of P bytes of parameters and buffers may hold ``8 P + 256 MiB`` of tensors: its weights,
an optimizer's states (two per weight for AdamW, in float32 where the weights are bf16), RNG, loader and metric
states; a file declaring more is not that model's."""


class UntrustedFileError(UsageError):
    """A file or directory that lit-ddp will not read as it is: a URL, a symbolic link in a run directory, or a
    checkpoint that holds more than tensors and plain data, declares more than the run can hold, or names paths
    outside its run."""


def force_weights_only(env: MutableMapping[str, str] | None = None) -> None:
    """Makes every ``torch.load`` of this process (and of the processes it starts) weights-only: torch's
    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1`` overrides a library's ``weights_only=False``; torch's opposite switch
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is removed (torch refuses both at once)."""
    env = os.environ if env is None else env
    env["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an http(s) or ftp URL, or any chained fsspec URL (``simplecache::https://...``)."""
    text = str(path).lower()
    return "::" in text or any(part.startswith(URL_SCHEMES) for part in text.split("::"))


def refuse_url(path: str | os.PathLike, option: str) -> None:
    """Raises :class:`UntrustedFileError` naming ``option`` when ``path`` is an http(s) or ftp URL, or a chained
    fsspec URL (its last link fetches from anywhere)."""
    if is_url(path):
        raise UntrustedFileError(
            f"{option} {path}: lit-ddp does not load checkpoints from URLs (Lightning would unpickle them with "
            "weights_only=False) nor through chained fsspec URLs; download the file and give its local path (or one "
            "object-store URL, s3://...)"
        )


def local_path(path: str | os.PathLike) -> str:
    """``path`` as Lightning should be handed it: a local path made absolute (Lightning takes any path that starts
    with "http" for a URL), an fsspec URL (``s3://...``) as given."""
    path = str(path)
    return path if "://" in path else os.path.abspath(path)


def refuse_symlink(path: str | os.PathLike, what: str) -> None:
    """Raises :class:`UntrustedFileError` when ``path`` is a symbolic link (``lstat``: the link itself, not
    resolved), naming ``what`` it should have been; nothing when it is missing or not local."""
    path = str(path)
    if "://" in path:
        return
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise UntrustedFileError(
            f"{path} is a symbolic link (to {os.readlink(path)}), not the {what} lit-ddp wrote: lit-ddp does not "
            "follow links in a run directory. Remove it (and check who made it), or copy the file it points to"
        )


def writable_by_others(directory: str | os.PathLike) -> bool:
    """Whether a local ``directory`` can be written by its group or by everyone (sticky directories too: anyone
    may add a checkpoint to them)."""
    try:
        return bool(os.stat(directory).st_mode & (stat.S_IWGRP | stat.S_IWOTH))
    except OSError:
        return False


def inside(path: str | os.PathLike, directory: str | os.PathLike) -> bool:
    """Whether ``path`` lies in ``directory`` (or is it): local paths compared as real paths (links and ``..``
    resolved), URLs by their normalized path (a ``..`` segment anywhere is outside), each with its own scheme."""
    path, directory = str(path), str(directory)
    if "://" in path or "://" in directory:
        scheme, _, rest = path.partition("://")
        base_scheme, _, base = directory.partition("://")
        if scheme != base_scheme or ".." in rest.split("/"):
            return False
        rest, base = posixpath.normpath(rest), posixpath.normpath(base)
        return rest == base or rest.startswith(base.rstrip("/") + "/")
    real, base = os.path.realpath(path), os.path.realpath(directory)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def kind_of(mode: int) -> str:
    """What a file of ``st_mode`` is, in words (``"a FIFO"``, ``"a directory"``, ``"a regular file"``...)."""
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def refuse_irregular(path: str | os.PathLike, what: str, follow: bool = True) -> os.stat_result:
    """The ``stat`` of a local ``path`` (``lstat`` where not ``follow``), which must be a regular file.

    Raises:
        UntrustedFileError: it is a FIFO, a device, a socket or a directory (reading one blocks or never ends), or
            (not ``follow``) a symbolic link.
        FileNotFoundError: it does not exist.
    """
    st = os.stat(path) if follow else os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise UntrustedFileError(
            f"{path} is {kind_of(st.st_mode)}, not the {what} lit-ddp wrote there (a regular file): it is not read. "
            "Remove it (and check who made it)"
        )
    return st


@contextlib.contextmanager
def open_regular(path: str | os.PathLike, what: str = "checkpoint file") -> Iterator[IO[bytes]]:
    """A local file opened for reading only if it is a regular file: opened without blocking (a FIFO would block the
    ``open`` itself) and checked on the descriptor, so the file read is the file checked.

    Raises:
        UntrustedFileError: it is not a regular file (:func:`refuse_irregular`).
        OSError: it cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UntrustedFileError(
                f"{path} is {kind_of(mode)}, not the {what} lit-ddp wrote there (a regular file): it is not read. "
                "Remove it (and check who made it)"
            )
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


_limit: contextvars.ContextVar[int | None] = contextvars.ContextVar("lit_ddp_state_bytes_limit", default=None)


def state_bytes_limit() -> int:
    """The most bytes of tensors a checkpoint read now may declare: :func:`bounded_by`'s while it applies, else
    the memory this machine has available (``MemAvailable``; half the physical memory where unknown)."""
    limit = _limit.get()
    return limit if limit is not None else available_memory()


def available_memory() -> int:
    """Bytes of memory available to new allocations (Linux ``MemAvailable``; else half the physical memory)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def state_bytes(module: torch.nn.Module) -> int:
    """The bytes of ``module``'s parameters and buffers, whole (a sharded ``DTensor`` counted at its global size;
    ``meta`` tensors too)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


@contextlib.contextmanager
def bounded_by(module: torch.nn.Module | None) -> Iterator[int]:
    """Within the block, a checkpoint may declare at most :data:`STATE_FACTOR` x ``module``'s bytes plus
    :data:`STATE_SLACK` of tensors (and never more than :func:`available_memory`): what a checkpoint of that model
    holds. None, or a module with no parameters yet: the machine's available memory only."""
    limit = available_memory()
    if module is not None and (size := state_bytes(module)) > 0:
        limit = min(limit, STATE_FACTOR * size + STATE_SLACK)
    token = _limit.set(limit)
    try:
        yield limit
    finally:
        _limit.reset(token)


@dataclasses.dataclass(frozen=True)
class Archive:
    """A ``torch.save`` archive's header, read by :func:`read_archive` without its tensors: the dictionary (tensors
    as :class:`lit_ddp.run_dir.inert.TensorRecord`, other objects as records, nothing built), the bytes its tensor
    records hold, and the bytes its tensors would take made whole (a view larger than its storage counts whole)."""

    header: Any
    stored_bytes: int
    declared_bytes: int


def read_archive(f: IO[bytes], name: str, header: bool = True) -> Archive:
    """The header of the ``torch.save`` archive open in ``f`` (rewound afterwards), its structure checked: every
    record stored uncompressed (as torch writes them), no more bytes in records than the file holds, a header of at
    most :data:`HEADER_BYTES`, each tensor within its storage. Without ``header``, the structure only (the
    returned header is None and the tensors' bytes 0).

    Raises:
        UntrustedFileError: a compressed record, a header or tensor that is not what ``torch.save`` writes (a
            refused opcode, ``BUILD`` on a class, a view past its storage's end).
        DamagedCheckpointError: the header's bytes differ from their CRC-32.
        ValueError: not a zip archive, or cut short (the message says why, without the file's name).
    """
    try:
        size = f.seek(0, io.SEEK_END)
        f.seek(0)
        archive = zipfile.ZipFile(f)
        infos = archive.infolist()
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
                raise UntrustedFileError(
                    f"{name}: its record {info.filename} is compressed (zip method {info.compress_type}); torch.save "
                    "stores records uncompressed, and a compressed one can expand to any size: not loaded"
                )
        if sum(info.file_size for info in infos) > size:
            raise UntrustedFileError(f"{name}: its records declare more bytes than the file holds: not loaded")
        pkl = next((i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"), None)
        if pkl is None:
            raise ValueError("it has no data.pkl")
        if pkl.file_size > HEADER_BYTES:
            raise UntrustedFileError(
                f"{name}: its header (data.pkl) is {pkl.file_size} bytes, more than a checkpoint's ({HEADER_BYTES}): "
                "not loaded"
            )
        if not header:
            return Archive(None, 0, 0)
        prefix = pkl.filename[: -len("data.pkl")]
        try:  # zipfile checks this record's CRC-32; an archive written without them has none to check
            pickled = integrity.record_bytes(f, pkl) if integrity.unchecked(infos) else archive.read(pkl)
        except zipfile.BadZipFile as e:
            if not str(e).startswith("Bad CRC-32"):
                raise
            raise DamagedCheckpointError(
                f"{name}: its record {pkl.filename} (the header: step, hyperparameters, loop state) does not match "
                "the CRC-32 torch.save wrote with it: the file changed after it was saved"
            ) from None
        data, tensors = inert.read(pickled)
        records = {i.filename: i.file_size for i in infos}
        stored, declared = 0, 0
        seen: set[str] = set()
        for tensor in tensors:
            storage = tensor.storage
            if storage is None:
                continue
            record = records.get(f"{prefix}data/{storage.key}")
            if record is None:
                raise ValueError(f"its storage {storage.key} has no record")
            itemsize = record // storage.numel if storage.numel else 1
            extent = tensor.offset + sum((n - 1) * s for n, s in zip(tensor.size, tensor.stride, strict=True)) + 1
            if min(tensor.size, default=1) > 0 and (
                tensor.offset < 0 or min(tensor.stride, default=0) < 0 or extent > storage.numel
            ):
                raise UntrustedFileError(
                    f"{name}: a tensor of size {tensor.size} and stride {tensor.stride} reaches past its storage of "
                    f"{storage.numel} elements: not what torch.save writes, not loaded"
                )
            declared += tensor.numel * max(itemsize, 1)
            if storage.key not in seen:
                seen.add(storage.key)
                stored += record
    except inert.RefusedPickle as e:
        raise UntrustedFileError(f"{name}: its header is not a checkpoint's and was not loaded: {e}") from None
    except (zipfile.BadZipFile, inert.NotAPlainPickle, EOFError, KeyError, OverflowError) as e:
        raise ValueError(str(e) or type(e).__name__) from None
    finally:
        with contextlib.suppress(OSError, ValueError):
            f.seek(0)
    return Archive(data, stored, declared)


def check_archive(f: IO[bytes], name: str) -> Archive:
    """:func:`read_archive`, and the tensors it declares within :func:`state_bytes_limit`.

    Raises:
        UntrustedFileError: see :func:`read_archive`; or the tensors declare more bytes than the limit.
        ValueError: not a readable archive.
    """
    archive = read_archive(f, name)
    limit = state_bytes_limit()
    if max(archive.stored_bytes, archive.declared_bytes) > limit:
        raise UntrustedFileError(
            f"{name} declares {max(archive.stored_bytes, archive.declared_bytes):,} bytes of tensors, more than this "
            f"run can hold ({limit:,}: {STATE_FACTOR} x its model's parameters and buffers + {STATE_SLACK >> 20} MiB, "
            "at most the memory available): it is not this model's checkpoint, not loaded"
        )
    return archive


def verify(f: IO[bytes], name: str) -> Archive:
    """:func:`check_archive`, then every record's bytes against the CRC-32 ``torch.save`` wrote with it
    (:func:`lit_ddp.run_dir.integrity.verify_archive`; once per process while the file stays the same).

    Raises:
        UntrustedFileError: see :func:`check_archive`.
        DamagedCheckpointError: a record's bytes differ from its CRC-32 (the file and the tensors named).
        ValueError: not a readable archive.
    """
    with verified(f, name, in_background=False) as archive:
        return archive


@contextlib.contextmanager
def verified(f: IO[bytes], name: str, in_background: bool = True) -> Iterator[Archive]:
    """:func:`check_archive`, then the records' CRC-32s checked while the block reads the file (in a background
    thread: :func:`lit_ddp.run_dir.integrity.verifying`), a difference raised at its end.

    Raises:
        UntrustedFileError: see :func:`check_archive`.
        DamagedCheckpointError: a record's bytes differ from its CRC-32 (the file and the tensors named), whatever
            the block raised.
        ValueError: not a readable archive.
    """
    archive = check_archive(f, name)
    with integrity.verifying(f, name, archive.header, in_background=in_background):
        yield archive


def verify_path(path: str | os.PathLike) -> None:
    """:func:`verify` of the local ``torch.save`` file ``path``, for a reader that loads it itself (Lightning's
    ``ModelParallelStrategy`` memory-maps it).

    Raises:
        UntrustedFileError: see :func:`check_archive`; or not a regular file.
        DamagedCheckpointError: its bytes differ from their CRC-32s.
        ValueError: not a readable archive.
    """
    with open_regular(path) as f:
        verify(f, str(path))


def load(source: str | os.PathLike | IO[bytes], map_location: Any = "cpu", mmap: bool = False) -> Any:
    """A ``torch.save`` file (a local path, an fsspec URL or an open binary file) checked by :func:`check_archive`
    and verified against its CRC-32s (:func:`verify`), then read with ``torch.load(weights_only=True)``; ``mmap``: a
    local file memory-mapped, its tensors not read until used.

    Raises:
        UntrustedFileError: ``source`` is a URL, not a regular file, or holds objects other than tensors and plain
            data or more than :func:`check_archive` admits.
        DamagedCheckpointError: its bytes differ from the CRC-32s written with them (the record and tensors named).
        ValueError: it is not a readable ``torch.save`` archive.
        OSError: it cannot be read.
    """
    name = str(source) if isinstance(source, str | os.PathLike) else str(getattr(source, "name", "checkpoint"))
    try:
        if not isinstance(source, str | os.PathLike):
            verify(source, name)
            return torch.load(source, map_location=map_location, weights_only=True)
        refuse_url(source, "checkpoint")
        if "://" not in name:
            with open_regular(name) as f:
                if not mmap:  # the CRC-32s checked while torch reads the file
                    with verified(f, name):
                        return torch.load(f, map_location=map_location, weights_only=True)
                verify(f, name)
            return torch.load(name, map_location=map_location, weights_only=True, mmap=True)
        with fsspec.open(name, "rb") as f:
            verify(f, name)
            return torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UntrustedFileError(
            f"{name} holds objects other than tensors and plain data, which lit-ddp does not load "
            f"(torch.load(weights_only=True) refused it: {_reason(e)})"
        ) from None
    except (UntrustedFileError, DamagedCheckpointError):
        raise
    except ValueError as e:
        raise ValueError(f"{name} is not a readable checkpoint: {e}") from None


def _metadata_globals() -> dict[str, Any]:
    """What a DCP ``.metadata`` pickle may name, by ``"module.name"``: the dataclasses and enums of
    ``torch.distributed.checkpoint.metadata``, the file system writer's entry record, ``torch.Size``, dtypes, layouts
    (by name, through :func:`_get_layout`) and memory formats, ``pathlib``'s paths (``StorageMeta.checkpoint_id``) and
    ``OrderedDict``."""
    import collections

    allowed: dict[str, Any] = {}
    for name, value in vars(dcp_metadata).items():
        defined_there = isinstance(value, type) and value.__module__ == dcp_metadata.__name__
        if defined_there and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)):
            allowed[f"{dcp_metadata.__name__}.{name}"] = value
    allowed.update({f"{module}.{name}": cls for (module, name), cls in compat.dcp_private_metadata_classes().items()})
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
            allowed[f"torch.{name}"] = value
    allowed["torch.Size"] = torch.Size
    allowed["torch.serialization._get_layout"] = _get_layout  # lit-ddp's in its place: names of layouts only
    for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath):
        allowed[f"pathlib.{cls.__name__}"] = allowed[f"{cls.__module__}.{cls.__name__}"] = cls  # pathlib._local: 3.13
    allowed["collections.OrderedDict"] = collections.OrderedDict
    return allowed


def _get_layout(name: str) -> torch.layout:
    """``torch.serialization._get_layout``'s job (a layout pickled by name, ``"torch.strided"``), for names of
    torch's layouts only."""
    layout = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(layout, torch.layout):
        raise inert.RefusedPickle(f"{name!r} is not a torch layout")
    return layout


SHARD_SUFFIX = ".distcp"
"""The suffix of the files DCP's file system writer names in ``.metadata`` (``__0_0.distcp``)."""


def read_dcp_metadata(path: str | os.PathLike) -> Metadata:
    """A sharded checkpoint's DCP ``.metadata`` (the directory ``path``), read without running code from it
    (:func:`lit_ddp.run_dir.inert.read` with :func:`_metadata_globals`: as torch's weights-only unpickler, which
    reads pickle protocol 2 only, and DCP writes 4) and checked before anything
    reads by it: each entry's file a plain ``*.distcp`` name in ``path``, a regular file at least as long as the
    entries it holds (``offset + length``, non-negative), the tensors it declares and the bytes of its entries
    within :func:`state_bytes_limit`.

    Raises:
        UntrustedFileError: it names anything but the metadata's own classes (a planted pickle), an entry outside
            the directory or in anything but a regular file, a negative or malformed offset, more than the limit.
        ValueError: it is missing, cut short, not DCP metadata, or a shard is shorter than its entries (a
            checkpoint cut short).
    """
    file = os.path.join(path, ".metadata")
    try:
        with open_regular(file, "checkpoint's metadata") as f:
            if os.fstat(f.fileno()).st_size > METADATA_BYTES:
                raise UntrustedFileError(f"{file} is larger than a checkpoint's metadata ({METADATA_BYTES} bytes)")
            data = f.read(METADATA_BYTES + 1)
        integrity.verify_metadata(path, data)
        metadata, _ = inert.read(io.BytesIO(data), _metadata_globals())
    except inert.RefusedPickle as e:
        raise UntrustedFileError(f"{file} is not a checkpoint's metadata and was not loaded: {e}") from None
    except (inert.NotAPlainPickle, OSError, EOFError) as e:
        raise ValueError(f"{file} is not readable checkpoint metadata: {type(e).__name__}: {e}") from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{file} is not checkpoint metadata (it holds a {type(metadata).__name__})")
    _check_metadata(metadata, str(path), file)
    return metadata


def _check_metadata(metadata: Metadata, directory: str, file: str) -> None:
    """:func:`read_dcp_metadata`'s checks of what the metadata declares (no nested structure is walked: each field
    is checked for its own type)."""

    def refuse(why: str) -> UntrustedFileError:
        return UntrustedFileError(f"{file} is not a checkpoint's metadata and was not loaded: {why}")

    storage_data = metadata.storage_data
    if not isinstance(storage_data, dict) or not isinstance(metadata.state_dict_metadata, dict):
        raise refuse("its storage or state entries are not mappings")
    extents: dict[str, int] = {}
    entry_bytes = 0
    for info in storage_data.values():
        name, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
        if not (isinstance(name, str) and isinstance(offset, int) and isinstance(length, int)):
            raise refuse("an entry without a file name, an offset and a length")
        if os.path.basename(name) != name or name in ("", ".", "..") or not name.endswith(SHARD_SUFFIX):
            raise refuse(
                f"an entry names the file {name!r}, not a shard ({SHARD_SUFFIX}) in the checkpoint's directory"
            )
        if offset < 0 or length < 0:
            raise refuse(f"an entry of {name} has offset {offset} and length {length}")
        extents[name] = max(extents.get(name, 0), offset + length)
        entry_bytes += length
    declared = 0
    for fqn, entry in metadata.state_dict_metadata.items():
        size = getattr(entry, "size", None)
        if size is None:  # bytes entries: their length is in storage_data
            continue
        dtype = getattr(getattr(entry, "properties", None), "dtype", None)
        if not (isinstance(size, tuple) and all(isinstance(n, int) and n >= 0 for n in size)):
            raise refuse(f"{fqn} has the size {size!r}")
        if not isinstance(dtype, torch.dtype):
            raise refuse(f"{fqn} has no dtype")
        declared += math.prod(size) * torch.empty((), dtype=dtype).element_size()
    limit = state_bytes_limit()
    if max(declared, entry_bytes) > limit:
        raise UntrustedFileError(
            f"{file} declares {max(declared, entry_bytes):,} bytes of tensors, more than this run can hold "
            f"({limit:,}): it is not this model's checkpoint, not loaded"
        )
    for name, end in extents.items():
        try:
            st = refuse_irregular(os.path.join(directory, name), "checkpoint shard", follow=False)
        except FileNotFoundError:
            raise ValueError(f"{file} names the shard {name}, which is missing (a checkpoint cut short)") from None
        if st.st_size < end:
            raise ValueError(f"{os.path.join(directory, name)} is shorter than its entries (a checkpoint cut short)")


class SafeFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` whose ``read_metadata`` is :func:`read_dcp_metadata` (torch's unpickles the
    ``.metadata`` file with ``pickle.load``), and whose ``read_data`` first verifies the entries this rank reads
    against their CRC-32s (:func:`lit_ddp.run_dir.integrity.verify_entries`). The shards' tensors torch already reads
    with ``weights_only=True``.

    Raises (from ``read_data``; DCP's ``load`` gathers it from every rank into a ``CheckpointException``):
        DamagedCheckpointError: an entry's bytes differ from its CRC-32 (the shard and the tensor named).
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(self.path)
        storage_meta = getattr(metadata, "storage_meta", None) or dcp_metadata.StorageMeta()  # as torch's completes it
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        reads = {item.storage_index for item in plan.items}
        integrity.verify_entries(self.path, shard_entries(self.storage_data, reads))
        return super().read_data(plan, planner)


def shard_entries(storage_data: Any, only: set[Any] | None = None) -> list[integrity.Entry]:
    """The entries of a sharded checkpoint (its metadata's ``storage_data``, or those of it ``only`` names) as
    :class:`lit_ddp.run_dir.integrity.Entry`, each named by its tensor's fully qualified name (and the chunk's offset
    where it is not the tensor's start)."""
    found = []
    for index, file, offset, length in compat.dcp_entries(storage_data):
        if only is not None and index not in only:
            continue
        chunk = getattr(index, "offset", None)
        what = str(getattr(index, "fqn", index))
        if chunk is not None and any(chunk):
            what += f" from {tuple(chunk)}"
        found.append(integrity.Entry(file, offset, length, what))
    return found


class WeightsOnlyBytes:
    """A load planner mixin: each non-tensor entry of a sharded checkpoint (an optimizer's ``param_groups``, a
    step count) is checked with ``torch.load(weights_only=True)`` before torch's planner reads it (torch's
    ``DefaultLoadPlanner.load_bytes`` asks for ``weights_only=False``).

    Raises (from ``load_bytes``):
        UntrustedFileError: the entry holds objects other than tensors and plain data.
    """

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        data = value.read()
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as e:
            raise UntrustedFileError(
                f"the sharded checkpoint's entry {read_item.dest_index.fqn} holds objects other than tensors and "
                f"plain data, which lit-ddp does not load ({_reason(e)})"
            ) from None
        super().load_bytes(read_item, io.BytesIO(data))  # type: ignore[misc]


class SafeLoadPlanner(WeightsOnlyBytes, DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner`` with :class:`WeightsOnlyBytes`."""


def read_sharded(path: str | os.PathLike) -> dict[str, Any]:
    """A sharded checkpoint's DCP state (``{"state_dict": ..., "optimizer_0": ...}``, full tensors on the CPU) read
    whole, in this process, by :class:`SafeFileSystemReader` with a weights-only planner: what torch's
    ``dcp_to_torch_save`` reads, without its plain reader.

    Raises:
        UntrustedFileError: its metadata or an entry holds more than the checkpoint's own classes and plain data.
        ValueError: its metadata cannot be read.
    """
    planner = type("_SafeFullStatePlanner", (WeightsOnlyBytes, compat.dcp_full_state_planner()), {})()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, on purpose
        dcp_load({}, path, planner, no_dist=True)
    return dict(planner.original_state_dict)


def dcp_load(state: dict[str, Any], path: str | os.PathLike, planner: Any = None, **kwargs: Any) -> None:
    """torch's ``dcp.load(state, ...)`` from the sharded checkpoint ``path`` through :class:`SafeFileSystemReader`
    and (by default) :class:`SafeLoadPlanner`; collective unless ``no_dist=True`` is given.

    Raises:
        UntrustedFileError: on any rank, a file holds more than the checkpoint's own classes and plain data (DCP
            wraps it in a ``CheckpointException``, which is unwrapped).
        DamagedCheckpointError: on any rank, an entry it reads differs from its CRC-32 (unwrapped too), or the
            ``.metadata`` from the digest record.
        CheckpointException: torch's, for any other failure.
    """
    planner = SafeLoadPlanner() if planner is None else planner
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=planner, **kwargs)
    except CheckpointException as e:
        for error, _ in e.failures.values():
            if isinstance(error, UntrustedFileError | DamagedCheckpointError):
                raise type(error)(str(error)) from None
        raise


def _reason(error: Exception) -> str:
    """The line of torch's weights-only refusal that names what was refused."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if "WeightsUnpickler error" in line), lines[0] if lines else repr(error))
