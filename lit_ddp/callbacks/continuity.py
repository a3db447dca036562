"""What a resumed run shows continues the killed run's: its logged curves and its progress bar.

- :class:`CurvesContinue`: each step's points appear once in TensorBoard, none missing: the points the killed run
  logged after its checkpoint are dropped (TensorBoard's purge marker), the checkpoint's own batch logged again
  where the killed run did not write it, and the logger's step put where the uninterrupted run's was after a
  checkpoint written at an epoch's end.
- :class:`ResumedEpochProgress`: an epoch resumed mid-way shows its total and ETA.

The ``lit-ddp`` command installs both (:class:`lit_ddp.cli.LitDDPCLI`); neither touches the training state.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger

from lit_ddp import compat
from lit_ddp.resilience.state import for_a_peer
from lit_ddp.tensorboard import tags_logged_at

CHECKPOINT_KEY = "logged"
"""The checkpoint's entry of :class:`CurvesContinue` (``{"pending_log": (step, metrics) | None}``)."""


class CurvesContinue(Callback):
    """Keeps TensorBoard's curves whole across a restart.

    - At a save in ``on_train_batch_end``, before Lightning logs that batch's point, the point goes into the
      checkpoint (a kill before the event file is flushed would lose it, and the resumed run starts at the next
      batch), and everything logged up to the save is flushed to disk with it (TensorBoard flushes every 2 minutes:
      a kill after a validation-end save would lose that validation's points, which the resumed run does not log
      again).
    - At the resumed run's first batch, a TensorBoard "session start" event at the first step it logs makes
      TensorBoard drop the points the killed run logged after its checkpoint, and the checkpoint's own point is
      logged where the event files lack it.
    - After a checkpoint written at an epoch's end, the next epoch's first batch logs where the saved epoch's last
      left off (Lightning adds one to the logger's step, or not, depending on where validation ran).
    """

    def __init__(self) -> None:
        self._in_train_batch = False  # between a batch's start and the logging of its point
        self._purge_pending = False
        self._pending_log: tuple[int, dict[str, float]] | None = None
        self._log_step_after_epoch_end: int | None = None

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if for_a_peer():  # a torchft heal's snapshot: nothing of this run's log goes to another group
            return
        pending = compat.pending_train_step_log(trainer) if self._in_train_batch else None
        checkpoint[CHECKPOINT_KEY] = {"pending_log": pending}
        for logger in trainer.loggers:
            logger.save()  # TensorBoardLogger's writes hparams.yaml only: its event file is flushed apart
            if isinstance(logger, TensorBoardLogger) and trainer.is_global_zero:
                logger.experiment.flush()

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn != "fit" or for_a_peer():
            return
        # Checkpoints written before this callback existed kept the point in ExactResume's entry.
        entry = checkpoint.get(CHECKPOINT_KEY) or checkpoint.get("exact_resume") or {}
        self._pending_log = entry.get("pending_log")
        self._purge_pending = trainer.is_global_zero

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log_step_after_epoch_end = (
            compat.batches_that_stepped(trainer) if trainer.fit_loop.restarted_on_epoch_end else None
        )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._log_step_after_epoch_end is not None:
            compat.set_batches_that_stepped(trainer, self._log_step_after_epoch_end)
            self._log_step_after_epoch_end = None
        self._in_train_batch = True
        if self._purge_pending:  # the step the first point of the resumed run is logged at, known only now
            step, pending = compat.batches_that_stepped(trainer), self._pending_log
            _purge_tensorboard_from(trainer, step)
            if pending is not None and pending[0] < step:  # the checkpoint's own batch (see on_save_checkpoint)
                _log_missing_points(trainer, pending[0], pending[1])
            self._purge_pending = False
            self._pending_log = None

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._in_train_batch = False  # the training batch's point is logged by now

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._in_train_batch = False


class ResumedEpochProgress(Callback):
    """An epoch resumed mid-way gets its progress bar's total, description and ETA at its first batch
    (:func:`lit_ddp.compat.show_resumed_epoch`: Lightning skips ``on_train_epoch_start`` then). Listed after
    :class:`~lit_ddp.resilience.exact_resume.ExactResume`, whose put-back tells whether the epoch goes on."""

    def __init__(self) -> None:
        self._resumed_mid_epoch = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._resumed_mid_epoch = trainer.ckpt_path is not None and trainer.fit_loop.restarted_mid_epoch

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._resumed_mid_epoch:
            compat.show_resumed_epoch(trainer, batch_idx)
            self._resumed_mid_epoch = False


def _purge_tensorboard_from(trainer: Trainer, step: int) -> None:
    """Marks a restart at ``step`` in every TensorBoard log: readers drop the earlier points at ``>= step``.

    It is the event that ``SummaryWriter(purge_step=step)`` writes; the writer exists already here (Lightning
    creates it in the setup hook), so the event is added to it.
    """
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog

    for logger in trainer.loggers:
        if not isinstance(logger, TensorBoardLogger):
            continue
        writer = logger.experiment
        compat.tensorboard_file_writer(writer).add_event(
            Event(step=step, session_log=SessionLog(status=SessionLog.START))
        )
        writer.flush()


def _log_missing_points(trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
    """Logs each of ``metrics`` at ``step`` in every TensorBoard log that lacks it (the killed run may or may not
    have written it before it died)."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            missing = set(metrics) - tags_logged_at(logger.log_dir, step, list(metrics))
            if missing:
                logger.log_metrics({k: metrics[k] for k in sorted(missing)}, step=step)
                logger.experiment.flush()
