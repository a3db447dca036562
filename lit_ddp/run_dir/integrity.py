"""Whether a checkpoint's bytes are still those that were written, checked before anything of it is used.

Bits change silently on disks, file systems and in copies (docs/fault_tolerance.md, "What is verified"), and torch
reads them back without a word: ``torch.load`` does not check the CRC-32 that ``torch.save`` writes with every
record of its zip archive. Here:

- a ``torch.save`` file (a single-file checkpoint, a sharded checkpoint's ``meta.pt``): :func:`verify_archive`
  computes each record's CRC-32 and compares it with the one in the zip's central directory, which torch wrote with
  it; a mismatch names the file, the record and the tensors whose storage the record holds
  (``state_dict['model.lm_head.weight']``, read from the inert header: :mod:`lit_ddp.run_dir.inert`);
- a sharded checkpoint (torch's distributed checkpoint): every entry of a ``.distcp`` shard is itself a
  ``torch.save`` archive with its CRC-32s (DCP's file system writer saves each tensor, and each pickled object, with
  ``torch.save``), checked by :func:`verify_entries` for the entries a rank reads, and named by their tensor's
  fully qualified name. The CRC-32 and size of the ``.metadata`` that maps tensors to entries (a plain pickle,
  with no CRC of its own) are in the checkpoint's digest record (:data:`DIGEST_RECORD`, JSON), which rank zero
  writes into the hidden directory before it is committed (:func:`write_digest_record`), so that the record and the
  shards are always of one save (:mod:`lit_ddp.run_dir.sharded`). A sharded checkpoint written before lit-ddp wrote
  the record is still read, its shards checked, with one line saying that its ``.metadata`` could not be.

Records (and entries) are checked in parallel threads reading the file with ``os.pread``, a few MB at a time, by
ISA-L's CRC-32 (the ``isal`` package; zlib's where it is not installed), which releases the GIL; a load checks its
file while ``torch.load`` reads it (:func:`verifying`). A file verified once is not verified again by the same process while it stays the
same file (device, inode, size, modification and change times): a resume verifies the newest checkpoint on rank
zero before choosing it, then loads it.

CRC-32, not a cryptographic hash: it is what torch writes anyway (a save pays nothing more), it finds every change of
up to 32 consecutive bits and any other change but for one in 2^32, and it is the fastest to compute of the digests
measured (docs/fault_tolerance.md). It proves integrity, not authenticity: whoever can write a checkpoint can write
its digests too (docs/security.md). No library checks a zip's CRC-32s without extracting each record into memory
(``zipfile.ZipFile.testzip`` reads one record at a time in one thread and names nothing but the record): hence this
module.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import io
import json
import logging
import os
import struct
import threading
import zipfile
from collections.abc import Iterable, Iterator
from typing import IO, Any

from lightning.fabric.utilities.rank_zero import rank_zero_only

from lit_ddp.errors import DamagedCheckpointError
from lit_ddp.run_dir import inert
from lit_ddp.run_dir.atomic import fsync

try:  # ISA-L's CRC-32 (SIMD, carry-less multiplication): the same function as zlib's, several times faster
    from isal.isal_zlib import crc32
except ImportError:  # no wheel for this platform: zlib's
    from zlib import crc32

log = logging.getLogger(__name__)

DIGEST_RECORD = "digest.json"
"""A sharded checkpoint's digest record: the CRC-32 and size of its ``.metadata``."""
DIGEST_FORMAT = 1
CHUNK = 4 << 20
"""Bytes read at a time by each thread."""
MAX_THREADS = 16
VERIFIED_KEPT = 1 << 16
"""How many verified files and shard entries a process remembers (by the file's identity, an entry's place in it)."""

NO_CRC = (
    "records no CRC-32s (written with torch.serialization.set_crc32_options(False)): its bytes could not be verified"
)

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # PKZIP APPNOTE 4.3.7, the local file header (zipfile's own layout)
_LOCAL_SIGNATURE = b"PK\x03\x04"

_verified: collections.OrderedDict[tuple[int, ...], None] = collections.OrderedDict()
_said: set[str] = set()
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Record:
    """A zip record: its name, where its bytes start in the file (past its local header), its size and the CRC-32
    the writer recorded for it."""

    name: str
    start: int
    size: int
    crc: int


