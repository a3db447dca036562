"""Each replica group's committed step, as its launcher sees it: a record the group's rank zero rewrites at every
committed step (:class:`ProgressWriter`), which ``python -m lit_ddp.ft.launch`` and ``slurm/train_torchft.sbatch``
read (:func:`read`) to end a group that stops committing while the others commit, and to find each group's run
directory at the end (:mod:`lit_ddp.ft.fingerprint`).

A file, not a key of a store: the launcher and the sbatch's loop read it without joining anything, nothing listens
for it (a store would be one more unauthenticated server), and a file in a directory only the job's user writes
cannot be faked by another user. Its path comes in :data:`PROGRESS_ENV`; unset, nothing is written. One JSON object
padded to :data:`RECORD_BYTES`, rewritten in place by one ``pwrite`` (a reader never sees a shorter file; one that
reads it mid-write gets a line that does not parse, and keeps the one before).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

PROGRESS_ENV = "LIT_DDP_FT_PROGRESS_FILE"
RECORD_BYTES = 1024


class ProgressWriter:
    """Rewrites the group's record at ``path``: ``{"step", "time", "pid", "run_dir", "finished"}``; counts what the
    writes cost (``seconds``, ``writes``), for the strategy's report.

    Raises:
        OSError: ``path`` cannot be created (its directory is missing, or it is a symbolic link).
    """

    def __init__(self, path: str, run_dir: str) -> None:
        self.run_dir, self.pid = run_dir, os.getpid()
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        self.seconds, self.writes = 0.0, 0
        self._rest = f', "pid": {self.pid}, "run_dir": {json.dumps(run_dir)}, "finished": '  # the same each step

    def write(self, step: int, finished: bool = False) -> None:
        start = time.perf_counter()
        data = f'{{"step": {int(step)}, "time": {time.time():.3f}{self._rest}{"true" if finished else "false"}}}'
        encoded = data.encode()
        os.pwrite(self.fd, encoded.ljust(RECORD_BYTES) if len(encoded) < RECORD_BYTES else encoded, 0)
        self.seconds += time.perf_counter() - start
        self.writes += 1

    def close(self) -> None:
        os.close(self.fd)


def read(path: str | Path) -> dict[str, Any] | None:
    """The record at ``path``; None where there is none yet, or it is being written."""
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read(4 * RECORD_BYTES))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None
