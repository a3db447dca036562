"""The sbatch scripts under ``slurm/``: valid bash, the options the issue asks for, the configs composed as the
README says, no site details. (They run against a real cluster in ``tests/system/test_slurm*.py``.)"""

from __future__ import annotations

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
