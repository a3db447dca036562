"""lit_ddp.launch.environment: the launcher's layout read from its environment (torchrun's process counts, an srun
task's GPU and its step's port) and the trainer's devices per node."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.fabric.accelerators import cuda as fabric_cuda
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import cuda as pytorch_cuda
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero as pytorch_rank_zero
from lightning_utilities.core import rank_zero as utilities_rank_zero

from lit_ddp.errors import UsageError
from lit_ddp.launch.environment import (
    TaskGPUAccelerator,
    TorchrunEnvironment,
    devices_per_node,
    follow_slurm_port,
    follow_torchrun,
    slurm_task,
    step_port,
    task_gpu_accelerator,
)
from lit_ddp.strategies import DDPStrategy

# Task 3 of an srun step of 2 nodes x 2 tasks (its node's second), as Slurm 22.05 sets it
TASK_3 = {"SLURM_JOB_ID": "4321", "SLURM_JOB_NAME": "t", "SLURM_STEP_ID": "1", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
          "SLURM_NODEID": "1", "SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "2",
          "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODELIST": "n[1-2]"}  # fmt: skip


def test_devices_per_node() -> None:
    assert [devices_per_node(d) for d in (2, "2", [0, 1], "0,1,", "auto", -1, None)] == [2, 2, 2, 2, None, None, None]


def test_trainer_layout_follows_torchrun() -> None:
    torchrun_1 = {"TORCHELASTIC_RUN_ID": "7", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2"}
    trainer = {"devices": 2, "num_nodes": 1}
    assert follow_torchrun(trainer, torchrun_1) == (
        "torchrun started 1 process(es) per node on 2 node(s): trainer.devices=2 -> 1, trainer.num_nodes=1 -> 2"
    )
    assert trainer == {"devices": 1, "num_nodes": 2}
    assert follow_torchrun(trainer, torchrun_1) is None  # already matching
    assert follow_torchrun({"devices": 2}, {"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "1"}) is None  # no torchrun
    auto = {"devices": "auto", "num_nodes": 1}
    follow_torchrun(auto, {**torchrun_1, "LOCAL_WORLD_SIZE": "2"})
    assert auto == {"devices": 2, "num_nodes": 1}


def test_nodes_with_different_process_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun --nproc_per_node 2 on one node and 1 on the other: each node's devices are its own count, the nodes
    are torchrun's agents (GROUP_WORLD_SIZE), and the environment accepts what Lightning's rejects (2 x 2 != 3)."""
    node0 = {"TORCHELASTIC_RUN_ID": "7", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "3", "GROUP_WORLD_SIZE": "2"}
    node1 = {**node0, "LOCAL_WORLD_SIZE": "1"}
    for env, devices in ((node0, 2), (node1, 1)):
        trainer = {"devices": 1, "num_nodes": 2}
        follow_torchrun(trainer, env)
        assert trainer == {"devices": devices, "num_nodes": 2}
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        TorchrunEnvironment().validate_settings(devices, 2)
    with pytest.raises(ValueError, match="trainer.devices=2 and trainer.num_nodes=2, but torchrun started 1 process"):
        TorchrunEnvironment().validate_settings(2, 2)  # node1's environment


