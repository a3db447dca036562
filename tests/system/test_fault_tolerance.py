"""Fault tolerance end to end: runs killed mid-epoch and resumed end bit-identical to uninterrupted runs.

Every run is the real CLI in a subprocess (``python -m lit_ddp``); the kill schedule and the records come from
``tests.callbacks`` callbacks added through a YAML fragment, for what a fault from outside cannot arrange: a
truncated last.ckpt met on resume. Sizes are tiny: a few epochs of a few steps. torchrun restarts under faults
from outside at random moments: ``tests/system/test_chaos.py`` (``lit-ddp chaos``).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from tests.callbacks import KillAtSteps
from tests.helpers import QUIET, Runner, callback, compose, lit_ddp, load_records, tensorboard_steps

# The README's fault-tolerant compositions: DDP, the step's config, the checkpointing fragment (and for minGPT
# its fault-tolerant fragment over cpu.yaml).
REGRESSION_FT = ("trainer/ddp", "checkpoint/fault_tolerant", "regression/fault_tolerant")
MINGPT_FT = ("trainer/ddp", "mingpt/cpu", "checkpoint/fault_tolerant", "mingpt/fault_tolerant")


def regression_args(steps: int, every: int) -> list[str]:
    # 288 samples: 252 train, 8 batches of 32 per epoch in one process, 4 per rank in two.
    return [
        *compose(*REGRESSION_FT),
        "--data.num_samples", "288",
        "--trainer.max_epochs", "-1",
        "--trainer.max_steps", str(steps),
        "--checkpoint.every_n_train_steps", str(every),
        "--trainer.log_every_n_steps", "1",
        *QUIET,
    ]  # fmt: skip


def mingpt_args(steps: int, every: int, text: Path) -> list[str]:
    return [
        *compose(*MINGPT_FT),
        "--data.path", str(text),
        "--data.block_size", "16",
        "--data.batch_size", "8",
        "--model.warmup_steps", "2",
        "--trainer.max_steps", str(steps),
        "--trainer.val_check_interval", "5",
        "--trainer.limit_val_batches", "2",
        "--checkpoint.every_n_train_steps", str(every),
        "--trainer.log_every_n_steps", "1",
        *QUIET,
    ]  # fmt: skip


def one_process(args: list[str]) -> list[str]:
    return [*args, "--trainer.devices", "1", "--trainer.strategy", "auto"]


def assert_same_params(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) and a
    for ra, rb in zip(a, b, strict=True):
        assert ra["global_step"] == rb["global_step"]
        for name, tensor in rb["params"].items():
            assert torch.equal(ra["params"][name], tensor), f"parameter {name} differs"


def assert_same_tensorboard(resumed: Path, reference: Path) -> None:
    """Every scalar tag at the same steps, each once, as in the uninterrupted run."""
    got, want = tensorboard_steps(resumed), tensorboard_steps(reference)
    assert got.keys() == want.keys()
    # ThroughputMonitor logs its validate/* points against its own per-process counter, not the global step.
    for tag in [t for t in want if not t.startswith("validate/")]:
        assert sorted(got[tag]) == sorted(want[tag]), tag
    loss_tag = "train/loss_step" if "train/loss_step" in got else "train/loss"
    assert got[loss_tag] == sorted(set(got[loss_tag])), "train loss steps strictly increasing, no duplicates"


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("task", ["regression", "mingpt"])
def test_one_process_resume_is_exact(
    task: str, tmp_path: Path, request: pytest.FixtureRequest, runner: Runner, recorder
) -> None:
    """Killed twice (SIGKILL, mid-epoch) and re-run with the same command: same parameters, same TensorBoard
    steps as the uninterrupted run. The second resume also meets a truncated last.ckpt and falls back."""
    if task == "regression":
        args, kills = one_process(regression_args(20, 4)), [5, 10]
    else:
        text = request.getfixturevalue("tiny_text")
        # mingpt: asynchronous saves, to show they are as exact.
        args = one_process(mingpt_args(14, 4, text))
        args += ["--trainer.plugins", "lit_ddp.resilience.checkpoint_io.AsyncAtomicCheckpointIO"]
        kills = [6, 11]
    ref_cb, ref_rec = recorder("ref")
    out = runner.fit(*args, "--config", str(ref_cb), "--trainer.default_root_dir", str(tmp_path / "ref"), timeout=120)
    assert out.returncode == 0, out.stdout[-3000:]

    state = tmp_path / "state"
    cb, rec = recorder("ft", callback(KillAtSteps, steps=kills, state_dir=str(state)))
    root = tmp_path / "run"
    cmd = lit_ddp("fit", *args, "--config", str(cb), "--trainer.default_root_dir", str(root))
    for attempt in range(len(kills) + 1):
        if attempt == 2:  # a kill while writing last.ckpt, as far as a reader can tell
            last = root / "checkpoints" / "last.ckpt"
            last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
        out = runner.run(cmd, 120)
        if attempt < len(kills):
            assert out.returncode == -signal.SIGKILL, out.stdout[-3000:]
        else:
            assert out.returncode == 0, out.stdout[-3000:]
    assert "last.ckpt is truncated or unreadable" in out.stdout
    [final], [reference] = load_records(rec), load_records(ref_rec)
    assert_same_params([final], [reference])
    # The last resume: the step-8 checkpoint, below the kill at 10/11; the regression's trigger at step 8 falls on
    # an epoch's end, after which it validates: saved at step 9.
    assert final["start_step"] == (9 if task == "regression" else 8)
    assert final["optimizer_steps"] == reference["global_step"] - final["start_step"]
    assert_same_tensorboard(root, tmp_path / "ref")
    assert not list(root.glob("version_*"))
