"""A torchft heal puts back what a resume from disk puts back (issue 59): two replica groups whose fit has a
precision plugin with a GradScaler's kind of state and a callback with a state of its own; group_1 SIGKILLed
mid-training, restarted by the launcher and healed from group_0. At the end the two groups' checkpoints hold the
same weights, the same precision state and the same callback state: the healed group took its peer's, not its own
stale ones (a heal that restored only the module, optimizers, schedulers, loop, loaders, RNG and metrics left both
behind)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.callbacks import ScalerLikePrecision, StepsSeen, StepTrace
from tests.helpers import callback, compose, start, subprocess_env, wait, write_callbacks_config
from tests.system.test_torchft import steps

pytest.importorskip("torchft")

MAX_STEPS = 120


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_a_heal_restores_the_precision_plugin_and_the_callbacks_too(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    callbacks = write_callbacks_config(
        tmp_path / "callbacks.yaml",
        callback(StepTrace, directory=str(trace), sleep={"group_0": 0.2, "group_1": 0.25}, indices=True),
        callback(StepsSeen),
    )
    plugin = tmp_path / "precision.yaml"
    plugin.write_text(f"trainer:\n  plugins:\n    - class_path: {ScalerLikePrecision.__module__}.ScalerLikePrecision\n")
    cmd = [
        sys.executable, "-m", "lit_ddp.ft.launch", "--replica_groups", "2", "--root", str(tmp_path / "runs"),
        "--max_restarts", "1", "--heartbeat_timeout_ms", "1000", "--",
        "fit", *compose("trainer/torchft", "regression/single_device"), "--config", str(callbacks),
        "--config", str(plugin), "--trainer.max_steps", str(MAX_STEPS), "--trainer.max_epochs", "-1",
        "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
        "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip
    proc = start(cmd, env=subprocess_env(OMP_NUM_THREADS="1", RUST_LOG="warn"))
    try:
        deadline = time.monotonic() + 240
        while len(steps(trace, "group_1")) < 15:
            assert proc.poll() is None and time.monotonic() < deadline, "group_1 did not train"
            time.sleep(0.2)
        victim = steps(trace, "group_1")[-1][1]
        os.kill(victim, signal.SIGKILL)
        done = wait(proc, timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert done.returncode == 0, done.stdout[-3000:]
    back = [step for _, pid, step in steps(trace, "group_1") if pid != victim]
    survivor = [step for _, _, step in steps(trace, "group_0")]
    assert back and back[0] > 15, f"group_1 came back at step {back[:1]} (not healed to the survivor's)"
    assert max(survivor) == MAX_STEPS

    final = {
        g: torch.load(tmp_path / "runs" / g / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        for g in ("group_0", "group_1")
    }
    first, second = final["group_0"], final["group_1"]
    assert first["global_step"] == second["global_step"] == MAX_STEPS
    assert all(torch.equal(first["state_dict"][k], second["state_dict"][k]) for k in first["state_dict"])
    assert first["ScalerLikePrecision"]["steps"] == second["ScalerLikePrecision"]["steps"] == MAX_STEPS, (
        "the healed group's precision plugin counts other steps than its peer's"
    )
    assert torch.equal(first["ScalerLikePrecision"]["scale"], second["ScalerLikePrecision"]["scale"])
    [key] = [k for k in first["callbacks"] if k.startswith("StepsSeen")]
    assert first["callbacks"][key] == second["callbacks"][key] == {"steps": MAX_STEPS}, (
        "the healed group's callback counts other steps than its peer's"
    )
    print(f"\ngroup_1 back at step {back[0]} after its SIGKILL; both groups end with the same weights, scale "
          f"{float(first['ScalerLikePrecision']['scale'])} and callback state {first['callbacks'][key]}")  # fmt: skip
