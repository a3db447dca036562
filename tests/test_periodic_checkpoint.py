"""PeriodicCheckpoint: the step trigger and the time trigger together, the time decision taken off the step
(read one step after rank zero made it)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from lightning.pytorch import Trainer

from lit_ddp.callbacks import PeriodicCheckpoint
from lit_ddp.data.regression import RegressionDataModule
from lit_ddp.tasks.regression import RegressionModule


def saved_steps(tmp_path: Path, every: int, interval: timedelta | None) -> list[int]:
    ckpt = PeriodicCheckpoint(
        dirpath=tmp_path / "ckpt",
        filename="{step}",
        every_n_train_steps=every,
        train_time_interval=interval,
        monitor="step",
        mode="max",
        save_top_k=-1,
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(RegressionModule(), RegressionDataModule(num_samples=512))
    return sorted(int(p.stem.split("=")[1]) for p in (tmp_path / "ckpt").glob("step=*.ckpt"))


@pytest.mark.parametrize(
    ("every", "interval", "expected"),
    [
        (4, timedelta(hours=1), [4]),  # time never due: the step trigger alone
        (4, timedelta(0), [2, 3, 4, 5, 6]),  # due after every step, acted on one step later, plus step 4
        (0, timedelta(0), [2, 3, 4, 5, 6]),  # the time trigger alone
    ],
)
def test_step_and_time_triggers(tmp_path: Path, every: int, interval: timedelta, expected: list[int]) -> None:
    assert saved_steps(tmp_path, every, interval) == expected
