"""What a resume says it did: one line where the run continues (or that it had already finished), and a warning for
each model hyperparameter and each optimizer or LR-scheduler setting that the checkpoint's replaced (the model is
built from the config; the restored optimizer and schedule keep the checkpoint's settings).

:class:`~lit_ddp.resilience.exact_resume.ExactResume` calls :func:`report` after the state is put back
(:mod:`lit_ddp.resilience.state`), and :func:`report_resume` with ``finished`` where Lightning skipped training.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_ddp.resilience.resume import restart_count
from lit_ddp.run_dir import events


def report(
    trainer: Trainer, hyperparameters: Mapping[str, Any], saved: Mapping[str, Any], configured: Mapping[str, Any]
) -> None:
    """After a resume's state is put back: where the run continues (:func:`report_resume`), and on rank zero a
    warning for each of the model's ``hyperparameters`` that the checkpoint's ``saved`` ones differ from
    (:func:`warn_changed_hyperparameters`), and for each optimizer or scheduler setting the config gave
    (``configured``: :func:`training_settings` before Lightning's restore) that the checkpoint's replaced."""
    report_resume(trainer)
    path = str(trainer.ckpt_path)
    if trainer.is_global_zero:
        warn_changed_hyperparameters(path, saved, hyperparameters)
    warn_restored_settings(path, configured, training_settings(trainer))


def warn_changed_hyperparameters(path: str, saved: Mapping[str, Any], configured: Mapping[str, Any]) -> list[str]:
    """Warns, key by key, where the config's model hyperparameters (``configured``) differ from those the checkpoint
    at ``path`` was written with (``saved``): the model is built from the config, while a resume restores the
    optimizer and LR scheduler states, which keep the checkpoint's rates and schedule (:func:`warn_restored_settings`
    names them). Returns the keys.
    """
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
        if trainer.is_global_zero:
            fields = {"global_step": trainer.global_step, "epoch": trainer.current_epoch, "restart": restart}
            events.record(trainer.default_root_dir, events.RESUMED, path=str(trainer.ckpt_path), **fields)


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
