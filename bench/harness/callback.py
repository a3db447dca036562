"""The step clock of a ``lit-ddp fit`` (:mod:`bench.harness.clock` says what it writes):

lit-ddp fit ... --trainer.callbacks+=bench.harness.callback.StepClock --trainer.callbacks.init_args.path=clock.txt
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from bench.harness.clock import ClockFile

TOKENS_PER_S, MFU = "train/device/items_per_sec", "train/device/mfu"  # TokenThroughputMonitor's


class StepClock(Callback):
    """Appends the step clock's events to ``path`` (rank zero's), or with ``every_rank`` each rank's to
    ``<path>/rank<RANK>.txt`` (a restarted process appends to its rank's file).

    Args:
        path: the file (with ``every_rank``: the folder).
        every_rank: every rank writes, not only rank zero.
    """

    def __init__(self, path: str, every_rank: bool = False) -> None:
        self.every_rank = every_rank
        self.clock = ClockFile(Path(path) / f"rank{os.environ.get('RANK', '0')}.txt" if every_rank else path)
        self._tput: float | None = None
        self._job, self._writes = False, False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._writes = self.every_rank or trainer.is_global_zero
        if self._writes:
            self.clock.start()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if not self._writes:
            return
        if not self._job:
            self._job = True
            model = getattr(pl_module, "model", None)
            flops = model.flops_per_token() if hasattr(model, "flops_per_token") else math.nan
            tokens = int(batch[0].numel()) * trainer.world_size
            self.clock.write("job", tokens, trainer.world_size, torch.get_num_threads(), flops)
        self.clock.write("step", trainer.global_step, os.getpid())
        tput = trainer.logged_metrics.get(TOKENS_PER_S)
        if tput is not None and float(tput) != self._tput:
            self._tput = float(tput)
            mfu = trainer.logged_metrics.get(MFU)
            self.clock.write("tput", trainer.global_step, self._tput, math.nan if mfu is None else float(mfu))

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        loss = trainer.callback_metrics.get("val/loss")
        if self._writes and not trainer.sanity_checking and loss is not None:
            self.clock.write("val", trainer.global_step, float(loss))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._writes:
            self.clock.write("end", trainer.global_step)
        self.clock.close()
