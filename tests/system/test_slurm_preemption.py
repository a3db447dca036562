"""Preemption by Slurm itself, on the real local cluster: a higher-priority job takes the node of a running
one, Slurm sends SIGTERM, the job saves, requeues and ends bit-identical to an uninterrupted job. Preemption by
``scancel --signal=USR1`` at moments drawn from a seed, on a cluster whose controller is slow and whose steps
have no ``scontrol``: ``lit-ddp chaos --launcher slurm`` (``tests/system/test_chaos.py``)."""

from __future__ import annotations

import random
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests.helpers import QUIET, load_records, recorder_config
from tests.system.helpers_slurm import (
    cancel,
    job_info,
    jobcomp_records,
    require_cluster,
    sbatch,
    wait_job_done,
)

FT = ["--config", "configs/checkpoint/fault_tolerant.yaml"]  # after CONFIG: train.sbatch passes it on


@pytest.mark.slurm
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_preemption_by_a_higher_priority_job_requeues_and_ends_exact(tmp_path: Path, seed: int) -> None:
    """Real preemption (``slurm/local_cluster.sh``: ``PreemptType=preempt/partition_prio``, ``PreemptMode=REQUEUE``):
    the regression runs in partition ``low`` on one node; at a random moment a job of partition ``high`` asks
    for that whole node. Slurm sends SIGTERM (GraceTime 60 s); the tasks save at a step boundary and exit
    143, and train.sbatch, seeing Slurm's PreemptTime, requeues the job (Slurm requeues only a job it has to
    kill). The rerun resumes and ends bit-identical to an uninterrupted job beside it."""
    require_cluster(nodes=2)
    rng = random.Random(seed)
    args = ["configs/regression/slurm.yaml", *FT, "--trainer.max_epochs", "150", *QUIET]
    jobs: dict[str, tuple[str, Path, Path]] = {}
    high = None
    try:
        for name, node, partition in (("ref", "n2", "debug"), ("low", "n1", "low")):
            cb, rec = recorder_config(tmp_path, name)
            out = tmp_path / f"{name}.out"
            run = ["--config", str(cb), "--trainer.default_root_dir", str(tmp_path / name / "run")]
            opts = ["-J", f"pre-{name}-{uuid.uuid4().hex[:6]}", "-o", str(out), "-p", partition, "-w", node, "-N1"]
            jobs[name] = (sbatch("slurm/train.sbatch", [*args, *run], [*opts, "--ntasks-per-node=2"]), out, rec)
            time.sleep(2)  # one launch at a time (see above)
        job, out, _ = jobs["low"]
        deadline = time.monotonic() + 120
        while "Starting with 2 processes" not in (out.read_text() if out.exists() else ""):
            assert job_info(job).get("JobState") in ("PENDING", "RUNNING"), out.read_text()[-3000:]
            assert time.monotonic() < deadline, "the low job never started training"
            time.sleep(0.2)
        delay = rng.uniform(0.5, 20.0)  # of about 50 s of training
        time.sleep(delay)
        cmd = ["sbatch", "--parsable", "-p", "high", "-w", "n1", "--exclusive", "-J", "high", "-o", "/dev/null"]
        submitted = subprocess.run([*cmd, "--wrap", "sleep 5"], capture_output=True, text=True, check=True, timeout=30)
        high = submitted.stdout.strip().split(";")[0]
        print(f"high-priority job submitted {delay:.1f} s into training")
        final = {name: wait_job_done(j, 420, o) for name, (j, o, _) in jobs.items()}
    finally:
        for j in [high, *(j for j, _, _ in jobs.values())]:
            cancel(j)
    log = jobs["low"][1].read_text()
    assert final["ref"]["JobState"] == "COMPLETED", jobs["ref"][1].read_text()[-3000:]
    assert final["low"]["JobState"] == "COMPLETED" and final["low"]["Restarts"] == "1", log[-5000:]
    assert "SIGTERM received: saving" in log and "preempted (SIGTERM), checkpoint saved: requeueing" in log, log
    runs = jobcomp_records(jobs["low"][0])  # the cluster's accounting: one record per run
    assert [r["JobState"] for r in runs] == ["PENDING", "COMPLETED"], runs  # PENDING: the requeued run
    resumed, reference = load_records(jobs["low"][2]), load_records(jobs["ref"][2])
    assert [r["global_step"] for r in resumed] == [r["global_step"] for r in reference]
    for a, b in zip(resumed, reference, strict=True):
        differing = [k for k, v in b["params"].items() if not torch.equal(v, a["params"][k])]
        assert not differing, f"parameters differ from the uninterrupted job: {differing}"
