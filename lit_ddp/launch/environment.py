"""What the launcher decides: under torchrun, the process layout comes from torchrun, not from the config."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from lightning.fabric.plugins.environments import TorchElasticEnvironment


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """``config[key]`` of a dict or a Namespace, else ``default``."""
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def leading_int(value: str | None) -> int | None:
    """The leading count of a Slurm task list such as ``2``, ``2(x3)`` or ``2,1``."""
    match = re.match(r"\s*(\d+)", value or "")
    return int(match.group(1)) if match else None


def devices_per_node(devices: Any) -> int | None:
    """``trainer.devices`` as a process count, or ``None`` where only the accelerator can tell (``auto``, -1)."""
    if isinstance(devices, list | tuple):
        return len(devices)
    if isinstance(devices, str):
        devices = devices.strip()
        if "," in devices:
            return len([d for d in devices.split(",") if d.strip()])
        if not re.fullmatch(r"\d+", devices):
            return None
        devices = int(devices)
    if isinstance(devices, int) and devices > 0:
        return devices
    return None


def follow_torchrun(trainer: Any, env: Mapping[str, str] | None = None) -> str | None:
    """Under torchrun, sets ``trainer.devices`` to the processes torchrun started on this node
    (``LOCAL_WORLD_SIZE``, its ``--nproc_per_node``) and ``trainer.num_nodes`` to the number of agents
    (``GROUP_WORLD_SIZE``, its ``--nnodes``) where the config says otherwise: the launcher decides the layout, as ``slurm/*.sbatch``
    pass Slurm's. A run started with ``--nproc_per_node 2`` therefore resumes under ``--nproc_per_node 1``
    with the same command (Lightning alone would raise that ``devices * num_nodes`` is not the world size).

    Args:
        trainer: the ``trainer`` section of the parsed config (a Namespace or a dict), changed in place.
        env: the environment; defaults to ``os.environ``.

    Returns:
        A line saying what changed, or None (not under torchrun, or the config already matches).
    """
    env = os.environ if env is None else env
    local, world = leading_int(env.get("LOCAL_WORLD_SIZE")), leading_int(env.get("WORLD_SIZE"))
    if "TORCHELASTIC_RUN_ID" not in env or not local or not world:
        return None
    changes = []
    devices = config_value(trainer, "devices")
    if devices_per_node(devices) != local:  # "auto" and -1 count here: only torchrun knows
        changes.append(f"trainer.devices={devices} -> {local}")
        _set(trainer, "devices", local)
    nodes = leading_int(env.get("GROUP_WORLD_SIZE")) or max(1, world // local)  # agents: one per node
    if int(config_value(trainer, "num_nodes", 1) or 1) != nodes:
        changes.append(f"trainer.num_nodes={config_value(trainer, 'num_nodes', 1)} -> {nodes}")
        _set(trainer, "num_nodes", nodes)
    if not changes:
        return None
    return f"torchrun started {local} process(es) per node on {nodes} node(s): " + ", ".join(changes)


def _set(config: Any, key: str, value: Any) -> None:
    if isinstance(config, dict):
        config[key] = value
    else:
        setattr(config, key, value)


class TorchrunEnvironment(TorchElasticEnvironment):
    """Lightning's environment for torchrun, also for nodes that run different numbers of processes.

    torchrun gives every worker its ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``, which Lightning's
    :class:`TorchElasticEnvironment` reads; but it also demands ``devices * num_nodes == WORLD_SIZE``, true only
    when every node runs as many processes. torchrun itself allows ``--nproc_per_node 2`` on one node and ``1`` on
    another (one job of 3, as the multinode tutorial runs 4 + 2 GPUs). Here ``devices`` must be this node's
    process count (``LOCAL_WORLD_SIZE``) and ``num_nodes`` the number of agents (``GROUP_WORLD_SIZE``), which
    :func:`follow_torchrun` sets. Ranks, shards and the gradient average come from the process group.

    Raises:
        ValueError: from :meth:`validate_settings`, when ``devices`` or ``num_nodes`` is not torchrun's.
    """

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        local = leading_int(os.environ.get("LOCAL_WORLD_SIZE")) or num_devices
        nodes = leading_int(os.environ.get("GROUP_WORLD_SIZE")) or num_nodes
        if (num_devices, num_nodes) != (local, nodes):
            raise ValueError(
                f"trainer.devices={num_devices} and trainer.num_nodes={num_nodes}, but torchrun started {local} "
                f"process(es) on this node and {nodes} node(s): use --trainer.devices {local} --trainer.num_nodes "
                f"{nodes}, or leave both to torchrun"
            )
