"""Helpers for the tests against a real Slurm cluster (``slurm/local_cluster.sh start``).

Every Slurm call has a timeout; jobs are cancelled by the caller in a ``finally``. Training-side callbacks
(:class:`PauseForSignal`, :class:`RecordStart`, :class:`KillWorkerOnce`) are passed to the CLI through a
YAML fragment (``tests.helpers.write_callbacks_config``) and write what they saw as files the test reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lightning.pytorch import Callback, LightningModule, Trainer

from tests.helpers import REPO, subprocess_env

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


def require_cluster() -> None:
    """Skips the test when no Slurm cluster answers; in CI (``CI=true``) fails instead."""
    up, why = cluster_answers()
    if up:
        return
    msg = f"no Slurm cluster answers ({why}); start one with `slurm/local_cluster.sh start`"
    if in_ci():
        pytest.fail(f"CI=true but {msg}", pytrace=False)
    pytest.skip(msg)


def slurm_env(**extra: str) -> dict[str, str]:
    """The environment a job inherits (sbatch/srun export it): this venv first on PATH, the repo importable."""
    env = subprocess_env(**extra)
    env["PATH"] = os.pathsep.join([str(VENV_BIN), env.get("PATH", "")])
    env["LIT_DDP_PYTHON"] = sys.executable
    env["LIT_DDP_TORCHRUN"] = str(VENV_BIN / "torchrun")
    for key in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "TORCHELASTIC_"))]:
        del env[key]  # a test run inside a Slurm job must not leak that job's layout
    return env


def sbatch(script: str, args: list[str], opts: list[str], timeout: float = 30, **env: str) -> str:
    """Submits ``script ARGS`` with sbatch ``OPTS`` from the repo root and returns the job id."""
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


def restart_count() -> int:
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0)


class RecordStart(Callback):
    """Writes ``<out_dir>/start_r<restart>_rank<R>.json`` when fit starts: where this (re)run begins.

    Args:
        out_dir: where to write; created if missing.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        record = {
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "restart_count": os.environ.get("SLURM_RESTART_COUNT"),
            "torchelastic_restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
            "world_size": trainer.world_size,
            "cluster_environment": type(trainer.strategy.cluster_environment).__name__,
        }
        name = f"start_r{restart_count()}_t{record['torchelastic_restart_count'] or 0}_rank{trainer.global_rank}"
        Path(self.out_dir, name + ".json").write_text(json.dumps(record))


class PauseForSignal(Callback):
    """On the first run of a job only, stops every rank after training step ``step`` and waits there.

    Each rank writes ``<out_dir>/paused_rank<R>`` and then sleeps in short slices, so the test can send
    ``scancel --signal=USR1`` at a known step, and Lightning's handler (which saves a checkpoint collectively)
    runs on all ranks at the same point. Gives up after ``max_wait`` seconds.

    Args:
        step: the global step after which to wait.
        out_dir: where the marker files go.
        max_wait: seconds to wait for the signal at most.
    """

    def __init__(self, step: int, out_dir: str, max_wait: float = 120.0) -> None:
        self.step = step
        self.out_dir = out_dir
        self.max_wait = max_wait

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step or restart_count() != 0:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        Path(self.out_dir, f"paused_rank{trainer.global_rank}").write_text(str(os.getpid()))
        deadline = time.monotonic() + self.max_wait
        while time.monotonic() < deadline:  # Python-level sleep: signal handlers run between slices
            time.sleep(0.1)


class KillWorkerOnce(Callback):
    """SIGKILLs global rank ``rank`` when training epoch ``epoch`` starts, once per run directory.

    A marker file (written before the kill) keeps the restarted workers from dying again.

    Args:
        epoch: the zero-based epoch at whose start to die.
        rank: the global rank that dies.
        marker: the marker file's path.
    """

    def __init__(self, epoch: int, rank: int, marker: str) -> None:
        self.epoch = epoch
        self.rank = rank
        self.marker = marker

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.current_epoch == self.epoch and trainer.global_rank == self.rank and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


def run_srun(cmd: list[str], timeout: float, job_name: str) -> subprocess.CompletedProcess:
    """Runs an ``srun`` command line with output captured; on timeout, or whatever happens, the job named
    ``job_name`` is cancelled and the process group killed.
    """
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
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # srun forwards it and ends the step
        out = ""
        with contextlib.suppress(subprocess.TimeoutExpired):
            out, _ = proc.communicate(timeout=15)
        raise AssertionError(f"{cmd} did not finish in {timeout} s; output:\n{out[-5000:]}") from None
    finally:
        subprocess.run(["scancel", "--name", job_name], capture_output=True, timeout=15, check=False)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)
