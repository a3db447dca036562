"""Per-step fault tolerance with torchft (lit_ddp.ft) when every replica group is lost: the launcher's whole process
group (lighthouse and both groups) SIGKILLed mid-training, the launcher started again on the same root. Each group
resumes from its own run directory's newest checkpoint (the usual automatic resume); group_1's newest ones are
removed first, so that the groups resume at different steps and the first quorum heals group_1 from group_0 (torchft
heals from the group at the highest step: the manager's step must follow the restored ``global_step``)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lit_ddp.run_dir.checkpoints import ranked_checkpoints
from tests.callbacks import StepTrace
from tests.helpers import callback, compose, descendants, start, subprocess_env, wait, write_callbacks_config
from tests.system.test_torchft import steps, trained

pytest.importorskip("torchft")

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

MAX_STEPS = 200
EVERY = 10  # steps between checkpoints


def launch(root: Path, trace: Path, nproc: int) -> subprocess.Popen:
    callbacks = write_callbacks_config(
        root / "trace.yaml",
        callback(StepTrace, directory=str(trace), sleep={"group_0": 0.03, "group_1": 0.03}, indices=True),
    )
    cmd = [
        sys.executable, "-m", "lit_ddp.ft.launch", "--replica_groups", "2", "--root", str(root / "runs"),
        "--max_restarts", "0", "--nproc_per_group", str(nproc), "--",
        "fit", *compose("trainer/torchft", "regression/single_device", "checkpoint/fault_tolerant"),
        "--config", str(callbacks), "--checkpoint.every_n_train_steps", str(EVERY),
        "--trainer.max_steps", str(MAX_STEPS), "--trainer.max_epochs", "-1", "--trainer.limit_val_batches", "0",
        "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip
    return start(cmd, env=subprocess_env(OMP_NUM_THREADS="1", RUST_LOG="warn"))


def checkpoints(root: Path, group: str) -> list[tuple[int, str]]:
    """(global step, path) of the group's checkpoints, newest first."""
    return ranked_checkpoints(str(root / "runs" / group))


@pytest.mark.timeout(250)
@pytest.mark.parametrize("nproc", [1, 2], ids=["groups of 1 process", "groups of 2 processes"])
def test_every_group_lost_resumes_from_disk_and_heals_the_older_from_the_newer(tmp_path: Path, nproc: int) -> None:
    """Both groups (and the lighthouse) are SIGKILLed at once; group_1's checkpoints newer than group_0's newest
    less EVERY steps are removed (as if its last saves had been lost; the kill may itself have cut one). Started
    again, each group resumes from its own newest checkpoint, group_1 EVERY steps behind group_0; the first quorum
    heals group_1 from group_0, whose step is the higher (group_0 never goes back), both train to max_steps, and
    their final checkpoints hold the same parameters and optimizer states, bit for bit, and torchft's manager at
    max_steps."""
    trace = tmp_path / "trace"
    first = launch(tmp_path, trace, nproc)
    try:
        deadline = time.monotonic() + 60
        while len(steps(trace, "group_1")) < 2 * EVERY + 5:  # both groups past two checkpoints together
            assert first.poll() is None and time.monotonic() < deadline, "the groups did not both train"
            time.sleep(0.2)
        # The launcher, its lighthouse and both groups, torchrun's workers too (in sessions of their own).
        for pid in [first.pid, *descendants(first.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        first.wait(timeout=10)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    killed_pids = {pid for g in ("group_0", "group_1") for _, pid, _ in steps(trace, g)}
    killed_at = {g: max(s for _, _, s in steps(trace, g)) for g in ("group_0", "group_1")}

    saved = {g: [step for step, _ in checkpoints(tmp_path, g)] for g in ("group_0", "group_1")}
    newest_0 = saved["group_0"][0]
    # The kill lands at a moment nobody chose: one group may have finished its save at newest_0 while the other was
    # still writing it (or had it one step later); each then holds the save before it.
    assert newest_0 - EVERY in saved["group_1"], f"the groups' checkpoints (steps): {saved}"
    for step, path in checkpoints(tmp_path, "group_1"):
        if step > newest_0 - EVERY:
            os.remove(path)
    newest_1 = checkpoints(tmp_path, "group_1")[0][0]
    assert newest_1 == newest_0 - EVERY > 0

    restarted_at = time.time()
    second = launch(tmp_path, trace, nproc)
    done = wait(second, timeout=120)  # two groups' start-ups, 180 steps, their exits (6 to 14 s each, here)
    assert done.returncode == 0, done.stdout[-3000:]

    resumed = {
        m.group(2): int(m.group(1))
        for m in re.finditer(r"torchft: the manager resumes at step (\d+) \(\S*?(group_\d)\S*\)", done.stdout)
    }
    assert resumed == {"group_0": newest_0, "group_1": newest_1}, done.stdout[-3000:]
    back = {g: [row for row in steps(trace, g) if row[1] not in killed_pids] for g in ("group_0", "group_1")}
    after = {g: trained(trace, g)[len(steps(trace, g)) - len(back[g]) :] for g in ("group_0", "group_1")}
    first_step = {g: after[g][0][0] for g in after}
    print(
        f"\ntorchft, every group lost: killed at steps {killed_at['group_0']} (group_0), {killed_at['group_1']} "
        f"(group_1); resumed from disk at steps {newest_0} (group_0) and {newest_1} (group_1, its newer checkpoints "
        f"removed); first step after the restart: group_0 {first_step['group_0']} after "
        f"{back['group_0'][0][0] - restarted_at:.1f} s, group_1 {first_step['group_1']} after "
        f"{back['group_1'][0][0] - restarted_at:.1f} s (from the launcher's start)"
    )
    assert first_step["group_0"] == newest_0, "group_0 did not continue from its checkpoint"
    assert first_step["group_1"] == newest_0, "group_1 did not heal from group_0, the group at the highest step"
    assert min(step for step, _, _ in after["group_0"]) == newest_0, "group_0 went back to an older step"

    final = {
        g: torch.load(tmp_path / "runs" / g / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        for g in ("group_0", "group_1")
    }
    for ckpt in final.values():
        assert ckpt["global_step"] == MAX_STEPS
        assert ckpt["torchft"]["step"] == MAX_STEPS, "torchft's manager did not follow the restored global_step"
    for key in ("state_dict", "optimizer_states"):
        leaves_0, leaves_1 = (torch.utils._pytree.tree_flatten(final[g][key])[0] for g in ("group_0", "group_1"))
        pairs = zip(leaves_0, leaves_1, strict=True)
        same = [torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in pairs]
        assert all(same), f"the groups' final {key} differ"
