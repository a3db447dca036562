"""The errors lit-ddp reports itself: one line, no traceback, and the exit status each class carries.

Everything else keeps its traceback (:mod:`lit_ddp.launch.reporting`). Standard library only and importing
nothing of the package, so any layer can raise these without importing a layer above it; for the same reason the
one parse of an integer environment variable, :func:`int_from_env`, is here: its error names the variable.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping


class LitDDPError(Exception):
    """A failure lit-ddp explains in one line; ``exit_code`` is the process's exit status."""

    exit_code = 1


class UsageError(LitDDPError, ValueError):
    """A value given on the command line, in a config or by the launcher is wrong; the message says what would
    be right. Exit status 2."""

    exit_code = 2


BAD_USE_FILE_ENV = "LIT_DDP_BAD_USE_FILE"
"""Names a file that ``lit-ddp`` creates when it exits for bad use (:class:`UsageError`'s status), for a launcher
that sees only torchrun's status (1 for any failure) and must not start a bad command again."""


class ResumePointError(UsageError):
    """The ranks cannot all resume from the checkpoint rank zero chose (the run directory is not shared)."""


class NoValidCheckpointError(LitDDPError):
    """Checkpoints exist in the run directory but none of them can be read."""


class DamagedCheckpointError(UsageError):
    """A checkpoint's bytes do not match the digest written with them (a bit changed on a disk, a file system or in a
    copy since it was saved): the message names the file and the tensor or record that differs. Nothing of it is
    used; exit status 2, as for any checkpoint that cannot be loaded."""


class ReplicaMismatchError(LitDDPError):
    """Under DDP the ranks' parameters or optimizer states, which must be bit-identical, differ
    (:mod:`lit_ddp.resilience.replica_check`): a device or its memory changed one of them. Training stops before
    another checkpoint is written; the last one saved before the difference is kept."""


class RestoreMismatchError(LitDDPError):
    """A resumed fit restored a state other than the one its checkpoint holds
    (:mod:`lit_ddp.resilience.restore_check`); it stops before its first step."""


class RunDirectoryNotWritable(LitDDPError):
    """A file of the run directory cannot be written (a read-only or full file system, a quota, no permission);
    what the run saved before is left as it was."""


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


def int_from_env(name: str, env: Mapping[str, str] | None = None, minimum: int = 0, meaning: str = "") -> int | None:
    """The environment variable ``name`` (of ``env``, default ``os.environ``) as an integer; None when it is unset.

    Args:
        name: the variable.
        env: the environment; defaults to ``os.environ``.
        minimum: the smallest value allowed.
        meaning: what the variable holds and who sets it, for the message.

    Raises:
        UsageError: it is set but not a whole number ``>= minimum`` (an empty value included), naming the variable
            and its value.
    """
    value = (os.environ if env is None else env).get(name)
    if value is None:
        return None
    try:
        number: int | None = int(value)
    except ValueError:
        number = None
    if number is None or number < minimum:
        what = f" ({meaning})" if meaning else ""
        raise UsageError(
            f"{name}={value!r} is not a whole number >= {minimum}{what}: unset it, or give it a number such as "
            f"{name}={minimum}"
        )
    return number
