"""lit_ddp.ft.launch's rules for ending a group, lit_ddp.ft.progress's record and lit_ddp.ft.fingerprint's final
comparison, without processes (the whole launcher: tests/system/test_torchft_liveness.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lit_ddp.ft import fingerprint, progress
from lit_ddp.ft.launch import ended_why, parse_args


def test_a_group_whose_step_stands_while_another_commits_is_ended() -> None:
    """Frozen: its step stood longer than the limit while another group committed; not when nobody commits (a lost
    lighthouse, a validation all groups run) nor when another only started (its first record), nor within the limit,
    nor before its first record (starting up)."""
    seen = {0: (50, 100.0), 1: (20, 80.0), 2: (50, 100.0)}
    committed = {0: 100.0, 2: 100.0}
    assert "committed no step for 30 s (since step 20)" in str(ended_why(1, seen, committed, None, 110.0, 25))
    assert ended_why(1, seen, committed, None, now=100.0, stall_s=25) is None  # within the limit
    assert ended_why(0, seen, committed, None, now=200.0, stall_s=25) is None  # the others did not commit after it
    assert ended_why(1, seen, {}, None, now=200.0, stall_s=25) is None  # the others only started: no commit
    assert ended_why(3, seen, committed, None, now=500.0, stall_s=25) is None  # no record yet


def test_after_a_group_finished_no_other_trains_alone() -> None:
    """A group finished at step 100 at t=50: one that has not trained since is ended (nothing is left to heal it);
    one that commits a lower step after that trains alone on a stale state: ended; one at the final step gets the
    limit to finish."""
    final = (100, 50.0)
    assert "nothing to heal from" in str(ended_why(1, {}, {}, final, now=51.0, stall_s=25))
    stale = ended_why(1, {1: (42, 51.0)}, {1: 51.0}, final, now=51.5, stall_s=25)
    assert "trains alone on a stale state" in str(stale)
    assert ended_why(1, {1: (42, 51.0)}, {1: 40.0}, final, now=51.5, stall_s=25) is None  # not since the end
    assert "nothing to heal from" in str(ended_why(1, {1: (42, 51.0)}, {}, final, now=51.5, stall_s=25))
    assert ended_why(1, {1: (100, 49.0)}, {1: 49.0}, final, now=60.0, stall_s=25) is None
    assert "did not finish within 25 s" in str(ended_why(1, {1: (100, 49.0)}, {1: 49.0}, final, now=80.0, stall_s=25))


def test_min_replicas_above_the_groups_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        parse_args(["--replica_groups", "2", "--min_replicas", "3", "--", "fit"])
    assert (
        refused.value.code == 2
        and "--min_replicas 3 must be between 1 and --replica_groups 2" in capsys.readouterr().err
    )


def test_the_progress_record_is_rewritten_in_place(tmp_path: Path) -> None:
    path = tmp_path / "group_0.progress"
    assert progress.read(path) is None
    writer = progress.ProgressWriter(str(path), "runs/x/group_0")
    writer.write(3)
    writer.write(4, finished=True)
    record = progress.read(path)
    assert record is not None and record["step"] == 4 and record["finished"] and record["run_dir"] == "runs/x/group_0"
    assert path.stat().st_size == progress.RECORD_BYTES and oct(path.stat().st_mode & 0o777) == "0o600"
    writer.close()
    path.write_text('{"step": 5, "ti')  # read mid-write: no record, the reader keeps its last
    assert progress.read(path) is None
    os.remove(path)
    os.symlink(tmp_path / "elsewhere", path)
    with pytest.raises(OSError):
        progress.ProgressWriter(str(path), "runs")  # a planted link is not written through


def save(run_dir: Path, step: int, weight: torch.Tensor, loaders: int = 0) -> None:
    (run_dir / "checkpoints").mkdir(parents=True)
    ckpt = {
        "global_step": step,
        "state_dict": {"w": weight},
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "loops": {"loaders": loaders},  # differs between groups by design: not compared
        "torchft": {"step": step, "batches_committed": 2 * step},
    }
    torch.save(ckpt, run_dir / "checkpoints" / "last.ckpt")


def test_the_groups_final_states_are_compared_every_tensor(tmp_path: Path) -> None:
    """Equal weights, step and torchft state: one model, whatever the loaders' positions; the lowest mantissa bit of
    one weight changed, a step behind or no checkpoint: one line naming the group."""
    w = torch.tensor([1.0, 2.0, 3.0])
    save(tmp_path / "group_0", 10, w)
    save(tmp_path / "group_1", 10, w.clone(), loaders=1)
    flipped = w.clone()
    flipped.view(torch.int32)[1] ^= 1
    save(tmp_path / "group_2", 10, flipped)
    save(tmp_path / "group_3", 9, w.clone())
    groups = {g: tmp_path / g for g in ("group_0", "group_1")}
    assert fingerprint.first_difference(groups) is None
    found = fingerprint.first_difference({**groups, "group_2": tmp_path / "group_2"})
    assert found == "group_2's final state differs from group_0's (state_dict; global_step 10 against 10)"
    found = fingerprint.first_difference({**groups, "group_3": tmp_path / "group_3"})
    assert (
        found is not None and found.startswith("group_3's final state differs") and "global_step 9 against 10" in found
    )
    assert fingerprint.first_difference({**groups, "group_4": tmp_path / "group_4"}) == (
        f"group_4 has no final checkpoint ({tmp_path}/group_4/checkpoints/last.ckpt)"
    )
    assert fingerprint.main([f"group_0={tmp_path / 'group_0'}", f"group_2={tmp_path / 'group_2'}"]) == 1


def test_a_group_with_a_stopped_process_is_told_apart() -> None:
    """Where no group commits (a stopped worker of a group of several keeps the others waiting in their quorum), a
    group whose process tree holds a stopped process is the one to end; a running tree is not."""
    import signal
    import subprocess

    from lit_ddp.ft.launch import stopped_why

    child = subprocess.Popen(["sleep", "60"])
    try:
        assert stopped_why(child.pid, 7, 12.0) is None
        os.kill(child.pid, signal.SIGSTOP)
        for _ in range(100):  # the state changes asynchronously
            if (why := stopped_why(child.pid, 7, 12.0)) is not None:
                break
        assert why == f"has a stopped process (pid {child.pid}) and committed no step for 12 s (since step 7)"
    finally:
        child.kill()
        child.wait()
