"""lit_ddp.data.regression: a seeded, learnable synthetic data set (or the tutorial's random targets), and the
arguments it refuses."""

from __future__ import annotations

import pytest
import torch

from lit_ddp.data.regression import RegressionDataModule


def test_bad_datamodule_arguments() -> None:
    with pytest.raises(ValueError, match="batch_size=0"):
        RegressionDataModule(batch_size=0)
    with pytest.raises(ValueError, match="val_fraction=1.5"):
        RegressionDataModule(val_fraction=1.5)


def test_data_is_seeded_and_learnable() -> None:
    a, b = RegressionDataModule(), RegressionDataModule()
    a.setup("fit"), b.setup("fit")
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])
    assert len(a.train_set) + len(a.val_set) == 2048
    assert a.train_set.tensors[0].shape == (1792, 20) and a.train_set.tensors[1].shape == (1792, 1)
    # The tutorial's option: targets unrelated to inputs.
    r = RegressionDataModule(random_targets=True)
    r.setup("fit")
    assert r.train_set.tensors[1].min() >= 0 and r.train_set.tensors[1].max() < 1
