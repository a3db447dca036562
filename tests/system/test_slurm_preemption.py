"""Preemption at moments nobody chose, on the real local Slurm: ``scancel --signal=USR1`` three times in a
2-task job's life, each after a random delay (during start-up, a step, validation or a save, whatever it
hits); the job requeues each time and ends bit-identical to an uninterrupted job, also where the controller
takes 5 s to answer ``scontrol`` and the steps have none (a container). Both tasks: the regression
as 1 node x 2 tasks, minGPT as 2 nodes x 1 task (``sbatch --nodes 2``, where Slurm records two distinct
nodes); the four jobs run side by side to keep the suite short."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers import QUIET, TINY_GPT_ARGS, load_records, recorder_config
from tests.system.helpers_slurm import (
    cancel,
    hostnames,
    job_info,
    jobcomp_records,
    require_cluster,
    sbatch,
    wait_job_done,
)

SIGNALS = 3
FT = ["--config", "configs/checkpoint/fault_tolerant.yaml"]  # after CONFIG: train.sbatch passes it on
TASKS = {
    # Long enough that three delays of up to 45 s of training each cannot reach the end: 120 regression epochs
    # (~40 s here) did once (the third run resumed at epoch 119 and finished before its signal), 2000 minGPT
    # steps too (the third run resumed at step 1048).
    "regression": ["configs/regression/slurm.yaml", *FT, "--trainer.max_epochs", "500", *QUIET],
    "mingpt": [
        "configs/mingpt/cpu.yaml", "--config", "configs/mingpt/slurm.yaml", *FT, *TINY_GPT_ARGS,
        "--trainer.max_epochs", "-1", "--trainer.max_steps", "5000", "--trainer.val_check_interval", "500",
        "--trainer.limit_val_batches", "4",
    ],
}  # fmt: skip
LAYOUT = {"regression": ["-N1", "--ntasks-per-node=2"], "mingpt": ["--nodes=2", "--ntasks-per-node=1"]}
# The local cluster's nodes share one 2-core host: one thread per task, where Lightning would give each
# single-task node all the cores.
ENV = {"regression": {}, "mingpt": {"OMP_NUM_THREADS": "1"}}


def unkind_cluster(tmp: Path) -> dict[str, str]:
    """The environment of a job on a cluster less kind than the local one: a controller that takes 5 s to
    answer ``scontrol`` (first on the batch script's PATH), and steps that run as in a container without
    Slurm's tools (``LIT_DDP_PYTHON``: this Python with the venv alone on PATH, no ``scontrol``)."""
    slow = tmp / "slow_controller"
    slow.mkdir(parents=True)
    (slow / "scontrol").write_text(f'#!/bin/sh\nsleep 5\nexec {shutil.which("scontrol")} "$@"\n')
    container = tmp / "container_python"
    container.write_text(f'#!/bin/sh\nPATH={Path(sys.executable).parent} exec {sys.executable} "$@"\n')
    for script in (slow / "scontrol", container):
        script.chmod(0o755)
    return {"PATH": f"{slow}{os.pathsep}{os.environ['PATH']}", "LIT_DDP_PYTHON": str(container)}


def submit(tmp: Path, task: str, name: str, **env: str) -> tuple[str, Path, Path, Path]:
    cb, rec = recorder_config(tmp, name)
    out, root = tmp / f"{name}.out", tmp / name / "run"
    args = [*TASKS[task], "--config", str(cb), "--trainer.default_root_dir", str(root)]
    job = sbatch("slurm/train.sbatch", args, ["-J", f"{name}-{uuid.uuid4().hex[:6]}", "-o", str(out),
                                              *LAYOUT[task]], **ENV[task], **env)  # fmt: skip
    return job, out, rec, root


def preempt(job: str, rng: random.Random, out: Path) -> list[float]:
    """Sends USR1 after a random delay into each of the job's first ``SIGNALS`` runs; waits for each requeue
    (a signal sent before any task exists reaches nobody and is sent again). Returns the delays."""
    delays = []
    for restarts in range(SIGNALS):
        deadline = time.monotonic() + 240
        while (info := job_info(job)).get("JobState") != "RUNNING" or info.get("Restarts") != str(restarts):
            assert info.get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED"), (info, out.read_text()[-3000:])
            assert time.monotonic() < deadline, f"run {restarts} of job {job} did not start"
            time.sleep(0.2)
        delays.append(rng.uniform(1.0, 45.0))  # start-up takes 10-25 s here: some land in it, most in training
        time.sleep(delays[-1])
        while (info := job_info(job)).get("Restarts") == str(restarts):
            # COMPLETING / REQUEUED: the last signal is being acted on; send another only while it still runs
            assert info.get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED"), (info, out.read_text()[-3000:])
            if info.get("JobState") == "RUNNING":
                with contextlib.suppress(subprocess.TimeoutExpired):  # a busy controller: sent again next round
                    subprocess.run(["scancel", "--signal=USR1", job], capture_output=True, timeout=30, check=False)
            time.sleep(5)
    return delays


@pytest.mark.slurm
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_random_preemptions_requeue_and_end_exact(tmp_path: Path, seed: int) -> None:
    require_cluster(nodes=2)
    rng = random.Random(seed)
    jobs = {}
    try:
        for task in TASKS:
            for kind in ("ref", "pre"):
                env = unkind_cluster(tmp_path / f"{task}-{kind}") if kind == "pre" else {}
                jobs[f"{task}-{kind}"] = submit(tmp_path, task, f"{task}-{kind}", **env)
                # One launch at a time: the local cluster's slurmd once died launching four jobs in the same
                # second (its log ends at "Launching batch job"; Slurm 22.05, several slurmd on one host).
                time.sleep(2)
        with ThreadPoolExecutor(len(TASKS)) as pool:  # both preempted jobs at once, each with its own delays
            futures = {
                task: pool.submit(preempt, jobs[f"{task}-pre"][0], random.Random(rng.random()), jobs[f"{task}-pre"][1])
                for task in TASKS
            }
            for task, future in futures.items():
                print(f"{task}: USR1 after {[round(d, 1) for d in future.result()]} s into runs 0-{SIGNALS - 1}")
        final = {name: wait_job_done(job, 600, out) for name, (job, out, _, _) in jobs.items()}
    finally:
        for job, *_ in jobs.values():
            cancel(job)
    for task in TASKS:
        (_, ref_out, ref_rec, _), (job, out, rec, root) = jobs[f"{task}-ref"], jobs[f"{task}-pre"]
        log = out.read_text()
        assert final[f"{task}-ref"]["JobState"] == "COMPLETED", ref_out.read_text()[-3000:]
        assert final[f"{task}-pre"]["JobState"] == "COMPLETED", log[-5000:]
        assert final[f"{task}-pre"]["Restarts"] == str(SIGNALS)
        nodes = {name: hostnames(final[name]["NodeList"]) for name in (f"{task}-ref", f"{task}-pre")}
        for name, hosts in nodes.items():  # Slurm's record of where each job ran its last run
            assert len(set(hosts)) == (2 if "--nodes=2" in LAYOUT[task] else 1), (name, hosts)
        # (Slurm's Restarts above is the record of the requeues: "Requeued Slurm job" may not reach the log.)
        # Each run saved at a step boundary (the requeue may end the tasks before they print anything more).
        assert log.count("SIGUSR1 received: saving") == SIGNALS, log[-5000:]
        # requeued by the batch script (its scontrol 5 s slow), never by a step (none has scontrol)
        assert log.count("preempted (SIGUSR1), checkpoint saved: requeueing") == SIGNALS, log[-5000:]
        # one preemption checkpoint per signal, each removing the ones before it
        assert [p.name for p in root.glob("hpc_ckpt_*.ckpt")] == [f"hpc_ckpt_{SIGNALS}.ckpt"]
        resumed, reference = load_records(rec), load_records(ref_rec)
        assert [r["global_step"] for r in resumed] == [r["global_step"] for r in reference]
        for a, b in zip(resumed, reference, strict=True):
            differing = [k for k, v in b["params"].items() if not torch.equal(v, a["params"][k])]
            assert not differing, f"{task}: parameters differ from the uninterrupted job: {differing}"


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
