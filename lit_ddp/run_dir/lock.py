"""One live job per run directory: an OS lock (``flock``, through the ``filelock`` library) that the kernel
releases when its holder dies, so a SIGKILLed run, a torchrun restart and a Slurm requeue are never blocked.

Two jobs in one run directory overwrite each other's ``last.ckpt``, delete each other's files through top-k, and
resume from each other's checkpoints. Global rank zero of a ``fit`` job takes the lock before any process group or
file exists and holds it until it exits; a second launch stops with one line naming the directory and the holder.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from collections.abc import Mapping

from filelock import FileLock, Timeout
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from lightning.pytorch.utilities import rank_zero_warn

from lit_ddp.errors import UsageError
from lit_ddp.run_dir import untrusted
from lit_ddp.run_dir.atomic import write_atomic
from lit_ddp.run_dir.layout import CHECKPOINTS, HOLDER_FILE, LOCK_FILE

ORPHAN_WAIT_S = 30.0  # how long a dead holder's forked children may keep its lock

_held: dict[str, FileLock] = {}  # by path, for the life of the process: the lock goes when the process does


class RunDirectoryBusy(UsageError):
    """Another live job holds the run directory."""


def job_rank(env: Mapping[str, str] | None = None) -> int | None:
    """This process's global rank as the launcher set it, before any process group exists; None for the
    processes that Lightning's own launcher starts (they belong to the job whose rank zero holds the lock)."""
    env = os.environ if env is None else env
    if "RANK" in env:  # torchrun
        return int(env["RANK"])
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):  # srun
        return int(env["SLURM_PROCID"])
    if "LOCAL_RANK" in env or int(env.get("NODE_RANK", "0") or 0) > 0:  # started by Lightning's launcher
        return None
    return 0


def hold_run_directory(root: str, env: Mapping[str, str] | None = None) -> bool:
    """Takes the run directory's lock if this process is the job's rank zero; returns whether it did.

    Raises:
        RunDirectoryBusy: another live process holds it; the message names the directory and the holder
            (host, pid, start time).
        UntrustedFileError: the lock or holder file is a symbolic link.
    """
    if job_rank(env) != 0:
        return False
    fs, path = url_to_fs(str(root))
    if not isinstance(fs, LocalFileSystem):
        rank_zero_warn(f"The run directory {root} is not local and cannot be locked: make sure one job uses it.")
        return False
    # The run directory and its checkpoints/ as given, not where a link planted in their place points (lstat).
    untrusted.refuse_symlink(path.rstrip("/"), "run directory")
    untrusted.refuse_symlink(os.path.join(path, CHECKPOINTS), "checkpoint directory")
    os.makedirs(path, exist_ok=True)
    for directory in (path, os.path.join(path, CHECKPOINTS)):
        if untrusted.writable_by_others(directory):
            rank_zero_warn(
                f"{'The run directory' if directory == path else 'The checkpoint directory'} {directory} is writable "
                "by its group or by everyone: whoever can write there can plant checkpoints that this run will resume "
                "(lit-ddp runs no code from them, but trains on their weights); chmod go-w it unless that is what you "
                "want"
            )
    lock_path = os.path.abspath(os.path.join(path, LOCK_FILE))
    if lock_path in _held:  # a second fit in this process (from Python): it is ours already
        return True
    # Links are refused, not resolved: a planted one would make the lock truncate the file it points to
    # (filelock >= 3.20.3 opens with O_NOFOLLOW too, CVE-2025-68146).
    untrusted.refuse_symlink(lock_path, "run directory's lock file")
    untrusted.refuse_symlink(os.path.join(path, HOLDER_FILE), "run directory's holder record")
    lock = FileLock(lock_path, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        holder = _holder_record(path)
        if not _holder_gone(holder):
            raise RunDirectoryBusy(
                f"the run directory {root} is in use by another live job ({_describe(holder)}); wait for it to end, "
                "stop it, or give this run another trainer.default_root_dir"
            ) from None
        # The holder died (a restart or requeue): processes it forked (data-loader workers) share its lock until
        # their watchdog sees the parent gone, within seconds.
        try:
            lock.acquire(timeout=ORPHAN_WAIT_S)
        except Timeout:
            raise RunDirectoryBusy(
                f"the run directory {root} is still locked {ORPHAN_WAIT_S:.0f} s after its holder ({_describe(holder)}) "
                "ended: processes it started are still alive; end them"
            ) from None
    _held[lock_path] = lock
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "start": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    write_atomic(os.path.join(path, HOLDER_FILE), json.dumps(holder).encode())
    return True


def _holder_record(path: str) -> dict | None:
    """The holder record, read only from a regular file (not through a link, nor from a FIFO that would block)."""
    try:
        with open(os.path.join(path, HOLDER_FILE), opener=_no_follow) as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            record = json.loads(f.read(1 << 16))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)


def _describe(holder: dict | None) -> str:
    if not holder:
        return "its holder is unknown"
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('start')}"


def _holder_gone(holder: dict | None) -> bool:
    """Whether the recorded holder is a process of this host that no longer runs (a zombie counts as gone)."""
    if not holder or holder.get("host") != socket.gethostname():
        return False
    try:
        with open(f"/proc/{int(holder['pid'])}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, ValueError, KeyError, IndexError):
        return True
