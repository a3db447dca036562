"""lit_ddp.tasks.regression: the loss is a real MSE (the tutorial's cross-entropy on one output is always 0)."""

from __future__ import annotations

import torch

from lit_ddp.tasks.regression import RegressionModule


def test_mse_not_cross_entropy(seed: int) -> None:
    """The tutorial's cross_entropy on one output is constantly 0; our loss is a real MSE that learns."""
    torch.manual_seed(seed)
    model = RegressionModule()
    x, y = torch.randn(8, 20), torch.randn(8, 1)
    loss = torch.nn.functional.mse_loss(model(x), y)
    assert loss.item() > 0
    assert torch.nn.functional.cross_entropy(model(x), y).item() == 0.0  # the tutorial's defect


def test_validation_scores_a_one_sample_last_batch(tmp_path) -> None:
    """A validation split that leaves one sample for the last batch (any world size can): R² over the epoch,
    not per batch, so no "needs at least two samples" error."""
    from lightning.pytorch import Trainer

    from lit_ddp.data.regression import RegressionDataModule
    from lit_ddp.tasks.regression import RegressionModule

    dm = RegressionDataModule(num_samples=200, val_fraction=0.125, batch_size=8)  # 25 items: 3 x 8 + 1
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    [scores] = trainer.validate(RegressionModule(), datamodule=dm, verbose=False)
    assert set(scores) == {"val/loss", "val/r2"}
