"""``lit-ddp chaos --launcher torchft`` (issues 54, 61): replica groups of the regression on CPU, faults at moments
drawn from the seed: two groups, one group's worker SIGKILLed; three groups, a kill during a heal, a hang and the
lighthouse lost. The report's facts per fault (no survivor restarted, the survivors stepped while the group was down),
the groups bit-identical at the end, the calibrated verdict. The launcher alone:
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


def run_chaos(
    tmp_path: Path,
    runner: Runner,
    groups: int,
    chaos: list[str],
    fit: list[str],
    sleep: float,
    timeout: float,
    rust_log: str,
) -> tuple[str, str]:
    """``lit-ddp chaos --launcher torchft`` over ``groups`` groups of the regression, each step of the faulted run
    slowed by ``sleep`` seconds (:class:`~tests.callbacks.StepTrace`; the uninterrupted runs go at full speed);
    ``chaos``: its options, ``fit``: the fit's beyond the regression's. Returns chaos's output and the end of the
    faulted run's log."""
    names = [f"group_{i}" for i in range(groups)]
    trace = callback(StepTrace, directory=str(tmp_path / "trace"), sleep=dict.fromkeys(names, sleep), under="faulted")
    slow = write_callbacks_config(tmp_path / "slow.yaml", trace)
    cmd = lit_ddp("chaos", "--launcher", "torchft", "--replica_groups", str(groups), *chaos,
                  "--root", str(tmp_path / "chaos"), "--",
                  "fit", *compose("trainer/torchft", "regression/single_device"), "--config", str(slow), *fit,
                  "--trainer.max_epochs", "-1", "--trainer.limit_val_batches", "0",
                  "--trainer.num_sanity_val_steps", "0")  # fmt: skip
    result = runner.run(cmd, timeout=timeout, OMP_NUM_THREADS="1", RUST_LOG=rust_log)
    print(result.stdout)
    faulted = tmp_path / "chaos" / "faulted.log"
    log = faulted.read_text()[-4000:] if faulted.exists() else ""
    assert result.returncode == 0, result.stdout + log
    return result.stdout, log


@pytest.mark.timeout(600)
def test_chaos_kills_a_replica_group_and_the_other_goes_on(tmp_path: Path, runner: Runner, seed: int) -> None:
    """The report's facts: no survivor restart, the survivor's steps while group_1 was down, group_1 back, the
    groups bit-identical, the calibrated verdict (within 3 x the spread of a rerun with another seed).
    Three runs of 400 steps (two uninterrupted, one faulted). The fault comes by step 205 at the latest (chaos's
    ``delay x S / 2`` steps after the groups' first common step), and the faulted run's steps are slowed by 70 ms,
    so that the survivor still trains at least 195 x 70 ms = 14 s later: the killed group's restart (its imports,
    then the heal) took 5.1 s on a quiet day here, and more than the 6 s that 20 ms steps left in a full suite run.
    The lighthouse's heartbeat timeout 2 s, so that the survivor goes on alone before the group is back."""
    chaos = ["--heartbeat_timeout_ms", "2000", "--faults", "1", "--kinds", "kill", "--seed", str(seed),
             "--timeout", "180"]  # fmt: skip
    fit = ["--trainer.max_steps", "400"]
    stdout, log = run_chaos(tmp_path, runner, 2, chaos, fit, sleep=0.07, timeout=560, rust_log="warn")
    assert f"seed {seed}" in stdout, stdout
    rows = fault_rows(stdout)
    assert len(rows) == 1 and rows[0][1:3] == ["kill", "group_1"], stdout
    restarts, lost, during, back = rows[0][7:11]
    assert restarts == "0", stdout  # the survivor kept its process
    assert back != "-" and int(during) > 0, stdout + log  # it stepped on alone; the group came back
    assert "groups: group_0, group_1 end identical, bit for bit" in stdout, stdout + log
    assert "group_0: within 3 x the spread of two uninterrupted runs (seeds " in stdout


@pytest.mark.timeout(1500)
def test_chaos_three_groups_a_kill_during_a_heal_a_hang_and_the_lighthouse(
    tmp_path: Path, runner: Runner, seed: int
) -> None:
    """Three groups, the faults issue 61 adds, in an order drawn from the seed: ``heal`` (a group SIGKILLed, then its
    restart SIGKILLed again in its first step, as it heals), ``hang`` (a group SIGSTOPped: the launcher ends it once
    its step has stood ``--stall_timeout_s`` while the others commit, and it heals) and ``lighthouse`` (SIGKILLed,
    started again at its address). Per fault: no survivor restarted, the hit group back with the others; the three
    groups end identical bit for bit (the launcher's own check, and chaos's), and the calibrated verdict holds."""
    chaos = ["--heartbeat_timeout_ms", "1000", "--stall_timeout_s", "8", "--faults", "3", "--kinds", "heal", "hang",
             "lighthouse", "--seed", str(seed), "--timeout", "500"]  # fmt: skip
    fit = ["--trainer.strategy.init_args.timeout", "0:00:05", "--trainer.max_steps", "1000"]
    stdout, log = run_chaos(tmp_path, runner, 3, chaos, fit, sleep=0.02, timeout=1450, rust_log="error")
    assert f"seed {seed}" in stdout, stdout
    rows = fault_rows(stdout)
    assert sorted(row[1] for row in rows) == ["hang", "heal", "lighthouse"], stdout
    for row in rows:
        restarts, back = row[7], row[10]
        assert restarts == "0" and back != "-", stdout + log  # nobody else restarted; the group came back
    assert "lit_ddp.ft.launch: every group finished with the same state" in log, log
    assert "groups: group_0, group_1, group_2 end identical, bit for bit" in stdout, stdout + log
