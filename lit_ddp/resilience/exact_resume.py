"""The callback that carries each rank's :class:`~lit_ddp.resilience.restore.ResumeState` through a checkpoint and
has it restored at one point, and keeps TensorBoard's curves whole across the restart.

Lightning calls its hooks in its own order: ``on_save_checkpoint`` (every save), then on a resume
``on_load_checkpoint`` (inside Lightning's restore: this rank's state and what the restore check will compare),
``on_fit_start`` (the optimizers' settings as the config built them), ``on_train_start`` (the restore itself:
:meth:`ResumeState.restore`, numbered steps) and ``on_train_batch_start`` (TensorBoard's purge marker).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn

from lit_ddp import compat
from lit_ddp.resilience import restore_check
from lit_ddp.resilience.restore import ResumeState, global_batch, reached_its_end, report_resume, training_settings
from lit_ddp.tensorboard import tags_logged_at

CHECKPOINT_KEY = "exact_resume"


class ExactResume(Callback):
    """Saves every rank's :class:`~lit_ddp.resilience.restore.ResumeState` (RNG streams, train-loader
    positions, metric sums); on resume, restores each rank's own before the first step and checks the restore.

    On save (on every rank, inside ``trainer.save_checkpoint``), the ranks' states are gathered into the checkpoint
    under ``"exact_resume"`` (one ``all_gather_object``; the checkpoint is still written by rank zero only). On
    resume:

    - each rank's loader state is restored in place of rank zero's (which Lightning would load);
    - at ``on_train_start`` the rank's state is restored, checked against the checkpoint and reported
      (:meth:`ResumeState.restore`, at one point, after Lightning's own restore and the ``on_train_start`` of the
      callbacks listed before this one);
    - with ``purge_tensorboard``, a TensorBoard "session start" event at the first step the resumed run logs
      (written at its first training batch) makes TensorBoard drop the points that the killed run logged after
      its checkpoint, so each step appears once and none is missing.

    A checkpoint written with another global batch (``batch_size`` x processes): the epoch still ends after all
    of its samples (:func:`~lit_ddp.resilience.restore.remap_epoch_progress`), with a warning.

    A checkpoint from a different world size: the train loader continues from the saved global sample
    position (:class:`lit_ddp.data.samplers.GlobalOrderSampler`, whose state is the same on every rank), so
    the data is exact; the RNG states are those of rank ``r mod n`` (a warning says so), so random draws
    inside a step (dropout) differ from an uninterrupted run's; the metrics' running sums start afresh.

    Every resume (automatic, ``--ckpt_path``, a restart) says where it continues, or that the run had already
    finished (:func:`lit_ddp.resilience.restore.report_resume`), and warns about each setting the checkpoint
    replaced (:meth:`ResumeState.restore`, step 5).

    Args:
        purge_tensorboard: write TensorBoard's purge marker on resume (see above).
    """

    def __init__(self, purge_tensorboard: bool = True) -> None:
        self.purge_tensorboard = purge_tensorboard
        self._state = ResumeState()  # this rank's, as loaded; restored at on_train_start
        self._saved_global_batch: int | None = None
        self._promised: dict[str, Any] | None = None  # the restore check's: this rank's state in the checkpoint
        self._purge_pending = False
        self._log_step_after_epoch_end: int | None = None
        self._configured_settings: dict[str, Any] | None = None
        self._train_started = False
        self._in_train_batch = False  # between a batch's start and the logging of its point
        self._pending_log: tuple[int, dict[str, float]] | None = None
        self._resumed_mid_epoch = False

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        local = ResumeState.capture(trainer, pl_module).state_dict()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            per_rank: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, local)
        else:
            per_rank = [local]
        # A save in on_train_batch_end comes before Lightning logs that batch's point: a kill in between, or before
        # the event file is flushed, would lose it, and the resumed run starts at the next batch. It goes into the
        # checkpoint, and the resumed run logs it again.
        pending = compat.pending_train_step_log(trainer) if self._in_train_batch else None
        checkpoint[CHECKPOINT_KEY] = {
            "world_size": len(per_rank),
            "global_batch": global_batch(trainer),
            "per_rank": per_rank,
            "pending_log": pending,
        }
        # What was logged up to this checkpoint reaches the disk with it (TensorBoard flushes every 2 minutes): a
        # kill after a validation-end save would lose that validation's points, which the resumed run does not log
        # again.
        for logger in trainer.loggers:
            logger.save()  # TensorBoardLogger's writes hparams.yaml only: its event file is flushed apart
            if isinstance(logger, TensorBoardLogger) and trainer.is_global_zero:
                logger.experiment.flush()

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn != "fit":  # validate / test: no train loader, no training randomness to restore
            return
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is None:
            rank_zero_warn(
                "The checkpoint holds no RNG states (it was written without ExactResume): the run resumes, but "
                "not bit-exactly."
            )
            return
        per_rank = state["per_rank"]
        if len(per_rank) != trainer.world_size:
            rank_zero_warn(
                f"The checkpoint was written by {len(per_rank)} processes, this run has {trainer.world_size}: the "
                "train data continues from the same global sample (GlobalOrderSampler), but each rank restores the "
                "RNG states of rank (rank mod saved world size), so random draws in the step (dropout masks) "
                "differ from those of an uninterrupted run; without them (e.g. the regression) the resume is exact."
            )
        mine = per_rank[trainer.global_rank % len(per_rank)]
        self._state.load_state_dict(mine)
        same_world_size = len(per_rank) == trainer.world_size
        if not same_world_size:  # another rank's running sums would count its batches twice (or never)
            self._state.metrics = None
        # What the restore check compares before the first step: on another world size, not the RNG streams (rank r
        # restores rank r mod n's by design, see above).
        rng = self._state.rng if same_world_size else None
        self._promised = restore_check.promised(checkpoint, rng, tensors=restore_check.plain_tensors(pl_module))
        # The fit loop's own state: Lightning loads the train loaders' states it holds (rank zero's, on every rank)
        # when it builds them, and fails on a loader with another number of workers. This rank's are restored at
        # on_train_start instead (ResumeState.restore), where the live loaders can be checked against them.
        loop_state = (checkpoint.get("loops", {}).get("fit_loop") or {}).get("state_dict")
        if self._state.train_loaders and loop_state is not None:
            loop_state["combined_loader"] = []
            self._saved_global_batch = state.get("global_batch")
        else:
            self._state.train_loaders = []
        self._purge_pending = self.purge_tensorboard and trainer.is_global_zero
        self._pending_log = state.get("pending_log")

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning skips the training loop, and on_train_start, when the restored run is at its end already.
        if trainer.ckpt_path is not None and not self._train_started and reached_its_end(trainer):
            report_resume(trainer, finished=True)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._train_started = False
        # Lightning has built the optimizers and schedulers from the config and restores them after this hook.
        self._configured_settings = training_settings(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._train_started = True
        configured, self._configured_settings = self._configured_settings, None
        promised, self._promised = self._promised, None
        state, self._state = self._state, ResumeState()  # the checkpoint's tensors are let go once restored
        self._resumed_mid_epoch = state.restore(trainer, pl_module, self._saved_global_batch, promised, configured)
        # After a checkpoint from on_train_epoch_end the next epoch's first batch logs where the saved epoch's last
        # left off (Lightning adds one to it, or not, depending on where validation ran).
        self._log_step_after_epoch_end = (
            compat.batches_that_stepped(trainer) if trainer.fit_loop.restarted_on_epoch_end else None
        )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._log_step_after_epoch_end is not None:
            compat.set_batches_that_stepped(trainer, self._log_step_after_epoch_end)
            self._log_step_after_epoch_end = None
        self._in_train_batch = True
        if self._resumed_mid_epoch:  # Lightning skipped on_train_epoch_start, where the progress bar is set up
            compat.show_resumed_epoch(trainer, batch_idx)
            self._resumed_mid_epoch = False
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
