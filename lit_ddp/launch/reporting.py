"""How a failure reaches the user: once, from the rank it happened on, with its cause in the last lines.

- Before any process starts (parsing, :mod:`lit_ddp.launch.preflight`, instantiation), a mistake is the same on every
  rank: one ``lit-ddp: error: ...`` line, from rank zero (under torchrun, from another rank if it is seconds
  ahead), exit status 2.
- Once ``fit`` runs, the rank that raised prints its own message, tagged with its rank and host: a
  :class:`~lit_ddp.errors.LitDDPError` (a non-finite loss, an unreadable resume point) or a bad value
  that lit_ddp's own checks found (a data file too short for ``block_size``) as one line; anything else, a
  ``ValueError`` from torch included, with its traceback first and the one-line summary last. Exit status:
  the error's ``exit_code`` (2 for bad values, 1 otherwise).
- A rank that only sees its connection to another rank break (gloo "Connection closed by peer", NCCL's
  remote-process errors) says so in one line instead of a traceback of its own, and exits 1: the rank that
  failed has printed the cause, or was killed. Under a single torchrun agent it first leaves the agent up to
  :data:`AGENT_GRACE` seconds to see the dead rank and stop this one, so that torchrun's report names the rank
  that died (``Signal 9 (SIGKILL)``), not the survivor. No rank waits for the collective timeout.
- A preemption stop prints one line from rank zero and exits ``128 + signum``.

``LIT_DDP_DEBUG=1`` lets every exception through unchanged.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

from lightning.fabric.utilities.exceptions import MisconfigurationException

import lit_ddp
from lit_ddp import compat
from lit_ddp.errors import LitDDPError, Preempted, UsageError

USAGE_EXIT_CODE = UsageError.exit_code
FAILURE_EXIT_CODE = LitDDPError.exit_code
# Errors of a bad value that a constructor (ours, Lightning's, jsonargparse's) raises while the config is
# instantiated, before any process starts; once training runs, only those raised by lit_ddp's own checks.
CONFIG_ERRORS = (MisconfigurationException, ValueError, FileNotFoundError, IsADirectoryError)
_PACKAGE_DIR = os.path.dirname(os.path.abspath(lit_ddp.__file__))
# torchrun reports the failure with the earliest time (in whole seconds; ties go to the lowest local_rank) among
# the workers found exited at one check (every --monitor-interval, 0.1 s): a survivor exiting in the check that
# finds a SIGKILLed peer was named as the root cause in its place. Only a single agent waits: with several, the
# dead rank may be another node's, which this agent never sees, and an agent whose workers stay alive restarts
# them for the other node's new round without counting a restart (torch's SimpleElasticAgent._invoke_run).
AGENT_GRACE = 5.0
ERROR_GRACE = 3.0  # seconds a rank other than zero leaves rank zero to report an error every rank meets
_TORCH_DIR = os.path.dirname(os.path.abspath(getattr(importlib.util.find_spec("torch"), "origin", None) or ""))
PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "NCCL communicator was aborted",
    "Connection refused",
)
_state = {"running": False}


def mark_running() -> None:
    """From now on failures are reported per rank (processes may have started)."""
    _state["running"] = True


def report(fn: Callable[[], Any]) -> Any:
    """Runs ``fn`` and turns what it raises into the messages and exit statuses described above.

    Raises:
        SystemExit: with the status for the failure.
    """
    _state["running"] = False  # each call (a test may make several in one process) starts before launch
    if os.environ.get("LIT_DDP_DEBUG"):
        return fn()
    try:
        result = fn()
        release_process_group()
        return result
    except Preempted as e:
        # Keep the status 128 + signum (slurm/train.sbatch requeues on it): once a rank has exited, srun
        # --kill-on-bad-exit SIGTERMs the others, still on their way out, which would end them with 143.
        with contextlib.suppress(ValueError):  # not the main thread: nothing to keep
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        release_process_group()
        if _rank() == 0:
            print(f"lit-ddp: {e}", file=sys.stderr, flush=True)
        raise SystemExit(e.exit_code) from None
    except BaseException as e:  # noqa: BLE001 - every failure gets a message and a status
        if isinstance(e, SystemExit | KeyboardInterrupt):
            raise
        if not _state["running"]:
            if isinstance(e, (LitDDPError, *CONFIG_ERRORS)):
                _exit_once(e, exit_code(e))
            raise
        _exit_from_rank(e)


def exit_code(e: BaseException) -> int:
    """The exit status for ``e``: its own for :class:`LitDDPError`, 2 for a bad configured value, else 1."""
    if isinstance(e, LitDDPError):
        return e.exit_code
    return USAGE_EXIT_CODE if isinstance(e, CONFIG_ERRORS) else FAILURE_EXIT_CODE


def is_explained(e: BaseException) -> bool:
    """Whether ``e`` is printed as one line: a :class:`LitDDPError`, or a bad value that lit_ddp's own argument
    checks raised (its innermost frame is in this package). A ``ValueError`` from torch or another library
    keeps its traceback: it is a failure, not a mistake in the input."""
    if isinstance(e, LitDDPError):
        return True
    if not isinstance(e, ValueError | FileNotFoundError | IsADirectoryError):
        return False
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep)


def _rank() -> int:
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return int(getattr(rank_zero_only, "rank", 0) or 0)


def _message(e: BaseException) -> str:
    """The user's part of an error: jsonargparse wraps an ``__init__``'s ValueError in a report listing every
    subtype of the ``model`` / ``data`` union it tried; keep only the reasons that are not about ``None``."""
    text = str(e)
    if "Does not validate against any of the Union subtypes" in text:
        reasons = [
            line.strip()[2:] for line in text.splitlines() if line.strip().startswith("- ") and "NoneType" not in line
        ]
        if reasons:
            return "; ".join(reasons)
    return text


def _exit_once(e: BaseException, code: int) -> NoReturn:
    """Before launch every rank meets the same error: rank zero prints it at once. Under torchrun another rank
    first waits :data:`ERROR_GRACE` seconds, in which torchrun stops it once rank zero has exited, and prints it
    itself when rank zero is slower (stuck, or still importing): a rank exiting first in silence would have
    torchrun stop the group before rank zero printed anything. Under srun the other ranks stay silent (a bare
    ``srun`` does not stop them when rank zero exits: they would print it again)."""
    if _rank() != 0:
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            raise SystemExit(code)
        time.sleep(ERROR_GRACE)
    print(f"lit-ddp: error: {_message(e)}", file=sys.stderr)
    print("(set LIT_DDP_DEBUG=1 for the full traceback)", file=sys.stderr)
    sys.stderr.flush()
    raise SystemExit(code)


def is_peer_lost(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) is torch's report that another rank's process went away: a
    ``torch.distributed`` error, or one raised inside torch (gloo's errors surface in DDP's backward), whose
    message says a connection was lost. A lost connection of anything else (an HTTP download in
    ``prepare_data``, an s3fs write) is a failure of this rank, reported with its traceback."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if any(pattern in str(cur) for pattern in PEER_LOST) and _raised_by_torch(cur):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _raised_by_torch(e: BaseException) -> bool:
    """A ``torch.distributed`` error, or a non-OS error whose innermost frame is torch's or one of our own
    collectives' (a C++ backend error surfaces at the Python call into it)."""
    import torch.distributed as dist

    if isinstance(e, dist.DistError):
        return True
    if isinstance(e, OSError):  # sockets, HTTP and object stores raise OSErrors; torch's backends do not
        return False
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = os.path.abspath(tb.tb_frame.f_code.co_filename) if tb is not None else ""
    return where.startswith((_TORCH_DIR + os.sep, os.path.join(_PACKAGE_DIR, "resilience") + os.sep))


