"""Per-step fault tolerance with torchft (lit_ddp.ft) on CPU: two replica groups of one process each, launched by
``python -m lit_ddp.ft.launch`` with the lighthouse on loopback; one group SIGKILLed mid-training."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.callbacks import StepTrace
from tests.helpers import callback, compose, start, subprocess_env, wait, write_callbacks_config

pytest.importorskip("torchft")

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def launch(tmp_path: Path, trace: Path, max_steps: int, sleep: dict[str, float], *extra: str) -> subprocess.Popen:
    callbacks = write_callbacks_config(tmp_path / "trace.yaml", callback(StepTrace, directory=str(trace), sleep=sleep))
    cmd = [
        sys.executable, "-m", "lit_ddp.ft.launch", "--replica_groups", "2", "--root", str(tmp_path / "runs"),
        *extra, "--",
        "fit", *compose("trainer/torchft", "regression/single_device"), "--config", str(callbacks),
        "--trainer.max_steps", str(max_steps), "--trainer.max_epochs", "-1", "--trainer.limit_val_batches", "0",
        "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip
    return start(cmd, env=subprocess_env(OMP_NUM_THREADS="1", RUST_LOG="warn"))


def steps(trace: Path, group: str) -> list[tuple[float, int, int]]:
    """(time, pid, global step) of each training batch the group ran."""
    path = trace / f"{group}.txt"
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines() if line.count(" ") == 2]
    return [(float(t), int(pid), int(step)) for t, pid, step in rows]


def final_parameters(run_dir: Path) -> tuple[int, dict[str, torch.Tensor]]:
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    return ckpt["global_step"], ckpt["state_dict"]


@pytest.mark.timeout(150)
def test_a_killed_group_stops_no_one_and_heals_from_its_peer(tmp_path: Path) -> None:
    """group_1 is SIGKILLed mid-training (group_0 then waits in the all-reduce for it, group_1 being slower): group_0
    keeps its process and steps on during the outage; the launcher restarts group_1, which heals from group_0 and
    ends with parameters identical to group_0's, bit for bit."""
    trace = tmp_path / "trace"
    proc = launch(tmp_path, trace, 150, {"group_0": 0.05, "group_1": 0.1}, "--max_restarts", "1")
    try:
        deadline = time.monotonic() + 90
        while not (len(steps(trace, "group_1")) >= 20 and len(steps(trace, "group_0")) >= 20):
            assert proc.poll() is None and time.monotonic() < deadline, "the groups did not both train"
            time.sleep(0.2)
        survivor_pid, victim_pid = steps(trace, "group_0")[-1][1], steps(trace, "group_1")[-1][1]
        os.kill(victim_pid, signal.SIGKILL)
        killed_at = time.time()
        done = wait(proc, timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert done.returncode == 0, done.stdout[-3000:]

    survivor, victim = steps(trace, "group_0"), steps(trace, "group_1")
    assert {pid for _, pid, _ in survivor} == {survivor_pid}, "the survivor's process was restarted"
    back = [row for row in victim if row[1] != victim_pid]
    assert back, "group_1 never stepped again"
    back_at, _, back_step = back[0]
    during = [step for t, _, step in survivor if killed_at < t < back_at]
    before = max(step for t, _, step in survivor if t <= killed_at)
    gaps = [b[0] - a[0] for a, b in zip(survivor, survivor[1:], strict=False) if a[0] >= killed_at - 1]
    print(
        f"\ntorchft: group_1 killed at survivor step {before}; the survivor made {len(during)} steps "
        f"({before} -> {max(during, default=before)}) during the outage, its longest pause {max(gaps):.2f} s; "
        f"group_1 stepped again {back_at - killed_at:.2f} s after the kill, at step {back_step}"
    )
    assert len(during) > 0 and max(during) > before, "the survivor did not step during the outage"
    assert back_step > before, "the restarted group did not heal to the survivor's step"

    (step_0, params_0), (step_1, params_1) = (final_parameters(tmp_path / "runs" / g) for g in ("group_0", "group_1"))
    assert step_0 == step_1 == 150
    assert params_0.keys() == params_1.keys()
    assert all(torch.equal(params_0[k], params_1[k]) for k in params_0), "the groups' final parameters differ"
