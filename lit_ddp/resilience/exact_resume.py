"""What a Lightning checkpoint lacks for a bit-exact mid-epoch resume, per rank.

Lightning saves the model, optimizer, loops and (for loaders with ``state_dict``/``load_state_dict``, such as
torchdata's ``StatefulDataLoader``) rank zero's train-loader position. It does not save RNG states, it
restores rank zero's loader state on every rank, and on a mid-epoch resume it rebuilds the loader iterator
before it sets the ``DistributedSampler``'s epoch, so under DDP the rest of the epoch is drawn from epoch
0's permutation (torchdata's ``BatchSampler`` iterates the sampler eagerly). Under DDP, Lightning wraps a
``StatefulDataLoader(shuffle=True)``'s own sampler in a ``DistributedSamplerWrapper``, whose inner random
generator advances every epoch and is saved nowhere: a resume draws different samples (in every later epoch
too); :class:`lit_ddp.data.samplers.GlobalOrderSampler` (a torchdata ``StatefulDistributedSampler``) replaces it. When
``trainer.estimated_stepping_batches`` is called before the restore (e.g. in ``configure_optimizers`` for an
LR schedule), the loader state is not restored at all (Lightning issue 20550). :class:`ExactResume` closes
these gaps.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn

from lit_ddp import compat
from lit_ddp.resilience import restore_check
from lit_ddp.resilience.resume_report import (
    reached_its_end,
    report_resume,
    training_settings,
    warn_restored_settings,
)
from lit_ddp.tensorboard import tags_logged_at

CHECKPOINT_KEY = "exact_resume"


class ExactResume(Callback):
    """Saves every rank's RNG states and train-loader position; restores each rank's own on resume.

    On save (on every rank, inside ``trainer.save_checkpoint``), the RNG states of torch, CUDA, numpy and
    Python, the train loaders' ``state_dict()`` and the torchmetrics states (an epoch's running sums,
    :func:`metric_states`) of all ranks are gathered into the checkpoint under
    ``"exact_resume"`` (one ``all_gather_object``; the checkpoint is still written by rank zero only). On
    resume:

    - each rank's loader state replaces rank zero's in the restored fit loop;
    - on a mid-epoch resume each rank's metrics continue from their saved sums (same world size only);
    - at ``on_train_start`` of a mid-epoch resume, the samplers get the resumed epoch (``set_epoch``) and the
      loader iterator is rebuilt from the saved state, which also repairs the
      ``estimated_stepping_batches`` trap;
    - then each rank's RNG states are set, after everything that draws from them while the loaders are
      built, so the next training step sees the same random numbers as in the uninterrupted run;
    - then the restore check compares what was restored with the checkpoint, before the first step
      (:mod:`lit_ddp.resilience.restore_check`);
    - with ``purge_tensorboard``, a TensorBoard "session start" event at the first step the resumed run logs
      (written at its first training batch) makes TensorBoard drop the points that the killed run logged after
      its checkpoint, so each step appears once and none is missing.

    A checkpoint written in ``on_train_epoch_end`` (``save_on_train_epoch_end``) of a run bounded by ``max_steps``:
    Lightning counts that epoch twice on restart, so every later epoch would draw the next one's order and log a
    step off; both are set back (:func:`lit_ddp.compat.undo_epoch_end_recount`). A checkpoint written after an
    epoch's last batch: Lightning leaves the next epoch uncounted, and a second restart from a checkpoint of the
    resumed run would train a whole epoch again (:func:`lit_ddp.compat.fix_last_batch_restart`).

    A checkpoint written with another global batch (``batch_size`` x processes): the epoch still ends after all
    of its samples (:func:`remap_epoch_progress`), with a warning.

    A checkpoint from a different world size: the train loader continues from the saved global sample
    position (:class:`lit_ddp.data.samplers.GlobalOrderSampler`, whose state is the same on every rank), so
    the data is exact; the RNG states are those of rank ``r mod n`` (a warning says so), so random draws
    inside a step (dropout) differ from an uninterrupted run's.

    Every resume (automatic, ``--ckpt_path``, a restart) says where it continues, or that the run had already
    finished (:func:`lit_ddp.resilience.resume_report.report_resume`), and compares the optimizers' and LR schedulers' settings
    as the config built them with those the checkpoint restored, and warns about each that differs
    (:func:`lit_ddp.resilience.resume_report.warn_restored_settings`).

    Args:
        purge_tensorboard: write TensorBoard's purge marker on resume (see above).
    """

    def __init__(self, purge_tensorboard: bool = True) -> None:
        self.purge_tensorboard = purge_tensorboard
        self._rng_states: dict[str, Any] | None = None
        self._promised: dict[str, Any] | None = None  # the restore check's: this rank's state in the checkpoint
        self._metric_states: dict[str, dict[str, Any]] | None = None
        self._loader_states: list[dict[str, Any]] | None = None
        self._saved_global_batch: int | None = None
        self._purge_pending = False
        self._log_step_after_epoch_end: int | None = None
        self._configured_settings: dict[str, Any] | None = None
        self._train_started = False
        self._in_train_batch = False  # between a batch's start and the logging of its point
        self._pending_log: tuple[int, dict[str, float]] | None = None
        self._resumed_mid_epoch = False
        self._positions: list[dict[str, Any] | None] | None = None

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        loaders = compat.train_loader_states(trainer)
        local = {
            "rng": collect_rng_states(trainer.strategy.root_device),
            "train_loaders": loaders,
            "positions": restore_check.saved_positions(trainer, loaders),  # what the restore check compares
            "metrics": metric_states(pl_module),
        }
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
        # kill after a validation-end save lost that validation's points, which the resumed run does not log again.
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
        self._rng_states = mine["rng"]
        # What the restore check compares before the first step: on another world size, not the RNG streams (rank r
        # restores rank r mod n's by design, see above).
        rng = mine["rng"] if len(per_rank) == trainer.world_size else None
        self._promised = restore_check.promised(checkpoint, rng, tensors=restore_check.plain_tensors(pl_module))
        self._positions = mine.get("positions")  # None in a checkpoint written before they were recorded
        # Another world size: another rank's running sums would count its batches twice (or never).
        self._metric_states = mine.get("metrics") if len(per_rank) == trainer.world_size else None
        fit_state = checkpoint.get("loops", {}).get("fit_loop")
        if mine["train_loaders"] and fit_state is not None:
            fit_state["combined_loader"] = mine["train_loaders"]
            self._loader_states = mine["train_loaders"]
            self._saved_global_batch = state.get("global_batch")
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
        if trainer.ckpt_path is not None:
            report_resume(trainer)
            if self._configured_settings is not None:
                warn_restored_settings(str(trainer.ckpt_path), self._configured_settings, training_settings(trainer))
        self._configured_settings = None
        fit_loop = trainer.fit_loop
        if any(
            isinstance(getattr(getattr(dl, "batch_sampler", None), "sampler", None), DistributedSamplerWrapper)
            or isinstance(getattr(dl, "sampler", None), DistributedSamplerWrapper)
            for dl in compat.train_loaders(trainer)
        ):
            rank_zero_warn(
                "Lightning wrapped a train sampler in DistributedSamplerWrapper, whose inner sampler's random "
                "state is in no checkpoint: a resume will not draw the same samples. Give the train loader "
                "`sampler=lit_ddp.data.samplers.GlobalOrderSampler(dataset)`."
            )
        mid_epoch = fit_loop.restarted_mid_epoch
        # Resumed after an epoch's last batch: that epoch is over (its running sums and progress bar with it), the
        # next one starts afresh, and Lightning's counts are set right for the checkpoints it will write.
        epoch_over = compat.fix_last_batch_restart(trainer)
        if self._loader_states and mid_epoch:
            # draws from the RNGs while the iterator is built: before their restore below
            compat.restore_train_loaders(
                trainer,
                self._loader_states,
                # Lightning annotates `current` as a _ReadyCompletedTracker; the fit loop's is a _ProcessedTracker.
                fit_loop.epoch_progress.current.processed,  # type: ignore[attr-defined]
            )
            saved, now = self._saved_global_batch, global_batch(trainer)
            if saved is not None and saved != now and len(self._loader_states) == 1:
                remap_epoch_progress(trainer, self._loader_states, saved)
        self._loader_states = None
        if self._metric_states and mid_epoch and not epoch_over:  # the epoch's running sums go on
            restore_metric_states(pl_module, self._metric_states)
        self._metric_states = None
        self._resumed_mid_epoch = mid_epoch and not epoch_over
        # After a checkpoint from on_train_epoch_end the next epoch's first batch logs where the saved epoch's last
        # left off (Lightning adds one to it, or not, depending on where validation ran).
        self._log_step_after_epoch_end = (
            compat.batches_that_stepped(trainer) if fit_loop.restarted_on_epoch_end else None
        )
        if self._rng_states is not None:
            restore_rng_states(self._rng_states, trainer.strategy.root_device, trainer.local_rank)
            self._rng_states = None
        compat.undo_epoch_end_recount(trainer)
        if self._promised is not None:  # everything is restored: the restore check, before the first step
            rng, plain = collect_rng_states(trainer.strategy.root_device), restore_check.plain_tensors(pl_module)
            live = restore_check.restored(trainer, pl_module, rng, tensors=plain)
            promised, self._promised = self._promised, None  # the checkpoint's tensors are let go either way
            if not plain and (shards := restore_check.sharded_states(trainer)) is not None:
                promised.update(shards[0])
                live.update(shards[1])
            if self._positions and self._resumed_mid_epoch:  # else the next epoch starts at its first sample
                restore_check.add_positions(promised, self._positions)
                restore_check.add_positions(live, restore_check.live_positions(trainer, self._positions))
            restore_check.check(promised, live, str(trainer.ckpt_path))
        self._positions = None

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


def metric_states(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """The state of every torchmetrics ``Metric`` in ``module`` (by module name), on the CPU. A metric logged per
    epoch (``self.log("train/loss", metric, on_epoch=True)``) sums its batches on each rank until the epoch ends;
    Lightning's checkpoint holds none of it (torchmetrics states are not persistent), so a mid-epoch resume
    would log an epoch value over the batches since the resume only."""
    from torchmetrics import Metric

    return {
        name: {attr: _to_device(value, torch.device("cpu")) for attr, value in metric.metric_state.items()}
        for name, metric in module.named_modules()
        if isinstance(metric, Metric)
    }


def restore_metric_states(module: torch.nn.Module, states: dict[str, dict[str, Any]]) -> None:
    """Sets each ``Metric`` of ``module`` named in ``states`` (:func:`metric_states`) back to its saved state,
    on the module's device."""
    from torchmetrics import Metric

    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    modules = dict(module.named_modules())
    for name, state in states.items():
        metric = modules.get(name)
        if isinstance(metric, Metric):
            for attr, value in state.items():
                setattr(metric, attr, _to_device(value, device))


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if isinstance(value, list):  # a "cat" state: one tensor per update
        return [_to_device(v, device) for v in value]
    return value


