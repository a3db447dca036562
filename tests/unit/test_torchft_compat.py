"""lit_ddp.compat.torchft: torchft's DDP hook dies on a failed all-reduce, ours returns a completed future; the
torchft fragment without torchft is refused in one line."""

from __future__ import annotations

import sys

import pytest
import torch

from lit_ddp import compat
from lit_ddp.errors import UsageError


def test_stock_hook_still_asserts_on_a_failed_allreduce() -> None:
    """Fails once torchft's own hook survives a peer dying mid all-reduce: lit_ddp's hook can then go."""
    pytest.importorskip("torchft")
    assert not compat.stock_hook_survives_failed_allreduce()


def test_our_hook_returns_the_bucket_when_the_allreduce_failed() -> None:
    pytest.importorskip("torchft")
    from torchft.manager import _ManagedWork

    class Failed(torch.distributed._Work):
        def wait(self, timeout: object = None) -> bool:
            raise RuntimeError("Connection closed by peer")

    class Manager:
        errored: Exception | None = None

        class _logger:  # noqa: N801
            @staticmethod
            def exception(msg: str) -> None:
                pass

        def report_error(self, e: Exception) -> None:
            self.errored = e

        def allreduce(self, tensor: torch.Tensor) -> _ManagedWork:
            return _ManagedWork(self, Failed(), tensor)

    manager, grads = Manager(), torch.arange(4.0)
    bucket = type("Bucket", (), {"buffer": lambda self: grads})()
    fut = compat.comm_hook(manager, bucket)  # type: ignore[arg-type]
    assert fut.done() and fut.value() is grads
    assert isinstance(manager.errored, RuntimeError)  # should_commit() will say False


def test_without_torchft_the_fragment_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from lit_ddp.ft import strategy

    monkeypatch.setitem(sys.modules, "torchft", None)  # `import torchft` raises ImportError
    with pytest.raises(UsageError, match=r"\.\[torchft\]") as refused:
        strategy.TorchFTStrategy()
    assert "\n" not in str(refused.value)
