"""The DDP tutorial's toy regression: 20 features -> 1 target.

Source: pytorch/examples ``distributed/ddp-tutorial-series`` (``single_gpu.py``, ``multigpu.py``,
``multigpu_torchrun.py``, ``multinode.py``, ``datautils.py``).

The tutorial trains ``Linear(20, 1)`` with ``torch.nn.functional.cross_entropy``. On a single output column the softmax is
identically 1, so that loss is constantly 0 and the model never learns. Here the loss is the mean squared
error, and by default the targets are a fixed random linear map of the inputs plus small noise, so that
learning is measurable (the tutorial's purely random targets remain available as ``random_targets``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchmetrics import MeanSquaredError, R2Score

from lit_ddp.callbacks import resumable_sampler


class RegressionDataModule(LightningDataModule):
    """A seeded synthetic regression dataset, split into train and val.

    Every rank builds the same tensors (cheap, seeded), in ``setup``. Items are ``(x, y)`` with ``x`` of
    shape ``(num_features,)`` and ``y`` of shape ``(1,)``; a batch is ``((B, num_features), (B, 1))``.

    Args:
        num_samples: total samples, train and val together (the tutorial's 2048).
        num_features: input features (the tutorial's 20).
        val_fraction: fraction of the samples held out for validation, in (0, 1).
        batch_size: samples per device and step (the tutorial's ``--batch_size``).
        noise_std: standard deviation of the Gaussian noise added to the targets.
        random_targets: the tutorial's targets, uniform noise unrelated to the inputs: nothing can be learnt.
        data_seed: seed of the data (inputs, the linear map, the noise); independent of ``seed_everything``.
        num_workers: DataLoader worker processes per rank.

    Raises:
        ValueError: a size, fraction or batch size out of range.
    """

    def __init__(
        self,
        num_samples: int = 2048,
        num_features: int = 20,
        val_fraction: float = 0.125,
        batch_size: int = 32,
        noise_std: float = 0.01,
        random_targets: bool = False,
        data_seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if num_samples < 2:
            raise ValueError(f"num_samples={num_samples} must be at least 2")
        if num_features < 1:
            raise ValueError(f"num_features={num_features} must be at least 1")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
        if batch_size <= 0:
            raise ValueError(f"data.batch_size={batch_size} must be a positive integer (samples per device)")
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be >= 0")
        self.save_hyperparameters()
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    @staticmethod
    def make_tensors(
        num_samples: int, num_features: int, noise_std: float, random_targets: bool, data_seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole dataset: inputs ``(N, num_features)`` and targets ``(N, 1)``, both float32."""
        g = torch.Generator().manual_seed(data_seed)
        if random_targets:  # the tutorial's datautils.MyTrainDataset: inputs and targets both uniform
            return torch.rand(num_samples, num_features, generator=g), torch.rand(num_samples, 1, generator=g)
        x = torch.randn(num_samples, num_features, generator=g)
        weight = torch.randn(num_features, 1, generator=g)
        bias = torch.randn(1, generator=g)
        y = x @ weight + bias + noise_std * torch.randn(num_samples, 1, generator=g)
        return x, y

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        x, y = self.make_tensors(hp.num_samples, hp.num_features, hp.noise_std, hp.random_targets, hp.data_seed)
        n_val = max(1, round(hp.num_samples * hp.val_fraction))
        n_train = hp.num_samples - n_val
        self.train_set = TensorDataset(x[:n_train], y[:n_train])
        self.val_set = TensorDataset(x[n_train:], y[n_train:])

    def train_dataloader(self) -> StatefulDataLoader:
        # Shuffled, and resumable mid-epoch with or without DDP (Lightning's own DDP sampler is not).
        return StatefulDataLoader(
            self.train_set,
            batch_size=self.hparams.batch_size,
            sampler=resumable_sampler(self.train_set),
            num_workers=self.hparams.num_workers,
        )

    def val_dataloader(self) -> StatefulDataLoader:
        return StatefulDataLoader(
            self.val_set, batch_size=self.hparams.batch_size, shuffle=False, num_workers=self.hparams.num_workers
        )


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
        self.val_mse(preds, y)
        self.val_r2(preds.squeeze(-1), y.squeeze(-1))
        self.log("val/loss", self.val_mse, on_epoch=True, prog_bar=True)
        self.log("val/r2", self.val_r2, on_epoch=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate, momentum=self.hparams.momentum)
