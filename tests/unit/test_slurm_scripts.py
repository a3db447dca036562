"""The sbatch scripts under ``slurm/``: valid bash, the options the issue asks for, the configs composed as the
README says, no site details. (They run against a real cluster in ``tests/system/test_slurm*.py``.)"""

from __future__ import annotations

import os
import re
import subprocess

from tests.helpers import REPO


def test_sbatch_scripts_as_the_issue_asks() -> None:
    for name in ("local_cluster.sh", "train.sbatch", "train_elastic.sbatch"):
        subprocess.run(["bash", "-n", str(REPO / "slurm" / name)], check=True, timeout=30)
    train = (REPO / "slurm" / "train.sbatch").read_text()
    elastic = (REPO / "slurm" / "train_elastic.sbatch").read_text()
    for line in ("#SBATCH --signal=SIGUSR1@90", "#SBATCH --requeue", "#SBATCH --open-mode=append"):
        assert line in train
    # srun python -m lit_ddp fit, the fragments (configs/trainer/*.yaml) composed before CONFIG
    assert re.search(
        r"srun .*\"\$PYTHON\" -m lit_ddp fit[\s\\]+(--(config|trainer\.\w+) \S+[\s\\]+)*--config \"\$CONFIG\"", train
    )
    assert re.search(r"torchrun.*--nnodes \"\$SLURM_NNODES\" --nproc_per_node \"\$NPROC\"", elastic)
    assert (
        "--max-restarts" in elastic
        and "--rdzv_backend c10d" in elastic
        and '--rdzv_endpoint "${RDZV_HEAD}:${port}"' in elastic
        # a rendezvous port per job step (lit_ddp.launch.environment.step_port's rule), unless RDZV_PORT is given
        and "port=${RDZV_PORT:-$((25000 + (SLURM_JOB_ID + 7919 * SLURM_STEP_ID) % 5000))}" in elastic
    )
    # cores for the loader workers: cpus-per-task - 1 workers per rank after CONFIG (the default, 1: none)
    assert "#SBATCH --cpus-per-task=1" in train and "#SBATCH --cpus-per-task=2" in elastic
    assert re.search(r'--config "\$CONFIG" --data\.init_args\.num_workers "\$WORKERS" "\$@"', train)
    assert re.search(r'--config "\$CONFIG" --data\.init_args\.num_workers "\$WORKERS"', elastic)
    assert "WORKERS=${LIT_DDP_LOADER_WORKERS:-$((CPUS > 1 ? CPUS - 1 : 0))}" in train
    for text in (train, elastic):  # site details belong on the sbatch command line
        assert not re.search(r"^#SBATCH +(--partition|-p |--account|-A )", text, re.M)


def test_torchft_sbatch_script() -> None:
    """slurm/train_torchft.sbatch: valid bash, usage and status 2 outside a job or without CONFIG, the torchft fragment
    before CONFIG, the launcher's Slurm mode in the batch shell (which starts each group as an srun step), a job that
    survives a lost node (--no-kill) and is requeued after a preemption, the job's secret made at run time and never
    printed, the lighthouse bound to the first node's address (not every interface), no site details. (It runs on
    Slurm nodes in tests/system/test_slurm_torchft.py.)"""
    script = REPO / "slurm" / "train_torchft.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for args in ([], ["configs/regression/single_device.yaml"]):
        done = subprocess.run(
            ["bash", str(script), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 2 and done.stderr.startswith("usage: sbatch"), done.stderr
    text = script.read_text()
    for option in ("--nodes=3", "--no-kill", "--signal=SIGUSR1@90", "--requeue"):
        assert re.search(rf"^#SBATCH {option}$", text, re.M), option
    assert re.search(r'"\$PYTHON" -m lit_ddp\.ft\.launch --slurm --replica_groups "\$GROUPS_N"', text)
    assert re.search(r'-- fit .*--config "\$FRAGMENT" --config "\$CONFIG"', text)
    assert "FRAGMENT=configs/trainer/torchft.yaml" in text
    assert re.search(r"^LIT_DDP_JOB_SECRET=\$\(od -An -N32 -tx1 /dev/urandom", text, re.M)
    assert not re.search(r"echo[^\n]*JOB_SECRET", text)  # never printed
    assert 'address=$(getent ahostsv4 "${names[0]}"' in text and '--bind "${address}:${LIGHTHOUSE_PORT:-0}"' in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert not re.search(r"^#SBATCH +(--partition|-p |--account|-A )", text, re.M)


def test_torchft_sbatch_checks_its_layout() -> None:
    """NPROC_PER_GROUP W and SPARE_NODES: checked before anything starts (status 2, one line): W >= 1, and more
    nodes than spares (one group per node, the spares beside them)."""
    script = REPO / "slurm" / "train_torchft.sbatch"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for bad in ({"NPROC_PER_GROUP": "0"}, {"NPROC_PER_GROUP": "two"}, {"SPARE_NODES": "3"}):
        done = subprocess.run(
            ["bash", str(script), "configs/regression/single_device.yaml"],
            cwd=REPO, env={**env, "SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "3", **bad}, capture_output=True,
            text=True, timeout=30,
        )  # fmt: skip
        assert done.returncode == 2 and "NPROC_PER_GROUP must be >= 1" in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1, done.stderr
