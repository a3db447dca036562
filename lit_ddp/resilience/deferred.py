"""A few small integers agreed across ranks in a non-blocking collective, read at a later step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist


class DeferredFlag:
    """Int32 values that every rank sends after an optimizer step and reads after a later one.

    :meth:`start` launches the collective (``"max"``: an elementwise all-reduce MAX of every rank's values;
    ``"broadcast"``: rank zero's values) with ``async_op=True`` and returns at once; :meth:`result` waits for
    the one in flight, which by then has had at least a whole step to finish, so no step waits for the
    agreement. Every rank must call :meth:`start` at the same steps. One process (no process group): the
    values are the local ones, kept on the host. torch.distributed does the work; this keeps the work handle and
    its tensor together. On CUDA the values go to the device from pinned memory without blocking, and come back
    through a pinned host copy queued behind the collective and an event: :meth:`result` waits for that event,
    i.e. for the step the collective was started in, never for the work queued since (reading the device tensor,
    ``.tolist()``, or making it with ``torch.tensor(..., device=cuda)``, would wait for all of it: a host sync).

    Args:
        op: ``"max"`` or ``"broadcast"`` (from rank zero).

    Raises:
        ValueError: another ``op``.
    """

    def __init__(self, op: Literal["max", "broadcast"]) -> None:
        if op not in ("max", "broadcast"):
            raise ValueError(f"op={op!r} must be 'max' or 'broadcast'")
        self.op = op
        # (work or None, the tensor it fills, the CUDA event after its host copy or None)
        self._in_flight: tuple[Any, torch.Tensor, Any] | None = None

    def start(self, values: int | Sequence[int], device: torch.device, world_size: int) -> None:
        """Sends ``values`` (replacing unread ones, which the caller must have read with :meth:`result`)."""
        flag = torch.tensor([values] if isinstance(values, int) else list(values), dtype=torch.int32)
        if not (dist.is_available() and dist.is_initialized() and world_size > 1):
            self._in_flight = (None, flag, None)  # one process: the values stay on the host
            return
        if device.type == "cuda":  # a blocking copy (torch.tensor(..., device=cuda)) would wait for the queue
            flag = flag.pin_memory().to(device, non_blocking=True)
        elif device.type != "cpu":
            flag = flag.to(device)
        if self.op == "max":
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        else:
            work = dist.broadcast(flag, src=0, async_op=True)
        event = None
        if flag.is_cuda:
            if work is not None:
                work.wait()  # NCCL: the current stream waits for the collective; the host does not
            work, flag = None, flag.to("cpu", non_blocking=True)  # pinned by the CUDA caching host allocator
            event = torch.cuda.Event()
            event.record()
        self._in_flight = (work, flag, event)

    def result(self) -> int | None:
        """The agreed (first) value of the collective in flight (waiting for it), or None when none is in flight."""
        values = self.results()
        return None if values is None else values[0]

    def results(self) -> list[int] | None:
        """The agreed values of the collective in flight (waiting for it), or None when none is in flight."""
        if self._in_flight is None:
            return None
        work, flag, event = self._in_flight
        self._in_flight = None
        if work is not None:
            work.wait()
        if event is not None:
            event.synchronize()
        return flag.tolist()
