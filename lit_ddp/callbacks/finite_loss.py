"""Stop training on a NaN or infinite loss, on every rank at once, before it reaches a checkpoint."""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer


class NonFiniteLossError(RuntimeError):
    """The training loss (or a parameter about to be checkpointed) became NaN or infinite."""


class FiniteLossGuard(Callback):
    """Stops training when the loss becomes NaN or infinite, naming the step, before it is checkpointed.

    Every step, the ranks agree (one all-reduce of a flag) on whether any rank's loss is non-finite, so all
    ranks stop together instead of one hanging in the next collective. At each checkpoint save the
    parameters are checked too, so a non-finite update never overwrites the last good checkpoint (Lightning
    runs checkpoint callbacks after this one).

    Raises:
        NonFiniteLossError: from ``on_train_batch_end`` or ``on_save_checkpoint``.
    """

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        bad = loss is not None and not bool(torch.isfinite(loss.detach()).all())
        if trainer.strategy.reduce_boolean_decision(bad, all=False):
            value = float(loss.detach().float().mean()) if loss is not None else math.nan
            raise NonFiniteLossError(
                f"train loss became {value} at global_step {trainer.global_step} (epoch {trainer.current_epoch}, "
                f"batch {batch_idx}); training stopped and the last good checkpoint is kept. Lower the learning "
                "rate or set trainer.gradient_clip_val"
            )

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        for name, p in pl_module.named_parameters():
            if not bool(torch.isfinite(p.detach()).all()):
                raise NonFiniteLossError(
                    f"parameter {name} became non-finite at global_step {trainer.global_step}; the checkpoint was "
                    "not written and the last good one is kept. Lower the learning rate or set "
                    "trainer.gradient_clip_val"
                )
