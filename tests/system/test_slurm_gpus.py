"""Slurm GPU nodes on the local cluster, whose nodes declare 2 GPUs each as generic resources (``Gres=gpu:2``,
device files in ``gres.conf``: ``slurm/local_cluster.sh``): the environment Slurm gives each task of a
``--gpus-per-task=1`` step and of a ``--gres=gpu:2`` step of one job, and what lit-ddp derives from it
(:func:`lit_ddp.launch.environment.slurm_task`, :func:`~lit_ddp.launch.environment.follow_slurm_port`). There is no
CUDA behind the device files: each task runs the derivation and prints it. (That Lightning then trains a bound task
on ``cuda:0``: ``tests/unit/launch/test_environment.py``, CUDA mocked.)
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import uuid

import pytest

from lit_ddp.launch.environment import step_port
from tests.helpers import REPO
from tests.system.helpers_slurm import in_ci, require_cluster, slurm_env

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]

PROBE = """
import dataclasses, json, os
from lit_ddp.launch.environment import follow_slurm_port, slurm_task, task_gpu_accelerator
task = slurm_task()
follow_slurm_port()
seen = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_GPUS_ON_NODE", "SLURM_STEP_ID",
                                       "SLURM_JOB_ID", "SLURMD_NODENAME", "MASTER_PORT")}
print("PROBE", json.dumps({**seen, **dataclasses.asdict(task), "accelerator": type(task_gpu_accelerator("gpu")).__name__}))
"""


def node_gpus() -> dict[str, str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %G"], capture_output=True, text=True, timeout=15)
    return dict(line.split()[:2] for line in out.stdout.splitlines() if len(line.split()) >= 2)


@pytest.mark.timeout(150)
def test_gpu_binding_ranks_and_step_ports() -> None:
    """One job of 2 nodes x 2 tasks with 2 GPUs a node, two steps one after the other: ``--gpus-per-task=1`` gives
    each task one GPU of its node (``CUDA_VISIBLE_DEVICES`` 0 / 1), which lit-ddp trains on as ``cuda:0`` (bound,
    ``TaskGPUAccelerator``); without it every task sees both and takes ``cuda:LOCAL_RANK``, as Lightning does. Ranks
    as Slurm numbers them; each step gets its own ``MASTER_PORT``, the same on all its tasks."""
    require_cluster(nodes=2)
    gpus = node_gpus()
    if not all(g.startswith("gpu:") for g in gpus.values()):
        msg = f"the local cluster's nodes declare no GPUs ({gpus}); restart it: slurm/local_cluster.sh start --nodes 2"
        pytest.fail(f"CI=true but {msg}", pytrace=False) if in_ci() else pytest.skip(msg)
    name = f"gpus-{uuid.uuid4().hex[:8]}"
    probe = f"{shlex.quote(sys.executable)} -c {shlex.quote(PROBE)}"
    steps = f"srun --gpus-per-task=1 {probe} && srun {probe}"
    cmd = ["salloc", "-J", name, "-N", "2", "--ntasks-per-node", "2", "--gres=gpu:2", "--cpus-per-task", "1"]
    try:
        out = subprocess.run([*cmd, "bash", "-c", steps], cwd=REPO, env=slurm_env(), capture_output=True, text=True,
                             timeout=120)  # fmt: skip
    finally:
        subprocess.run(["scancel", "--name", name], capture_output=True, timeout=15, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    tasks = [json.loads(line.split("PROBE ", 1)[1]) for line in out.stdout.splitlines() if "PROBE " in line]
    by_step = {step: sorted((t for t in tasks if t["SLURM_STEP_ID"] == step), key=lambda t: t["global_rank"])
               for step in ("0", "1")}  # fmt: skip
    assert [len(s) for s in by_step.values()] == [4, 4], out.stdout[-3000:]
    for step, per_task in by_step.items():
        ranks = [(t["global_rank"], t["local_rank"], t["node_rank"], t["world_size"]) for t in per_task]
        assert ranks == [(0, 0, 0, 4), (1, 1, 0, 4), (2, 0, 1, 4), (3, 1, 1, 4)], ranks
        assert [t["SLURMD_NODENAME"] for t in per_task] == ["n1", "n1", "n2", "n2"]
        assert {t["SLURM_GPUS_ON_NODE"] for t in per_task} == {"2"}  # the preflight's one-GPU-per-task check holds
        ports = {t["MASTER_PORT"] for t in per_task}
        env = {"SLURM_JOB_ID": per_task[0]["SLURM_JOB_ID"], "SLURM_STEP_ID": step}
        assert ports == {str(step_port(env))}, ports
    bound, shared = by_step["0"], by_step["1"]
    # --gpus-per-task=1: each task sees its own GPU of the node; lit-ddp trains it as cuda:0
    assert [t["CUDA_VISIBLE_DEVICES"] for t in bound] == ["0", "1", "0", "1"]
    assert [t["SLURM_STEP_GPUS"] for t in bound] == ["0", "1", "0", "1"]
    assert all(t["bound"] and t["device"] == 0 and t["visible"] == [t["CUDA_VISIBLE_DEVICES"]] for t in bound), bound
    assert {t["accelerator"] for t in bound} == {"TaskGPUAccelerator"}
    # --gres=gpu:2 alone: every task sees both; cuda:LOCAL_RANK, Lightning's own choice (no accelerator swapped in)
    assert {t["CUDA_VISIBLE_DEVICES"] for t in shared} == {"0,1"}
    assert [(t["bound"], t["device"]) for t in shared] == [(False, 0), (False, 1), (False, 0), (False, 1)]
    assert {t["accelerator"] for t in shared} == {"NoneType"}
    assert by_step["0"][0]["MASTER_PORT"] != by_step["1"][0]["MASTER_PORT"]  # two steps of one job, one node
