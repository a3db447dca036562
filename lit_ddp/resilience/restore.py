"""What a resume puts back, and what each save records so that it can: one rank's :class:`ResumeState`.

Lightning saves the model, optimizer, loops and (for loaders with ``state_dict``/``load_state_dict``, such as
torchdata's ``StatefulDataLoader``) rank zero's train-loader position. It does not save RNG states or the
torchmetrics running sums of an epoch, it restores rank zero's loader state on every rank, and on a mid-epoch resume
it rebuilds the loader iterator before it sets the sampler's epoch, so under DDP the rest of the epoch is drawn from
epoch 0's permutation (torchdata's ``BatchSampler`` iterates the sampler eagerly); when
``trainer.estimated_stepping_batches`` is called before the restore (e.g. in ``configure_optimizers`` for an LR
schedule), the loader state is not restored at all (Lightning issue 20550). :class:`ResumeState` holds what closes
these gaps; :meth:`ResumeState.restore` puts it back at one point, in numbered steps, checks it and says what it did;
:class:`lit_ddp.resilience.exact_resume.ExactResume` carries it through the checkpoint. (Under DDP, Lightning would
wrap a ``StatefulDataLoader(shuffle=True)``'s own sampler in a ``DistributedSamplerWrapper`` whose inner generator is
saved nowhere: :class:`lit_ddp.data.samplers.GlobalOrderSampler` replaces it.) Which checkpoint is restored is
:mod:`lit_ddp.resilience.resume`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_ddp import compat
from lit_ddp.errors import UsageError
from lit_ddp.resilience import restore_check
from lit_ddp.resilience.resume import restart_count
from lit_ddp.run_dir.checkpoints import checkpoint_header


class ResumeState:
    """One rank's state that a resume must restore and a Lightning checkpoint lacks.

    - ``rng``: the RNG states of torch, numpy, Python and this rank's CUDA device (:func:`capture_rng`);
    - ``train_loaders``: this rank's ``state_dict()`` of every train loader;
    - ``positions``: each train loader's global position and next global batch, as the restore check compares them
      (:func:`saved_positions`);
    - ``metrics``: the torchmetrics states of the module, an epoch's running sums (:func:`metric_states`).

    ``state_dict()`` / ``load_state_dict()`` give and take these four entries (plain tensors, lists and numbers: a
    checkpoint of them loads with ``torch.load(weights_only=True)``). :meth:`restore` puts them back, at
    ``on_train_start``, after Lightning's own restore. Lightning's checkpoint holds rank zero's loader state and no
    RNG or metric state; torchtitan's per-rank ``Stateful`` objects plug into its own checkpointer, not Lightning's.
    """

    def __init__(
        self,
        rng: dict[str, Any] | None = None,
        train_loaders: list[dict[str, Any]] | None = None,
        positions: list[dict[str, Any] | None] | None = None,
        metrics: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self.rng = rng
        self.train_loaders = train_loaders or []
        self.positions = positions
        self.metrics = metrics

    @classmethod
    def capture(cls, trainer: Trainer, pl_module: LightningModule) -> ResumeState:
        """This rank's state now (inside ``trainer.save_checkpoint``)."""
        loaders = compat.train_loader_states(trainer)
        return cls(
            rng=capture_rng(trainer.strategy.root_device),
            train_loaders=loaders,
            positions=saved_positions(trainer, loaders),
            metrics=metric_states(pl_module),
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": self.rng,
            "train_loaders": self.train_loaders,
            "positions": self.positions,
            "metrics": self.metrics,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes :meth:`state_dict`'s entries; those a checkpoint written before them lacks (``positions``,
        ``metrics``) stay None."""
        self.rng, self.positions, self.metrics = state.get("rng"), state.get("positions"), state.get("metrics")
        self.train_loaders = state.get("train_loaders") or []

    def restore(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        saved_global_batch: int | None = None,
        promised: dict[str, Any] | None = None,
        configured: dict[str, Any] | None = None,
    ) -> bool:
        """Puts this state back into the live fit at ``on_train_start``, after Lightning's own restore (module,
        optimizers, schedulers, loop counters), checks it and says what it did; a fresh fit (no ``ckpt_path``) is left
        as it is. Returns whether the run resumed within an epoch that goes on.

        1. The fit loop's position and the train loaders (:func:`lit_ddp.compat.restore_loop_position`: on a
           mid-epoch resume the loaders from ``train_loaders``, after their workers are checked, and Lightning 2.6's
           restart counts mended), the epoch's batches remapped where the global batch differs from
           ``saved_global_batch`` (:func:`remap_epoch_progress`).
        2. The metrics' running sums, of an epoch that goes on.
        3. The RNG streams, last: the loaders are built by now, and the next step draws what the uninterrupted run
           drew.
        4. The restore check, where ``promised`` holds what the checkpoint says was saved
           (:func:`lit_ddp.resilience.restore_check.verify`): one line naming the first entry that differs, on
           every rank, before any step.
        5. The report: one line saying where the run continues, and a warning for each model hyperparameter and each
           optimizer or scheduler setting (``configured``: :func:`training_settings` before Lightning's restore)
           that the checkpoint's replaced.

        Raises:
            UsageError: a train loader has another number of workers than the one whose position it would continue.
            RestoreMismatchError: the restore check found a difference.
        """
        # 1. The loop's position and the train loaders.
        warn_unsaved_sampler(trainer)
        if trainer.fit_loop.restarted_mid_epoch:
            check_loader_workers(trainer, self.train_loaders)
        mid_epoch, epoch_over = compat.restore_loop_position(trainer, self.train_loaders)
        one_loader = mid_epoch and len(self.train_loaders) == 1
        if one_loader and saved_global_batch is not None and saved_global_batch != global_batch(trainer):
            remap_epoch_progress(trainer, self.train_loaders, saved_global_batch)
        goes_on = mid_epoch and not epoch_over
        # 2. The metrics' running sums.
        if self.metrics and goes_on:
            restore_metric_states(pl_module, self.metrics)
        # 3. The RNG streams.
        if self.rng is not None:
            restore_rng(self.rng, trainer.strategy.root_device, trainer.local_rank)
        # 4. The restore check.
        if promised is not None:
            positions = self.positions if goes_on else None  # else the next epoch starts at its first sample
            restore_check.verify(trainer, pl_module, promised, capture_rng(trainer.strategy.root_device), positions)
        # 5. The report.
        if trainer.ckpt_path is not None:
            report_resume(trainer)
            if trainer.is_global_zero:
                warn_changed_hyperparameters(str(trainer.ckpt_path), dict(pl_module.hparams))
            if configured is not None:
                warn_restored_settings(str(trainer.ckpt_path), configured, training_settings(trainer))
        return goes_on


def warn_unsaved_sampler(trainer: Trainer) -> None:
    """Warns where Lightning wrapped a train sampler in ``DistributedSamplerWrapper``, whose inner sampler's random
    state no checkpoint holds."""
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


def saved_positions(trainer: Trainer, loader_states: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """At a save, for each train loader: ``{"epoch", "consumed", "next_indices"}``, the global position its saved
    state ``loader_states`` resumes at and the dataset indices of the next global batch (batch size x world size
    samples) from there, and for a loader with workers ``"worker_seed"``, the seed their RNGs start from; None for a
    loader without a GlobalOrderSampler position in its state. What the restore check compares a resume's live
    positions with (:func:`lit_ddp.resilience.restore_check.live_positions`)."""
    positions: list[dict[str, Any] | None] = []
    for loader, state in zip(compat.train_loaders(trainer), loader_states, strict=False):
        sampler, saved = restore_check.loader_sampler(loader), compat.sampler_state(state)
        if sampler is None or "consumed" not in saved:
            positions.append(None)
            continue
        epoch, consumed = int(saved["epoch"]), int(saved["consumed"])
        count = int(loader.batch_size or 1) * trainer.world_size
        upcoming = restore_check.upcoming(sampler, epoch, consumed, count)
        position = {"epoch": epoch, "consumed": consumed, "next_indices": upcoming}
        if (seed := compat.worker_seed(state)) is not None:
            position["worker_seed"] = seed
        positions.append(position)
    return positions


def check_loader_workers(trainer: Trainer, loader_states: list[dict[str, Any]]) -> None:
    """Raises UsageError where a live train loader runs another number of worker processes than the one whose saved
    state (``loader_states``) a mid-epoch resume would continue: torchdata's ``StatefulDataLoader`` loads a position
    only into a loader with as many (else an ``AssertionError`` that Lightning's teardown hides)."""
    for i, (loader, state) in enumerate(zip(compat.train_loaders(trainer), loader_states, strict=False)):
        saved, live = compat.loader_workers(state), int(getattr(loader, "num_workers", 0) or 0)
        if saved != live:
            raise UsageError(
                f"{trainer.ckpt_path} stopped mid-epoch with train loader {i} running {saved} worker processes per "
                f"rank; this run's has {live} (data.init_args.num_workers): the loader continues its position only "
                f"with as many: resume with num_workers {saved} (it may change at a checkpoint from an epoch's end)"
            )


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
    Lightning counts as done in the epoch to the samples the sampler consumed, in batches of this run's global batch,
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


def capture_rng(device: torch.device) -> dict[str, Any]:
    """This rank's RNG states: torch, numpy (as a tensor), Python, and the CUDA generator of its own ``device``
    only. Lightning's collector saves every visible GPU's state, which a resume with fewer visible GPUs (one
    process for debugging, ``--gpus-per-task``) cannot restore (``set_rng_state_all`` raises IndexError)."""
    states = _rng_states_to_tensors(compat.collect_rng_states(include_cuda=False))
    if device.type == "cuda":
        states["cuda_device"] = torch.cuda.get_rng_state(device)
    return states


def restore_rng(states: dict[str, Any], device: torch.device, local_rank: int = 0) -> None:
    """Restores :func:`capture_rng`'s states on ``device``; an older checkpoint's every-GPU list
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


# What a resume reports: where it continues and which settings the checkpoint replaced (step 5).


def warn_changed_hyperparameters(path: str, configured: dict[str, Any]) -> list[str]:
    """Warns, key by key, where the config's model hyperparameters differ from those the checkpoint was written
    with: the model is built from the config, while a resume restores the optimizer and LR scheduler states, which
    keep the checkpoint's rates and schedule (:func:`warn_restored_settings` names them). Returns the keys.
    """
    saved = checkpoint_header(path).get("hyper_parameters") or {}
    changed = [
        k for k, v in configured.items() if k in saved and not k.startswith("_") and _plain(saved[k]) != _plain(v)
    ]
    for key in changed:
        rank_zero_warn(
            f"Resuming from {path}, written with model.init_args.{key}={saved[key]!r}; the config now says "
            f"{configured[key]!r}: the model is built with the config's value, the restored optimizer and "
            "learning-rate schedule keep the checkpoint's settings (a warning lists those that differ)."
        )
    return changed


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, list | tuple) else value


def reached_its_end(trainer: Trainer) -> bool:
    """Whether ``trainer`` stands at the end its ``max_steps`` or ``max_epochs`` sets (not a stop on request)."""
    max_epochs = trainer.max_epochs
    return (trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps) or (
        max_epochs is not None and max_epochs != -1 and trainer.current_epoch >= max_epochs
    )


def report_resume(trainer: Trainer, finished: bool = False) -> None:
    """One line once the checkpoint is restored: the step, epoch and launcher restart the run continues from, or,
    ``finished``, that it had already finished there (nothing trained) and how to go on."""
    restart = restart_count()
    where = f"global_step {trainer.global_step}, epoch {trainer.current_epoch}"
    where += f", restart {restart} of this job" if restart else ""
    if finished:
        bound = f"max_steps={trainer.max_steps}" if trainer.max_steps != -1 else f"max_epochs={trainer.max_epochs}"
        rank_zero_info(
            f"Already finished ({where}; {bound}), nothing to train: raise trainer.max_steps / max_epochs to go "
            f"on, or delete {trainer.default_root_dir} to start over."
        )
    else:
        rank_zero_info(f"Resumed from {trainer.ckpt_path} at {where}")


# Scheduler state that moves as training goes (restored on purpose); the rest is how the schedule was configured.
_SCHEDULE_PROGRESS = frozenset(
    {"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial", "verbose", "best",
     "num_bad_epochs", "cooldown_counter"}
)  # fmt: skip


def training_settings(trainer: Trainer) -> dict[str, Any]:
    """How the optimizers and LR schedulers are configured, as a restore would replace it: each param group's
    settings (its current ``lr`` only where no scheduler moves it; ``initial_lr`` is the configured one) and
    each scheduler's state without its progress (milestones, ``T_max``, base rates...)."""
    scheduled = bool(trainer.lr_scheduler_configs)
    settings: dict[str, Any] = {}
    for i, optimizer in enumerate(trainer.optimizers):
        for j, group in enumerate(optimizer.param_groups):
            for key, value in group.items():
                if key != "params" and not (scheduled and key == "lr"):
                    settings[f"optimizer {i} param_groups[{j}].{key}"] = _copy(value)
    for i, config in enumerate(trainer.lr_scheduler_configs):
        _flatten(f"lr_scheduler {i} ", config.scheduler.state_dict(), settings)
    return settings


def warn_restored_settings(path: str, configured: Mapping[str, Any], restored: Mapping[str, Any]) -> list[str]:
    """Warns once, naming each optimizer or LR-scheduler setting whose restored value (from the checkpoint at
    ``path``) differs from the one the config gave (:func:`training_settings` before and after the restore):
    an edited learning rate, or a ``max_steps`` that moved the end of a cosine schedule, does not apply to a
    resumed run. Returns the differing settings' names."""
    changed = [key for key in configured if key in restored and not _same(configured[key], restored[key])]
    if changed:
        listed = "; ".join(f"{key}: {restored[key]!r} (the config gives {configured[key]!r})" for key in changed)
        rank_zero_warn(
            f"Resuming from {path}: the optimizer and learning-rate schedule continue with the checkpoint's "
            f"settings where the config now gives others: {listed}. Start a new run (another "
            "trainer.default_root_dir) to train with the config's."
        )
    return changed


def _flatten(prefix: str, value: Any, into: dict[str, Any]) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            if key not in _SCHEDULE_PROGRESS:
                _flatten(f"{prefix}{key}." if isinstance(item, Mapping | list) else f"{prefix}{key}", item, into)
    elif isinstance(value, list) and any(isinstance(item, Mapping) for item in value):
        for i, item in enumerate(value):
            _flatten(f"{prefix.rstrip('.')}[{i}].", item, into)
    else:
        into[prefix.rstrip(".")] = _copy(value)


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    return [_copy(v) for v in value] if isinstance(value, list | tuple) else value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return bool(torch.equal(torch.as_tensor(a).cpu(), torch.as_tensor(b).cpu()))
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
