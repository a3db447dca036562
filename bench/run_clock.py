"""A Lightning callback that writes what a timed launch needs, as it happens: the wall time of every optimizer step,
of every ``val/loss`` and of the throughput figures. One line per event, flushed at once, so a run that a time box
kills still leaves its figures (TensorBoard's writer flushes every two minutes). :func:`bench.gpu_check.read_run_clock`
reads it (without importing Lightning).

    lit-ddp fit ... --trainer.callbacks+=bench.run_clock.RunClock --trainer.callbacks.init_args.path=/tmp/clock.txt

Lines (wall-clock seconds since the epoch, rank zero only):

- ``start <time> <pid>``: fit start (the first step follows);
- ``step <time> <global_step>``: after each optimizer step;
- ``val <time> <global_step> <val/loss>``: each validation's end (the sanity check left out);
- ``tput <time> <global_step> <tokens/s> <mfu>``: each new value of
  :class:`~lit_ddp.callbacks.throughput.TokenThroughputMonitor`'s ``train/device/items_per_sec`` (``nan`` where
  no MFU is logged);
- ``end <time> <global_step>``: fit end (before the end-of-fit sample).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import IO, Any

from lightning.pytorch import Callback, LightningModule, Trainer

TOKENS_PER_S = "train/device/items_per_sec"
MFU = "train/device/mfu"


class RunClock(Callback):
    """Appends the events above to ``path`` (rank zero).

    Args:
        path: the file; its folder is created.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = None
        self._tput: float | None = None

    def _write(self, trainer: Trainer, *fields: object) -> None:
        if not trainer.is_global_zero:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", buffering=1)  # line-buffered: each event reaches the file at once
        self._file.write(" ".join(str(f) for f in fields) + "\n")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._write(trainer, "start", time.time(), os.getpid())

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        now = time.time()
        self._write(trainer, "step", now, trainer.global_step)
        tput = trainer.logged_metrics.get(TOKENS_PER_S)
        if tput is not None and float(tput) != self._tput:
            self._tput = float(tput)
            mfu = trainer.logged_metrics.get(MFU)
            self._write(trainer, "tput", now, trainer.global_step, self._tput, math.nan if mfu is None else float(mfu))

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        loss = trainer.callback_metrics.get("val/loss")
        if not trainer.sanity_checking and loss is not None:
            self._write(trainer, "val", time.time(), trainer.global_step, float(loss))

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._write(trainer, "end", time.time(), trainer.global_step)
        if self._file is not None:
            self._file.close()
            self._file = None
