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


class _Payload:
    """Unpickled, it creates ``marker``: code from a peer's answer ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        import builtins

        return builtins.open, (self.marker, "w")


def test_a_peers_state_is_read_weights_only(tmp_path) -> None:
    """torchft's HTTP transport still unpickles a peer's answer (``weights_only=False``): the workaround stays needed;
    with it a pickle that would run code is refused and a state of tensors and plain data is read."""
    import io

    from torch.distributed._serialization import _streaming_save
    from torchft.checkpointing import http_transport

    assert not compat.transport_loads_weights_only(), "torchft reads weights-only now: drop weights_only_transport"
    compat.weights_only_transport()
    compat.weights_only_transport()  # idempotent
    marker = tmp_path / "MARKER"
    planted = io.BytesIO()
    _streaming_save({"step": 3, "payload": _Payload(str(marker))}, planted)
    planted.seek(0)
    with pytest.raises(Exception, match="Unsupported global"):
        http_transport._streaming_load(planted, weights_only=False)
    assert not marker.exists()
    good = io.BytesIO()
    _streaming_save({"step": 3, "w": torch.ones(2), "groups": [{"lr": 0.1}]}, good)
    good.seek(0)
    state = http_transport._streaming_load(good, weights_only=False)
    assert state["step"] == 3 and torch.equal(state["w"], torch.ones(2))
