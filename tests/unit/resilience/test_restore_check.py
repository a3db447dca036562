"""lit_ddp.resilience.restore_check: the first differing entry is named, and a resumed fit stops before its first
step when what it restored is not what its checkpoint holds (a callback editing a weight on resume stands in for a
loading bug)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_ddp.data.regression import RegressionDataModule
from lit_ddp.errors import RestoreMismatchError, UsageError
from lit_ddp.resilience.exact_resume import ExactResume
from lit_ddp.resilience.restore_check import first_mismatch, saved_leaves
from lit_ddp.tasks.regression import RegressionModule
from tests.callbacks import ForgetLoaderPosition, NudgeBeforeTheCheck


def test_first_mismatch_names_the_first_entry_saved_that_differs_or_is_missing() -> None:
    w = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    saved = {"global_step": 6, "parameters/w": w, "rng/torch": torch.arange(3), "parameters/old": w}
    assert first_mismatch(saved, {**saved, "parameters/w": w.clone()}) is None  # equal bits; a key the module lacks
    assert first_mismatch(saved, {**saved, "parameters/w": w.T.contiguous(), "rng/torch": 0}) == "parameters/w"
    assert first_mismatch(saved, {**saved, "parameters/w": w.double()}) == "parameters/w"  # same values, not bits
    assert first_mismatch(saved, {"global_step": 6, "parameters/w": w}) == "rng/torch"
    assert first_mismatch(saved, {**saved, "global_step": 7}) == "global_step"


def fit(
    root: Path, max_steps: int, *callbacks: Callback, ckpt_path: str | None = None, num_workers: int = 0
) -> Trainer:
    save = ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_last=True)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, callbacks=[*callbacks, ExactResume(), save],
        logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=root,
    )  # fmt: skip
    data = RegressionDataModule(num_samples=512, num_workers=num_workers)
    trainer.fit(RegressionModule(), data, ckpt_path=ckpt_path)
    return trainer


def test_a_resume_that_restored_another_state_stops_before_its_first_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fit(tmp_path, 6)
    last = str(tmp_path / "last.ckpt")
    with caplog.at_level(logging.INFO):
        assert fit(tmp_path / "ok", 9, ckpt_path=last).global_step == 9  # restored as saved: trains on
    assert f"Restore check passed: the state restored from {last} is the one saved there (" in caplog.text

    with pytest.raises(RestoreMismatchError, match=r"differs from the one saved there, first at parameters/") as e:
        fit(tmp_path / "nudged", 9, NudgeBeforeTheCheck(), ckpt_path=last)
    assert last in str(e.value) and "nothing was trained" in str(e.value)
    assert not list((tmp_path / "nudged").glob("*.ckpt"))  # no step, no save


def test_a_resume_at_another_data_position_stops_before_its_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saved at step 6 of a 16-batch epoch: a resume that lost the loaders' state would start the epoch over, one
    with another sampler seed would draw other batches; the check names the position or the next batch's indices."""
    fit(tmp_path, 6)
    last = str(tmp_path / "last.ckpt")
    entry = torch.load(last, weights_only=False)["exact_resume"]["per_rank"][0]
    assert entry["positions"][0]["consumed"] == 6 * 32 and len(entry["positions"][0]["next_indices"]) == 32
    with pytest.raises(RestoreMismatchError, match=r"first at loader0/consumed"):
        fit(tmp_path / "forgot", 9, ForgetLoaderPosition(keep_promise=True), ckpt_path=last)
    assert fit(tmp_path / "forgot_all", 9, ForgetLoaderPosition(), ckpt_path=last).global_step == 9  # nothing promised
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")  # the sampler's seed (seed_everything's): the epoch in another order
    with pytest.raises(RestoreMismatchError, match=r"first at loader0/next_indices \(rank 0\): the sampler's seed"):
        fit(tmp_path / "reseeded", 9, ckpt_path=last)


class ReseedLoaderWorkers(Callback):
    """Listed before ExactResume: a resume loads the train loader's state with another seed for its workers, as a
    loader that lost its workers' state does (their random draws, e.g. augmentations, would differ)."""

    def on_load_checkpoint(self, trainer: Trainer, pl_module: object, checkpoint: dict) -> None:
        for entry in checkpoint["exact_resume"]["per_rank"]:
            entry["train_loaders"][0]["_snapshot"]["_main_snapshot"]["_base_seed"] += 1


def test_a_loader_with_workers_compares_its_position_and_its_workers_seed(tmp_path: Path) -> None:
    """With workers, torchdata keeps the sampler's state in the main process's snapshot: the position is recorded
    and compared there too, and so is the seed of the workers' RNGs."""
    fit(tmp_path, 6, num_workers=2)
    last = str(tmp_path / "last.ckpt")
    position = torch.load(last, weights_only=False)["exact_resume"]["per_rank"][0]["positions"][0]
    assert position["consumed"] == 6 * 32 and isinstance(position["worker_seed"], int)
    assert fit(tmp_path / "ok", 9, ckpt_path=last, num_workers=2).global_step == 9
    with pytest.raises(RestoreMismatchError, match=r"first at loader0/worker_seed \(rank 0\): the loader's workers"):
        fit(tmp_path / "reseeded", 9, ReseedLoaderWorkers(), ckpt_path=last, num_workers=2)
    with pytest.raises(RestoreMismatchError, match=r"first at loader0/consumed"):
        fit(tmp_path / "forgot", 9, ForgetLoaderPosition(keep_promise=True), ckpt_path=last, num_workers=2)


@pytest.mark.parametrize(("saved", "live"), [(0, 2), (2, 0), (2, 3)])
def test_a_mid_epoch_resume_with_another_number_of_workers_stops_with_one_message(
    tmp_path: Path, saved: int, live: int
) -> None:
    """torchdata's StatefulDataLoader continues a position only with as many workers (else an AssertionError that
    Lightning's teardown hides behind "Please call `iter(combined_loader)` first"): the run stops before its first
    step, naming both numbers and the setting."""
    fit(tmp_path, 6, num_workers=saved)
    last = str(tmp_path / "last.ckpt")
    message = rf"train loader 0 running {saved} worker processes per rank; this run's has {live} \(data.init_args"
    with pytest.raises(UsageError, match=message):
        fit(tmp_path / "changed", 9, ckpt_path=last, num_workers=live)
    assert not list((tmp_path / "changed").glob("*.ckpt"))


def test_another_world_size_compares_the_state_but_not_the_rng_streams() -> None:
    """Rank r restores rank (r mod n)'s RNG streams there by design; the module and optimizers under DDP are the
    same global state on every rank, and still compared."""
    checkpoint = {"global_step": 6, "state_dict": {"w": torch.ones(2)}, "optimizer_states": [], "lr_schedulers": []}
    same = saved_leaves(checkpoint, {"torch": torch.arange(3)}, tensors=True)
    other = saved_leaves(checkpoint, None, tensors=True)
    assert "rng/torch" in same and not any(k.startswith("rng") for k in other)
    assert other["parameters/w"] is checkpoint["state_dict"]["w"] and other["global_step"] == 6
