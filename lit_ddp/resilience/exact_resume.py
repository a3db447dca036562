"""The callback that carries each rank's part of the training state through every checkpoint and has the whole
state put back at one point (:mod:`lit_ddp.resilience.state`).

Lightning calls its hooks in its own order: ``on_save_checkpoint`` (every save), then on a resume
``on_load_checkpoint`` (inside Lightning's restore: what the checkpoint holds of this rank), ``on_fit_start`` (the
optimizers' settings as the config built them) and ``on_train_start`` (the put-back and the report).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from lit_ddp.resilience import report, state


class ExactResume(Callback):
    """Saves every rank's :class:`~lit_ddp.resilience.state.RankState` (RNG streams, train-loader positions, metric
    sums) into each checkpoint (:func:`lit_ddp.resilience.state.rank_entry`: one ``all_gather_object``; rank zero
    still writes the file); on a resume from disk, puts this rank's back with the rest of the state at
    ``on_train_start``, after Lightning's own restore and the ``on_train_start`` of the callbacks listed before this
    one (:func:`lit_ddp.resilience.state.put_back`: loop and loaders, metrics, RNG, the restore check), then says
    where the run continues and which settings the checkpoint replaced (:func:`lit_ddp.resilience.report.report`),
    or that the run had already finished.

    A checkpoint written with another global batch (``batch_size`` x processes): the epoch still ends after all of
    its samples (:func:`~lit_ddp.resilience.state.remap_epoch_progress`), with a warning. A checkpoint from another
    world size: the train loader continues from the saved global sample position
    (:class:`lit_ddp.data.samplers.GlobalOrderSampler`), so the data is exact; the RNG states are those of rank
    ``r mod n`` (a warning says so); the metrics' running sums start afresh.
    """

    def __init__(self) -> None:
        self._loaded: state.Loaded | None = None  # this rank's, as the checkpoint holds it, until on_train_start
        self._configured: dict[str, Any] = {}
        self._train_started = False

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if not state.for_a_peer():  # a heal's snapshot adds this rank's entry itself (state.capture)
            checkpoint[state.CHECKPOINT_KEY] = state.rank_entry(trainer, pl_module)

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # validate / test: no train loader, no training randomness; a heal puts its state back itself (state.take)
        if trainer.state.fn == "fit" and not state.for_a_peer():
            self._loaded = state.loaded(trainer, pl_module, checkpoint)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._train_started = False
        # Lightning has built the optimizers and schedulers from the config and restores them after this hook.
        self._configured = report.training_settings(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._train_started = True
        loaded, self._loaded = self._loaded, None  # the checkpoint's tensors are let go once put back
        resumed = trainer.ckpt_path is not None
        held = loaded or state.Loaded(state.RankState(), None, None, {}, trainer.world_size)
        state.put_back(trainer, pl_module, held, str(trainer.ckpt_path))  # a fresh fit: the loop as it is
        if resumed:
            report.report(trainer, dict(pl_module.hparams), held.hyperparameters, self._configured)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning skips the training loop, and on_train_start, when the restored run is at its end already.
        if trainer.ckpt_path is not None and not self._train_started and report.reached_its_end(trainer):
            report.report_resume(trainer, finished=True)
