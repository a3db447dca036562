"""Your own LightningModule and DataModule under lit-ddp: a small classifier of seeded Gaussian blobs.

What a model of yours needs for lit-ddp to resume it exactly (docs/your_model.md says why):

- the train loader is a ``StatefulDataLoader`` (torchdata) whose sampler is lit-ddp's ``GlobalOrderSampler``: its
  position in the epoch goes into every checkpoint, the same on any number of processes;
- what is summed over an epoch lives in torchmetrics ``Metric`` objects (lit-ddp saves and restores their states);
- randomness comes from torch's, numpy's or Python's global generators (lit-ddp saves each rank's);
- the hyperparameters are plain values (checkpoints are loaded weights-only).

    .venv/bin/python -m lit_ddp fit --config configs/trainer/ddp.yaml --config examples/your_model.yaml
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchmetrics import Accuracy, MeanMetric

from lit_ddp.data.samplers import GlobalOrderSampler, evaluation_sampler


class BlobsDataModule(LightningDataModule):
    """Points in ``num_features`` dimensions around ``num_classes`` seeded centres; items ``(x, y)``, ``x`` of shape
    ``(num_features,)``, ``y`` a class index.

    Args:
        num_samples: points, train and validation together.
        num_features: dimensions of a point.
        num_classes: blobs, one class each.
        batch_size: points per process and step.
        num_workers: DataLoader worker processes per rank.
    """

    def __init__(
        self, num_samples: int = 4096, num_features: int = 16, num_classes: int = 4, batch_size: int = 32,
        num_workers: int = 0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()  # no work here: every rank runs __init__, setup builds the data

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        g = torch.Generator().manual_seed(0)  # the data's own seed: the same tensors on every rank
        centres = torch.randn(hp.num_classes, hp.num_features, generator=g)
        y = torch.randint(hp.num_classes, (hp.num_samples,), generator=g)
        x = centres[y] + 2 * torch.randn(hp.num_samples, hp.num_features, generator=g)  # blobs that overlap
        n_val = hp.num_samples // 8
        self.train_set = TensorDataset(x[n_val:], y[n_val:])
        self.val_set = TensorDataset(x[:n_val], y[:n_val])

    def train_dataloader(self) -> StatefulDataLoader:
        # GlobalOrderSampler: this rank's shard of one global order per epoch, and its position in every checkpoint.
        sampler = GlobalOrderSampler(self.train_set)
        return StatefulDataLoader(
            self.train_set, batch_size=self.hparams.batch_size, sampler=sampler, num_workers=self.hparams.num_workers
        )

    def val_dataloader(self) -> StatefulDataLoader:
        sampler = evaluation_sampler(self.val_set, self.trainer)  # each point once, on any number of processes
        return StatefulDataLoader(self.val_set, batch_size=self.hparams.batch_size, sampler=sampler)


class Classifier(LightningModule):
    """A two-layer MLP with dropout: ``(B, num_features)`` to ``(B, num_classes)`` logits.

    Args:
        num_features: input dimensions (the data's).
        num_classes: classes (the data's).
        hidden: hidden units.
        dropout: dropout probability (random masks: a resume must restore each rank's generator).
        learning_rate: AdamW's.
    """

    def __init__(
        self, num_features: int = 16, num_classes: int = 4, hidden: int = 64, dropout: float = 0.1,
        learning_rate: float = 1e-2,
    ) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(num_features, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, num_classes)
        )
        self.train_loss = MeanMetric()  # an epoch's running mean: a torchmetrics state, saved with the run
        self.val_accuracy = Accuracy(task="multiclass", num_classes=num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.train_loss(loss.detach())
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_accuracy.update(logits, y)
        self.log("val/loss", F.cross_entropy(logits, y), on_epoch=True, sync_dist=True, prog_bar=True)
        self.log("val/accuracy", self.val_accuracy, on_epoch=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)
