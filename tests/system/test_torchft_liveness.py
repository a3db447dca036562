"""Three torchft replica groups of the regression (``python -m lit_ddp.ft.launch``) through a frozen group, a lost
lighthouse and a late group (issue 61): group_1 SIGSTOPped mid-training, then the lighthouse SIGKILLed, then group_2
SIGSTOPped a few steps before the end and woken after the others finished. The launcher ends the
frozen group (its committed step stands while the others commit) and starts it again, and it heals from the
survivors; the lighthouse comes back at its address and nobody restarts; the late group is not let train alone on
its stale state, and the launcher names it and exits non-zero: the job never ends 0 with groups apart."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.callbacks import StepTrace
from tests.helpers import callback, compose, start, subprocess_env, wait, write_callbacks_config
from tests.system.test_torchft import final_parameters, steps

pytest.importorskip("torchft")

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

MAX_STEPS = 400
HOLD_AT = 70  # the survivors wait here until the frozen group's restart has begun (a test's moment, not a race)
# Sized for this 2-core VM beside another test: at 5 s, a new quorum's gloo connection after the lighthouse's restart
# timed out there (a group then stood and was restarted), which this test's survivors must not be.
STALL_S = 16  # the launcher's --stall_timeout_s
TIMEOUT_S = 10  # the strategy's timeout: what the frozen group costs the survivors' all-reduce
GROUPS = ("group_0", "group_1", "group_2")


def launch(tmp: Path, trace: Path, release: Path) -> subprocess.Popen:
    held = {"hold_at": HOLD_AT, "hold_until": str(release)}
    callbacks = write_callbacks_config(
        tmp / "trace.yaml",
        callback(StepTrace, directory=str(trace), sleep=dict.fromkeys(("group_0", "group_1", "group_2"), 0.03),
                 indices=True, **held),
    )  # fmt: skip
    cmd = [
        sys.executable, "-m", "lit_ddp.ft.launch", "--replica_groups", "3", "--root", str(tmp / "runs"),
        "--heartbeat_timeout_ms", "1000", "--stall_timeout_s", str(STALL_S), "--max_restarts", "2", "--",
        "fit", *compose("trainer/torchft", "regression/single_device"), "--config", str(callbacks),
        "--trainer.strategy.init_args.timeout", f"0:00:{TIMEOUT_S:02d}",
        "--trainer.max_steps", str(MAX_STEPS), "--trainer.max_epochs", "-1", "--trainer.limit_val_batches", "0",
        "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip
    return start(cmd, env=subprocess_env(OMP_NUM_THREADS="1", RUST_LOG="error"))


@pytest.mark.timeout(450)
def test_a_frozen_group_a_lost_lighthouse_and_a_late_group(tmp_path: Path, seed: int) -> None:
    """group_1 is SIGSTOPped at a step drawn from the seed: group_0 and group_2 keep their processes and commit
    steps without it (after one ``timeout``); once its step has stood ``--stall_timeout_s`` while theirs moved, the
    launcher SIGKILLs it and starts it again, and it heals from them (its first step back at theirs). Then the
    lighthouse is SIGKILLed: the launcher starts it again at the address it printed, and the groups train on through
    its restart, none of them restarted. group_2 is SIGSTOPped four steps before ``max_steps`` and woken once the
    others have finished (as fcd05a0 let it, it would train alone from its stale step to the end and exit 0): the
    launcher ends it and does not start it again (nothing is left to heal it from), and exits 1 with one line naming
    group_2. group_0 and group_1 end at ``max_steps`` with the same weights."""
    freeze_at = random.Random(seed).randrange(15, 40)
    print(f"group_1 frozen at step {freeze_at} (seed {seed})")
    trace, release = tmp_path / "trace", tmp_path / "release"
    job = launch(tmp_path, trace, release)
    assert job.stdout is not None
    out = [job.stdout.readline()]  # the launcher's first line: the lighthouse, its address and pid
    found = re.search(r"lighthouse (http://\S+) \(bind \S+\) pid (\d+)", out[0])
    assert found, out[0]
    address, lighthouse = found.group(1), int(found.group(2))
    frozen = None
    try:
        deadline = time.monotonic() + 90
        while not all(steps(trace, g) and steps(trace, g)[-1][2] >= freeze_at for g in ("group_0", "group_1")):
            assert job.poll() is None and time.monotonic() < deadline, "the groups did not train"
            time.sleep(0.05)
        frozen = steps(trace, "group_1")[-1][1]
        survivors = {g: steps(trace, g)[-1][1] for g in ("group_0", "group_2")}
        os.kill(frozen, signal.SIGSTOP)
        frozen_at, frozen_step = time.time(), steps(trace, "group_1")[-1][2]
        deadline = time.monotonic() + 60
        while Path(f"/proc/{frozen}").exists():  # until the launcher ends it
            assert job.poll() is None and time.monotonic() < deadline, "group_1 was not ended"
            time.sleep(0.1)
        ended_at = time.time()
        release.touch()  # the survivors, held at HOLD_AT, go on while group_1 starts again
        deadline = time.monotonic() + 90
        while not (back := [row for row in steps(trace, "group_1") if row[1] != frozen]):
            assert job.poll() is None and time.monotonic() < deadline, "group_1 did not train again"
            time.sleep(0.1)
        os.kill(lighthouse, signal.SIGKILL)
        lost_at, lost_step = time.time(), max(steps(trace, g)[-1][2] for g in GROUPS)
        while not all(steps(trace, g)[-1][2] > lost_step + 5 for g in GROUPS):
            assert job.poll() is None and time.monotonic() < deadline, "the groups did not go on after the lighthouse"
            time.sleep(0.1)
        late = None
        while late is None:  # group_2 frozen four steps before the end, woken once the others have finished
            rows = steps(trace, "group_2")
            if rows and rows[-1][2] >= MAX_STEPS - 4:
                late = rows[-1][1]
                os.kill(late, signal.SIGSTOP)
            assert job.poll() is None and time.monotonic() < deadline, "the survivors did not near the end"
            time.sleep(0.01)
        while steps(trace, "group_0")[-1][2] < MAX_STEPS:
            assert job.poll() is None and time.monotonic() < deadline, "the survivors did not finish"
            time.sleep(0.05)
        time.sleep(1)  # their last save and exit
        # It may now train alone from its stale step: the launcher must not let it. On a slow machine the launcher
        # may have ended it already, stopped while the others finished (either ending is asserted below).
        with contextlib.suppress(ProcessLookupError):
            os.kill(late, signal.SIGCONT)
        done = wait(job, timeout=90)
        out.append(done.stdout)
    finally:
        if frozen is not None and Path(f"/proc/{frozen}").exists():
            os.kill(frozen, signal.SIGCONT)  # fcd05a0's launcher never ends it
        if job.poll() is None:
            job.kill()
    log = "".join(out)
    (tmp_path / "launcher.log").write_text(log)
    print(log[-3000:])

    during = {g: [s for t, pid, s in steps(trace, g) if frozen_at < t < back[0][0]] for g in survivors}
    assert all({pid for _, pid, _ in steps(trace, g)} == {survivors[g]} for g in ("group_0",)), "group_0 restarted"
    assert all(during[g] and max(during[g]) > frozen_step for g in during), "the survivors did not commit meanwhile"
    assert re.search(r"group_1 committed no step for \d+ s \(since step \d+\) while another group did: SIGKILLed", log)
    first_back = back[0][2]
    print(
        f"\ngroup_1 frozen at step {frozen_step}; ended {ended_at - frozen_at:.1f} s later (limit {STALL_S} s); "
        f"back at step {first_back} {back[0][0] - frozen_at:.1f} s after the freeze; the survivors committed "
        f"{len(during['group_0'])} steps meanwhile ({frozen_step} -> {max(during['group_0'])})"
    )
    assert first_back >= HOLD_AT, "group_1 did not heal to the survivors' step"

    restarted = re.search(r"lighthouse exited with -9: restarted at (\S+) pid \d+", log)
    assert restarted and restarted.group(1) == address, log[-3000:]
    pids = {g: {pid for t, pid, _ in steps(trace, g) if t > lost_at} for g in GROUPS}
    assert pids["group_0"] == {survivors["group_0"]} and pids["group_1"] == {back[0][1]}, "restarted with it"
    rows = steps(trace, "group_0")
    pause = max(b[0] - a[0] for a, b in zip(rows, rows[1:], strict=False) if a[0] >= lost_at - 1)
    print(
        f"the lighthouse SIGKILLed at step {lost_step}: restarted at {address}; the groups' longest pause {pause:.1f} s"
    )

    assert job.returncode == 1, log[-3000:]
    assert re.search(r"the groups did not end with one model: group_2's final state differs from group_0's", log), log
    assert re.search(
        r"group_2 (committed step \d+ after a group finished|did not finish within|has a stopped process).*: SIGKILLed",
        log,
    )
    assert "group_2 exited with -9; a group has finished: not restarted" in log, log[-3000:]
    (step_0, params_0), (step_1, params_1) = (final_parameters(tmp_path / "runs" / g) for g in ("group_0", "group_1"))
    assert step_0 == step_1 == MAX_STEPS
    assert all(torch.equal(params_0[k], params_1[k]) for k in params_0), "group_0's and group_1's weights differ"
