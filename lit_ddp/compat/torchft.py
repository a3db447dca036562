"""torchft's DDP wrapper and checkpoint transport: a replica group whose peer dies in the middle of the cross-group
all-reduce keeps training instead of crashing (:func:`fault_tolerant_ddp`), and a healing group loads its peer's state
weights-only (:func:`weights_only_transport`).

torchft's ``DistributedDataParallel`` (0.2.0) averages each gradient bucket across replica groups in a
communication hook, ``torchft.ddp.DistributedDataParallel._comm_hook``: it waits on ``Manager.allreduce``'s work and
returns the private future under torchft's ``_ManagedFuture`` (``assert fut._fut``). When the all-reduce fails
(gloo's "Connection closed by peer": a peer group SIGKILLed mid-step), ``_ManagedWork.wait`` records the error on the
manager and returns, and the future under the managed one is never set: the assert fails inside the backward pass,
and the survivor's process dies with the peer. :func:`fault_tolerant_ddp` installs a hook that returns a completed
future holding the bucket instead; the error stays recorded on the manager, so ``should_commit()`` is False and the
step's gradients are discarded, as torchft intends. No upstream issue or pull request was found for it (searched
2026-11: torchft issues, "ddp comm hook assert fut._fut"); it is known on torchft 0.2.0, and the hook mends only a
future that is missing, so it does nothing once torchft sets one. ``tests/unit/test_torchft_compat.py`` shows
whether the stock hook still fails (:func:`stock_hook_survives_failed_allreduce`).

torchft is an optional extra (``pip install -e ".[torchft]"``): it is imported inside the functions, never here.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch
from torch import nn

from lit_ddp.compat.imports import private


def comm_hook(manager: Any, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The gradient bucket averaged across the replica groups of the quorum through ``manager`` (a torchft
    ``Manager``), as torchft's own hook, except that a failed all-reduce yields a completed future holding the bucket
    as it is (the step is then not committed: the manager has the error) instead of an ``AssertionError``."""
    work = manager.allreduce(bucket.buffer())
    work.wait()  # on failure: records the error on the manager, returns False
    fut = work.get_future()
    inner = getattr(fut, "_fut", fut)  # torchft's _ManagedFuture keeps the chain's torch future in `_fut`
    if inner is None:
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
    return inner


# torch checks a hook's annotations (DistributedDataParallel._check_comm_hook) as objects, not as the strings
# `from __future__ import annotations` leaves.
comm_hook.__annotations__["bucket"] = torch.distributed.GradBucket
comm_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def fault_tolerant_ddp(manager: Any, module: nn.Module) -> nn.Module:
    """``module`` wrapped in torchft's ``DistributedDataParallel`` (gradients averaged across replica groups through
    ``manager`` in a communication hook) with :func:`comm_hook` in place of torchft's.

    Raises:
        ImportError: torchft is not installed.
    """
    torchft_ddp = private("torchft.ddp", "DistributedDataParallel")

    class _DistributedDataParallel(torchft_ddp):  # type: ignore[misc, valid-type]
        _comm_hook = staticmethod(comm_hook)  # torchft's __init__ registers self._comm_hook

    return _DistributedDataParallel(manager, module)


def stock_hook_survives_failed_allreduce() -> bool:
    """Whether torchft's own DDP communication hook returns a future when the all-reduce under it fails (the bug
    :func:`comm_hook` works around is then fixed): it is run on a bucket whose all-reduce work fails to wait, as
    gloo's does when a peer dies."""
    import torch.distributed as dist
    from torchft.ddp import DistributedDataParallel
    from torchft.manager import _ManagedWork

    class FailedWork(dist._Work):
        def wait(self, timeout: Any = None) -> bool:
            raise RuntimeError("Connection closed by peer")

        def get_future(self) -> torch.futures.Future[Any]:
            fut: torch.futures.Future[Any] = torch.futures.Future()
            fut.set_exception(RuntimeError("Connection closed by peer"))
            return fut

    class Manager:
        """What ``_ManagedWork`` and the hook ask of torchft's Manager."""

        errored: Exception | None = None

        class _logger:  # noqa: N801 (torchft's attribute name)
            @staticmethod
            def exception(msg: str) -> None:
                pass

        def report_error(self, e: Exception) -> None:
            self.errored = e

        def wrap_future(self, fut: Any, default: Any, timeout: Any = None) -> Any:
            return fut

        def allreduce(self, tensor: torch.Tensor) -> Any:
            work = _ManagedWork(self, FailedWork(), tensor)
            work.get_future().then(lambda f: f.value())
            return work

    bucket = type("Bucket", (), {"buffer": lambda self: torch.zeros(4)})()
    try:
        DistributedDataParallel._comm_hook(Manager(), bucket)
    except AssertionError:
        return False
    return True


def weights_only_transport() -> None:
    """Makes torchft's HTTP checkpoint transport read a peer's state weights-only (tensors and plain data). torchft
    0.2.0's ``HTTPTransport.recv_checkpoint`` (its ``_load_from_address``) calls torch's private
    ``_streaming_load(f, weights_only=False)``, a plain
    unpickle of whatever answers at the address the quorum gives (``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` does not reach it:
    it is not ``torch.load``); the state a lit-ddp group sends (:class:`lit_ddp.ft.heal.PeerState`) is tensors and
    plain data. Idempotent; :func:`transport_loads_weights_only` shows whether torchft still asks for pickles.
    """
    module: Any = importlib.import_module("torchft.checkpointing.http_transport")
    load = module._streaming_load
    if getattr(load, "lit_ddp_weights_only", False):
        return

    def weights_only(f: Any, *args: Any, weights_only: bool = True, **kwargs: Any) -> Any:
        return load(f, *args, weights_only=True, **kwargs)

    weights_only.lit_ddp_weights_only = True  # type: ignore[attr-defined]
    module._streaming_load = weights_only


def transport_loads_weights_only() -> bool:
    """Whether torchft's own HTTP transport loads weights-only (then :func:`weights_only_transport` is no longer
    needed): read from the source of the module that loads a peer's answer."""
    module = importlib.import_module("torchft.checkpointing.http_transport")
    return "weights_only=False" not in inspect.getsource(module)
