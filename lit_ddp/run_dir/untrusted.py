"""How lit-ddp reads files that someone else may have written: one loading policy, in one place.

A checkpoint, a sharded checkpoint's directory, a run directory that others can write and a URL are untrusted
input (docs/security.md). Nothing read from them may run code:

- checkpoint files: ``torch.load(weights_only=True)`` only (:func:`load`). Every ``lit-ddp`` process also sets
  torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` (:func:`force_weights_only`), so a library's own loads in that process
  (Lightning's, torch's distributed checkpoint's ``load_bytes``) are weights-only too, whatever they ask for;
- a sharded checkpoint's DCP ``.metadata``, which torch's ``FileSystemReader.read_metadata`` reads with a plain
  ``pickle.load``: read by :func:`read_dcp_metadata`, an unpickler that admits the metadata's own dataclasses,
  ``torch.Size``, dtypes and layouts and nothing else (the "Restricting Globals" recipe of Python's ``pickle``
  docs; torch has no such reader: its weights-only unpickler reads ``torch.save`` archives, not raw pickles).
  :class:`SafeFileSystemReader` and :class:`SafeLoadPlanner` are torch's reader and planner with that metadata
  reader and weights-only non-tensor entries, for every ``dcp.load`` lit-ddp makes;
- a URL (``http://``, ``https://``, ``ftp://``): refused (:func:`refuse_url`). Lightning loads paths that start
  with "http" through ``torch.hub`` with ``weights_only=False``; paths lit-ddp hands it are absolute
  (:func:`local_path`), so a local directory named ``http_demo`` is never taken for one;
- a run directory's lock, holder, config, hyperparameter and checkpoint files: never followed through a symbolic
  link (:func:`refuse_symlink`); every file lit-ddp writes there is an atomic replace
  (:mod:`lit_ddp.run_dir.atomic`), which replaces a planted link rather than writing through it.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pathlib
import pickle
import stat
import warnings
from collections.abc import MutableMapping
from typing import IO, Any

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from lit_ddp import compat
from lit_ddp.errors import UsageError

URL_SCHEMES = ("http://", "https://", "ftp://")
"""Checkpoint locations refused: Lightning would fetch them through ``torch.hub`` and unpickle them with
``weights_only=False``. Object stores (``s3://``, ``gs://``) go through fsspec and :func:`load`."""


class UntrustedFileError(UsageError):
    """A file or directory that lit-ddp will not read as it is: a URL, a symbolic link in a run directory, or a
    checkpoint that holds more than tensors and plain data."""


def force_weights_only(env: MutableMapping[str, str] | None = None) -> None:
    """Makes every ``torch.load`` of this process (and of the processes it starts) weights-only: torch's
    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1`` overrides a library's ``weights_only=False``; torch's opposite switch
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is removed (torch refuses both at once)."""
    env = os.environ if env is None else env
    env["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)


def is_url(path: str | os.PathLike) -> bool:
    return str(path).lower().startswith(URL_SCHEMES)


def refuse_url(path: str | os.PathLike, option: str) -> None:
    """Raises :class:`UntrustedFileError` naming ``option`` when ``path`` is an http(s) or ftp URL."""
    if is_url(path):
        raise UntrustedFileError(
            f"{option} {path}: lit-ddp does not load checkpoints from URLs (Lightning would unpickle them with "
            "weights_only=False); download the file and give its local path"
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


def load(source: str | os.PathLike | IO[bytes], map_location: Any = "cpu", mmap: bool = False) -> Any:
    """A ``torch.save`` file (a local path, an fsspec URL or an open binary file) read with
    ``torch.load(weights_only=True)``; ``mmap``: a local file memory-mapped, its tensors not read until used.

    Raises:
        UntrustedFileError: ``source`` is a URL, or the file holds objects other than tensors and plain data.
        OSError: it cannot be read.
    """
    name = source if isinstance(source, str | os.PathLike) else getattr(source, "name", "checkpoint")
    try:
        if not isinstance(source, str | os.PathLike):
            return torch.load(source, map_location=map_location, weights_only=True)
        refuse_url(source, "checkpoint")
        if mmap and "://" not in str(source):
            return torch.load(str(source), map_location=map_location, weights_only=True, mmap=True)
        with fsspec.open(str(source), "rb") as f:
            return torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UntrustedFileError(
            f"{name} holds objects other than tensors and plain data, which lit-ddp does not load "
            f"(torch.load(weights_only=True) refused it: {_reason(e)})"
        ) from None


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """What a DCP ``.metadata`` pickle may name: the dataclasses and enums of torch's
    ``torch.distributed.checkpoint.metadata``, the file system writer's entry record, ``torch.Size``,
    dtypes, layouts and memory formats, ``pathlib``'s paths (``StorageMeta.checkpoint_id``) and ``OrderedDict``."""
    allowed: dict[tuple[str, str], Any] = {}
    for name, value in vars(dcp_metadata).items():
        defined_there = isinstance(value, type) and value.__module__ == dcp_metadata.__name__
        if defined_there and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)):
            allowed[(dcp_metadata.__name__, name)] = value
    allowed.update(compat.dcp_private_metadata_classes())
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
            allowed[("torch", name)] = value
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = _get_layout  # lit-ddp's in its place: names of layouts only
    for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath):
        allowed[("pathlib", cls.__name__)] = allowed[(cls.__module__, cls.__name__)] = cls  # pathlib._local: 3.13
    import collections

    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    return allowed


