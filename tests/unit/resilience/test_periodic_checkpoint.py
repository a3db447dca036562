"""PeriodicCheckpoint: the step trigger and the time trigger together, the time decision taken off the step
(read one step after rank zero made it)."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_ddp.data.regression import RegressionDataModule
from lit_ddp.resilience.periodic_checkpoint import PeriodicCheckpoint
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


def test_lightning_skips_the_validation_after_a_checkpoint_written_before_it(tmp_path: Path) -> None:
    """Why PeriodicCheckpoint moves such a save: Lightning's ModelCheckpoint saves at step 4 (in
    ``on_train_batch_end``), before the validation due after it; a run resumed from there to step 6 runs no
    validation, where the uninterrupted run validated after step 4 (the discrepancy of
    Lightning-AI/pytorch-lightning#14579). When the resumed run validates once, Lightning has changed this:
    revisit the move."""
    from lightning.pytorch import Callback
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Validations(Callback):
        count = 0

        def on_validation_start(self, trainer: Trainer, pl_module) -> None:
            self.count += 0 if trainer.sanity_checking else 1

    def fit(max_steps: int, *callbacks: Callback, ckpt_path: str | None = None) -> None:
        trainer = Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, val_check_interval=4,
                          enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                          callbacks=list(callbacks))  # fmt: skip
        trainer.fit(RegressionModule(), RegressionDataModule(num_samples=288, batch_size=32), ckpt_path=ckpt_path)

    fit(4, ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=4, save_top_k=-1))
    validations = Validations()
    fit(6, validations, ckpt_path=str(tmp_path / "ckpt" / "step=4.ckpt"))
    assert validations.count == 0


def test_a_trigger_before_validation_or_an_epoch_end_saves_at_the_next_step(tmp_path: Path) -> None:
    """Epochs of 8 batches, validation every 4 and at each epoch's end: the trigger at steps 4 and 12 (validation
    follows) saves at 5 and 13, the one at 8 (the epoch ends) at 9, each after the validation ran; the run's last
    step (16) is last.ckpt's."""
    ckpt = PeriodicCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=4, monitor="step",
                              mode="max", save_top_k=-1, save_last=True)  # fmt: skip
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=16, callbacks=[ckpt], logger=False, val_check_interval=4,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(RegressionModule(), RegressionDataModule(num_samples=288, batch_size=32))
    assert trainer.num_training_batches == 8
    assert sorted(int(p.stem.split("=")[1]) for p in (tmp_path / "ckpt").glob("step=*.ckpt")) == [5, 9, 13]
    for step in (5, 13):  # the epoch's validation batches so far (a new epoch starts its count at 0)
        loops = torch.load(tmp_path / "ckpt" / f"step={step}.ckpt", weights_only=False)["loops"]["fit_loop"]
        assert loops["epoch_loop.val_loop.batch_progress"]["total"]["completed"] > 0, step
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 16


def test_resume_keeps_top_k_and_one_last(tmp_path: Path) -> None:
    """Saves made while the time trigger is swapped in keep the state key a resume looks up: the resumed run
    still deletes beyond save_top_k and overwrites last.ckpt (no last-v1.ckpt)."""

    def fit(max_steps: int, ckpt_path: str | None) -> PeriodicCheckpoint:
        ckpt = PeriodicCheckpoint(
            dirpath=tmp_path / "ckpt",
            every_n_train_steps=2,
            train_time_interval=timedelta(hours=1),
            monitor="step",
            mode="max",
            save_top_k=2,
            save_last=True,
        )
        trainer = Trainer(
            accelerator="cpu", devices=1, max_steps=max_steps, callbacks=[ckpt], logger=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
        )  # fmt: skip
        trainer.fit(RegressionModule(), RegressionDataModule(num_samples=512), ckpt_path=ckpt_path)
        return ckpt

    fit(6, None)
    resumed = fit(10, str(tmp_path / "ckpt" / "last.ckpt"))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "epoch=0-step=10.ckpt", "epoch=0-step=8.ckpt", "last.ckpt",
    ]  # fmt: skip
    assert set(resumed.best_k_models) == {str(tmp_path / "ckpt" / f"epoch=0-step={s}.ckpt") for s in (8, 10)}


