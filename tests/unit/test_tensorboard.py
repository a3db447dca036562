"""lit_ddp.tensorboard: reading back what a tiny in-process regression run logged (``regression_run``) with
tensorboard's own reader: the exact scalar tags the README lists, losses, r2, the learning rate, hyperparameters."""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_ddp.tensorboard import read_hparams, read_scalars, scalar_tags

# The exact scalar tags of one-process runs (the README's monitoring section lists them).
REGRESSION_SCALARS = {"train/loss_step", "train/loss_epoch", "val/loss", "val/r2", "lr-SGD", "epoch"}


def test_regression_logs_losses_r2_lr_and_hparams(regression_run: Path) -> None:
    assert set(scalar_tags(regression_run)) == REGRESSION_SCALARS
    val_loss = read_scalars(regression_run, "val/loss")
    assert len(val_loss) == 3  # one per epoch
    assert val_loss[-1][1] < val_loss[0][1]
    assert all(0.0 < r2 <= 1.0 for _, r2 in read_scalars(regression_run, "val/r2")[1:])
    assert all(lr == pytest.approx(1e-3) for _, lr in read_scalars(regression_run, "lr-SGD"))
    steps = [s for s, _ in read_scalars(regression_run, "train/loss_step")]
    assert steps == sorted(steps) and len(steps) >= 3 * 56 // 5 - 1  # 56 steps per epoch, every 5th logged
    hparams, metrics = read_hparams(regression_run)
    assert hparams["learning_rate"] == pytest.approx(1e-3) and hparams["batch_size"] == 32  # model and data
    assert metrics == ["val/loss"]
