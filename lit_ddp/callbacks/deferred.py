"""A small flag agreed across ranks in a non-blocking collective, read one step after it was sent."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist


class DeferredFlag:
    """One int32 value that every rank sends after an optimizer step and reads after the next one.

    :meth:`start` launches the collective (``"max"``: an all-reduce MAX of every rank's value; ``"broadcast"``:
    rank zero's value) with ``async_op=True`` and returns at once; :meth:`result` waits for the one in flight,
    which by then has had a whole step to finish, so no step waits for the agreement. Every rank must call
    :meth:`start` at the same steps. One process (no process group): the value is the local one.
    torch.distributed does the work; this keeps the work handle and its tensor together.

    Args:
        op: ``"max"`` or ``"broadcast"`` (from rank zero).
    """

    def __init__(self, op: Literal["max", "broadcast"]) -> None:
        if op not in ("max", "broadcast"):
            raise ValueError(f"op={op!r} must be 'max' or 'broadcast'")
        self.op = op
        self._in_flight: tuple[Any, torch.Tensor] | None = None  # (work or None, the tensor it fills)

    def start(self, value: int, device: torch.device, world_size: int) -> None:
        """Sends ``value`` (replacing an unread one, which the caller must have read with :meth:`result`)."""
        flag = torch.tensor([value], dtype=torch.int32, device=device)
        work = None
        if dist.is_available() and dist.is_initialized() and world_size > 1:
            if self.op == "max":
                work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
            else:
                work = dist.broadcast(flag, src=0, async_op=True)
        self._in_flight = (work, flag)

    def result(self) -> int | None:
        """The agreed value of the collective in flight (waiting for it), or None when none is in flight."""
        if self._in_flight is None:
            return None
        work, flag = self._in_flight
        self._in_flight = None
        if work is not None:
            work.wait()
        return int(flag.item())