def global_batch(trainer: Trainer) -> int | None:
    """Samples per step over all ranks (``batch_size`` x world size) of the single train loader; None otherwise."""
    loaders = compat.train_loaders(trainer)
    if len(loaders) != 1 or not loaders[0].batch_size:
        return None
    return int(loaders[0].batch_size) * trainer.world_size


def remap_epoch_progress(trainer: Trainer, loader_states: list[dict[str, Any]], saved_global_batch: int) -> None:
    """On a resume with another global batch than the checkpoint's ``saved_global_batch``: sets the batches
    Lightning counts as done in the epoch to the samples the sampler consumed, in batches of today's global batch,
    and warns.

    Lightning ends an epoch after ``len(train_dataloader)`` batches counted from the restored batch count, while
    the sampler (:class:`~lit_ddp.data.samplers.GlobalOrderSampler`) resumes at its sample position. With another
    global batch they disagree: stopped after 20 batches of 32 and resumed with 64, Lightning would run 8 of the
    18 batches the remaining 1,152 of 1,792 samples make. With ``consumed // global_batch`` batches done, the
    count never runs out before the data does, so the epoch ends on its last batch (Lightning's ``is_last_batch``).
    Only a single train loader whose saved state holds a ``consumed`` position is counted so.
    """
    now = global_batch(trainer)
    sampler_state = compat.sampler_state(loader_states[0])
    if now is None or "consumed" not in sampler_state:
        return
    consumed = int(sampler_state["consumed"])
    rank_zero_warn(
        f"Resuming with a global batch of {now} samples ({now // trainer.world_size} x {trainer.world_size} "
        f"processes); the checkpoint's was {saved_global_batch}: the epoch continues from its sample {consumed} and "
        "ends after all of its samples, none lost or repeated, but the steps (and a schedule counted in steps) "
        "differ from the uninterrupted run's."
    )
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    shift = consumed // now - progress.ready
    # By the same amount: a checkpoint saved in on_train_batch_end has completed = ready - 1, which Lightning's
    # restart accounts for.
    for counter in ("ready", "started", "processed", "completed"):  # Lightning's _ProcessedTracker
        setattr(progress, counter, getattr(progress, counter) + shift)


