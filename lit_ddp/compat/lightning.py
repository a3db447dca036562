"""Every read or write of another object's private attribute in the package, here and nowhere else: Lightning's
loops' positions and restart counts, its connectors, callbacks' and strategies' private state, and the bugs of
Lightning 2.6 this package mends; torch's two (``os._exit``, ``SummaryWriter``'s file writer); Lightning's RNG
helpers. Lightning's other private functions and methods are in :mod:`lit_ddp.compat.lightning_names`, torch's in
:mod:`lit_ddp.compat.torch`.

Lightning 2.6 has no public API for these; each function names what it works around (an upstream issue or PR
where there is one). A workaround of a bug states the versions known to have it and is off on any other (its
flag below), or checks the state it mends and does nothing where it is right; ``tests/unit/test_compat.py`` shows
on any version whether each bug is still there. Private names are imported where used
(:func:`~lit_ddp.compat.imports.private`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, cast

from lightning.fabric.strategies import model_parallel as lightning_model_parallel
from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from lit_ddp.compat.imports import lightning_minor, private

LIGHTNING_RECOUNTS_EPOCH_END = lightning_minor(2, 6)
""":func:`undo_epoch_end_recount`'s bug: measured on Lightning 2.6.6; off on another minor until its test_compat
run shows the bug there."""
LIGHTNING_REKEYS_BY_MODEL_ORDER = lightning_minor(2, 6)
""":func:`rekey_optimizer_states_by_groups`' bug: measured on Lightning 2.6.6, as above."""

# ---- the training loop's position


def should_accumulate(trainer: Trainer) -> bool:
    """Whether the batch that just ran only accumulates gradients (no optimizer step follows it).

    Lightning decides this in ``TrainingEpochLoop._should_accumulate`` and exposes no public flag.
    """
    return bool(trainer.fit_loop.epoch_loop._should_accumulate())


def should_update_logs(trainer: Trainer) -> bool:
    """Whether the logger writes this step (``trainer.log_every_n_steps``, or the last step): Lightning's own
    decision, which callbacks that time or sync only logged steps must follow exactly."""
    return bool(trainer._logger_connector.should_update_logs)


def log_metrics(trainer: Trainer, metrics: dict[str, Any], step: int | None = None) -> None:
    """Logs ``metrics`` as Lightning's own callbacks do (its logger connector): to every logger, at ``step`` (None:
    the global step), and into ``trainer.logged_metrics``. ``LightningModule.log`` cannot be called from a
    callback's batch-end hook of another stage, and the loggers' own ``log_metrics`` skips ``logged_metrics``."""
    trainer._logger_connector.log_metrics(metrics, step=step)


def pending_train_step_log(trainer: Trainer) -> tuple[int, dict[str, float]] | None:
    """``(step, metrics)`` of the point Lightning will log for the current training batch, asked during
    ``on_train_batch_end`` (Lightning logs it after that hook, ``update_train_step_metrics``); None when it logs
    nothing for this batch. Collective where the metrics are ``sync_dist``: every rank must ask."""
    connector = trainer._logger_connector
    if should_accumulate(trainer) or connector._first_loop_iter is None or not connector.should_update_logs:
        return None
    metrics = convert_tensors_to_scalars(dict(connector.metrics["log"]))
    if not metrics:
        return None
    step = metrics.pop("step", None)
    if step is None:  # as LoggerConnector.log_metrics adds it
        metrics.setdefault("epoch", trainer.current_epoch)
        step = batches_that_stepped(trainer)
    return int(step), {k: float(v) for k, v in metrics.items()}


def batches_that_stepped(trainer: Trainer) -> int:
    """The step the logger writes under: Lightning's count of batches that stepped an optimizer."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


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


def validation_due(trainer: Trainer) -> bool:
    """Whether Lightning runs validation after the current training batch (asked in ``on_train_batch_end``)."""
    fit_loop, data_fetcher = trainer.fit_loop, trainer.fit_loop._data_fetcher
    return data_fetcher is not None and bool(fit_loop.epoch_loop._should_check_val_fx(data_fetcher))


def set_batches_that_stepped(trainer: Trainer, value: int) -> None:
    """Sets the step the logger writes under (see :func:`batches_that_stepped`)."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = value


def disable_sigterm_broadcast(trainer: Trainer) -> bool:
    """Turns off Lightning's blocking per-step SIGTERM broadcast for this trainer; returns whether it was there.

    Since Lightning 2.6 the training loop broadcasts rank zero's "SIGTERM received" flag before every step
    and reads it on the CPU (``_broadcast_sigterm_tensor``, Lightning PR 20825): a blocking collective per step
    (Lightning issue 21487, open on 2.6.6; PR 21640 proposes an interval). Only called while our own handler owns
    SIGTERM, when Lightning's flag can never be set; a Lightning without the broadcast leaves nothing to turn off.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if not hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        return False
    cast(Any, epoch_loop)._broadcast_sigterm_tensor = _no_sigterm_broadcast  # an instance attribute over the method
    return True


def _no_sigterm_broadcast() -> None:
    """Stands in for Lightning's per-step SIGTERM broadcast."""


