"""Slurm on two nodes (``slurm/local_cluster.sh start --nodes 2``): srun, train.sbatch and train_elastic.sbatch.

Where the tasks ran is read from Slurm (``scontrol show job``, and the jobcomp/filetxt log when the cluster
writes one), not from the program's output. The tests skip when fewer than 2 Slurm nodes are up (idle, mixed,
allocated or completing), and fail instead when ``CI=true``. The shared constants and Slurm calls come from
:mod:`tests.helpers` and :mod:`tests.system.helpers_slurm`; the two-node helpers are defined here.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests.helpers import QUIET, REPO
from tests.system.helpers_slurm import FINAL_STATES, hostnames, in_ci, jobcomp_records, sbatch, slurm_env

SLURM_CONFIG = "configs/regression/slurm.yaml"  # the step config train.sbatch is given
# srun by hand: what train.sbatch composes (DDPStrategy, SLURMEnvironment), then the step config
SRUN_CONFIGS = ["--config", "configs/trainer/ddp.yaml", "--config", "configs/trainer/slurm.yaml"]
SRUN_CONFIGS += ["--config", SLURM_CONFIG]
# train_elastic.sbatch: a step config without SLURMEnvironment, the DDP fragment (strategy only) after it
TORCHRUN_CONFIG = ["configs/regression/torchrun.yaml", "--config", "configs/trainer/ddp.yaml"]
UP_STATES = {"idle", "mixed", "allocated", "completing"}

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]


def nodes_up(timeout: float = 15) -> tuple[list[str], str]:
    """The Slurm nodes that answer and take jobs, and what ``sinfo`` said."""
    if shutil.which("sinfo") is None:
        return [], "`sinfo` is not installed"
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [], f"`sinfo` did not answer in {timeout} s"
    if out.returncode != 0:
        return [], f"`sinfo` failed: {(out.stderr or out.stdout).strip()[:300]}"
    states = dict(line.split()[:2] for line in out.stdout.splitlines() if len(line.split()) >= 2)
    return sorted(n for n, s in states.items() if s in UP_STATES), out.stdout.strip()


@pytest.fixture(scope="module")
def two_nodes() -> list[str]:
    up, said = nodes_up()
    if len(up) >= 2:
        return up
    msg = f"fewer than 2 Slurm nodes up ({said!r}); start them with `slurm/local_cluster.sh start --nodes 2`"
    if in_ci():
        pytest.fail(f"CI=true but {msg}", pytrace=False)
    pytest.skip(msg)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_fields(line: str) -> dict[str, str]:
    return dict(f.split("=", 1) for f in line.split() if "=" in f)


def job_by_id(job_id: str) -> dict[str, str]:
    """``scontrol show job -o`` as a dict; empty once Slurm forgot the job (MinJobAge, 300 s by default)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=15)
    return parse_fields(out.stdout) if out.returncode == 0 else {}


def job_by_name(name: str) -> dict[str, str]:
    """The newest job named ``name`` that ``scontrol`` still knows (finished ones included)."""
    out = subprocess.run(["scontrol", "show", "job", "-o"], capture_output=True, text=True, timeout=15)
    jobs = [parse_fields(line) for line in out.stdout.splitlines()]
    jobs = [j for j in jobs if j.get("JobName") == name]
    return max(jobs, key=lambda j: int(j["JobId"])) if jobs else {}


def jobcomp_record(job_id: str) -> dict[str, str]:
    """The job's line in the jobcomp/filetxt log, when the cluster writes one (local_cluster.sh does)."""
    records = jobcomp_records(job_id)
    return records[0] if records else {}


def assert_two_nodes_one_task_each(info: dict[str, str], log: str = "") -> None:
    """Slurm's own record: the job completed on 2 distinct nodes, 1 task per node, 2 tasks in all."""
    assert info, "Slurm no longer knows the job"
    assert info["JobState"] == "COMPLETED", f"{info.get('JobState')} {info.get('Reason')}\n{log[-5000:]}"
    nodes = hostnames(info["NodeList"])
    assert len(set(nodes)) == 2 and info["NumNodes"] == "2", info["NodeList"]
    assert info["NtasksPerN:B:S:C"].startswith("1:"), info["NtasksPerN:B:S:C"]
    recorded = jobcomp_record(info["JobId"])
    if recorded:  # written by slurmctld when the job ended
        assert (recorded["JobState"], recorded["NodeCnt"]) == ("COMPLETED", "2"), recorded
        assert hostnames(recorded["NodeList"]) == nodes


def wait_job_done(job_id: str, timeout: float, output: Path) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_by_id(job_id)
        if info.get("JobState") in FINAL_STATES:
            return info
        time.sleep(0.5)
    tail = output.read_text()[-4000:] if output.exists() else ""
    raise AssertionError(f"job {job_id} not done after {timeout} s ({job_by_id(job_id).get('JobState')}):\n{tail}")


def wait_job_final(name: str, timeout: float = 60) -> dict[str, str]:
    """The job named ``name`` once Slurm has finished ending it: srun returns while the job may still be
    COMPLETING (its epilog and the nodes' release are not done)."""
    deadline = time.monotonic() + timeout
    while True:
        info = job_by_name(name)
        if info.get("JobState") in FINAL_STATES or time.monotonic() > deadline:
            return info
        time.sleep(0.5)


