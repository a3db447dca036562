"""torchft's DDP wrapper and manager server: a replica group whose peer dies in the middle of the cross-group
all-reduce keeps training instead of crashing (:func:`fault_tolerant_ddp`), and each group's manager server listens on
the group's own address instead of every interface (:func:`bind_manager_server`). (A healing group's transport is
lit-ddp's own, through torchft's public ``checkpoint_transport`` argument: :mod:`lit_ddp.ft.transport`.)

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


def bind_manager_server(host: str) -> None:
    """Makes torchft's manager server (the gRPC server a group's rank 0 runs: quorums, ``should_commit``, the heal
    source's address, and an unauthenticated ``Kill``) listen on ``host`` only. torchft 0.2.0's ``Manager.__init__``
    binds it to ``[::]:<port>``, every interface, and takes no bind address (only the ``hostname`` it advertises,
    which the strategy sets to ``host`` too); no upstream issue or pull request about it was found (searched
    2026-12: torchft issues, "manager bind", "authentication"). Patched: the ``ManagerServer`` name
    ``torchft.manager`` calls, with the bind's host replaced by ``host`` (the port kept). Idempotent; the last
    ``host`` given wins (one group per process). :func:`manager_binds_every_interface` shows whether torchft still
    binds ``[::]``.

    Raises:
        ImportError: torchft is not installed.
    """
    module: Any = importlib.import_module("torchft.manager")
    global _manager_host
    _manager_host = host
    if getattr(module.ManagerServer, "lit_ddp_bound", False):
        return
    server = module.ManagerServer

    def bound(*args: Any, bind: str, **kwargs: Any) -> Any:
        port = bind.rsplit(":", 1)[1]
        host = f"[{_manager_host}]" if ":" in _manager_host else _manager_host
        return server(*args, bind=f"{host}:{port}", **kwargs)

    bound.lit_ddp_bound = True  # type: ignore[attr-defined]
    module.ManagerServer = bound


_manager_host = "127.0.0.1"


def manager_binds_every_interface() -> bool:
    """Whether torchft's ``Manager`` still binds its server to every interface (``[::]``), which
    :func:`bind_manager_server` undoes: read from the source of ``Manager.__init__``."""
    manager = importlib.import_module("torchft.manager")
    return 'bind = f"[::]:{port}"' in inspect.getsource(manager.Manager.__init__)
