"""What the launcher decides: under torchrun, the process layout comes from torchrun, not from the config; under srun,
each task's GPU comes from what Slurm lets it see, and each job step's main port from its job and step ids."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch.accelerators import CUDAAccelerator

from lit_ddp.errors import UsageError


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


SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 10000  # Lightning's range for MASTER_PORT under Slurm: 15000-24999
STEP_STRIDE = 7919  # a prime: (job + STRIDE x step) mod SPAN differs for every two steps of one job


def step_port(env: Mapping[str, str], base: int = SLURM_PORT_BASE, span: int = SLURM_PORT_SPAN) -> int | None:
    """The port of this Slurm job step: ``base + (job id + 7919 x step id) mod span``, or None outside a job.

    Lightning's ``SLURMEnvironment`` takes ``15000 + the last 4 digits of the job id``: every step of one job gets
    the same port, so a second ``srun`` of the job on the same node (two trainings side by side in one allocation)
    finds the first one's store. Here the step id counts too: no two steps of one job (fewer than ``span`` apart)
    share a port, and step 0 of two jobs collides only where Lightning's rule collides (ids ``span`` apart).
    ``slurm/train_elastic.sbatch`` puts torchrun's rendezvous on ``25000 + (...) mod 5000`` by the same rule.
    """
    job = leading_int(env.get("SLURM_JOB_ID"))
    if job is None:
        return None
    step = leading_int(env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))) or 0  # the batch step has none
    return base + (job + STEP_STRIDE * step) % span


def follow_slurm_port(env: MutableMapping[str, str] | None = None) -> str | None:
    """In an srun step whose ``MASTER_PORT`` is not set, sets it to :func:`step_port` for Lightning's
    ``SLURMEnvironment`` to read; returns a line saying so, or None (not in a step, or set already)."""
    env = os.environ if env is None else env
    if "MASTER_PORT" in env or not ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        return None
    port = step_port(env)
    if port is None:
        return None
    env["MASTER_PORT"] = str(port)
    return (
        f"MASTER_PORT={port}: Slurm job {env['SLURM_JOB_ID']}, step {env.get('SLURM_STEP_ID', env.get('SLURM_STEPID'))}"
    )


def _expand_counts(value: str | None) -> list[int]:
    """A Slurm per-node list such as ``2(x3),1`` expanded: ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for count, times in re.findall(r"(\d+)(?:\(x(\d+)\))?", value or ""):
        counts += [int(count)] * int(times or 1)
    return counts


@dataclass(frozen=True)
class SlurmTask:
    """What an srun task is given, and the CUDA device lit-ddp trains it on.

    Attributes:
        global_rank, local_rank, node_rank, world_size: ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``,
            ``SLURM_NTASKS`` (Lightning's ``SLURMEnvironment`` reads the same).
        tasks_on_node: the step's tasks on this node (``SLURM_STEP_TASKS_PER_NODE`` at this node's index).
        visible: the GPUs this task may use, as ``CUDA_VISIBLE_DEVICES`` lists them (None: unset, every GPU of the
            machine; empty: none).
        device: the CUDA index, in this process's numbering, it trains on; None without a GPU.
        bound: True where Slurm bound one GPU to each task (``--gpus-per-task=1``, ``--gpu-bind=single:1``) and
            the node runs several: Lightning's ``cuda:LOCAL_RANK`` would not exist, the task's GPU is ``cuda:0``.
    """

    global_rank: int
    local_rank: int
    node_rank: int
    world_size: int
    tasks_on_node: int
    visible: tuple[str, ...] | None
    device: int | None
    bound: bool


