"""Fault tolerance end to end, one process re-run after each fault: ``lit-ddp chaos --launcher single`` kills it
from outside at moments drawn from a seed, then a torn last.ckpt meets a second launch of the finished run. Also
the helpers the other fault tests share (the README's fault-tolerant compositions at tiny sizes, and the
comparisons of parameters and TensorBoard steps). torchrun and Slurm under faults: ``tests/system/test_chaos.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lit_ddp.chaos.cli import checkpoint_steps, resumed_steps
from lit_ddp.chaos.compare import compare
from lit_ddp.chaos.job import PHASE_PROBE
from tests.helpers import QUIET, Runner, compose, lit_ddp, tensorboard_steps

# The README's fault-tolerant compositions: DDP, the step's config, the checkpointing fragment (and for minGPT
# its fault-tolerant fragment over cpu.yaml), with deterministic kernels (checkpoint/exact: the bit-for-bit
# proof's mode on any device; on CPUs the kernels are deterministic either way: test_checkpoint_triggers.py's
# regression runs compare bit for bit without it).
REGRESSION_FT = ("trainer/ddp", "checkpoint/fault_tolerant", "checkpoint/exact", "regression/fault_tolerant")
MINGPT_FT = ("trainer/ddp", "mingpt/cpu", "checkpoint/fault_tolerant", "checkpoint/exact", "mingpt/fault_tolerant")


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
@pytest.mark.timeout(600)  # 40-50 s alone; 299 s once beside a 4-process test under make test's two workers
def test_one_process_survives_kills_and_a_torn_last_checkpoint(
    tmp_path: Path, runner: Runner, seed: int, tiny_text: Path
) -> None:
    """One process with asynchronous saves (the writer is a thread), re-run after each fault as a requeue would:
    ``lit-ddp chaos`` SIGKILLs it once mid-step and once while a checkpoint is being written, at moments drawn from
    the seed, and the run ends bit-identical to the uninterrupted one. Then storage tears the finished run's
    last.ckpt (half of it left) and the same command is launched a second time: it warns, resumes from the newest
    step checkpoint, trains the steps after it again and ends identical once more, each TensorBoard point once."""
    fit = one_process(mingpt_args(60, 5, tiny_text))
    fit += ["--trainer.plugins", "lit_ddp.resilience.checkpoint_io.AsyncAtomicCheckpointIO"]
    root = tmp_path / "c"
    chaos = lit_ddp("chaos", "--faults", "2", "--kinds", "kill", "save", "--seed", str(seed), "--root", str(root),
                    "--", *fit)  # fmt: skip
    result = runner.run(chaos, timeout=480)
    assert result.returncode == 0, result.stdout[-6000:] + (root / "faulted.log").read_text()[-6000:]
    assert "identical: the faulted run ends bit for bit" in result.stdout

    run = root / "faulted"
    last = run / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    newest = checkpoint_steps(run)[-1]
    before = len(resumed_steps(run))
    again = lit_ddp("fit", *fit, "--trainer.default_root_dir", str(run), f"--trainer.callbacks+={PHASE_PROBE}")
    out = runner.run(again, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "last.ckpt is truncated or unreadable" in out.stdout
    assert resumed_steps(run)[before:] == [newest], out.stdout[-3000:]
    assert newest < 60
    assert compare(root / "reference", run) is None
    assert_same_tensorboard(run, root / "reference")
    assert not list(run.glob("version_*"))
