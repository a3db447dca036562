"""Lightning's training loop: the position a resume restores (the batch, the epoch's end, the train loaders'
states), when a batch steps the optimizer or validates, the step a batch is logged at, and a torchft group's
loaders moved within a step (a discarded step's batch read again, a healed group's taken from its peer). Lightning
2.6 has no public API for them; two of its bugs are mended here, each on the versions known to have it
(:data:`LIGHTNING_RECOUNTS_EPOCH_END`, :func:`fix_last_batch_restart`), and ``tests/unit/test_compat.py`` shows on
any version whether each is still there."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf

from lit_ddp.compat.imports import lightning_minor, private

LIGHTNING_RECOUNTS_EPOCH_END = lightning_minor(2, 6)
""":func:`undo_epoch_end_recount`'s bug: measured on Lightning 2.6.6; off on another minor until its test_compat
run shows the bug there."""


def should_accumulate(trainer: Trainer) -> bool:
    """Whether the batch that just ran only accumulates gradients (no optimizer step follows it).

    Lightning decides this in ``TrainingEpochLoop._should_accumulate`` and exposes no public flag.
    """
    return bool(trainer.fit_loop.epoch_loop._should_accumulate())


def validation_due(trainer: Trainer) -> bool:
    """Whether Lightning runs validation after the current training batch (asked in ``on_train_batch_end``)."""
    fit_loop, data_fetcher = trainer.fit_loop, trainer.fit_loop._data_fetcher
    return data_fetcher is not None and bool(fit_loop.epoch_loop._should_check_val_fx(data_fetcher))


def batches_that_stepped(trainer: Trainer) -> int:
    """The step the logger writes under: Lightning's count of batches that stepped an optimizer."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def set_batches_that_stepped(trainer: Trainer, value: int) -> None:
    """Sets the step the logger writes under (see :func:`batches_that_stepped`)."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = value


def optimizer_steps(trainer: Trainer) -> int:
    """Lightning's count of optimizer steps under automatic optimization (``trainer.global_step``): its progress
    tracker's ``optimizer.step.total.completed``."""
    return int(trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed)


def set_optimizer_steps(trainer: Trainer, value: int) -> None:
    """Sets ``trainer.global_step`` (automatic optimization) to ``value``, keeping the tracker's ready count as far
    ahead of its completed count as it is: inside an optimizer step (ready counted, completed not yet), Lightning
    then completes the step at ``value + 1``."""
    step = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step
    delta = value - int(step.total.completed)
    for tracker in (step.total, step.current):
        tracker.ready += delta
        tracker.completed += delta


def undo_epoch_end_recount(trainer: Trainer) -> None:
    """Takes back the second count of an epoch when Lightning restarts from a checkpoint written in
    ``on_train_epoch_end`` of a run bounded by ``max_steps``.

    Lightning 2.6 runs that epoch's end again on restart (``_FitLoop.on_advance_end``; with ``max_epochs``,
    ``_FitLoop.on_run_start`` marks the epoch completed instead) and counts the epoch as processed a second time:
    the sampler of every later epoch gets the next epoch's order (``set_epoch(epoch_progress.current.processed)``).
    Its ``_batches_that_stepped`` then gains one too, or not, depending on where validation ran
    (:func:`set_batches_that_stepped` puts it right). Called at ``on_train_start``; does nothing for any other
    restart, and on a Lightning outside :data:`LIGHTNING_RECOUNTS_EPOCH_END` (it would take back a count made
    once). No upstream issue reports it; ``tests/unit/test_compat.py`` shows whether the recount is there.
    """
    fit_loop = trainer.fit_loop
    if LIGHTNING_RECOUNTS_EPOCH_END and fit_loop.restarted_on_epoch_end and fit_loop._iteration_based_training():
        # The fit loop's trackers are _ProcessedTrackers; Lightning annotates them as _ReadyCompletedTrackers.
        fit_loop.epoch_progress.total.processed -= 1  # type: ignore[attr-defined]
        fit_loop.epoch_progress.current.processed -= 1  # type: ignore[attr-defined]