def slurm_task(env: Mapping[str, str] | None = None) -> SlurmTask | None:
    """This srun task's ranks and device (:class:`SlurmTask`), derived from its environment; None outside a step.

    A node's tasks see its GPUs in one of two ways: all of them (``--gres=gpu:N``: each task's
    ``CUDA_VISIBLE_DEVICES`` lists the node's N, and task ``LOCAL_RANK`` takes ``cuda:LOCAL_RANK``, as Lightning
    does), or one each (``--gpus-per-task=1``: ``CUDA_VISIBLE_DEVICES`` names the task's own, ``0`` or ``1``...,
    which the process sees as ``cuda:0``). The second is a site's binding (the GPU nearest the task's cores), kept
    as given.

    Raises:
        UsageError: a task that sees more than one GPU but fewer than its node's tasks (``--gpus-per-task=2``):
            one GPU per task is what DDP here runs.
    """
    env = os.environ if env is None else env
    if not ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env) or "SLURM_PROCID" not in env:
        return None
    local_rank = leading_int(env.get("SLURM_LOCALID")) or 0
    node_rank = leading_int(env.get("SLURM_NODEID")) or 0
    per_node = _expand_counts(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE"))
    tasks_on_node = per_node[node_rank] if node_rank < len(per_node) else 1
    raw = env.get("CUDA_VISIBLE_DEVICES")
    visible = None if raw is None else tuple(d.strip() for d in raw.split(",") if d.strip())
    bound = visible is not None and len(visible) == 1 and tasks_on_node > 1
    if visible is not None and 1 < len(visible) < tasks_on_node:
        raise UsageError(
            f"Slurm task {local_rank} of {tasks_on_node} on this node sees {len(visible)} GPUs "
            f"(CUDA_VISIBLE_DEVICES={raw}): lit-ddp runs one GPU per task. Launch with --gpus-per-task=1, or "
            f"--gres=gpu:{tasks_on_node} for every task to see all of the node's"
        )
    device = None if visible == () else 0 if visible is not None and len(visible) == 1 else local_rank
    return SlurmTask(
        global_rank=leading_int(env.get("SLURM_PROCID")) or 0,
        local_rank=local_rank,
        node_rank=node_rank,
        world_size=leading_int(env.get("SLURM_NTASKS")) or 1,
        tasks_on_node=tasks_on_node,
        visible=visible,
        device=device,
        bound=bound,
    )


class TaskGPUAccelerator(CUDAAccelerator):
    """Lightning's CUDA accelerator for srun tasks bound to one GPU each (``--gpus-per-task=1``).

    Lightning trains task ``LOCAL_RANK`` on ``cuda:LOCAL_RANK`` and checks that ``trainer.devices`` GPUs are
    visible; a bound task sees one, its own, as ``cuda:0``. This accelerator gives the strategy
    ``trainer.devices`` copies of ``cuda:0``: every task's root device (``parallel_devices[LOCAL_RANK]``) is its
    own GPU, while the process count per node (the sampler's replicas, ``SLURMEnvironment``'s check against
    ``--ntasks-per-node``) stays ``trainer.devices``. The CLI puts it in place of ``gpu`` / ``cuda`` (or ``auto``
    with a GPU) where :func:`slurm_task` says the task is bound (:func:`task_gpu_accelerator`).
    """

    @staticmethod
    def parse_devices(devices: int | str | list[int]) -> list[int]:
        count = devices_per_node(devices)
        return list(range(count if count is not None else 1))

    @staticmethod
    def get_parallel_devices(devices: list[int]) -> list[torch.device]:
        return [torch.device("cuda", 0) for _ in devices]


def task_gpu_accelerator(accelerator: Any, env: Mapping[str, str] | None = None) -> TaskGPUAccelerator | None:
    """:class:`TaskGPUAccelerator` where Slurm bound one GPU to each task (:func:`slurm_task`) and ``accelerator``
    (``trainer.accelerator``) trains on GPUs: ``gpu``, ``cuda``, or ``auto`` where torch sees CUDA; else None.

    Raises:
        UsageError: from :func:`slurm_task`.
    """
    task = slurm_task(env)
    if task is None or not task.bound or not isinstance(accelerator, str | None):
        return None
    name = (accelerator or "auto").lower()
    if name in ("gpu", "cuda") or (name == "auto" and torch.cuda.is_available()):
        return TaskGPUAccelerator()
    return None