def _exit_from_rank(e: BaseException) -> NoReturn:
    where = f"rank {_rank()} on {socket.gethostname()}"
    if is_peer_lost(e):
        print(
            f"lit-ddp: {where}: lost the connection to another rank, which stopped: its own lit-ddp message names "
            "the cause, or, with none, it was killed (SIGKILL, out of memory; the launcher's report names it)",
            file=sys.stderr,
            flush=True,
        )
        if os.environ.get("GROUP_WORLD_SIZE") == "1":  # one torchrun agent: let it find the dead rank first
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(AGENT_GRACE)
        compat.exit_now(FAILURE_EXIT_CODE)  # nothing left to clean up that would not wait on the dead peer
    if is_explained(e):
        message = _message(e)
        if not _same_as_rank_zero(message):
            print(f"lit-ddp: error: {where}: {message}", file=sys.stderr, flush=True)
        release_process_group()
        raise SystemExit(exit_code(e))
    release_process_group()
    traceback.print_exception(e, file=sys.stderr)
    print(f"lit-ddp: error: {where} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    raise SystemExit(FAILURE_EXIT_CODE)


def _same_as_rank_zero(message: str, timeout: float = 3.0) -> bool:
    """Whether rank zero failed with this very message, so this rank need not print it again.

    An error that every rank meets alike (a data file too short for ``block_size``, a non-finite loss) would
    otherwise print once per rank. Rank zero posts its message on the process group's store and waits up to
    ``timeout`` seconds (the store may live in its process) for the other ranks to read it; any other rank
    waits up to ``timeout`` seconds for it and stays quiet only when it is identical. A rank that fails alone,
    or a store that cannot be reached, prints as before. Our own: Lightning and torch have no such exchange.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return False
    key = "lit_ddp/error/rank0"
    try:
        store = compat.default_store()
        if dist.get_rank() == 0:
            store.set(key, message)
            deadline = time.monotonic() + timeout
            while store.add(key + "/read", 0) < dist.get_world_size() - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            return False
        store.wait([key], timedelta(seconds=timeout))
        same = store.get(key).decode() == message
        store.add(key + "/read", 1)
        return same
    except Exception:  # noqa: BLE001 - no answer in time: print
        return False


def release_process_group() -> None:
    """Destroys the default process group, if any, before the interpreter exits.

    A process that exits with a live gloo group can abort in its C++ destructors ("terminate called without
    an active exception", SIGABRT) after torchrun restarts, turning a finished run into a failed one.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # A broken group cannot be destroyed cleanly; exiting is what is left then.
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


# Lines other libraries print on every command that say nothing about the run: advertisements, deprecations
# inside Lightning's and torchdata's own code, and Lightning's srun hint on any machine where srun exists
# (preflight checks the launch instead).
NOISE_WARNINGS = (
    r".*isinstance\(treespec, LeafSpec\)",  # Lightning's utilities/_pytree.py on torch >= 2.10
    r".*set_vital",  # torchdata's StatefulDataLoader
    r"The `srun` command is available on your system but is not used",
)
NOISE_INFO_PREFIX = "💡 Tip:"  # Lightning's litlogger / litmodels advertisements


def silence_library_noise() -> None:
    """Drops :data:`NOISE_WARNINGS` and Lightning's advertisements from this process's output."""
    import logging
    import warnings

    for pattern in NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: not str(record.getMessage()).startswith(NOISE_INFO_PREFIX)
    )