class _Reader:
    """Reads ``f`` at given offsets: with ``os.preadv`` on its descriptor (any number of threads at once), else by
    seeking under a lock (an fsspec or in-memory file)."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        try:
            self.fd: int | None = f.fileno()
        except (AttributeError, OSError, io.UnsupportedOperation):
            self.fd = None
        self.lock = threading.Lock()

    @property
    def parallel(self) -> bool:
        return self.fd is not None

    def readinto(self, offset: int, view: memoryview) -> int:
        if self.fd is not None:
            return os.preadv(self.fd, [view], offset)
        with self.lock:
            self.f.seek(offset)
            return self.f.readinto(view)  # type: ignore[attr-defined]

    def read(self, offset: int, size: int) -> bytes:
        buffer = bytearray(size)
        view, done = memoryview(buffer), 0
        while done < size:
            n = self.readinto(offset + done, view[done:])
            if n <= 0:
                break
            done += n
        return bytes(buffer[:done])


class _Window(io.RawIOBase):
    """Bytes ``start`` to ``start + length`` of a file, as a file of their own: a DCP entry (a ``torch.save``
    archive inside a ``.distcp`` shard) for :mod:`zipfile`."""

    def __init__(self, reader: _Reader, start: int, length: int) -> None:
        super().__init__()
        self.reader, self.start, self.length, self.pos = reader, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.length - self.pos)
        if n <= 0:
            return 0
        got = self.reader.readinto(self.start + self.pos, memoryview(b).cast("B")[:n])
        self.pos += got
        return got


def records(f: IO[bytes], start: int = 0, reader: _Reader | None = None) -> list[Record]:
    """The records of the zip archive open in ``f`` (or of its part from ``start``, a :class:`_Window`), each with
    where its bytes start, read from its local header.

    Raises:
        zipfile.BadZipFile: not a zip archive, or a local header that is not one.
        EOFError: cut short.
    """
    reader = reader or _Reader(f)
    with zipfile.ZipFile(f) as archive:
        infos = archive.infolist()
    found = []
    for info in infos:
        header = reader.read(start + info.header_offset, _LOCAL_HEADER.size)
        if len(header) < _LOCAL_HEADER.size:
            raise EOFError(f"the local header of {info.filename} is cut short")
        fields = _LOCAL_HEADER.unpack(header)
        if fields[0] != _LOCAL_SIGNATURE:
            raise zipfile.BadZipFile(f"the local header of {info.filename} is not one")
        data = start + info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
        found.append(Record(info.filename, data, info.compress_size, info.CRC))
    return found


def unchecked(infos: list[zipfile.ZipInfo]) -> bool:
    """Whether an archive of these records was written without CRC-32s (``torch.serialization.set_crc32_options
    (False)`` writes 0 for every record)."""
    return any(i.file_size for i in infos) and all(i.CRC == 0 for i in infos if i.file_size)


def record_bytes(f: IO[bytes], info: zipfile.ZipInfo) -> bytes:
    """The bytes of the stored record ``info`` of the zip archive open in ``f``, read without checking its CRC-32
    (``zipfile`` checks it, and an archive :func:`unchecked` has none).

    Raises:
        zipfile.BadZipFile: its local header is not one.
        EOFError: cut short.
    """
    reader = _Reader(f)
    header = reader.read(info.header_offset, _LOCAL_HEADER.size)
    fields = _LOCAL_HEADER.unpack(header) if len(header) == _LOCAL_HEADER.size else None
    if fields is None or fields[0] != _LOCAL_SIGNATURE:
        raise zipfile.BadZipFile(f"the local header of {info.filename} is not one")
    data = reader.read(info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1], info.compress_size)
    if len(data) < info.compress_size:
        raise EOFError(f"{info.filename} is cut short")
    return data


def _holders(header: Any, prefix: str) -> dict[str, list[str]]:
    """Each tensor record's name (``<prefix>data/<key>``) -> where in the checkpoint the tensors on that storage are
    (``state_dict['model.lm_head.weight']``, ``optimizer_states[0]['state'][3]['exp_avg']``)."""
    found: dict[str, list[str]] = {}
    pending: list[tuple[Any, str]] = [(header, "")]
    seen: set[int] = set()
    while pending:
        item, path = pending.pop()
        if isinstance(item, inert.TensorRecord):
            if item.storage is not None:
                found.setdefault(f"{prefix}data/{item.storage.key}", []).append(path or "the checkpoint")
            continue
        if id(item) in seen:
            continue
        if isinstance(item, dict):
            seen.add(id(item))
            pending.extend(
                (value, str(key) if not path and isinstance(key, str) else f"{path}[{key!r}]")
                for key, value in reversed(item.items())
            )
        elif isinstance(item, list | tuple):
            seen.add(id(item))
            pending.extend((value, f"{path}[{i}]") for i, value in reversed(list(enumerate(item))))
        elif isinstance(item, inert.Call):
            seen.add(id(item))
            pending.extend((value, path) for value in (*item.args, item.state, *item.items.values(), *item.elements))
    return found


def _name(holders: list[str]) -> str:
    shown = ", ".join(holders[:3])
    return shown + (f" and {len(holders) - 3} more" if len(holders) > 3 else "")


_buffers = threading.local()


def _crc(reader: _Reader, start: int, size: int) -> int:
    """The CRC-32 of ``size`` bytes of the file from ``start``, read :data:`CHUNK` bytes at a time into this thread's
    buffer.

    Raises:
        EOFError: the file ends before them.
    """
    buffer = getattr(_buffers, "buffer", None)
    if buffer is None:
        buffer = _buffers.buffer = memoryview(bytearray(CHUNK))
    crc, done = 0, 0
    while done < size:
        n = reader.readinto(start + done, buffer[: min(CHUNK, size - done)])
        if n <= 0:
            raise EOFError(f"the file ends {size - done} bytes before the end of a record")
        crc = crc32(buffer[:n], crc)
        done += n
    return crc


def _threads(reader: _Reader, tasks: int) -> int:
    if not reader.parallel:
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores, tasks))


def _first_failure(fn: Any, items: list[Any], threads: int) -> Any:
    """``fn`` over ``items`` (in ``threads`` threads): the first item's non-None result in ``items``' order, else
    None; an exception of ``fn`` is raised."""
    if threads <= 1 or len(items) <= 1:
        return next((r for r in map(fn, items) if r is not None), None)
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="lit-ddp-verify") as pool:
        return next((r for r in pool.map(fn, items) if r is not None), None)


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _known(fd: int | None) -> tuple[int, ...] | None:
    """The identity of the file open as ``fd`` (None for a file without a descriptor)."""
    return None if fd is None else _identity(os.fstat(fd))


def _remember(key: tuple[int, ...] | None) -> None:
    if key is None:
        return
    with _lock:
        _verified[key] = None
        _verified.move_to_end(key)
        while len(_verified) > VERIFIED_KEPT:
            _verified.popitem(last=False)


def _was_verified(key: tuple[int, ...] | None) -> bool:
    with _lock:
        return key is not None and key in _verified


def forget() -> None:
    """Forgets which files this process has verified (each is verified again when next read)."""
    with _lock:
        _verified.clear()
        _said.clear()


def say_once(key: str, message: str) -> None:
    """``message`` as one warning line, once per ``key`` in this process, on rank zero only."""
    with _lock:
        if key in _said:
            return
        _said.add(key)
    if getattr(rank_zero_only, "rank", 0) == 0:
        log.warning(message)


def verify_archive(f: IO[bytes], name: str, header: Any = None) -> None:
    """Checks every record of the ``torch.save`` archive open in ``f`` against the CRC-32 torch recorded for it
    (``f`` is rewound afterwards), unless this process verified the file before and it stayed the same. An archive
    that records no CRC-32s (written with ``torch.serialization.set_crc32_options(False)``) is not checked: one line
    says so.

    Args:
        f: the archive, open for reading (a local file: read in parallel threads; any other: in one).
        name: the file, for messages.
        header: its header as :func:`lit_ddp.run_dir.untrusted.read_archive` reads it (or a function that reads
            it, called only for a record that differs), to name the tensors on that record; None: the record only.

    Raises:
        DamagedCheckpointError: a record differs from its CRC-32 (named, with the tensors it holds), or the file ends
            before a record's last byte.
        ValueError: not a zip archive.
    """
    with verifying(f, name, header, in_background=False):
        pass


@contextlib.contextmanager
def verifying(f: IO[bytes], name: str, header: Any = None, in_background: bool = True) -> Iterator[None]:
    """:func:`verify_archive` of ``f``, done in a background thread while the block runs (``torch.load`` reading the
    same file: the check reads it with ``os.pread``, which leaves the file's position alone) and waited for at its
    end, where a difference is raised, in place of any error of the block. A file without a descriptor (fsspec, in
    memory) is checked before the block, in this thread.

    Raises:
        DamagedCheckpointError: see :func:`verify_archive`.
        ValueError: not a zip archive (before the block).
    """
    reader = _Reader(f)
    key = _known(reader.fd)
    if _was_verified(key):
        yield
        return
    try:
        found = records(f, reader=reader)
    except (zipfile.BadZipFile, EOFError) as e:
        raise ValueError(f"{name} is not a readable zip archive ({e})") from None
    finally:
        with contextlib.suppress(OSError, ValueError):
            f.seek(0)
    if any(r.size for r in found) and all(r.crc == 0 for r in found if r.size):
        say_once(f"crc:{name}", f"Checkpoint {name} {NO_CRC}")
        yield
        return
    found.sort(key=lambda r: -r.size)  # the largest first: the threads end together
    if not (in_background and reader.parallel):
        try:
            failure = _check_records(reader, found)
        finally:  # a file read by seeking (fsspec's, in memory) is read next from its start
            with contextlib.suppress(OSError, ValueError):
                f.seek(0)
        _raise_failure(failure, found, name, header)
        _remember(key)
        yield
        return
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lit-ddp-verify") as pool:
        pending = pool.submit(_check_records, reader, found)
        try:
            yield
        finally:
            _raise_failure(pending.result(), found, name, header)
    _remember(key)


def _check_records(reader: _Reader, found: list[Record]) -> tuple[Record, int | None] | None:
    """The first of ``found`` whose bytes differ from its CRC-32 and the CRC-32 computed (None: the file ends before
    its last byte), or None when all match; in parallel threads."""

    def check(record: Record) -> tuple[Record, int | None] | None:
        try:
            crc = _crc(reader, record.start, record.size)
        except EOFError:
            return record, None
        return None if crc == record.crc else (record, crc)

    return _first_failure(check, found, _threads(reader, len(found)))


def _raise_failure(failure: tuple[Record, int | None] | None, found: list[Record], name: str, header: Any) -> None:
    if failure is None:
        return
    record, crc = failure
    if crc is None:
        raise DamagedCheckpointError(f"{name} is cut short: its record {record.name} ends past the end of the file")
    pkl = next((r.name for r in found if r.name.endswith("data.pkl")), "data.pkl")
    try:
        read = header() if callable(header) else header
    except (ValueError, OSError):  # a header that cannot be read names nothing
        read = None
    holders = _holders(read, pkl[: -len("data.pkl")])
    holders.setdefault(pkl, ["the header: step, hyperparameters, loop state"])
    holds = f" ({_name(holders[record.name])})" if holders.get(record.name) else ""
    raise DamagedCheckpointError(
        f"{name}: its record {record.name}{holds} does not match the CRC-32 torch.save wrote with it (computed "
        f"{crc:08x}, written {record.crc:08x}): the file changed after it was saved"
    )


@dataclasses.dataclass(frozen=True)
class Entry:
    """One entry of a sharded checkpoint: bytes ``offset`` to ``offset + length`` of the shard ``file`` (a
    ``torch.save`` archive), holding ``what`` (a tensor's fully qualified name, with its chunk's offset)."""

    file: str
    offset: int
    length: int
    what: str


def verify_entries(directory: str | os.PathLike, entries: Iterable[Entry], whole: bool = False) -> None:
    """Checks each of ``entries`` of the sharded checkpoint ``directory``: every record of the ``torch.save``
    archive it is against its CRC-32, in parallel threads; entries this process has verified before, alone or with
    their whole shard (while it stayed the same), are skipped. ``whole``: ``entries`` are all of each shard's entries,
    so each shard is then remembered as verified.

    Raises:
        DamagedCheckpointError: an entry's record differs from its CRC-32, or the entry is not a ``torch.save``
            archive (the shard and the tensor named).
        OSError: a shard cannot be read.
    """
    by_file: dict[str, list[Entry]] = {}
    for entry in entries:
        by_file.setdefault(entry.file, []).append(entry)
    with contextlib.ExitStack() as stack:
        readers: dict[str, _Reader] = {}
        keys: dict[str, tuple[int, ...] | None] = {}
        for file in by_file:
            f = stack.enter_context(open(os.path.join(directory, file), "rb"))
            readers[file] = _Reader(f)
            keys[file] = _known(readers[file].fd)

        def known(entry: Entry) -> bool:
            key = keys[entry.file]
            return key is not None and (_was_verified(key) or _was_verified((*key, entry.offset, entry.length)))

        todo = sorted(
            (e for es in by_file.values() for e in dict.fromkeys(es) if not known(e)), key=lambda e: -e.length
        )

        def check(entry: Entry) -> str | None:
            where = f"{os.path.join(directory, entry.file)}: its entry of {entry.what} (bytes {entry.offset} to "
            reader = readers[entry.file]
            try:
                found = records(_Window(reader, entry.offset, entry.length), entry.offset, reader)  # type: ignore[arg-type]
                if any(r.size for r in found) and all(r.crc == 0 for r in found if r.size):
                    say_once(f"crc:{directory}", f"Checkpoint {directory} {NO_CRC}")
                    return None
                for record in found:
                    crc = _crc(reader, record.start, record.size)
                    if crc != record.crc:
                        return (
                            f"{where}{entry.offset + entry.length}, record {record.name}) does not match the CRC-32 "
                            f"torch.save wrote with it (computed {crc:08x}, written {record.crc:08x}): the shard "
                            "changed after it was saved"
                        )
            except (zipfile.BadZipFile, EOFError, ValueError, struct.error) as e:
                return (
                    f"{where}{entry.offset + entry.length}) is not the torch.save archive torch's distributed "
                    f"checkpoint wrote there ({e}): the shard changed after it was saved"
                )
            return None

        failure = _first_failure(check, todo, max(_threads(r, len(todo)) for r in readers.values()) if todo else 1)
    if failure is not None:
        raise DamagedCheckpointError(failure)
    for entry in todo:  # a second read of these (the restore check's) is not verified again
        if (key := keys[entry.file]) is not None:
            _remember((*key, entry.offset, entry.length))
    if whole:
        for key in keys.values():
            _remember(key)


def crc32_of(data: bytes | memoryview) -> str:
    """``data``'s CRC-32 as the digest record writes it (8 hex digits)."""
    return f"{crc32(data):08x}"


def write_digest_record(directory: str | os.PathLike) -> None:
    """Writes the digest record (:data:`DIGEST_RECORD`) of the sharded checkpoint written into ``directory``: the
    CRC-32 and size of its ``.metadata`` (the shards' entries carry their own CRC-32s), fsynced. Rank zero, once every
    rank has written its shards and before the directory is committed (:func:`lit_ddp.run_dir.sharded.commit`).

    Raises:
        OSError: ``.metadata`` cannot be read or the record written.
    """
    metadata = _read(os.path.join(directory, ".metadata"))
    record = {
        "format": DIGEST_FORMAT,
        "digest": "crc32",
        "metadata": {"bytes": len(metadata), "crc32": crc32_of(metadata)},
        "entries": "each .distcp entry is a torch.save archive with the CRC-32 of each of its records",
    }
    # A plain write: the directory is not yet in place, and the commit that puts it there fsyncs this file first.
    with open(os.path.join(directory, DIGEST_RECORD), "wb") as f:
        f.write((json.dumps(record, indent=1) + "\n").encode())
    fsync(os.path.join(directory, DIGEST_RECORD))


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def digest_record(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The sharded checkpoint's digest record; None where it has none (written before lit-ddp wrote one).

    Raises:
        DamagedCheckpointError: the record is there but not one lit-ddp writes (changed since).
    """
    path = os.path.join(directory, DIGEST_RECORD)
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 24)
    except FileNotFoundError:
        return None
    try:
        record = json.loads(data)
        metadata = record["metadata"]
        if not (
            record["format"] == DIGEST_FORMAT
            and record["digest"] == "crc32"
            and isinstance(metadata["bytes"], int)
            and isinstance(metadata["crc32"], str)
        ):
            raise ValueError("fields of other types")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DamagedCheckpointError(
            f"{path} is not the digest record lit-ddp writes ({type(e).__name__}: {e}): the checkpoint changed after "
            "it was saved"
        ) from None
    return record


def verify_metadata(directory: str | os.PathLike, data: bytes) -> bool:
    """Checks a sharded checkpoint's ``.metadata`` (its bytes, ``data``) against its digest record. True when
    verified; False when it has no record (one line says that it could not be verified).

    Raises:
        DamagedCheckpointError: the ``.metadata`` differs from the record, or the record is not one lit-ddp writes.
    """
    record = digest_record(directory)
    if record is None:
        say_once(
            f"record:{os.path.abspath(directory)}",
            f"Checkpoint {directory} has no digest record ({DIGEST_RECORD}: written before lit-ddp wrote one), so its "
            ".metadata could not be verified; its shards' CRC-32s are checked",
        )
        return False
    expected = record["metadata"]
    if len(data) != expected["bytes"] or crc32_of(data) != expected["crc32"]:
        raise DamagedCheckpointError(
            f"{os.path.join(directory, '.metadata')} does not match the digest record saved with it ({len(data)} "
            f"bytes, CRC-32 {crc32_of(data)}; recorded: {expected['bytes']} bytes, {expected['crc32']}): the "
            "checkpoint changed after it was saved"
        )
    return True
