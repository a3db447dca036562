"""lit_ddp.compat.torchft: torchft's DDP hook dies on a failed all-reduce, ours returns a completed future; torchft's
manager server binds every interface, ours the group's address; the torchft fragment without torchft is refused in
one line."""

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


def listening_addresses(port: int) -> list[str]:
    """The local addresses (hexadecimal, as /proc/net/tcp writes them) of the sockets listening on ``port``."""
    from pathlib import Path

    return [
        line.split()[1].rsplit(":", 1)[0]
        for name in ("/proc/net/tcp", "/proc/net/tcp6")
        if Path(name).exists()
        for line in Path(name).read_text().splitlines()[1:]
        if line.split()[3] == "0A" and int(line.split()[1].rsplit(":", 1)[1], 16) == port
    ]


def test_the_manager_server_listens_on_the_groups_address_only() -> None:
    """torchft 0.2.0's Manager still binds its server to every interface (``[::]``, which answers an unauthenticated
    ``Kill``): the workaround stays needed; with it the server a Manager starts listens on 127.0.0.1 alone."""
    pytest.importorskip("torchft")
    from datetime import timedelta

    import torchft.manager
    from torchft.coordination import LighthouseServer

    from lit_ddp.strategies import loopback

    assert compat.manager_binds_every_interface(), "torchft binds its manager server elsewhere now: see compat"
    compat.bind_manager_server("127.0.0.1")
    compat.bind_manager_server("127.0.0.1")  # idempotent
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    store = loopback.store(0, None, True, wait_for_workers=False)
    server = torchft.manager.ManagerServer(
        replica_id="group_0", lighthouse_addr="http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1],
        hostname="127.0.0.1", bind="[::]:0", store_addr=f"127.0.0.1:{store.port}", world_size=1,
        heartbeat_interval=timedelta(milliseconds=100), connect_timeout=timedelta(seconds=5), quorum_retries=0,
    )  # fmt: skip
    try:
        port = int(server.address().rsplit(":", 1)[1])
        assert server.address() == f"http://127.0.0.1:{port}"
        assert listening_addresses(port) == ["0100007F"], listening_addresses(port)
    finally:
        server.shutdown()
        lighthouse.shutdown()