def test_slurm_task_device() -> None:
    """--gpus-per-task=1: the task sees its own GPU (CUDA_VISIBLE_DEVICES=1, or 0 where the site renumbers) and
    trains on cuda:0; --gres=gpu:2: it sees both and takes cuda:LOCAL_RANK; no GPU: no device."""
    bound = slurm_task({**TASK_3, "CUDA_VISIBLE_DEVICES": "1"})
    assert bound is not None
    assert (bound.global_rank, bound.local_rank, bound.node_rank, bound.world_size) == (3, 1, 1, 4)
    assert (bound.tasks_on_node, bound.visible, bound.device, bound.bound) == (2, ("1",), 0, True)
    shared = slurm_task({**TASK_3, "CUDA_VISIBLE_DEVICES": "0,1"})
    assert shared is not None and (shared.device, shared.bound) == (1, False)
    unset = slurm_task(TASK_3)  # a machine whose GPUs nobody hides: Lightning's cuda:LOCAL_RANK
    assert unset is not None and (unset.visible, unset.device, unset.bound) == (None, 1, False)
    none = slurm_task({**TASK_3, "CUDA_VISIBLE_DEVICES": ""})
    assert none is not None and (none.device, none.bound) == (None, False)
    alone = slurm_task(
        {**TASK_3, "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_LOCALID": "0", "CUDA_VISIBLE_DEVICES": "1"}
    )
    assert alone is not None and (alone.tasks_on_node, alone.device, alone.bound) == (1, 0, False)  # node 1 runs 1
    assert slurm_task({k: v for k, v in TASK_3.items() if k != "SLURM_STEP_ID"}) is None  # the batch script
    with pytest.raises(UsageError, match=r"sees 2 GPUs \(CUDA_VISIBLE_DEVICES=2,3\).*--gpus-per-task=1"):
        slurm_task({**TASK_3, "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "CUDA_VISIBLE_DEVICES": "2,3"})
    assert isinstance(task_gpu_accelerator("gpu", {**TASK_3, "CUDA_VISIBLE_DEVICES": "1"}), TaskGPUAccelerator)
    assert task_gpu_accelerator("cpu", {**TASK_3, "CUDA_VISIBLE_DEVICES": "1"}) is None
    assert task_gpu_accelerator("gpu", {**TASK_3, "CUDA_VISIBLE_DEVICES": "0,1"}) is None


def test_step_ports() -> None:
    """A port per job step in Lightning's range: every two steps of one job differ; step 0 collides only where
    Lightning's per-job rule does."""
    job = {"SLURM_JOB_ID": "4321"}
    ports = [step_port({**job, "SLURM_STEP_ID": str(step)}) for step in range(2000)]
    assert len(set(ports)) == 2000 and all(p is not None and 15000 <= p < 25000 for p in ports)
    assert step_port(job) == step_port({**job, "SLURM_STEP_ID": "0"}) == 15000 + 4321  # the batch step: 0
    assert step_port({"SLURM_JOB_ID": "14321"}) == step_port(job) and step_port({}) is None
    env = {**TASK_3}
    assert follow_slurm_port(env) == "MASTER_PORT=17240: Slurm job 4321, step 1"
    assert env["MASTER_PORT"] == "17240"  # 15000 + (4321 + 7919) % 10000
    assert follow_slurm_port({**TASK_3, "MASTER_PORT": "29500"}) is None  # the user's
    assert follow_slurm_port({"SLURM_JOB_ID": "4321"}) is None  # not in a step


@pytest.mark.parametrize("accelerator", ["gpu", "bound"])
def test_bound_task_trains_on_cuda_0(monkeypatch: pytest.MonkeyPatch, accelerator: str) -> None:
    """Task 3 (LOCAL_RANK 1) of 2 nodes x 2 tasks, bound to one GPU, which torch counts as 1 device (mocked: no CUDA
    here): Lightning's ``gpu`` asks for cuda:0 and cuda:1 and refuses; :class:`TaskGPUAccelerator` gives the strategy
    cuda:0 twice, so the task's root device is its GPU and the world stays 4 processes of 2 per node."""
    monkeypatch.setattr(os, "environ", {**os.environ, **TASK_3, "CUDA_VISIBLE_DEVICES": "1"})
    # The strategy makes this process rank 3 for Lightning's rank-zero-only output: back to what it was afterwards,
    # or every later test in this worker loses its warnings and messages.
    for module in (pytorch_rank_zero, utilities_rank_zero):
        monkeypatch.setattr(module.rank_zero_only, "rank", module.rank_zero_only.rank)
    monkeypatch.setattr(fabric_cuda, "num_cuda_devices", lambda: 1)
    monkeypatch.setattr(pytorch_cuda, "num_cuda_devices", lambda: 1)
    kwargs = {"devices": 2, "num_nodes": 2, "strategy": DDPStrategy(), "logger": False, "enable_checkpointing": False}
    kwargs["plugins"] = [SLURMEnvironment(auto_requeue=False)]
    if accelerator == "gpu":
        with pytest.raises(MisconfigurationException, match=r"requested gpu: \[0, 1\]"):
            Trainer(accelerator="gpu", **kwargs)
        return
    trainer = Trainer(accelerator=task_gpu_accelerator("gpu"), **kwargs)
    strategy = trainer.strategy
    assert strategy.root_device == torch.device("cuda", 0) and strategy.determine_ddp_device_ids() == [0]
    assert (strategy.local_rank, strategy.global_rank, strategy.world_size, strategy.num_processes) == (1, 3, 4, 2)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 4, "rank": 3}