def _get_layout(name: str) -> torch.layout:
    """``torch.serialization._get_layout``'s job (a layout pickled by name, ``"torch.strided"``), for names of
    torch's layouts only."""
    layout = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(layout, torch.layout):
        raise pickle.UnpicklingError(f"{name!r} is not a torch layout")
    return layout


class _Refused(pickle.UnpicklingError):
    """A name or reference that DCP metadata never holds."""


class _MetadataUnpickler(pickle.Unpickler):
    allowed: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:
            raise _Refused(f"{module}.{name} is not part of a checkpoint's metadata")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("a checkpoint's metadata holds no persistent references")


def read_dcp_metadata(path: str | os.PathLike) -> Metadata:
    """A sharded checkpoint's DCP ``.metadata`` (the directory ``path``), read without running code from it.

    Raises:
        UntrustedFileError: it names anything but the metadata's own classes (a planted pickle).
        ValueError: it is missing, cut short, or not DCP metadata.
    """
    if not _MetadataUnpickler.allowed:
        _MetadataUnpickler.allowed = _metadata_globals()
    file = os.path.join(path, ".metadata")
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as e:
        raise UntrustedFileError(f"{file} is not a checkpoint's metadata and was not loaded: {e}") from None
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, TypeError, IndexError, KeyError) as e:
        raise ValueError(f"{file} is not readable checkpoint metadata: {e}") from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{file} is not checkpoint metadata (it holds a {type(metadata).__name__})")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` whose ``read_metadata`` is :func:`read_dcp_metadata` (torch's unpickles the
    ``.metadata`` file with ``pickle.load``). The shards' tensors torch already reads with ``weights_only=True``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(self.path)
        storage_meta = getattr(metadata, "storage_meta", None) or dcp_metadata.StorageMeta()  # as torch's completes it
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


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
        CheckpointException: torch's, for any other failure.
    """
    planner = SafeLoadPlanner() if planner is None else planner
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=planner, **kwargs)
    except CheckpointException as e:
        for error, _ in e.failures.values():
            if isinstance(error, UntrustedFileError):
                raise UntrustedFileError(str(error)) from None
        raise


def _reason(error: Exception) -> str:
    """The line of torch's weights-only refusal that names what was refused."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if "WeightsUnpickler error" in line), lines[0] if lines else repr(error))
