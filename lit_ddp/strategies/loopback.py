"""A run on one machine listens on loopback only.

torch's ``init_process_group`` (which Lightning calls) has rank zero start a TCPStore server that binds every
interface of the host, even when ``MASTER_ADDR`` is ``127.0.0.1``, and gloo picks the address the host name
resolves to for its connections between ranks: other machines on the network could reach both, though nothing a
one-machine run does needs them to (torch's store and collectives trust whoever connects). When a run is on one
machine (one node, ``MASTER_ADDR`` a loopback address or unset), :func:`init_process_group` creates the default
process group itself, before Lightning would: the store listens on a socket bound to ``127.0.0.1`` and handed to
torch (TCPStore's ``master_listen_fd``), and gloo and NCCL use the loopback interface (``GLOO_SOCKET_IFNAME``,
``NCCL_SOCKET_IFNAME``, unless set). Runs over several machines keep torch's binding (docs/security.md says which
ports). Lightning's strategies pass no store or bind address to torch, so the strategies create the group here.

Under torchrun the store is its agent's (torch's; docs/security.md); a one-machine torchrun job still gets the
loopback interface for gloo and NCCL.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import MutableMapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed.constants import default_pg_timeout

from lit_ddp import compat

LOOPBACK = "127.0.0.1"
_lightning_log = logging.getLogger("lightning.fabric.utilities.distributed")  # where Lightning logs the same lines


def is_loopback(address: str | None) -> bool:
    """Whether ``address`` (a host name or an IP address) is this machine's loopback; None (unset) counts as
    loopback (Lightning's default ``MASTER_ADDR`` is ``127.0.0.1``). A name that does not resolve is not."""
    if not address:
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(address, None)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux), or None where there is none by that name."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return "lo" if "lo" in names else None


def use_loopback_interface(env: MutableMapping[str, str] | None = None) -> None:
    """Sets ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` to the loopback interface where the user set neither."""
    env = os.environ if env is None else env
    name = loopback_interface()
    if name is not None:
        env.setdefault("GLOO_SOCKET_IFNAME", name)
        env.setdefault("NCCL_SOCKET_IFNAME", name)


def on_one_machine(strategy: Any, env: MutableMapping[str, str] | None = None) -> bool:
    """Whether the strategy's job runs on this machine alone: one node, and the main address loopback."""
    env = os.environ if env is None else env
    if getattr(strategy, "num_nodes", 1) != 1:
        return False
    if "TORCHELASTIC_RUN_ID" in env and env.get("LOCAL_WORLD_SIZE") != env.get("WORLD_SIZE"):
        return False
    cluster = strategy.cluster_environment
    return cluster is not None and is_loopback(cluster.main_address)


def store(
    port: int,
    world_size: int | None,
    is_master: bool,
    timeout: timedelta | None = None,
    multi_tenant: bool = False,
    wait_for_workers: bool = True,
    host: str = LOOPBACK,
) -> dist.TCPStore:
    """torch's TCPStore on ``host:port`` (default ``127.0.0.1``; port 0: a free one, then ``store.port``); the server
    side listens there only (a socket bound here and handed to torch, which would otherwise bind every interface).

    Raises:
        OSError: the port is taken (the store's server side).
    """
    timeout = default_pg_timeout if timeout is None else timeout
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout)
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    port = listener.getsockname()[1]
    # The store owns the descriptor from here on (a closed Python socket would close it under torch).
    return dist.TCPStore(
        host,
        port,
        world_size,
        True,
        timeout,
        wait_for_workers=wait_for_workers,
        multi_tenant=multi_tenant,
        master_listen_fd=listener.detach(),
    )


def init_process_group(strategy: Any) -> bool:
    """Creates the default process group for a one-machine run on loopback (:func:`on_one_machine`), as
    Lightning's strategy would create it otherwise (its backend, ranks and timeout); returns whether it did.
    Does nothing where a process group exists, under torchrun (its agent's store), or for runs over several
    machines. Every rank of the job calls it, from the strategy's ``setup_environment``.
    """
    if not (dist.is_available() and on_one_machine(strategy)) or dist.is_initialized():
        return False
    use_loopback_interface()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return False
    strategy.set_world_ranks()
    cluster = strategy.cluster_environment
    rank, world_size, port = strategy.global_rank, strategy.world_size, cluster.main_port
    backend = compat.process_group_backend(strategy)
    timeout = compat.strategy_timeout(strategy)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = LOOPBACK, str(port)  # as Lightning sets them
    # Lightning's own lines, which operators and log readers look for ("Starting with N processes").
    _lightning_log.info(f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{world_size}")
    device = strategy.root_device
    dist.init_process_group(
        backend,
        store=store(port, world_size, rank == 0, timeout),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    if backend == "nccl":  # as Lightning registers it: torch warns about a group not destroyed at exit
        import atexit

        atexit.register(_destroy)
    rank_zero_info(
        f"{'-' * 100}\ndistributed_backend={backend} (on loopback: {LOOPBACK}:{port})\n"
        f"All distributed processes registered. Starting with {world_size} processes\n{'-' * 100}\n"
    )
    return True


def _destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
