"""One live job per run directory (issue 21, item 3): a second launch on a live directory stops at once with one
line naming the holder and touches nothing; once the first job is SIGKILLed the same command resumes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lit_ddp.run_dir.lock import HOLDER_FILE
from tests.helpers import QUIET, Runner, compose, kill_group, lit_ddp, wait

DDP = ["trainer/ddp", "regression/ddp"]


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_second_launch_on_a_live_directory_is_refused(tmp_path: Path, runner: Runner) -> None:
    root = tmp_path / "run"
    args = [*compose(*DDP), "--trainer.default_root_dir", str(root), *QUIET]
    first = runner.start(lit_ddp("fit", *args, "--trainer.max_epochs", "100000", "--checkpoint.every_n_epochs", "1"))
    deadline = time.monotonic() + 120
    while not list((root / "checkpoints").glob("*.ckpt")) and time.monotonic() < deadline and first.poll() is None:
        time.sleep(0.5)
    assert first.poll() is None and (root / HOLDER_FILE).exists(), "the first run did not start"
    events = sorted(p.name for p in root.glob("events.out.tfevents.*"))
    config_mtime = (root / "config.yaml").stat().st_mtime_ns

    started = time.monotonic()
    second = wait(runner.start(lit_ddp("fit", *args, "--trainer.max_epochs", "1")), timeout=60)
    took = time.monotonic() - started
    assert second.returncode == 2, second.stdout[-3000:]
    [line] = [x for x in second.stdout.splitlines() if x.startswith("lit-ddp: error:")]
    assert f"the run directory {root} is in use by another live job (pid {first.pid} on " in line, line
    # Imports and the parse, then the lock: under 10 s on a quiet day; 60 s leaves 3x margin (the refusal itself, not
    # its speed, is what the return code above shows).
    assert took < 60, f"the second launch took {took:.1f} s to stop"
    assert sorted(p.name for p in root.glob("events.out.tfevents.*")) == events, "the second launch wrote a log"
    assert (root / "config.yaml").stat().st_mtime_ns == config_mtime, "the second launch rewrote config.yaml"
    assert first.poll() is None, "the first run must go on"

    kill_group(first)  # SIGKILL: the kernel releases the lock with the process
    first.wait(timeout=30)
    # The same command (max_steps below the checkpoint's step: it resumes and ends at once).
    third = wait(runner.start(lit_ddp("fit", *args, "--trainer.max_epochs", "100000", "--trainer.max_steps", "1")), 120)
    assert third.returncode == 0, third.stdout[-3000:]
    assert "Resuming from" in third.stdout