def cancel(job: str | None = None, name: str | None = None) -> None:
    """``scancel`` by id or name that never raises (for ``finally`` blocks)."""
    args = [job] if job else ["--name", name] if name else []
    if args:
        subprocess.run(["scancel", *args], capture_output=True, timeout=15, check=False)


def world_sizes(log: str) -> set[str]:
    """Lightning's "Initializing distributed: GLOBAL_RANK: r, MEMBER: m/W" lines: the W values."""
    return set(re.findall(r"Initializing distributed: GLOBAL_RANK: \d+, MEMBER: \d+/(\d+)", log))


@pytest.mark.timeout(240)
def test_srun_two_nodes_world_size_2(two_nodes, tmp_path: Path) -> None:
    name = unique("mn-srun")
    cmd = ["srun", "-J", name, "-N", "2", "--ntasks-per-node", "1", sys.executable, "-m", "lit_ddp", "fit"]
    cmd += [*SRUN_CONFIGS, "--trainer.num_nodes", "2", "--trainer.devices", "1"]
    cmd += ["--trainer.max_epochs", "1", "--trainer.default_root_dir", str(tmp_path / "run"), *QUIET]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=slurm_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # srun forwards it and ends the step
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=15)
        raise AssertionError(f"{cmd} did not finish in 180 s") from None
    finally:
        cancel(name=name)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-5000:]
    info = wait_job_final(name)
    assert_two_nodes_one_task_each(info, out)
    assert info["NumTasks"] == "2"  # SLURM_NTASKS, which SLURMEnvironment takes as the world size
    assert world_sizes(out) == {"2"}, out[-5000:]
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()


def train_one_epoch(tmp_path: Path, name: str, *layout: str) -> tuple[dict[str, str], str]:
    """slurm/train.sbatch with the regression's Slurm step for one epoch, the allocation given as sbatch options
    ``layout``, into ``tmp_path/run``: (Slurm's final job record, the job's output)."""
    out = tmp_path / "job.out"
    args = [SLURM_CONFIG, "--trainer.max_epochs", "1", "--trainer.default_root_dir", str(tmp_path / "run"), *QUIET]
    job = None
    try:
        job = sbatch("slurm/train.sbatch", args, ["-J", unique(name), "-o", str(out), *layout, "--time", "5"])
        info = wait_job_done(job, timeout=240, output=out)
    finally:
        cancel(job)
    return info, out.read_text()


@pytest.mark.timeout(300)
def test_sbatch_train_on_two_nodes(two_nodes, tmp_path: Path) -> None:
    info, log = train_one_epoch(tmp_path, "mn-sbatch", "--nodes", "2", "--ntasks-per-node", "1")
    assert_two_nodes_one_task_each(info, log)
    assert "nodes=2 ntasks-per-node=1" in log and "`Trainer.fit` stopped: `max_epochs=1` reached." in log
    assert world_sizes(log) == {"2"}, log[-5000:]


@pytest.mark.timeout(300)
def test_sbatch_nodes_with_different_task_counts(two_nodes, tmp_path: Path) -> None:
    """``sbatch --nodes 2 --ntasks 3``: Slurm places 2 + 1 tasks, and train.sbatch trains them as one job of 3
    (Lightning's SLURMEnvironment takes ranks and world size from Slurm), 19 steps an epoch of 3 x 32 (issue 22)."""
    info, log = train_one_epoch(tmp_path, "mn-het", "--nodes", "2", "--ntasks", "3")
    assert info["JobState"] == "COMPLETED" and info["NumNodes"] == "2", log[-5000:]
    assert world_sizes(log) == {"3"}, log[-5000:]
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 19  # 1,792 training samples in global batches of 96


@pytest.mark.timeout(540)
def test_elastic_sbatch_on_two_nodes_survives_worker_faults(two_nodes, tmp_path: Path, seed: int) -> None:
    """``lit-ddp chaos --sbatch slurm/train_elastic.sbatch``: one torchrun agent per node, joined by a c10d
    rendezvous hosted by the first node's agent; a worker SIGKILLed (a crash) and a worker SIGSTOPped (a hung
    host: the other worker fails at the 20 s collective timeout, and the stopped worker's agent restarts it for the
    new round), on a node and at a step drawn from the seed. torchrun restarts the group on both nodes within the
    one job (no resubmission), and the job ends bit-identical to the uninterrupted one."""
    fit = ["--config", *TORCHRUN_CONFIG, "--config", "configs/checkpoint/fault_tolerant.yaml"]
    fit += ["--trainer.max_epochs", "150", "--trainer.enable_model_summary", "false"]
    cmd = [sys.executable, "-m", "lit_ddp", "chaos", "--launcher", "slurm", "--sbatch", "slurm/train_elastic.sbatch",
           "--nodes", "2", "--nproc_per_node", "1", "--faults", "2", "--kinds", "kill", "hang", "--seed", str(seed),
           "--root", str(tmp_path), "--", *fit]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, env=slurm_env(), capture_output=True, text=True, timeout=500)
    outputs = [p.read_text() for p in sorted(tmp_path.glob("faulted-*.out"))]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:] + "".join(outputs)[-4000:]
    assert "identical: the faulted run ends bit for bit" in result.stdout, result.stdout[-3000:]
    assert len(outputs) == 1, "the faults were survived within the job, not by submitting it again"
    log = outputs[0]
    assert "rdzv=" in log and world_sizes(log) == {"2"}, log[-4000:]
    assert log.count("Starting with 2 processes") == 3, log[-5000:]  # the first group and one per fault
