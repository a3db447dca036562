"""Lightning's ThroughputMonitor for token batches, with a measured peak for MFU on CPUs and no per-step
device synchronization."""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_only

from lit_ddp import compat

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


class TokenThroughputMonitor(ThroughputMonitor):
    """Lightning's ThroughputMonitor for ``(x, y)`` token batches: samples/s, tokens/s (``items_per_sec``),
    FLOPs/s from the module's ``flops_per_batch``, and MFU against ``available_flops`` when known.

    Training steps are counted after every batch, but the clock is read only on the steps the logger
    writes (``trainer.log_every_n_steps``): Lightning's ThroughputMonitor reads it after every batch and,
    on CUDA, calls ``torch.cuda.synchronize()`` before each read, a host stall per step that a plain loop
    does not pay. Rates are averaged over the last ``window_size`` logging intervals; validation batches
    are timed as Lightning does it. The training counts (``train/batches``, ``train/samples``,
    ``train/lengths``, rank zero's) go into checkpoints and go on after a resume, where Lightning's start again
    from 0.

    Args:
        available_flops: peak FLOP/s of one device (one process); None: :data:`PEAK_FLOPS`, else Lightning's table
            (GPUs only).
            On CPU, measure it with ``python -m bench.matmul_peak``.
        window_size: points the training rates are averaged over: the start of training and each logging
            step (at least 2; 2: the rate of the last logging interval), and batches the validation rates
            are averaged over.
    """

    def __init__(self, available_flops: float | None = None, window_size: int = 2, **kwargs: Any) -> None:
        super().__init__(
            batch_size_fn=lambda batch: batch[0].size(0),
            length_fn=lambda batch: batch[0].numel(),
            window_size=window_size,
            **kwargs,
        )
        self._available_flops_override = available_flops
        self._flops_since_update = 0
        self._resumed_counts: dict[str, int] | None = None

    def state_dict(self) -> dict[str, Any]:
        stage = RunningStage.TRAINING
        return {
            "batches": self._batches.get(stage, 0),
            "samples": self._samples.get(stage, 0),
            "lengths": self._lengths.get(stage, 0),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed_counts = dict(state_dict)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._available_flops_override is None:
            self._available_flops_override = peak_flops(trainer.strategy.root_device, str(trainer.precision))
        with warnings.catch_warnings():
            if self._available_flops_override is not None:  # Lightning's table is not asked: its miss is no news
                warnings.filterwarnings("ignore", message="FLOPs not found")
            super().setup(trainer, pl_module, stage)
        if self._available_flops_override is not None:
            # Lightning types it int | None; Throughput, which reads it, takes a float.
            self.available_flops = self._available_flops_override  # type: ignore[assignment]
            for throughput in self._throughputs.values():
                throughput.available_flops = self._available_flops_override

    @rank_zero_only
    def on_train_start(self, trainer: Trainer, *args: Any) -> None:
        super().on_train_start(trainer, *args)  # counts from 0
        self._flops_since_update = 0
        stage = trainer.state.stage
        assert stage is not None
        if self._resumed_counts is not None:  # a resumed run goes on counting where the checkpoint was
            self._batches[stage] = self._resumed_counts["batches"]
            self._samples[stage] = self._resumed_counts["samples"]
            self._lengths[stage] = self._resumed_counts["lengths"]
            self._resumed_counts = None
        # The start is the window's first point, so rates appear from the first logging step on, after a
        # resume too: TensorBoard then shows the same throughput steps as an uninterrupted run.
        self._throughputs[stage].update(
            time=0.0,
            batches=self._batches[stage],
            samples=self._samples[stage],
            lengths=None if self.length_fn is None else self._lengths[stage],
            flops=0,
        )

    @rank_zero_only
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, *args: Any
    ) -> None:
        stage = trainer.state.stage
        assert stage is not None
        self._samples[stage] += self.batch_size_fn(batch)
        if self.length_fn is not None:
            self._lengths[stage] += self.length_fn(batch)
        self._batches[stage] += 1
        self._flops_since_update += getattr(pl_module, "flops_per_batch", None) or 0
        if compat.should_accumulate(trainer) or not compat.should_update_logs(trainer):
            return
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # the clock must see the device's work: once per logging interval
        self._throughputs[stage].update(
            time=time.perf_counter() - self._t0s[stage],
            batches=self._batches[stage],
            samples=self._samples[stage],
            lengths=None if self.length_fn is None else self._lengths[stage],
            flops=self._flops_since_update or None,
        )
        self._flops_since_update = 0
        self._compute(trainer)
