"""Lightning's ThroughputMonitor for token batches, with a measured peak for MFU on CPUs."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ThroughputMonitor


class TokenThroughputMonitor(ThroughputMonitor):
    """Lightning's ThroughputMonitor for ``(x, y)`` token batches: samples/s, tokens/s (``items_per_sec``),
    FLOPs/s from the module's ``flops_per_batch``, and MFU against ``available_flops`` when known.

    Args:
        available_flops: peak FLOP/s of one device (one process); None: Lightning's table (GPUs only).
            On CPU, measure it with ``python -m bench.matmul_peak``.
        window_size: batches the rates are averaged over (rates appear once this many have run).
    """

    def __init__(self, available_flops: float | None = None, window_size: int = 20, **kwargs: Any) -> None:
        super().__init__(
            batch_size_fn=lambda batch: batch[0].size(0),
            length_fn=lambda batch: batch[0].numel(),
            window_size=window_size,
            **kwargs,
        )
        self._available_flops_override = available_flops

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self._available_flops_override is not None:
            self.available_flops = self._available_flops_override
            for throughput in self._throughputs.values():
                throughput.available_flops = self._available_flops_override
