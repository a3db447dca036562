"""Three torchft replica groups of the regression (``python -m lit_ddp.ft.launch``), a frozen group and a late one
(issue 61): group_1 SIGSTOPped mid-training, then group_2 SIGKILLed a few steps before the end, so that its restart
comes back after the others finished. The launcher ends the frozen group (its committed step stands while the others
commit) and starts it again, and it heals from the survivors; the late group is not let train alone on its stale
state, and the launcher names it and exits non-zero: the job never ends 0 with groups apart."""

from __future__ import annotations

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
STALL_S = 8  # the launcher's --stall_timeout_s
TIMEOUT_S = 5  # the strategy's timeout: what the frozen group costs the survivors' all-reduce


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
        "--trainer.strategy.init_args.timeout", f"0:00:0{TIMEOUT_S}",
        "--trainer.max_steps", str(MAX_STEPS), "--trainer.max_epochs", "-1", "--trainer.limit_val_batches", "0",
        "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip
    return start(cmd, env=subprocess_env(OMP_NUM_THREADS="1", RUST_LOG="error"))


@pytest.mark.timeout(450)
def test_a_frozen_group_is_restarted_and_heals_a_late_one_never_trains_alone(tmp_path: Path, seed: int) -> None:
    """group_1 is SIGSTOPped at a step drawn from the seed: group_0 and group_2 keep their processes and commit
    steps without it (after one ``timeout``); once its step has stood ``--stall_timeout_s`` while theirs moved, the
    launcher SIGKILLs it and starts it again, and it heals from them (its first step back at theirs). group_2 is
    SIGKILLed four steps before ``max_steps``: the others finish before its restart is back, which then has no live
    group to heal from; it is ended without training, and the launcher exits 1 with one line naming group_2. group_0
    and group_1 end at ``max_steps`` with the same state, every tensor."""
    freeze_at = random.Random(seed).randrange(15, 40)
    print(f"group_1 frozen at step {freeze_at} (seed {seed})")
    trace, release = tmp_path / "trace", tmp_path / "release"
    job = launch(tmp_path, trace, release)
    out: list[str] = []
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
        late = None
        while late is None:
            rows = steps(trace, "group_2")
            if rows and rows[-1][2] >= MAX_STEPS - 4:
                late = rows[-1][1]
                os.kill(late, signal.SIGKILL)
            assert job.poll() is None and time.monotonic() < deadline, "the survivors did not near the end"
            time.sleep(0.01)
        done = wait(job, timeout=90)
        out.append(done.stdout)
    finally:
        if frozen is not None and Path(f"/proc/{frozen}").exists():
            os.kill(frozen, signal.SIGCONT)  # fcd05a0's launcher never ends it
        if job.poll() is None:
            job.kill()
    log = "".join(out)
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

    assert job.returncode == 1, log[-3000:]
    assert re.search(r"the groups did not end with one model: group_2's final state differs from group_0's", log), log
    assert "group_2 has not trained since its start" in log or "group_2 found no live group to heal from" in log, log
    (step_0, params_0), (step_1, params_1) = (final_parameters(tmp_path / "runs" / g) for g in ("group_0", "group_1"))
    assert step_0 == step_1 == MAX_STEPS
    assert all(torch.equal(params_0[k], params_1[k]) for k in params_0), "group_0's and group_1's weights differ"
