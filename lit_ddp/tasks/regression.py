"""The DDP tutorial's toy regression: ``Linear(20, 1)`` trained with MSE.

Source: pytorch/examples ``distributed/ddp-tutorial-series`` (``single_gpu.py``, ``multigpu.py``,
``multigpu_torchrun.py``, ``multinode.py``).

The tutorial trains ``Linear(20, 1)`` with ``torch.nn.functional.cross_entropy``. On a single output column the softmax is
identically 1, so that loss is constantly 0 and the model never learns. Here the loss is the mean squared
error (the data: :class:`lit_ddp.data.regression.RegressionDataModule`).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torchmetrics import MeanSquaredError, R2Score


class RegressionModule(LightningModule):
    """The tutorial's ``Linear(num_features, 1)`` trained with MSE and SGD.

    ``forward`` maps ``(B, num_features)`` to ``(B, 1)``. Logged: ``train/loss`` (MSE, per step and per
    epoch), ``val/loss`` (MSE) and ``val/r2`` (coefficient of determination); the epoch values are
    torchmetrics states reduced across all ranks.

    Args:
        num_features: input features.
        learning_rate: SGD learning rate (the tutorial's 1e-3).
        momentum: SGD momentum (the tutorial uses none).
    """

    def __init__(self, num_features: int = 20, learning_rate: float = 1e-3, momentum: float = 0.0) -> None:
        super().__init__()
        if learning_rate <= 0:
            raise ValueError(f"learning_rate={learning_rate} must be > 0")
        self.save_hyperparameters()
        self.net = nn.Linear(num_features, 1)
        self.train_mse = MeanSquaredError()
        self.val_mse = MeanSquaredError()
        self.val_r2 = R2Score()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        preds = self(x)
        loss = F.mse_loss(preds, y)
        self.train_mse(preds.detach(), y)
        self.log("train/loss", self.train_mse, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        preds = self(x)
        # update(), not forward: the epoch value is all that is logged, and R² of a 1-sample batch is undefined.
        self.val_mse.update(preds, y)
        self.val_r2.update(preds.squeeze(-1), y.squeeze(-1))
        stage = "test" if self.trainer.testing else "val"
        self.log(f"{stage}/loss", self.val_mse, on_epoch=True, prog_bar=True)
        self.log(f"{stage}/r2", self.val_r2, on_epoch=True)

    test_step = validation_step  # `lit-ddp test`: the held-out split (RegressionDataModule.test_dataloader)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = cast(Any, self.hparams)  # an AttributeDict of __init__'s arguments
        return torch.optim.SGD(self.parameters(), lr=hp.learning_rate, momentum=hp.momentum)
