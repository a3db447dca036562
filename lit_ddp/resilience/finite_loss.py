"""Stop training on a NaN or infinite loss, on every rank at once, before it reaches a checkpoint."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from lit_ddp.errors import NonFiniteLossError

_NO_STEP = 2**62  # "no bad step seen" in the step slot of the flags


class FiniteLossGuard(Callback):
    """Stops training when the loss becomes NaN or infinite, naming the first such step, before it is checkpointed.

    No step pays for the check: each rank keeps a reference to every step's loss (no tensor op, no host
    sync, no collective), and every ``check_every_n_steps`` optimizer steps it looks at the losses kept
    since the last look and the ranks agree in one all-reduce whether any rank saw a non-finite one, and
    at which step first; then all ranks raise together, so none hangs in the next collective. A checkpoint save checks the parameters too (they are the same on every rank
    under DDP, so no collective is needed there): a non-finite update never overwrites the last good
    checkpoint, whatever the interval (Lightning runs checkpoint callbacks after this one).

    Args:
        check_every_n_steps: optimizer steps between the ranks' agreements; None: ``trainer.log_every_n_steps``.

    Raises:
        NonFiniteLossError: from ``on_train_batch_end``, ``on_train_end`` or ``on_save_checkpoint``.
        ValueError: ``check_every_n_steps`` < 1.
    """

    def __init__(self, check_every_n_steps: int | None = None) -> None:
        if check_every_n_steps is not None and check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps={check_every_n_steps} must be >= 1 (or None)")
        self.check_every_n_steps = check_every_n_steps
        self._losses: list[tuple[int, torch.Tensor]] = []  # (global_step after the step, its loss) since the last look

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._losses = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._losses.append((trainer.global_step, loss))  # global_step counts this step already
        # Trainer's log_every_n_steps is set by its logger connector and undeclared on the class.
        every = self.check_every_n_steps or trainer.log_every_n_steps or 1  # type: ignore[attr-defined]
        if trainer.global_step % every == 0:
            self._agree(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._agree(trainer)  # the steps since the last agreement (every rank ends training at the same step)

    def _agree(self, trainer: Trainer) -> None:
        # [kind (0 finite, 1 inf, 2 nan), -first bad global_step]: MAX over ranks keeps the worst kind and
        # the earliest step.
        flags = torch.tensor([0, -_NO_STEP], dtype=torch.int64, device=trainer.strategy.root_device)
        if self._losses:
            losses = torch.stack([loss.detach().float().sum() for _, loss in self._losses])
            nan, bad = losses.isnan(), ~losses.isfinite()
            if bool(bad.any()):
                first = int(bad.nonzero()[0])
                flags[0], flags[1] = (2 if bool(nan[first]) else 1), -self._losses[first][0]
            self._losses = []
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # worst kind; -min(step) is max(-step)
        kind, step = int(flags[0]), -int(flags[1])
        if kind:
            raise NonFiniteLossError(
                f"train loss became {'nan' if kind == 2 else 'inf'} at global_step {step}; training stopped "
                f"at global_step {trainer.global_step} (epoch {trainer.current_epoch}) and the last good checkpoint "
                "is kept. Lower the learning rate or set trainer.gradient_clip_val"
            )

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        for name, p in pl_module.named_parameters():
            if not bool(torch.isfinite(p.detach()).all()):
                raise NonFiniteLossError(
                    f"parameter {name} became non-finite at global_step {trainer.global_step}; the checkpoint was "
                    "not written and the last good one is kept. Lower the learning rate or set "
                    "trainer.gradient_clip_val"
                )
