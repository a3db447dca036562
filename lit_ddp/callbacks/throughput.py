"""Tokens/s, FLOPs/s and MFU of token batches, with a measured peak for MFU on CPUs and no per-step device
synchronization."""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only

from lit_ddp import compat

TRAIN = "train"  # the metrics' prefix, as Lightning's RunningStage names the stage

# Dense peak FLOP/s of GPUs whose name Lightning 2.6's table misses, by the precision the run computes in. The H200
# reports itself as "NVIDIA H200", which is neither of Lightning's "h200 sxm1" / "h200 nvl1" (whose figures are the
# sparse ones besides); it is the H100 SXM's GH100 chip at the same clocks: NVIDIA's H200 datasheet gives 989 TFLOP/s
# dense bf16, Lightning's "h100 sxm" 989.4e12.
PEAK_FLOPS = {
    "NVIDIA H200": {"bf16-mixed": 989.4e12, "bf16-true": 989.4e12, "16-mixed": 989.4e12, "16-true": 989.4e12},
}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """Dense peak FLOP/s of ``device`` computing in ``precision`` (a Trainer precision such as ``"bf16-mixed"``) from
    :data:`PEAK_FLOPS`; None where it has no figure (Lightning's table then decides)."""
    if device.type != "cuda":
        return None
    return PEAK_FLOPS.get(torch.cuda.get_device_name(device), {}).get(precision)


def available_flops(device: torch.device, precision: str, dtype: Any) -> float | None:
    """Dense peak FLOP/s of ``device`` computing in ``precision``, matrix products in ``dtype``: :func:`peak_flops`'s,
    else Lightning's table's (GPUs only; None for a CPU). The benchmarks' MFU takes its GPU peak from here too."""
    flops = peak_flops(device, precision)
    return flops if flops is not None else get_available_flops(device, dtype)


class TokenThroughputMonitor(Callback):
    """Training throughput of ``(x, y)`` token batches, rank zero's, by Lightning's
    :class:`~lightning.fabric.utilities.throughput.Throughput`: samples/s, tokens/s (``items_per_sec``), FLOPs/s from
    the module's ``flops_per_batch`` and MFU against ``available_flops``, logged as ``train/device/items_per_sec``,
    ``train/device/mfu``... (with DDP also the world's ``train/items_per_sec``...).

    Lightning's ``ThroughputMonitor`` logs the same names but reads the clock after every training batch, behind a
    ``torch.cuda.synchronize()`` on CUDA: a host stall per step that a plain loop does not pay. Here batches are
    counted after each one, and the clock is read (the device synchronized) only on the steps the logger writes
    (``trainer.log_every_n_steps``). Time spent validating is left out of the clock; validation batches are not
    measured (Lightning's points for them fall on logging steps by coincidence). The counts (``train/batches``,
    ``train/samples``, ``train/lengths``) go into checkpoints and go on after a resume.

    Args:
        available_flops: peak FLOP/s of one device (one process); None: :data:`PEAK_FLOPS`, else Lightning's table
            (GPUs only). On CPU, ``make bench-speed`` measures it (its fp32 matmul peak).
        window_size: points each rate is averaged over: the start of training and each logging step (2: the rate
            of the last logging interval).
        separator: between the stage and a metric's name (``train/device/mfu``).

    Raises:
        ValueError: ``window_size < 2``.
    """

    def __init__(self, available_flops: float | None = None, window_size: int = 2, separator: str = "/") -> None:
        if window_size < 2:
            raise ValueError(f"window_size={window_size} must be >= 2 (a rate needs two points)")
        self.available_flops = available_flops
        self.window_size = window_size
        self.separator = separator
        self.counts = {"batches": 0, "samples": 0, "lengths": 0}  # since the run's start; lengths: tokens
        self._throughput: Throughput | None = None
        self._t0 = 0.0  # perf_counter() of the training clock's zero
        self._flops_since_update = 0
        self._validation_started: float | None = None
        self._resumed_counts: dict[str, int] | None = None

    def state_dict(self) -> dict[str, Any]:
        return dict(self.counts)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed_counts = {k: int(state_dict[k]) for k in self.counts}

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        flops = self.available_flops
        if flops is None:
            flops = available_flops(trainer.strategy.root_device, str(trainer.precision), compat.compute_dtype(trainer))
        self._throughput = Throughput(
            available_flops=flops, world_size=trainer.world_size, window_size=self.window_size, separator=self.separator
        )

    def _update(self, trainer: Trainer, flops: float | None) -> Throughput:
        assert self._throughput is not None, "setup('fit') makes it"
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # the clock must see the device's work: once per logging interval
        c = self.counts
        self._throughput.update(
            time=time.perf_counter() - self._t0,
            batches=c["batches"],
            samples=c["samples"],
            lengths=c["lengths"],
            flops=None if flops is None else int(flops),
        )
        return self._throughput

    @rank_zero_only
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.counts = self._resumed_counts or dict.fromkeys(self.counts, 0)  # a resumed run counts on
        self._resumed_counts = None
        self._flops_since_update = 0
        self._t0 = time.perf_counter()
        # The start is the window's first point, so rates appear from the first logging step on, after a
        # resume too: TensorBoard then shows the same throughput steps as an uninterrupted run.
        assert self._throughput is not None, "setup('fit') makes it"
        self._throughput.reset()
        self._update(trainer, 0)

    @rank_zero_only
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        x = batch[0]  # (B, T) token ids
        self.counts["batches"] += 1
        self.counts["samples"] += x.size(0)
        self.counts["lengths"] += x.numel()
        self._flops_since_update += getattr(pl_module, "flops_per_batch", None) or 0
        if compat.should_accumulate(trainer) or not compat.should_update_logs(trainer):
            return
        metrics = self._update(trainer, self._flops_since_update or None).compute()
        self._flops_since_update = 0
        compat.log_metrics(trainer, {f"{TRAIN}{self.separator}{k}": v for k, v in metrics.items()})

    @rank_zero_only
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._validation_started = time.perf_counter()

    @rank_zero_only
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._validation_started is not None:
            self._t0 += time.perf_counter() - self._validation_started  # not training time
        self._validation_started = None