def after_lightning_signal_handlers(trainer: Trainer, install: Callable[[], None]) -> None:
    """Calls ``install`` right after Lightning registers its signal handlers in this trainer's next run.

    ``trainer.fit`` registers them (``_signal_connector.register_signal_handlers``) after restoring the
    checkpoint and before the sanity check; no public hook runs between that and ``on_train_start``. Its SIGTERM
    handler broadcasts inside the handler, wherever the rank is (a collective that can interleave with DDP's),
    and sets a flag only the per-step broadcast reads, which :func:`disable_sigterm_broadcast` turns off: a
    SIGTERM in that window would be lost."""
    connector = cast(Any, trainer)._signal_connector
    register = type(connector).register_signal_handlers

    def register_then_install() -> None:
        register(connector)
        install()

    connector.register_signal_handlers = register_then_install  # an instance attribute over the method


# ---- train loader state per rank (Lightning restores rank zero's on every rank)


def train_loader_states(trainer: Trainer) -> list[dict[str, Any]]:
    """This rank's ``state_dict()`` of every train loader (``StatefulDataLoader``), as Lightning saves rank zero's."""
    combined_loader = trainer.fit_loop._combined_loader
    return combined_loader._state_dicts() if combined_loader is not None else []


def train_loaders(trainer: Trainer) -> list[Any]:
    """The train DataLoaders of the fit loop (empty before they exist)."""
    combined_loader = trainer.fit_loop._combined_loader
    return list(combined_loader.flattened) if combined_loader is not None else []


def restore_train_loaders(trainer: Trainer, states: list[dict[str, Any]], epoch: int) -> bool:
    """Rebuilds the train loader iterator of a mid-epoch resume from ``states`` with the samplers at ``epoch``.

    Lightning rebuilds the iterator before it sets the sampler's epoch, so the rest of the epoch comes from
    epoch 0's permutation, and skips the loader state altogether when ``trainer.estimated_stepping_batches``
    was read before the restore (Lightning issue 20550; both measured on Lightning 2.6.6). It also restores this
    rank's own states, where Lightning restores rank zero's on every rank, so it runs on any version: where Lightning
    restored right, it builds the same iterator again. Returns whether there was a loader to restore.
    """
    fit_loop = trainer.fit_loop
    combined_loader, fetcher = fit_loop._combined_loader, fit_loop._data_fetcher
    if combined_loader is None or fetcher is None:
        return False
    set_sampler_epoch = private("lightning.fabric.utilities.data", "_set_sampler_epoch")
    for dl in combined_loader.flattened:
        set_sampler_epoch(dl, epoch)
    combined_loader._load_state_dicts(states)
    fit_loop._combined_loader_states_to_load = []
    iter(fetcher)  # a fresh iterator from the restored position
    return True


# ---- RNG states (Lightning's helpers are private functions)


# ---- checkpoints


def hpc_save_path(trainer: Trainer) -> str:
    """``<default_root_dir>/hpc_ckpt_N.ckpt`` with the next free N: the name Lightning's Slurm handler saves to."""
    return str(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))


