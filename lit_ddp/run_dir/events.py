"""What happened to a run, as records a program reads: one JSON object a line in the run directory's
``lit_ddp_events.jsonl`` (:data:`lit_ddp.run_dir.layout.EVENTS`), written by rank zero.

The run's messages are for people and may be reworded; ``lit-ddp chaos`` and the tests read these records instead.
Both sides name the events through this module:

- :data:`RESUMED` ``{"path", "global_step", "epoch", "restart"}``: a fit continues from a checkpoint;
- :data:`RESTORE_CHECK` ``{"path", "passed", "entries"}`` or ``{"path", "passed": false, "first", "rank",
  "message"}``: the restore check of that resume (:mod:`lit_ddp.resilience.restore_check`);
- :data:`GROUP_STARTED` ``{"group", "pid", "run_dir"}`` and :data:`LIGHTHOUSE_STARTED` ``{"pid", "address"}``: the
  torchft launcher started a replica group's process, or its lighthouse's (in the launcher's ``--root``).

Each record also holds ``"event"`` (its kind) and ``"time"`` (seconds since the epoch). A record is appended in one
``write`` of at most a few hundred bytes with ``O_APPEND`` (local file systems append it whole); a run directory in
an object store keeps none. Reading is untrusted input like the rest of a run directory: a regular file only, at most
:data:`MAX_BYTES`, each line parsed as JSON, a line that is not an object skipped.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from lit_ddp.run_dir import untrusted
from lit_ddp.run_dir.layout import EVENTS

RESUMED = "resumed"
RESTORE_CHECK = "restore_check"
GROUP_STARTED = "group_started"
LIGHTHOUSE_STARTED = "lighthouse_started"
MAX_BYTES = 16 << 20


def record(directory: str | os.PathLike, event: str, **fields: Any) -> None:
    """Appends one ``event`` with ``fields`` (JSON values) to the records of ``directory`` (a run directory, or a
    launcher's root); nothing where it is not a local directory. Never raises for a record it cannot write: the run
    matters more than its record."""
    if "://" in str(directory) or not os.path.isdir(directory):
        return
    line = json.dumps({"event": event, "time": time.time(), **fields}, default=str) + "\n"
    path = os.path.join(directory, EVENTS)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError:
        return
    try:
        os.write(fd, line.encode())
    except OSError:
        pass
    finally:
        os.close(fd)


def read(run_dir: str | os.PathLike, event: str | None = None) -> list[dict[str, Any]]:
    """``run_dir``'s records in the order written (only those of kind ``event`` where given); none where it has no
    record file.

    Raises:
        UntrustedFileError: the record file is not a regular file, or is larger than :data:`MAX_BYTES`.
    """
    path = Path(run_dir, EVENTS)
    if not os.path.lexists(path):
        return []
    untrusted.refuse_symlink(path, "run's record of events")
    with untrusted.open_regular(path, "run's record of events") as f:
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise untrusted.UntrustedFileError(f"{path} is larger than a run's record of events ({MAX_BYTES} bytes)")
    found = []
    for line in data.decode(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill mid-write, or not a record
        if isinstance(entry, dict) and (event is None or entry.get("event") == event):
            found.append(entry)
    return found
