"""Signal handlers that only record a request: no I/O, no collective, nothing else.

A preemption signal (Slurm's ``--signal=SIGUSR1@90``, ``scancel --signal=USR1``, a site's SIGTERM before the
kill) reaches each rank at its own moment: during a forward pass, inside DDP's gradient all-reduce, during
validation or a checkpoint save. Lightning's own handlers save a checkpoint (SIGUSR1) or broadcast (SIGTERM)
inside the handler, i.e. wherever the rank happens to be, which can interleave a collective with DDP's
(Lightning issue 21406) and captures loop counters mid-step. Here the handler records the signal and
returns; :class:`lit_ddp.resilience.preemption.PreemptionCheckpoint` acts on it at the next optimizer-step
boundary, where every rank is at the same point.

Standard library only: ``lit_ddp.__main__`` installs the SIGUSR1 handler before importing Lightning (about
5 s here), so a signal during start-up is not fatal either.
"""

from __future__ import annotations

import signal
import time
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
