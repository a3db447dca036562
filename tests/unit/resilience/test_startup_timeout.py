"""StartupTimeout: the strategy creates its process group with the start-up timeout and gets its own back."""

from __future__ import annotations

from datetime import timedelta

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy

from lit_ddp import compat
from lit_ddp.resilience.startup_timeout import StartupTimeout


def trainer_with(strategy: object, tmp_path) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, default_root_dir=tmp_path)


def test_arm_lengthens_the_start_up_and_teardown_restores_the_collective_timeout(tmp_path) -> None:
    trainer = trainer_with(DDPStrategy(timeout=timedelta(minutes=5)), tmp_path)
    callback = StartupTimeout()
    callback.arm(trainer)
    callback.arm(trainer)  # a second arm (fit, then validate) keeps the collective timeout it saw first
    assert compat.strategy_timeout(trainer.strategy) == timedelta(minutes=30)
    callback.teardown(trainer, trainer.lightning_module, "fit")  # a start-up that failed, or ended
    assert compat.strategy_timeout(trainer.strategy) == timedelta(minutes=5)


def test_a_longer_collective_timeout_or_none_is_left_alone(tmp_path) -> None:
    long = trainer_with(DDPStrategy(timeout=timedelta(hours=1)), tmp_path)
    StartupTimeout().arm(long)
    assert compat.strategy_timeout(long.strategy) == timedelta(hours=1)
    single = trainer_with("auto", tmp_path)  # one device: no process group, no timeout
    StartupTimeout().arm(single)
    assert compat.strategy_timeout(single.strategy) is None


def test_a_non_positive_timeout_is_named() -> None:
    with pytest.raises(ValueError, match="startup.timeout=0:00:00 must be positive"):
        StartupTimeout(timedelta(0))
