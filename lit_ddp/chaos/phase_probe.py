"""What ``lit-ddp chaos`` adds to both of its runs: a file that says where the training is.

Neither the step a run has reached nor a validation can be seen from outside the processes (with the progress bar
off they print nothing), so chaos adds :class:`PhaseProbe`; the faults themselves still come from outside, a
signal from the tool at a moment of its choosing.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from lit_ddp.chaos.job import PHASE_FILE


class PhaseProbe(Callback):
    """Rank zero writes ``<phase> <global_step> <pid>`` into ``<trainer.default_root_dir>/.chaos_phase``: ``start``
    as the process's first training batch starts (a restarted torchft group heals in it), ``train`` after every
    training batch and as a validation ends, ``validation`` as one starts (not the sanity check). The pid tells a
    restarted process from the one a fault hit. It changes nothing else and holds no state but whether it began."""

    def __init__(self) -> None:
        self.began = False

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        if not self.began:
            self.began = True
            self._write(trainer, "start")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        self._write(trainer, "train")

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._write(trainer, "validation")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._write(trainer, "train")

    @staticmethod
    def _write(trainer: Trainer, phase: str) -> None:
        if trainer.is_global_zero:  # written whole, then renamed: the tool never reads a half-written line
            path = os.path.join(str(trainer.default_root_dir), PHASE_FILE)
            with open(path + ".tmp", "w") as f:
                f.write(f"{phase} {trainer.global_step} {os.getpid()}\n")
            os.replace(path + ".tmp", path)
