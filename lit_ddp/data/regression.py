"""The DDP tutorial's toy regression data: 20 features -> 1 target, seeded and synthetic.

Source: pytorch/examples ``distributed/ddp-tutorial-series`` (``datautils.py``). The tutorial's targets are
uniform noise unrelated to the inputs, so nothing can be learnt; here the targets are by default a fixed
random linear map of the inputs plus small noise (the tutorial's remain available as ``random_targets``).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lit_ddp.data.samplers import GlobalOrderSampler, evaluation_sampler, this_process


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
        hp = cast(Any, self.hparams)  # an AttributeDict of __init__'s arguments
        x, y = self.make_tensors(hp.num_samples, hp.num_features, hp.noise_std, hp.random_targets, hp.data_seed)
        n_val = max(1, round(hp.num_samples * hp.val_fraction))
        n_train = hp.num_samples - n_val
        self.train_set = TensorDataset(x[:n_train], y[:n_train])
        self.val_set = TensorDataset(x[n_train:], y[n_train:])

    def train_dataloader(self) -> StatefulDataLoader:
        # Shuffled, and resumable mid-epoch with or without DDP (Lightning's own DDP sampler is not).
        assert self.train_set is not None, "train_dataloader() is called after setup()"
        hp = cast(Any, self.hparams)
        return StatefulDataLoader(
            self.train_set,
            batch_size=hp.batch_size,
            sampler=GlobalOrderSampler(self.train_set, **this_process(self.trainer)),  # this rank's shard of the data
            num_workers=hp.num_workers,
        )

    def val_dataloader(self) -> StatefulDataLoader:
        assert self.val_set is not None, "val_dataloader() is called after setup()"
        hp = cast(Any, self.hparams)
        sampler = evaluation_sampler(self.val_set, self.trainer)  # each sample once, on any number of processes
        return StatefulDataLoader(self.val_set, batch_size=hp.batch_size, sampler=sampler, num_workers=hp.num_workers)

    test_dataloader = val_dataloader  # no third split: `lit-ddp test` scores the held-out one
