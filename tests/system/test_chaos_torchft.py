"""``lit-ddp chaos --launcher torchft`` (issue 54): two replica groups of the regression on CPU, one group's worker
SIGKILLed at a moment drawn from the seed; the report's facts per fault (no survivor restarted, the survivors
stepped while the group was down), the groups bit-identical at the end, the calibrated verdict. The launcher alone:
``tests/system/test_torchft.py``; chaos's options: ``tests/unit/chaos/test_chaos.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.callbacks import StepTrace
from tests.helpers import Runner, callback, compose, lit_ddp, write_callbacks_config

pytest.importorskip("torchft")

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def fault_rows(stdout: str) -> list[list[str]]:
    """The rows of the torchft fault table: number, kind, group, "pid", pid, at s, at step, survivor restarts,
    lost s, steps while down, back s."""
    lines = stdout.split("back s")[1].splitlines()[1:]
    return [line.split() for line in lines if line.strip() and line.split()[0].isdigit()]


@pytest.mark.timeout(200)
def test_chaos_kills_a_replica_group_and_the_other_goes_on(tmp_path: Path, runner: Runner, seed: int) -> None:
    """The report's facts: no survivor restart, the survivor's steps while group_1 was down, group_1 back, the
    groups bit-identical, the calibrated verdict (within 3 x the spread of a rerun with another seed).
    Three runs of 400 steps (two uninterrupted, one faulted), each step slowed by 20 ms so that the killed group's
    restart (its imports, seconds on this VM) comes while the survivor still trains; the lighthouse's heartbeat
    timeout 2 s, so that the survivor goes on alone before the group is back."""
    slow = write_callbacks_config(
        tmp_path / "slow.yaml",
        callback(StepTrace, directory=str(tmp_path / "trace"), sleep={"group_0": 0.02, "group_1": 0.02}),
    )
    cmd = lit_ddp("chaos", "--launcher", "torchft", "--replica_groups", "2", "--heartbeat_timeout_ms", "2000",
                  "--faults", "1", "--kinds", "kill", "--seed", str(seed), "--root", str(tmp_path / "chaos"),
                  "--timeout", "120", "--",
                  "fit", *compose("trainer/torchft", "regression/single_device"), "--config", str(slow),
                  "--trainer.max_steps", "400", "--trainer.max_epochs", "-1", "--trainer.limit_val_batches", "0",
                  "--trainer.num_sanity_val_steps", "0")  # fmt: skip
    result = runner.run(cmd, timeout=190, OMP_NUM_THREADS="1", RUST_LOG="warn")
    print(result.stdout)
    faulted = tmp_path / "chaos" / "faulted.log"
    log = faulted.read_text()[-4000:] if faulted.exists() else ""
    assert f"seed {seed}" in result.stdout, result.stdout
    rows = fault_rows(result.stdout)
    assert len(rows) == 1 and rows[0][1:3] == ["kill", "group_1"], result.stdout
    restarts, lost, during, back = rows[0][7:11]
    assert restarts == "0", result.stdout  # the survivor kept its process
    assert back != "-" and int(during) > 0, result.stdout + log  # it stepped on alone; the group came back
    assert "groups: group_0, group_1 end identical, bit for bit" in result.stdout, result.stdout + log
    assert "group_0: within 3 x the spread of two uninterrupted runs (seeds " in result.stdout
    assert result.returncode == 0, result.stdout + log