def collect_rng_states(device: torch.device) -> dict[str, Any]:
    """This rank's RNG states: torch, numpy (as a tensor), Python, and the CUDA generator of its own ``device``
    only. Lightning's collector saves every visible GPU's state, which a resume with fewer visible GPUs (one
    process for debugging, ``--gpus-per-task``) cannot restore (``set_rng_state_all`` raises IndexError)."""
    states = _rng_states_to_tensors(compat.collect_rng_states(include_cuda=False))
    if device.type == "cuda":
        states["cuda_device"] = torch.cuda.get_rng_state(device)
    return states


def restore_rng_states(states: dict[str, Any], device: torch.device, local_rank: int = 0) -> None:
    """Restores :func:`collect_rng_states`' states on ``device``; an older checkpoint's every-GPU list
    (``"torch.cuda"``) gives the entry of this rank's ``local_rank`` where it has one."""
    states = dict(states)
    own, every_gpu = states.pop("cuda_device", None), states.pop("torch.cuda", None)
    compat.set_rng_states(_rng_states_from_tensors(states))
    if device.type != "cuda":
        return
    if own is None and every_gpu is not None and local_rank < len(every_gpu):
        own = every_gpu[local_rank]
    if own is not None:
        torch.cuda.set_rng_state(own, device)


def _rng_states_to_tensors(states: dict[str, Any]) -> dict[str, Any]:
    """numpy's state as a tensor, so that checkpoints still load with ``torch.load(weights_only=True)``."""
    if "numpy" in states:
        kind, keys, pos, has_gauss, cached = states["numpy"]
        states = {**states, "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached)}
    return states


def _rng_states_from_tensors(states: dict[str, Any]) -> dict[str, Any]:
    if "numpy" in states:
        kind, keys, pos, has_gauss, cached = states["numpy"]
        states = {**states, "numpy": (kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached)}
    return states


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