def install_resume_resolver(trainer: Trainer, marker: str, resolve: Callable[[], str | None]) -> None:
    """Makes ``trainer.fit(ckpt_path=marker)`` resume from ``resolve()``, called once the process group exists.

    Lightning resolves ``ckpt_path`` in its private checkpoint connector (``resume_start``) and offers no
    hook between "the process group exists" and "the checkpoint is read"; its own choices (``"last"``,
    ``"hpc"``) are made per rank, by file name or time.
    """

    connector: Any = private("lightning.pytorch.trainer.connectors.checkpoint_connector", "_CheckpointConnector")

    class _ResolvingConnector(connector):
        def resume_start(self, checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
            if checkpoint_path == marker:
                checkpoint_path = resolve()
            super().resume_start(checkpoint_path, weights_only)

    trainer._checkpoint_connector = _ResolvingConnector(trainer)


def last_saved_step(callback: ModelCheckpoint) -> int:
    """The ``global_step`` of ``callback``'s newest save in this run (0 before any)."""
    return int(callback._last_global_step_saved)


def checkpoint_state_key(callback: ModelCheckpoint, **triggers: Any) -> str:
    """The key ``ModelCheckpoint`` files its state under in a checkpoint, built by Lightning's private
    ``Callback._generate_state_key`` from ``callback``'s monitor, mode and the given ``triggers`` (keyword
    ``every_n_train_steps``, ``every_n_epochs``, ``train_time_interval``), for a subclass whose base is configured
    with other triggers than the ones it was given and whose checkpoints must resume under the same key."""
    return str(callback._generate_state_key(monitor=callback.monitor, mode=callback.mode, **triggers))


def save_last_checkpoint(callback: ModelCheckpoint, trainer: Trainer) -> None:
    """Writes ``callback``'s ``last.ckpt`` now, as its triggers do (ModelCheckpoint has no public call for it).
    Collective: every rank must call it."""
    callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def wait_for_async_writes(checkpoint_io: Any) -> None:
    """Blocks until every write of Lightning's ``AsyncCheckpointIO`` in flight is on disk; re-raises a write's
    error. Lightning waits only in ``teardown`` (its executor and error are private)."""
    executor = getattr(checkpoint_io, "_executor", None)
    if executor is None:
        return
    executor.submit(lambda: None).result()  # one worker, FIFO: every earlier write has finished
    if checkpoint_io._error is not None:
        raise checkpoint_io._error


# ---- loggers


def flatten_hparams(params: Any) -> dict[str, Any]:
    """Hyperparameters flattened as Lightning's loggers do it (``_convert_params`` + ``_flatten_dict``)."""
    logger = "lightning.fabric.utilities.logger"
    return private(logger, "_flatten_dict")(private(logger, "_convert_params")(params))


def tensorboard_hparams(logger: TensorBoardLogger, params: Any) -> dict[str, Any]:
    """``params`` flattened and sanitized (non-scalars as strings) as ``TensorBoardLogger.log_hyperparams`` writes
    them (:func:`flatten_hparams`, then the logger's ``_sanitize_params``)."""
    return dict(logger._sanitize_params(flatten_hparams(params)))


def default_hp_metric(logger: TensorBoardLogger) -> bool:
    """The logger's ``default_hp_metric`` argument (kept private by ``TensorBoardLogger``)."""
    return bool(logger._default_hp_metric)


# ---- RNG states (Lightning's helpers are private functions)


def collect_rng_states(include_cuda: bool) -> dict[str, Any]:
    """torch, numpy, Python (and CUDA) RNG states of this process: Lightning's ``_collect_rng_states``."""
    return private("lightning.fabric.utilities.seed", "_collect_rng_states")(include_cuda=include_cuda)


def set_rng_states(states: dict[str, Any]) -> None:
    """Restores what :func:`collect_rng_states` returned: Lightning's ``_set_rng_states``."""
    private("lightning.fabric.utilities.seed", "_set_rng_states")(states)


# ---- strategies


def set_strategy_timeout(strategy: Any, timeout: timedelta) -> None:
    """Makes the strategy create its process group with ``timeout`` (before ``setup_environment``); Lightning
    takes one timeout, for the rendezvous and every collective alike."""
    strategy._timeout = timeout


def set_model_parallel_sizes(strategy: Any, data_parallel_size: int, tensor_parallel_size: int) -> None:
    """Gives a ``ModelParallelStrategy`` its mesh sizes before ``setup_environment`` builds the mesh: its "auto"
    data-parallel size is ``num_nodes`` (tensor parallel within a node), where FSDP2 alone wants every process,
    and the world size is known only once the Trainer has set the devices (no public setter)."""
    strategy._data_parallel_size = data_parallel_size
    strategy._tensor_parallel_size = tensor_parallel_size


@contextmanager
def rekey_optimizer_states_by_groups(model: Any, optimizers: list[Any]) -> Iterator[None]:
    """While it lasts, ``ModelParallelStrategy`` reads a single-file checkpoint's numbered optimizer states (DDP's)
    in the order of ``optimizers``' groups, as torch numbers them. A bug: Lightning's private
    ``_rekey_optimizer_state_if_needed`` numbers ``model.parameters()`` (``FSDP.rekey_optim_state_dict``,
    pytorch#113673): groups in another order (decay / no-decay, Muon + AdamW) get other parameters' state.
    Measured on Lightning 2.6.6; Lightning's own function stays on another minor
    (:data:`LIGHTNING_REKEYS_BY_MODEL_ORDER`)."""
    if not LIGHTNING_REKEYS_BY_MODEL_ORDER:
        yield
        return
    names = {param: name for name, param in model.named_parameters()}
    pending, original = list(optimizers), lightning_model_parallel._rekey_optimizer_state_if_needed

    def rekey(optimizer_state_dict: dict[str, Any], module: Any) -> dict[str, Any]:
        order = [names[p] for group in pending.pop(0).param_groups for p in group["params"]]
        state, groups = optimizer_state_dict["state"], optimizer_state_dict["param_groups"]
        if not all(isinstance(i, int) for i in state):
            return optimizer_state_dict  # named already (FSDP2's own single-file checkpoints)
        groups = [{**group, "params": [order[i] for i in group["params"]]} for group in groups]
        return {"state": {order[i]: s for i, s in state.items()}, "param_groups": groups}

    lightning_model_parallel._rekey_optimizer_state_if_needed = rekey
    try:
        yield
    finally:
        lightning_model_parallel._rekey_optimizer_state_if_needed = original


# ---- torch


def exit_now(code: int) -> None:
    """Ends the process at once (``os._exit``), without cleanup that would wait on a dead peer's collectives."""
    os._exit(code)


def tensorboard_file_writer(summary_writer: Any) -> Any:
    """The ``FileWriter`` behind torch's ``SummaryWriter``, for events it has no method for (an HParams summary
    without values, a ``SessionLog.START`` purge marker)."""
    return summary_writer._get_file_writer()
