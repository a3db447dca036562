"""lit_ddp.run_dir.lock: one live job per run directory, released by the kernel when its holder dies."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lit_ddp.run_dir.lock import HOLDER_FILE, RunDirectoryBusy, hold_run_directory, job_rank

HOLD = "import sys, time; from lit_ddp.run_dir.lock import hold_run_directory as h; h(sys.argv[1], {}); print('held', flush=True); time.sleep(120)"


@pytest.mark.parametrize(
    ("env", "rank"),
    [
        ({}, 0),
        ({"RANK": "0", "LOCAL_RANK": "0"}, 0),  # torchrun
        ({"RANK": "3", "LOCAL_RANK": "1"}, 3),
        ({"SLURM_PROCID": "1", "SLURM_STEP_ID": "0"}, 1),  # srun
        ({"SLURM_PROCID": "0", "SLURM_JOB_ID": "7"}, 0),  # a Slurm batch script (no step): Lightning launches
        ({"LOCAL_RANK": "1"}, None),  # a process Lightning's launcher started
        ({"NODE_RANK": "1"}, None),
    ],
)
def test_job_rank(env: dict[str, str], rank: int | None) -> None:
    assert job_rank(env) == rank


def test_a_second_holder_is_refused_until_the_first_dies(tmp_path: Path) -> None:
    root = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirectoryBusy, match=f"{root} is in use by another live job \\(pid {holder.pid} on "):
            hold_run_directory(str(root), {})
        assert not hold_run_directory(str(root), {"LOCAL_RANK": "1"})  # not rank zero: not its business
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    deadline = time.monotonic() + 10
    assert hold_run_directory(str(root), {})  # the kernel released it with the process
    assert hold_run_directory(str(root), {}), "a second fit in the same process holds it already"
    assert time.monotonic() < deadline
    assert str(__import__("os").getpid()) in (root / HOLDER_FILE).read_text()


def test_a_remote_directory_is_not_locked(recwarn: pytest.WarningsRecorder) -> None:
    assert hold_run_directory("memory://bucket/run", {}) is False