def fix_last_batch_restart(trainer: Trainer) -> bool:
    """Counts the next epoch as started when Lightning restarts from a checkpoint written in ``on_train_batch_end``
    of an epoch's last batch (a step or time trigger that falls on it); returns whether it was that restart.

    Lightning 2.6's ``_FitLoop.reset`` then counts the saved epoch as processed and completed but leaves the restart
    stage at "mid-epoch", so ``_FitLoop.on_advance_start`` of the next epoch counts it neither ready nor started and
    skips ``on_train_epoch_start``; and ``restarting`` stays set through that epoch, so its end steps no
    epoch-interval LR scheduler. Every later checkpoint of that run holds an epoch that is ready as many times as it
    is processed, which the next restart reads as no restart at all: it trains that epoch again from its first batch
    on top of the saved global_step (a 28-batch epoch resumed after batch 26: 26 extra steps, every later epoch off).
    Called at ``on_train_start``, after the restore; it clears the restart on the fit loop only, so the next epoch
    starts as in an uninterrupted run. Measured on Lightning 2.6.6; it acts only on the state the bug leaves (a
    "mid-epoch" restart whose epoch is processed as often as started), so a Lightning that starts that epoch turns
    it off. No upstream issue reports it; ``tests/unit/test_compat.py`` shows whether it is there.
    """
    fit_loop = trainer.fit_loop
    progress = fit_loop.epoch_progress.current
    # Lightning's trackers here are _ProcessedTrackers; it annotates them as _ReadyCompletedTrackers.
    if not (fit_loop.restarted_mid_epoch and progress.processed == progress.started):  # type: ignore[attr-defined]
        return False
    fit_loop.reset_restart_stage()
    fit_loop._restarting = False  # the fit loop's own flag: its child loops still finish their restart
    return True


def train_loaders(trainer: Trainer) -> list[Any]:
    """The train DataLoaders of the fit loop (empty before they exist)."""
    combined_loader = trainer.fit_loop._combined_loader
    return list(combined_loader.flattened) if combined_loader is not None else []


def train_loader_states(trainer: Trainer) -> list[dict[str, Any]]:
    """This rank's ``state_dict()`` of every train loader (``StatefulDataLoader``), as Lightning saves rank zero's."""
    combined_loader = trainer.fit_loop._combined_loader
    return combined_loader._state_dicts() if combined_loader is not None else []


def restore_train_loaders(trainer: Trainer, states: list[dict[str, Any]], epoch: int) -> bool:
    """Rebuilds the train loader iterator of a mid-epoch resume from ``states`` with the samplers at ``epoch``.

    Lightning rebuilds the iterator before it sets the sampler's epoch, so the rest of the epoch comes from
    epoch 0's permutation, and skips the loader state altogether when ``trainer.estimated_stepping_batches``
    was read before the restore (Lightning issue 20550; both measured on Lightning 2.6.6). It also restores this
    rank's own states, where Lightning restores rank zero's on every rank, so it runs on any version: where Lightning
    restored right, it builds the same iterator again. Returns whether there was a loader to restore.
    """
    return _rebuild_train_iterator(trainer, states, epoch) is not None


def _rebuild_train_iterator(trainer: Trainer, states: list[dict[str, Any]] | None, epoch: int) -> Any:
    """The fit loop's fetcher with a fresh iterator over the train loaders, their samplers at ``epoch`` and their
    ``states`` loaded (none: from the epoch's start); None where the fit loop has no loader yet."""
    fit_loop = trainer.fit_loop
    combined_loader, fetcher = fit_loop._combined_loader, fit_loop._data_fetcher
    if combined_loader is None or fetcher is None:
        return None
    set_sampler_epoch = private("lightning.fabric.utilities.data", "_set_sampler_epoch")
    for dl in combined_loader.flattened:
        set_sampler_epoch(dl, epoch)
    if states:
        combined_loader._load_state_dicts(states)
    fit_loop._combined_loader_states_to_load = []
    iter(fetcher)  # a fresh iterator from the restored position
    return fetcher


def reposition_train_loaders(trainer: Trainer, states: list[dict[str, Any]] | None, epoch: int, read: int) -> None:
    """Moves the train loaders, in the middle of a step, to another position of the epoch: the iterator rebuilt with
    the samplers at ``epoch`` and ``states`` loaded (:func:`train_loader_states` taken at that position; None: the
    epoch's start), and Lightning's fetcher counting ``read`` batches of the epoch as fetched. Lightning's fetcher of
    a loader with a length fetches no batch ahead (``_PrefetchDataFetcher.__iter__``) and flags the epoch's last
    batch (``is_last_batch``) by its count of fetched batches, which a fresh iterator sets to 0: the count is set
    to the position's, as Lightning's ``_TrainingEpochLoop.on_run_start`` does on a restart (Lightning 2.6.6)."""
    fetcher = _rebuild_train_iterator(trainer, states, epoch)
    if fetcher is not None:
        fetcher.fetched = read


