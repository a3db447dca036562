"""How a failure reaches the user: once, from the rank it happened on, with its cause in the last lines.

- Before any process starts (parsing, :mod:`lit_ddp.preflight`, instantiation), a mistake is the same on every
  rank: one ``lit-ddp: error: ...`` line from rank zero, exit status 2.
- Once ``fit`` runs, the rank that raised prints its own message, tagged with its rank and host: a known
  user-facing error (a bad value, a bad data file, a non-finite loss) as one line; anything else with its
  traceback first and the one-line summary last. Exit status 1 (2 for bad values).
- A rank that only sees its connection to another rank break (gloo "Connection closed by peer", NCCL's
  remote-process errors) says so in one line instead of a traceback of its own, and exits 1 at once: the
  rank that failed has printed the cause. No rank waits for the collective timeout.
- A preemption stop prints one line from rank zero and exits ``128 + signum``.

``LIT_DDP_DEBUG=1`` lets every exception through unchanged.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

from lightning.fabric.utilities.exceptions import MisconfigurationException

from lit_ddp.callbacks.finite_loss import NonFiniteLossError
from lit_ddp.callbacks.preemption import Preempted
from lit_ddp.checkpointing import NoValidCheckpointError, ResumePointError
from lit_ddp.preflight import UsageError

USAGE_EXIT_CODE = 2
FAILURE_EXIT_CODE = 1
USAGE_ERRORS = (
    UsageError,
    ResumePointError,
    MisconfigurationException,
    ValueError,
    FileNotFoundError,
    IsADirectoryError,
)
FAILURES = (NonFiniteLossError, NoValidCheckpointError)
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
        release_process_group()
        if _rank() == 0:
            print(f"lit-ddp: {e}", file=sys.stderr, flush=True)
        raise SystemExit(128 + e.signum) from None
    except BaseException as e:  # noqa: BLE001 - every failure gets a message and a status
        if isinstance(e, SystemExit | KeyboardInterrupt):
            raise
        if not _state["running"]:
            if isinstance(e, USAGE_ERRORS + FAILURES):
                _exit_once(e, FAILURE_EXIT_CODE if isinstance(e, FAILURES) else USAGE_EXIT_CODE)
            raise
        _exit_from_rank(e)


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
    """Before launch every rank has the same error: rank zero prints it."""
    if _rank() == 0:
        print(f"lit-ddp: error: {_message(e)}", file=sys.stderr)
        print("(set LIT_DDP_DEBUG=1 for the full traceback)", file=sys.stderr)
        sys.stderr.flush()
    raise SystemExit(code)


def is_peer_lost(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) says that another rank's process went away."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if any(pattern in str(e) for pattern in PEER_LOST):
            return True
        e = e.__cause__ or e.__context__
    return False


def _exit_from_rank(e: BaseException) -> NoReturn:
    where = f"rank {_rank()} on {socket.gethostname()}"
    if is_peer_lost(e):
        print(
            f"lit-ddp: {where}: lost the connection to another rank, which stopped; its message names the cause",
            file=sys.stderr,
            flush=True,
        )
        os._exit(FAILURE_EXIT_CODE)  # nothing left to clean up that would not wait on the dead peer
    if isinstance(e, USAGE_ERRORS + FAILURES):
        message = _message(e)
        if not _same_as_rank_zero(message):
            print(f"lit-ddp: error: {where}: {message}", file=sys.stderr, flush=True)
        release_process_group()
        raise SystemExit(USAGE_EXIT_CODE if isinstance(e, USAGE_ERRORS) else FAILURE_EXIT_CODE)
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
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
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
