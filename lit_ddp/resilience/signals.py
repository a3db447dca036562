"""Signal handlers that only record a request: no I/O, no collective, nothing else.

A preemption signal (Slurm's ``--signal=SIGUSR1@90``, ``scancel --signal=USR1``, a site's SIGTERM before the
kill) reaches each rank at its own moment: during a forward pass, inside DDP's gradient all-reduce, during
validation or a checkpoint save. Lightning's own handlers save a checkpoint (SIGUSR1) or broadcast (SIGTERM)
inside the handler, i.e. wherever the rank happens to be, which can interleave a collective with DDP's
(Lightning issue 21406) and captures loop counters mid-step. Here the handler records the signal and
returns; :class:`lit_ddp.resilience.preemption.PreemptionCheckpoint` acts on it at the next optimizer-step
boundary, where every rank is at the same point.

Standard library only: ``lit_ddp.__main__`` installs the SIGUSR1 handler before importing Lightning (seconds of
imports), so a signal during start-up is not fatal either.

A handler that only records has one gap: Python runs it in the main thread between two bytecodes, so a rank
blocked inside a collective whose peer is gone (NCCL's survivors see no error; a peer that hangs does the
same on gloo) never runs it, and the SIGTERM that torchrun and ``srun --kill-on-bad-exit`` send first is
lost until SIGKILL or the process group timeout. :func:`watch_for_stalls` closes it: the C-level handler also
writes the signal number to a socket (``signal.set_wakeup_fd``), read by a thread that does not need the main
thread; after a SIGTERM it ends the process when no step :func:`beat` for ``timeout_s`` seconds.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

_requested: dict[str, float] = {}


def _record(signum: int, frame: FrameType | None) -> None:
    # Async-signal-safe in the Python sense: one dict assignment, no I/O, no locks held by other code.
    _requested.setdefault("signum", float(signum))
    _requested.setdefault("time", time.monotonic())


def install(*signums: int) -> None:
    """Makes each of ``signums`` only record a request (see :func:`requested`)."""
    for signum in signums:
        signal.signal(signum, _record)


def requested() -> int | None:
    """The first recorded signal since the last :func:`clear`, or None."""
    return int(_requested["signum"]) if "signum" in _requested else None


def clear() -> None:
    """Forgets the recorded request (after it was handled)."""
    _requested.clear()


class _StallWatch:
    """The thread behind :func:`watch_for_stalls` (one per process): Python runs a signal handler only when the main
    thread returns to the interpreter, which a blocked collective never does."""

    def __init__(self) -> None:
        self.reader, self.writer = socket.socketpair()
        self.writer.setblocking(False)  # the C-level handler must never block
        self.timeout_s: float | None = None  # None: not watching
        self.last_beat = time.monotonic()
        self.describe: Callable[[], str] = str
        threading.Thread(target=self._run, name="lit-ddp-stall-watch", daemon=True).start()

    def _run(self) -> None:
        while True:
            data = self.reader.recv(64)
            if signal.SIGTERM not in data or self.timeout_s is None:
                continue
            received = time.monotonic()
            while (timeout := self.timeout_s) is not None:
                left = max(received, self.last_beat) + timeout - time.monotonic()
                if left <= 0:
                    sys.stderr.write(
                        f"lit-ddp: error: {self.describe()}: SIGTERM received and no step finished in "
                        f"{timeout:g} s since: a collective waits for a peer that is gone or hung; "
                        "exiting now without a checkpoint (the newest saved one stays)\n"
                    )
                    sys.stderr.flush()
                    from lit_ddp import compat  # imported long before (fit is running): no import work here

                    compat.exit_now(128 + signal.SIGTERM)
                time.sleep(min(left, 0.1))


_watch: _StallWatch | None = None


def watch_for_stalls(timeout_s: float | None, describe: Callable[[], str] = str) -> None:
    """After a SIGTERM, ends the process (status 143, one ``lit-ddp: error:`` line on stderr starting with
    ``describe()``) once no :func:`beat` has come for ``timeout_s`` seconds, measured from the signal or the
    last beat after it, whichever is later. ``None`` stops watching (a save that may take long has begun, or
    training ended). Call from the main thread (``signal.set_wakeup_fd``); the SIGTERM handler must be a Python
    one (:func:`install`), or the signal ends the process anyway.

    Raises:
        RuntimeError: something else already owns the process's wakeup fd (asyncio does).
    """
    global _watch
    if _watch is None and timeout_s is not None:
        _watch = _StallWatch()
        previous = signal.set_wakeup_fd(_watch.writer.fileno(), warn_on_full_buffer=False)
        if previous not in (-1, _watch.writer.fileno()):
            signal.set_wakeup_fd(previous)
            _watch.timeout_s = None
            raise RuntimeError(f"the wakeup fd is taken (fd {previous}): SIGTERM is not watched for stalls")
    if _watch is not None:
        _watch.describe = describe
        _watch.last_beat = time.monotonic()
        _watch.timeout_s = timeout_s


def beat() -> None:
    """Marks progress (a step finished) for :func:`watch_for_stalls`."""
    if _watch is not None:
        _watch.last_beat = time.monotonic()