def test_no_save_inside_a_gradient_accumulation_window(tmp_path: Path) -> None:
    """With accumulate_grad_batches=2 and a time trigger that falls due at either micro-batch, every checkpoint is written at a
    window's end: a save between its micro-batches would lose the partial gradients (issue 21, item 6)."""
    from lightning.pytorch import Callback

    from lit_ddp import compat

    class MidWindow(Callback):
        def __init__(self) -> None:
            self.saves: list[bool] = []

        def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
            self.saves.append(compat.should_accumulate(trainer))

        def on_train_batch_start(self, *args) -> None:
            time.sleep(0.03)  # the 0.05 s interval passes every second micro-batch, at either place in a window

    ckpt = PeriodicCheckpoint(
        dirpath=tmp_path / "ckpt",
        train_time_interval=timedelta(seconds=0.05),
        monitor="step",
        mode="max",
        save_top_k=-1,
    )
    probe = MidWindow()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=12, accumulate_grad_batches=2, callbacks=[ckpt, probe], logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(RegressionModule(), RegressionDataModule(num_samples=512))
    assert probe.saves and not any(probe.saves), probe.saves


def test_a_run_says_where_it_resumed_saves_its_end_and_knows_when_it_finished(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture
) -> None:
    """max_steps=25 with a checkpoint every 10 steps: last.ckpt holds step 25, not 20 (a re-run retrained steps
    21-25); the same command again says it had finished and trains no step; a longer max_steps says where it
    resumed, and its progress bar keeps the epoch's total (issue 25)."""
    import logging

    from lit_ddp.cli import cli_main
    from lit_ddp.run_dir.checkpoints import checkpoint_step
    from tests.helpers import QUIET, REPO

    caplog.set_level(logging.INFO)
    config = ["--config", str(REPO / "configs/regression/single_device.yaml"), "--trainer.default_root_dir", str(tmp_path), "--checkpoint.every_n_epochs", "0", "--checkpoint.every_n_train_steps", "10", *QUIET]  # fmt: skip
    cli_main(["fit", *config, "--trainer.max_steps", "25"])
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert checkpoint_step(str(last)) == 25
    summary = capsys.readouterr().out
    assert f"last checkpoint: {last} (global_step 25)" in summary
    assert "last validation" not in summary, "max_steps ends the run before its first validation"
    saved_at = last.stat().st_mtime_ns
    caplog.clear()
    cli = cli_main(["fit", *config, "--trainer.max_steps", "25"])
    assert cli is not None and cli.trainer.global_step == 25
    assert "Already finished (global_step 25, epoch 0; max_steps=25), nothing to train" in caplog.text
    assert last.stat().st_mtime_ns == saved_at, "a run that trained nothing writes nothing"
    caplog.clear()
    resumed = cli_main(["fit", *config, "--trainer.max_steps", "30", "--trainer.enable_progress_bar", "true"])
    assert f"Resumed from {last} at global_step 25, epoch 0" in caplog.text
    assert resumed is not None
    bar = resumed.trainer.progress_bar_callback.train_progress_bar  # type: ignore[union-attr]
    assert (bar.total, bar.desc, bar.initial) == (56, "Epoch 0: ", 25), "the resumed epoch keeps its total and ETA"
    assert checkpoint_step(str(last)) == 30
    # the end's checkpoint is a mid-epoch one like any other: the longer run continues exactly
    straight = cli_main(["fit", *config, "--trainer.max_steps", "30", "--trainer.default_root_dir", str(tmp_path / "straight")])  # fmt: skip
    assert resumed is not None and straight is not None
    for a, b in zip(resumed.model.parameters(), straight.model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "triggers",
    [
        {},
        {"every_n_train_steps": 50},
        {"train_time_interval": timedelta(minutes=30)},
        {"every_n_epochs": 2},
    ],
)
def test_state_key_is_model_checkpoint_s_for_the_same_triggers(triggers: dict) -> None:
    """Checkpoints written with a trigger alone (filed under the key ModelCheckpoint computes for a subclass of this
    name) resume under the same key: their top-k files and ``last.ckpt`` are known again."""
    options = {"monitor": "val/loss", "mode": "min", **triggers}
    plain = type("PeriodicCheckpoint", (ModelCheckpoint,), {})  # the key's class name is the qualname
    assert PeriodicCheckpoint(**options).state_key == plain(**options).state_key


def test_steps_and_time_keep_their_key() -> None:
    """Both triggers (which ModelCheckpoint refuses together): the key this class has always written."""
    ckpt = PeriodicCheckpoint(every_n_train_steps=50, train_time_interval=timedelta(minutes=30), monitor="step")
    want = "PeriodicCheckpoint{'monitor': 'step', 'mode': 'min', 'every_n_train_steps': 50, 'every_n_epochs': 0, "
    assert ckpt.state_key == want + "'train_time_interval': datetime.timedelta(seconds=1800)}"


def test_epochs_with_a_step_or_time_trigger_refused() -> None:
    with pytest.raises(ValueError, match="every_n_epochs=2 with every_n_train_steps=50"):
        PeriodicCheckpoint(every_n_train_steps=50, every_n_epochs=2)
