"""The sbatch scripts under ``slurm/``: valid bash, the options the issue asks for, the configs composed as the
README says, no site details. (They run against a real cluster in ``tests/system/test_slurm*.py``.)"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

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
    before CONFIG, one srun step per group pinned to its node, the lighthouse bound to the first node's address (not
    every interface), no site details. (It runs on two Slurm nodes in tests/system/test_slurm_torchft.py.)"""
    script = REPO / "slurm" / "train_torchft.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for args in ([], ["configs/regression/single_device.yaml"]):
        done = subprocess.run(
            ["bash", str(script), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 2 and done.stderr.startswith("usage: sbatch"), done.stderr
    text = script.read_text()
    assert re.search(r'srun --nodes 1 --ntasks 1 --relative "\$i"', text)
    assert 'FIT=("$PYTHON" -m lit_ddp fit)' in text  # a group of one process; several: torchrun (the next test)
    assert re.search(r'"\$\{FIT\[@\]\}" .*--config "\$FRAGMENT" --config "\$CONFIG"', text)
    assert "FRAGMENT=configs/trainer/torchft.yaml" in text
    assert 'LighthouseServer(bind=f"{addr}:{port}"' in text and "addr = socket.gethostbyname(head)" in text
    assert not re.search(r"^#SBATCH +(--partition|-p |--account|-A )", text, re.M)


def test_torchft_sbatch_groups_of_several_processes(tmp_path: Path) -> None:
    """NPROC_PER_GROUP W: checked before anything starts (status 2); W > 1, each group's task runs torchrun with W
    processes (``--max_restarts 0``: the script restarts the group), ``--trainer.devices W`` after the configs, and
    its shell turns the bad-use file a worker created into status 2, torchrun's own status (1) otherwise."""
    script = REPO / "slurm" / "train_torchft.sbatch"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for bad in ("0", "two"):
        done = subprocess.run(
            ["bash", str(script), "configs/regression/single_device.yaml"],
            cwd=REPO, env={**env, "SLURM_JOB_ID": "1", "NPROC_PER_GROUP": bad}, capture_output=True, text=True,
            timeout=30,
        )  # fmt: skip
        assert done.returncode == 2 and f"NPROC_PER_GROUP must be a number of processes >= 1 (got '{bad}')" in (
            done.stderr
        ), done.stderr
    text = script.read_text()
    assert re.search(r'-m torch\.distributed\.run --standalone --nproc_per_node "\$NPROC"\s+--max_restarts 0', text)
    assert re.search(r'--config "\$CONFIG" .*\s+.*"\$\{run\[@\]\}" --trainer\.devices "\$NPROC"', text)
    assert "THREADS=$((CPUS / NPROC))" in text and "WORKERS=${LIT_DDP_LOADER_WORKERS:-$((THREADS > 1" in text

    wrapper = re.search(r"^  bad_use='(.*?)'$", text, re.S | re.M)
    assert wrapper, "the task shell's bad-use check"
    seen = tmp_path / "bad_use_path"
    for worker, expected in (
        ('touch "$LIT_DDP_BAD_USE_FILE"; exit 1', 2),  # a worker exited for bad use; torchrun says 1
        ("exit 1", 1),  # a crash: restarted
        ("exit 0", 0),
    ):
        cmd = f'echo "$LIT_DDP_BAD_USE_FILE" > {seen}; {worker}'
        done = subprocess.run(["bash", "-c", wrapper[1], "torchrun", "bash", "-c", cmd], timeout=30)
        assert done.returncode == expected, (worker, done.returncode)
        assert not Path(seen.read_text().strip()).parent.exists(), "the private directory was left behind"
