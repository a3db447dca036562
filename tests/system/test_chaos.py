"""``lit-ddp chaos`` (issue 23, first part): faults from outside at moments drawn from a seed, and the
verdict of a bit-for-bit comparison with an uninterrupted run; it also catches a run that does not resume
exactly. Its bad uses: ``tests/unit/launch/test_chaos.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.callbacks import NudgeOnResume
from tests.helpers import Runner, callback, compose, lit_ddp, write_callbacks_config

# 80 epochs of 28 steps on 2 processes (about 20 s here), a checkpoint every 50 steps.
REGRESSION = [
    *compose("trainer/ddp", "checkpoint/fault_tolerant", "regression/fault_tolerant"),
    "--trainer.max_epochs",
    "80",
]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_chaos_under_torchrun_finds_the_run_exact(tmp_path: Path, runner: Runner, seed: int) -> None:
    """Two faults, a SIGKILL of a worker or a SIGTERM of the job, drawn from the seed: the tool exits 0 with a
    line per fault and the verdict. (A frozen worker, ``--kinds hang``, costs a minute: the hung-worker tests of
    ``test_regression_cli.py`` and ``test_slurm_multinode.py`` cover it.)"""
    cmd = lit_ddp("chaos", "--launcher", "torchrun", "--nproc_per_node", "2", "--faults", "2", "--kinds", "kill",
                  "term", "--seed", str(seed), "--root", str(tmp_path), "--", *REGRESSION)  # fmt: skip
    result = runner.run(cmd, timeout=540)
    assert result.returncode == 0, result.stdout[-6000:]
    assert f"seed {seed}" in result.stdout and "identical: the faulted run ends bit for bit" in result.stdout
    table = result.stdout.split("newest checkpoint before")[1].splitlines()[1:3]
    assert [line.split()[0] for line in table] == ["1", "2"], result.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_chaos_catches_a_run_that_does_not_resume_exactly(tmp_path: Path, runner: Runner, seed: int) -> None:
    """One process, a callback (by class path, as a user's would be) that changes a weight when the fit resumes:
    one kill, and the tool exits 1 naming the first differing tensor."""
    nudge = write_callbacks_config(tmp_path / "nudge.yaml", callback(NudgeOnResume))
    fit = [*compose("regression/single_device", "checkpoint/fault_tolerant"), "--config", str(nudge)]
    fit += ["--trainer.max_epochs", "80", "--trainer.devices", "1"]
    cmd = lit_ddp(
        "chaos", "--faults", "1", "--kinds", "kill", "--seed", str(seed), "--root", str(tmp_path / "c"), "--", *fit
    )
    result = runner.run(cmd, timeout=240)
    assert result.returncode == 1, result.stdout[-6000:]
    assert "DIFFERENT: first at state_dict/net." in result.stdout, result.stdout[-3000:]
