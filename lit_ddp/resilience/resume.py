"""Finding the checkpoint a run resumes from, the same one on every rank.

Lightning's ``ckpt_path="last"`` only looks for ``last.ckpt`` and silently starts from scratch when it is
missing or unreadable. Here the newest *valid* checkpoint of the run directory, of all those
:func:`lit_ddp.run_dir.checkpoints.ranked_checkpoints` lists (``checkpoints/*.ckpt`` and ``hpc_ckpt_N.ckpt``), is the
resume point. No library offers this, hence our own code. Writing is :mod:`lit_ddp.resilience.checkpoint_io`.

A resume then says what it did (Lightning restores silently): where the run continues or that it had finished
(:func:`report_resume`), and which of the config's settings the checkpoint's replaced: the model's
hyperparameters (:func:`warn_changed_hyperparameters`), the optimizers' and LR schedulers'
(:func:`warn_restored_settings`).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_ddp import compat
from lit_ddp.errors import NoValidCheckpointError, ResumePointError, int_from_env
from lit_ddp.run_dir import layout, untrusted
from lit_ddp.run_dir.checkpoints import (
    checkpoint_header,
    checkpoint_step,
    is_valid_checkpoint,
    ranked_checkpoints,
    set_aside_later_checkpoints,
)

log = logging.getLogger(__name__)


def find_resume_checkpoint(root_dir: str, checkpoint_dir: str | None = None) -> str | None:
    """The valid checkpoint with the highest recorded step, or ``None`` when the run has none yet.

    Each candidate's small ``data.pkl`` record is read for its step; only the chosen file is then read in
    full (its CRCs). An invalid one (e.g. truncated by a kill) is skipped with a warning naming it.

    Raises:
        NoValidCheckpointError: checkpoints exist but none is valid; training must not silently restart
            from scratch over them.
    """
    candidates = ranked_checkpoints(root_dir, checkpoint_dir)
    for step, path in candidates:
        # A file whose step cannot be read at all (step -1) ranks last, but is named all the same: it is most
        # likely the newest one, cut short by a kill.
        if step < 0:
            log.warning("Checkpoint %s is truncated or unreadable; falling back to an older one.", path)
    for step, path in candidates:
        if step < 0:
            break
        if is_valid_checkpoint(path):
            return path
        log.warning("Checkpoint %s is truncated or unreadable; falling back to an older one.", path)
    if candidates:
        raise _no_valid_checkpoint(root_dir, candidates)
    return None


def _no_valid_checkpoint(root_dir: str, candidates: list[tuple[int, str]]) -> NoValidCheckpointError:
    return NoValidCheckpointError(
        f"None of the {len(candidates)} checkpoint(s) in {root_dir} can be read "
        f"({', '.join(p for _, p in candidates)}). Delete or move them to start from scratch, or pass "
        "--ckpt_path to a valid checkpoint."
    )


def check_resumable(root_dir: str, checkpoint_dir: str | None = None) -> None:
    """Fail before anything is written when the run directory holds checkpoints and not one of them has a
    readable header (a cheap early form of :func:`find_resume_checkpoint`'s refusal: no file is read in full).

    Raises:
        NoValidCheckpointError: every checkpoint there is unreadable.
    """
    candidates = ranked_checkpoints(root_dir, checkpoint_dir)
    if candidates and all(step < 0 for step, _ in candidates):
        raise _no_valid_checkpoint(root_dir, candidates)


RESUME_AUTO = "lit-ddp:resume-auto"
"""``ckpt_path`` value that :func:`resume_from_agreed_checkpoint` replaces with the agreed resume checkpoint."""


def agree_on_resume_checkpoint(trainer: Any, root_dir: str, checkpoint_dir: str) -> str | None:
    """Rank zero chooses the resume checkpoint (:func:`find_resume_checkpoint`); the choice is broadcast and
    every rank checks that it can read that file. Collective: every rank must call it.

    Raises:
        NoValidCheckpointError: on every rank, when rank zero finds checkpoints but none is valid.
        ResumePointError: on every rank, when some rank cannot read the chosen file; the message names the
            path and each such rank and host.
    """
    choice: tuple[str | None, str | None] = (None, None)
    if trainer.is_global_zero:
        try:
            choice = (find_resume_checkpoint(root_dir, checkpoint_dir), None)
        except NoValidCheckpointError as e:
            choice = (None, str(e))
    path, error = trainer.strategy.broadcast(choice, src=0)
    if error is not None:
        raise NoValidCheckpointError(error)
    if path is None:
        return None
    try:
        checkpoint_step(path)
        readable = True
    except ValueError:
        readable = False
    mine = (trainer.global_rank, socket.gethostname(), readable)
    everyone: list[Any] = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    blind = [f"rank {r} on {host}" for r, host, ok in everyone if not ok]
    if blind:
        raise ResumePointError(
            f"rank 0 chose to resume from {path}, which {', '.join(blind)} cannot read: the run directory "
            f"({root_dir}) must be on storage that every node shares, with the same path on each"
        )
    return path


def resume_from_agreed_checkpoint(
    trainer: Trainer, checkpoint_dir: str, required: bool = False, given: str | None = None
) -> None:
    """Makes ``trainer.fit/validate/test(ckpt_path=RESUME_AUTO)`` start from the checkpoint the ranks agree on
    once the process group exists (:func:`agree_on_resume_checkpoint`); Lightning's own choice
    (``ckpt_path="last"`` / ``"hpc"``) is per rank and by file name or time. ``required``: warn when the run
    directory has none (an evaluation would score the untrained weights). ``given``: the job's explicit
    ``--ckpt_path``, on a restart of that job: the run directory's checkpoint wins only from its step on."""

    def resolve() -> str | None:
        path = agree_on_resume_checkpoint(trainer, trainer.default_root_dir, checkpoint_dir)
        if given is not None and (path is None or checkpoint_step(path) < checkpoint_step(given)):
            path = given  # this job has saved nothing since it started from --ckpt_path
        if path is not None:
            path = untrusted.local_path(path)  # Lightning takes a relative "http..." path for a URL
        if path is not None:
            rank_zero_info(f"{'Evaluating' if required else 'Resuming from'} {path}")
            if not required and trainer.is_global_zero:
                warn_changed_hyperparameters(path, dict(trainer.lightning_module.hparams))
        elif required:
            rank_zero_warn(
                f"No checkpoint in {trainer.default_root_dir}: evaluating the untrained model. Give --ckpt_path, or "
                "the trainer.default_root_dir of the run to evaluate."
            )
        return path

    compat.install_resume_resolver(trainer, RESUME_AUTO, resolve)


def resolve_ckpt_path(trainer: Trainer, ckpt_path: str | None, fit: bool) -> str | None:
    """The ``ckpt_path`` to hand Lightning: without one, :data:`RESUME_AUTO`, the run directory's newest valid
    checkpoint, chosen once every rank has joined (``fit`` resumes it, ``validate`` / ``test`` evaluate it; a
    warning says when there is none); Lightning's names (``last``, ``best``, ``hpc``, ``registry``) as given.

    ``fit`` with a path is honoured once per job: its first attempt resumes from it and sets the run directory's
    checkpoints of later steps aside (:func:`~lit_ddp.run_dir.checkpoints.set_aside_later_checkpoints`); a torchrun
    restart or Slurm requeue of the same job resumes from what it saved since (the path while it saved nothing).
    Collective: every rank must call it.

    Raises:
        NoValidCheckpointError: the run directory holds checkpoints and none has a readable header.
    """
    root = trainer.default_root_dir
    if ckpt_path in ("last", "best", "hpc", "registry"):
        return ckpt_path
    if ckpt_path is not None:
        ckpt_path = untrusted.local_path(ckpt_path)  # Lightning takes a relative "http..." path for a URL
    if ckpt_path is not None and fit and restart_count() == 0:
        if trainer.is_global_zero:  # a rollback: the newer files are abandoned
            set_aside_later_checkpoints(root, layout.checkpoint_dir(root), str(ckpt_path))
        trainer.strategy.barrier("lit_ddp_later_checkpoints_moved")
        return ckpt_path
    if ckpt_path is not None and not fit:
        return ckpt_path
    check_resumable(root, layout.checkpoint_dir(root))  # before the logger writes anything
    resume_from_agreed_checkpoint(trainer, layout.checkpoint_dir(root), required=not fit, given=ckpt_path)
    return RESUME_AUTO


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times the launcher has restarted this job: torchrun's ``TORCHELASTIC_RESTART_COUNT`` plus
    Slurm's ``SLURM_RESTART_COUNT`` (requeues); 0 for its first attempt.

    Raises:
        UsageError: one of them is not a whole number (named).
    """
    return sum(int_from_env(key, env) or 0 for key in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


def warn_changed_hyperparameters(path: str, configured: dict[str, Any]) -> list[str]:
    """Warns, key by key, where the config's model hyperparameters differ from those the checkpoint was written
    with: the model is built from the config, while a resume restores the optimizer and LR scheduler states, which
    keep the checkpoint's rates and schedule (:func:`warn_restored_settings`
    names them). Returns the keys.
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