def next_train_batch(trainer: Trainer) -> Any:
    """The next training batch of the fit loop's fetcher, prepared as Lightning's ``_TrainingEpochLoop.advance``
    prepares the one it fetches (the precision plugin's ``convert_input``, the module's ``on_before_batch_transfer``,
    the strategy's ``batch_to_device``), with Lightning's ``is_last_batch`` set from the fetcher: for a step that
    trains another batch than the one the loop fetched (a torchft group healed in the middle of its step)."""
    fit_loop = trainer.fit_loop
    fetcher = fit_loop._data_fetcher
    assert fetcher is not None, "next_train_batch() is called during a fit's training"
    batch, _, _ = next(fetcher)
    fit_loop.epoch_loop.batch_progress.is_last_batch = fetcher.done
    batch = trainer.precision_plugin.convert_input(batch)
    batch = trainer.lightning_module._on_before_batch_transfer(batch, dataloader_idx=0)
    return trainer.strategy.batch_to_device(batch, dataloader_idx=0)


def loop_progress(trainer: Trainer) -> dict[str, Any]:
    """Where the fit loop stands: its epoch and batch counts (Lightning's progress trackers' ``state_dict()``, plain
    integers and a flag). Read in the middle of a step, they say the step's batch is read and not yet completed."""
    fit_loop = trainer.fit_loop
    return {"epoch": fit_loop.epoch_progress.state_dict(), "batch": fit_loop.epoch_loop.batch_progress.state_dict()}


def set_loop_progress(trainer: Trainer, progress: dict[str, Any]) -> None:
    """Puts :func:`loop_progress`'s counts, read at the same moment of a step on another fit, into this fit loop:
    ``current_epoch``, ``batch_idx`` and when the epoch ends (and validates) follow that fit's."""
    fit_loop = trainer.fit_loop
    fit_loop.epoch_progress.load_state_dict(progress["epoch"])
    fit_loop.epoch_loop.batch_progress.load_state_dict(progress["batch"])


def uncount_batch(trainer: Trainer) -> None:
    """Takes the batch of the step under way out of Lightning's batch counts, inside the step: Lightning completes it
    after the step, and the counts then stand where they stood before it was read, so the next batch gets its
    ``batch_idx``, the epoch ends after as many batches, and this one is not the epoch's last (``is_last_batch``)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    for tracker in (progress.total, progress.current):  # Lightning's _ProcessedTrackers
        for counter in ("ready", "started", "processed", "completed"):
            setattr(tracker, counter, getattr(tracker, counter) - 1)
    progress.is_last_batch = False


def restore_loop_position(trainer: Trainer, loader_states: list[dict[str, Any]]) -> tuple[bool, bool]:
    """Puts the fit loop where the checkpoint left it, at ``on_train_start`` of a resume (a fresh fit is left as it
    is): :func:`fix_last_batch_restart`, then on a mid-epoch restart the train loaders rebuilt from this rank's
    ``loader_states`` (:func:`restore_train_loaders`; none: Lightning's restore stands), then
    :func:`undo_epoch_end_recount`. The one call through which a resume reaches the loops' private state.
    Returns ``(mid_epoch, epoch_over)``: whether Lightning restarted mid-epoch, and whether that epoch had ended
    (the checkpoint was written after its last batch)."""
    fit_loop = trainer.fit_loop
    mid_epoch = fit_loop.restarted_mid_epoch
    epoch_over = fix_last_batch_restart(trainer)
    if loader_states and mid_epoch:
        # Lightning annotates `current` as a _ReadyCompletedTracker; the fit loop's is a _ProcessedTracker.
        restore_train_loaders(trainer, loader_states, fit_loop.epoch_progress.current.processed)  # type: ignore[attr-defined]
    undo_epoch_end_recount(trainer)
    return mid_epoch, epoch_over


def show_resumed_epoch(trainer: Trainer, batch_idx: int) -> None:
    """Give the progress bar of an epoch resumed mid-way its epoch, total and ETA, starting at ``batch_idx``.

    Lightning from 2.5 (2.6.6 measured) skips ``on_train_epoch_start`` when it resumes mid-epoch, and that hook is where
    ``TQDMProgressBar`` sets the epoch's total and description, so the resumed epoch shows ``Training: | 160/?``
    without an ETA (Lightning-AI/pytorch-lightning#20603; fix proposed in #21806). Call it at the resumed
    epoch's first batch; it does nothing where the hook ran (the bar has a total) or another bar is used. The
    bar starts at ``batch_idx``, so its rate and ETA count this run's batches only.
    """
    callback = trainer.progress_bar_callback
    if not isinstance(callback, TQDMProgressBar) or callback.is_disabled:
        return
    bar = callback.train_progress_bar
    if bar.total is not None:
        return
    total = callback.total_train_batches  # by max_steps: the steps left, as if the epoch began at this batch
    if trainer.max_epochs == -1 and trainer.max_steps > 0:
        total = min(trainer.num_training_batches, batch_idx + total)
    bar.reset(total=convert_inf(total))
    bar.initial = bar.n = batch_idx
    bar.set_description(f"Epoch {trainer.current_epoch}")
