"""What a resume tells the user: where the run continues (or that it had finished), and which optimizer and
LR-scheduler settings the checkpoint restored over the config's. Lightning restores them silently."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_ddp.resilience.resume import restart_count


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
