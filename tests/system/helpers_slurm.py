"""Slurm-specific helpers for the tests against a real Slurm cluster (``slurm/local_cluster.sh start``).

Every Slurm call has a timeout; jobs are cancelled by the caller in a ``finally``. The training-side
callbacks (``RecordStart``, ``PauseForSignal``...) are in :mod:`tests.callbacks`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import helpers
from tests.helpers import REPO, start, subprocess_env, wait

VENV_BIN = Path(sys.executable).parent
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def in_ci() -> bool:
    """Whether this is a CI run (``CI=true``), where a missing cluster is a failure, not a skip."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def cluster_answers(timeout: float = 15) -> tuple[bool, str]:
    """Whether ``sinfo`` answers, and why not when it does not."""
    if shutil.which("sinfo") is None:
        return False, "`sinfo` is not installed"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"`sinfo` did not answer in {timeout} s"
    if out.returncode != 0:
        return False, f"`sinfo` failed: {(out.stderr or out.stdout).strip()[:300]}"
    return True, out.stdout.strip()


def nodes_up(timeout: float = 15) -> list[str]:
    """The Slurm nodes that take jobs (idle, mixed, allocated or completing)."""
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=timeout)
    states = dict(line.split()[:2] for line in out.stdout.splitlines() if len(line.split()) >= 2)
    return sorted(n for n, s in states.items() if s.rstrip("*") in ("idle", "mixed", "allocated", "completing"))


def hostnames(nodelist: str, timeout: float = 15) -> list[str]:
    """``scontrol show hostnames``: a Slurm node list (``n[1-2]``) expanded."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=timeout)
    return out.stdout.split()


def require_cluster(nodes: int = 1) -> None:
    """Skips the test when no Slurm cluster with ``nodes`` nodes up answers; in CI (``CI=true``) fails instead."""
    up, why = cluster_answers()
    if up and len(nodes_up()) >= nodes:
        return
    why = why if not up else f"fewer than {nodes} nodes up: {why!r}"
    msg = f"no Slurm cluster answers ({why}); start one with `slurm/local_cluster.sh start --nodes {nodes}`"
    if in_ci():
        pytest.fail(f"CI=true but {msg}", pytrace=False)
    pytest.skip(msg)


def slurm_env(**extra: str) -> dict[str, str]:
    """The environment a job inherits (sbatch/srun export it): this venv first on PATH, the repo importable."""
    env = subprocess_env(**extra)
    env["PATH"] = os.pathsep.join([str(VENV_BIN), env.get("PATH", "")])
    env["LIT_DDP_PYTHON"] = extra.get("LIT_DDP_PYTHON", sys.executable)
    env["LIT_DDP_TORCHRUN"] = str(VENV_BIN / "torchrun")
    # No DataLoader worker processes in the jobs (the sbatch scripts start cpus-per-task - 1 per rank): the local
    # nodes advertise 8 CPUs on this machine's 2 cores. Chaos runs inherit it (they take the LIT_DDP_* variables).
    env.setdefault("LIT_DDP_LOADER_WORKERS", "0")
    if helpers.ONE_THREAD_PER_PROCESS and "OMP_NUM_THREADS" not in extra:
        del env["OMP_NUM_THREADS"]  # tests/conftest.py's, for local processes: a job's follow its CPUs
    for key in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "TORCHELASTIC_"))]:
        if key not in extra:
            del env[key]  # a test run inside a Slurm job must not leak that job's layout
    return env


def sbatch(script: str, args: list[str], opts: list[str], timeout: float = 30, **env: str) -> str:
    """Submits ``script ARGS`` with sbatch ``OPTS`` from the repo root and returns the job id. One CPU per task unless
    ``OPTS`` give ``--cpus-per-task`` (the scripts' default: a site's may differ)."""
    if not any(o == "-c" or o.startswith("--cpus-per-task") for o in opts):
        opts = ["--cpus-per-task", "1", *opts]
    cmd = ["sbatch", "--parsable", *opts, str(REPO / script), *args]
    out = subprocess.run(cmd, cwd=REPO, env=slurm_env(**env), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd} failed: {out.stderr}"
    return out.stdout.strip().split(";")[0]


def job_info(job_id: str, timeout: float = 15) -> dict[str, str]:
    """``scontrol show job`` as a dict (``JobState``, ``Restarts``, ...); empty once Slurm forgot the job."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        return {}
    return dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5):
    """Polls ``predicate()`` until it returns something truthy; fails the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def wait_job_done(job_id: str, timeout: float, output: Path | None = None) -> dict[str, str]:
    """Waits until the job reaches a final state; the assertion message holds its output file's tail."""
    try:
        return wait_for(
            lambda: (info := job_info(job_id)) and info.get("JobState") in FINAL_STATES and info,
            timeout,
            f"job {job_id} to finish",
        )
    except AssertionError as err:
        tail = output.read_text()[-4000:] if output is not None and output.exists() else ""
        raise AssertionError(f"{err}; state {job_info(job_id).get('JobState')}; output tail:\n{tail}") from None


def cancel(job_id: str | None) -> None:
    """``scancel`` that never raises (for ``finally`` blocks)."""
    if job_id:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=15, check=False)


def run_srun(cmd: list[str], timeout: float, job_name: str) -> subprocess.CompletedProcess:
    """Runs an ``srun`` command line with output captured (:func:`tests.helpers.wait`; on timeout srun gets a
    SIGTERM first, which it forwards to the job step); whatever happens, the job named ``job_name`` is
    cancelled and the process group killed.
    """
    try:
        return wait(start(cmd, env=slurm_env()), timeout, term_grace=15)
    finally:
        subprocess.run(["scancel", "--name", job_name], capture_output=True, timeout=15, check=False)


def jobcomp_records(job_id: str) -> list[dict[str, str]]:
    """The job's lines in the jobcomp/filetxt log, one per run (a requeued run first, as ``JobState=PENDING``),
    when the cluster writes one (local_cluster.sh does); empty otherwise."""
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=15)
    conf = dict(re.findall(r"^(\w+)\s*=\s*(.*?)\s*$", out.stdout, re.M))
    if conf.get("JobCompType") != "jobcomp/filetxt" or not conf.get("JobCompLoc"):
        return []
    try:
        lines = Path(conf["JobCompLoc"]).read_text().splitlines()
    except OSError:
        return []
    return [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in lines if f"JobId={job_id} " in line]
