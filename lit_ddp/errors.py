"""The errors lit-ddp reports itself: one line, no traceback, and the exit status each class carries.

Everything else keeps its traceback (:mod:`lit_ddp.launch.reporting`). Standard library only and importing
nothing of the package, so any layer can raise these without importing a layer above it.
"""

from __future__ import annotations

import signal


class LitDDPError(Exception):
    """A failure lit-ddp explains in one line; ``exit_code`` is the process's exit status."""

    exit_code = 1


class UsageError(LitDDPError, ValueError):
    """A value given on the command line, in a config or by the launcher is wrong; the message says what would
    be right. Exit status 2."""

    exit_code = 2


class ResumePointError(UsageError):
    """The ranks cannot all resume from the checkpoint rank zero chose (the run directory is not shared)."""


class NoValidCheckpointError(LitDDPError):
    """Checkpoints exist in the run directory but none of them can be read."""


class RestoreMismatchError(LitDDPError):
    """A resumed fit restored a state other than the one its checkpoint's digests record
    (:mod:`lit_ddp.resilience.restore_check`); it stops before its first step."""


class NonFiniteLossError(LitDDPError):
    """The training loss (or a parameter about to be checkpointed) became NaN or infinite."""


class Preempted(LitDDPError):
    """Training stopped at a step boundary after a preemption signal; the checkpoint is saved (and, under
    Slurm, the job requeued). Exit status ``128 + signum``, that of a process ended by the signal."""

    def __init__(self, signum: int, path: str, requeued: bool) -> None:
        self.signum, self.path, self.requeued = signum, path, requeued
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        action = "the job is requeued" if requeued else "re-run the same command to resume"
        super().__init__(f"stopped by {name} at a step boundary; saved {path}; {action}")
