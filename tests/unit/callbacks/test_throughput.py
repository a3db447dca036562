"""TokenThroughputMonitor: its counts, clock reads, resumed counts and training clock without validation; the H200's
peak (Lightning 2.6's table misses its reported name, ours fills it in: MFU on an H200)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, TensorDataset

from lit_ddp.callbacks.throughput import TokenThroughputMonitor, peak_flops


@pytest.fixture
def h200(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    return torch.device("cuda", 0)


def test_h200_peak_is_the_h100_sxm_dense_figure(h200: torch.device) -> None:
    assert peak_flops(h200, "bf16-mixed") == 989.4e12
    assert peak_flops(h200, "32-true") is None  # no figure: Lightning's table decides
    assert peak_flops(torch.device("cpu"), "bf16-mixed") is None


def test_lightning_still_misses_the_h200(h200: torch.device) -> None:
    """When Lightning's table knows "NVIDIA H200", PEAK_FLOPS's entry can go."""
    with pytest.warns(UserWarning, match="FLOPs not found for 'NVIDIA H200'"):
        assert get_available_flops(h200, torch.bfloat16) is None


class Tokens(LightningModule):
    """A linear next-token model on random ``(x, y)`` token batches of shape (4, 8); validation sleeps."""

    flops_per_batch = 1000

    def __init__(self, val_sleep: float = 0.0) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 16)
        self.val_sleep = val_sleep

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.emb(x).flatten(0, 1), y.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        time.sleep(self.val_sleep)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        data = torch.randint(0, 16, (64, 8), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(data, data), batch_size=4)

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()


class Points(Logger):
    """Every logged point: ``(step, metrics)``."""

    def __init__(self) -> None:
        super().__init__()
        self.points: list[tuple[int | None, dict[str, float]]] = []

    name = "points"  # type: ignore[assignment]
    version = "0"  # type: ignore[assignment]

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.points.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def fit(monitor: TokenThroughputMonitor, module: Tokens, **trainer: Any) -> Points:
    points = Points()
    options = {"max_steps": 6, "log_every_n_steps": 2, "limit_val_batches": 2, "val_check_interval": 3} | trainer
    Trainer(
        accelerator="cpu", devices=1, callbacks=[monitor], logger=points, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **options,
    ).fit(module)  # fmt: skip
    return points


def test_counts_every_batch_reads_the_clock_on_logging_steps_and_resumes_its_counts() -> None:
    monitor = TokenThroughputMonitor(available_flops=1e9)
    points = fit(monitor, Tokens(), val_check_interval=None, limit_val_batches=0)
    train = [(step, m) for step, m in points.points if "train/batches" in m]
    assert [m["train/batches"] for _, m in train] == [2, 4, 6]  # logging steps only
    assert train[-1][1]["train/lengths"] == 6 * 4 * 8  # tokens
    assert train[-1][1]["train/device/items_per_sec"] > 0 and "train/device/mfu" in train[-1][1]
    assert monitor.state_dict() == {"batches": 6, "samples": 24, "lengths": 192}

    resumed = TokenThroughputMonitor(available_flops=1e9)
    resumed.load_state_dict(monitor.state_dict())
    fit(resumed, Tokens(), max_steps=2, val_check_interval=None, limit_val_batches=0)
    assert resumed.state_dict() == {"batches": 8, "samples": 32, "lengths": 256}


def test_validation_time_is_not_training_time() -> None:
    """Two validations of 2 batches sleeping 0.3 s each: 1.2 s the training clock must not count."""
    points = fit(TokenThroughputMonitor(available_flops=1e9), Tokens(val_sleep=0.3))
    train_time = [m["train/time"] for _, m in points.points if "train/time" in m]
    assert train_time and train_time[-1] < 0.6, train_time
