"""The step clock: a file a timed run appends one line to per event, as it happens (line-buffered, so a run that a
time box kills still leaves its figures), and its reader. Times are wall-clock seconds since the epoch (one clock for
every process of the machine); the parent times its own events with ``time.time()`` too.

Lines (:class:`bench.harness.callback.StepClock` writes them from a fit, a plain loop through :class:`ClockFile`):

- ``start <time> <pid> <process start>``: training starts (the process's own start from ``/proc``);
- ``job <time> <tokens per step> <processes> <threads per process> <FLOPs per token>``: at the first step;
- ``step <time> <global step> <pid>``: after each optimizer step;
- ``val <time> <global step> <val/loss>``: each validation's end (not the sanity check);
- ``tput <time> <global step> <tokens/s> <mfu>``: each new value of the TokenThroughputMonitor's (``nan``: no MFU);
- ``end <time> <global step>``: training ends (before the end-of-fit sample).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import IO, Any

from bench.harness.launch import process_started_at

FIELDS = {"start": 3, "job": 5, "step": 3, "val": 3, "tput": 4, "end": 2}  # after the kind, the time included
Events = dict[str, list[tuple[float, ...]]]


class ClockFile:
    """Appends events to ``path`` (its folder created at the first one)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = None

    def write(self, kind: str, *fields: object) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", buffering=1)  # line-buffered: each event reaches the file at once
        self._file.write(" ".join(map(str, (kind, time.time(), *fields))) + "\n")

    def start(self) -> None:
        self.write("start", os.getpid(), process_started_at())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_clock(path: Path | str) -> Events:
    """The events of a clock file (a folder: of its ``rank*.txt``) by kind, each a tuple of floats: the time, then
    the fields above; every kind present, empty where none was written or the file is missing; a half-written line
    is skipped. ``span``: ``(start, end)`` of each step, from one ``step`` line to the next of the same process with
    no validation between."""
    path = Path(path)
    events: Events = {kind: [] for kind in (*FIELDS, "span")}
    for file in sorted(path.glob("rank*.txt")) if path.is_dir() else [path]:
        try:
            lines = file.read_text().splitlines()
        except OSError:
            continue
        last: tuple[float, ...] | None = None
        for line in lines:
            kind, *fields = line.split() or [""]
            if len(fields) != FIELDS.get(kind):
                continue
            with contextlib.suppress(ValueError):
                event = tuple(float(f) for f in fields)
                events[kind].append(event)
                if kind == "step" and last is not None and last[2] == event[2]:
                    events["span"].append((last[0], event[0]))
                last = event if kind == "step" else None if kind in ("val", "start") else last
    return events


def job_figures(job: tuple[float, ...], step_s: float, peak: float | None = None) -> dict[str, Any]:
    """Tokens/s (all processes) and, with ``peak`` (one process's FLOP/s), MFU of a step of ``step_s`` seconds, from
    the fields of a ``job`` line."""
    tokens, procs, threads, flops_per_token = job
    out = dict(procs=int(procs), threads_per_proc=int(threads), mean_step_s=step_s, tokens_per_s=tokens / step_s)
    if peak:
        out.update(peak_flops_per_proc=peak, mfu=flops_per_token * out["tokens_per_s"] / procs / peak)
    return out
