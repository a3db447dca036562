"""What ``lit-ddp chaos`` adds to a run for its ``validation`` faults: a file that says when validation runs.

A validation cannot be seen from outside the processes (with the progress bar off they print nothing), so chaos
adds :class:`PhaseProbe` to both of its runs; the fault itself still comes from outside, a SIGKILL from the tool.
"""

from __future__ import annotations

import os

from lightning.pytorch import Callback, LightningModule, Trainer

from lit_ddp.launch.chaos_job import PHASE_FILE


class PhaseProbe(Callback):
    """Rank zero writes ``validation`` into ``<trainer.default_root_dir>/.chaos_phase`` as a validation starts
    (not the sanity check) and ``train`` as it ends. It changes nothing else and holds no state."""

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._write(trainer, "validation")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._write(trainer, "train")

    @staticmethod
    def _write(trainer: Trainer, phase: str) -> None:
        if trainer.is_global_zero:
            with open(os.path.join(str(trainer.default_root_dir), PHASE_FILE), "w") as f:
                f.write(phase)
