"""ModelCheckpoint that saves every N steps *and/or* every T seconds of training."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from lit_ddp import compat
from lit_ddp.resilience.deferred import DeferredFlag
from lit_ddp.run_dir import untrusted

RESTORED_PATHS = ("best_model_path", "kth_best_model_path", "last_model_path")
"""The paths ``ModelCheckpoint`` restores from a checkpoint (with the keys of ``best_k_models``) and later removes
as the "previous" last or top-k file."""


class PeriodicCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint``, with ``every_n_train_steps`` and ``train_time_interval`` allowed together.

    This class decides when a step save is due and then calls ``ModelCheckpoint``'s step hook, whose own trigger
    is "every step"; what it writes, where, and which files it keeps (``save_last``, ``save_top_k``, ``monitor``,
    file names) stay ``ModelCheckpoint``'s. With both set, a checkpoint is written at every N-th optimizer step and
    whenever T has passed since the last save. The time decision is rank zero's; ``ModelCheckpoint`` broadcasts it
    every step (a blocking object broadcast), here it travels in a non-blocking tensor broadcast started after each
    step and read after the next, so a step never waits for it (a due save happens one step later, on every rank
    alike). No trigger saves inside a gradient-accumulation window, whose partial gradients no checkpoint holds; it
    fires at the window's end. To keep the newest K step checkpoints: ``monitor="step", mode="max",
    save_top_k=K``. With ``save_last``, a run that ends (``max_steps`` / ``max_epochs``) between two triggers also
    saves its last step as ``last.ckpt``.

    A trigger that falls on a step after which Lightning validates or ends the epoch saves at the next step
    instead (``step=N+1`` in the name): a resume from a checkpoint written before that validation skips it
    (Lightning counts it as run: the discrepancy of Lightning-AI/pytorch-lightning#14579), so a kill during it would lose its
    ``val/*`` points and the random draws it makes, and a resume after an epoch's last batch skips the epoch's
    end (its ``*_epoch`` metrics). The last step of the run is saved by ``save_last`` as above.

    Args:
        every_n_train_steps: save after every this many optimizer steps (``None`` or 0: never by steps).
        train_time_interval: save when this much time has passed since the last save (``None``: never by time).
        *args: positional arguments of ``ModelCheckpoint``.
        **kwargs: other keyword arguments of ``ModelCheckpoint``.

    Raises:
        ValueError: ``every_n_train_steps < 0``, or ``every_n_epochs`` given with a step or time trigger.
    """

    def __init__(
        self,
        *args: Any,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        if every_n_train_steps is not None and every_n_train_steps < 0:
            raise ValueError(f"every_n_train_steps={every_n_train_steps} must be >= 0 (0 or null: never by steps)")
        self.every_n_train_steps = every_n_train_steps or 0
        self.train_time_interval = train_time_interval
        ours = bool(every_n_train_steps) or train_time_interval is not None
        if ours and kwargs.get("every_n_epochs"):
            raise ValueError(
                f"every_n_epochs={kwargs['every_n_epochs']} with every_n_train_steps={every_n_train_steps} or "
                f"train_time_interval={train_time_interval}: give epochs alone, or steps and/or a time interval"
            )
        if ours:  # ModelCheckpoint saves whenever this class calls its step hook (see on_train_batch_end)
            kwargs.update(every_n_train_steps=1, train_time_interval=None)
        super().__init__(*args, **kwargs)
        self.last_save_time: float | None = None  # time.monotonic() of this run's start or latest save
        self._state_key: str | None = None
        self._time_due = DeferredFlag("broadcast")  # rank zero's "the time interval has passed"
        self._due_after_boundary = False  # a trigger fell on a step that validation or an epoch's end followed

    @property
    def state_key(self) -> str:
        """The key of this callback's state in a checkpoint: ``ModelCheckpoint``'s, from the triggers as given (its
        base is configured to save at every step it is asked to, which would give another key than earlier
        checkpoints', and a resume would forget their top-k files and write ``last-v1.ckpt`` beside ``last.ckpt``)."""
        if self._state_key is None:  # Lightning reads it at every hook call (profiler names): built once
            self._state_key = compat.checkpoint_state_key(
                self,
                every_n_train_steps=self.every_n_train_steps,
                every_n_epochs=self.every_n_epochs,
                train_time_interval=self.train_time_interval,
            )
        return self._state_key

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``ModelCheckpoint``'s, where every path the checkpoint names lies in this callback's directory (real paths
        compared: ``ModelCheckpoint`` removes the previous last and top-k files it restored at its next save, after a
        lexical check that a ``..`` passes, and a URL whole).

        Raises:
            UntrustedFileError: the checkpoint, written for this directory, names a path outside it (planted: a
                save would remove that path), or a path that is not a string.
        """
        directory = str(self.dirpath)
        same_directory = state_dict.get("dirpath", self.dirpath) == self.dirpath  # else only best_model_path returns
        named = [(key, state_dict.get(key)) for key in RESTORED_PATHS]
        named += [("best_k_models", path) for path in state_dict.get("best_k_models") or {}]
        for key, path in named:
            if path in (None, "") or (isinstance(path, str) and untrusted.inside(path, directory)):
                continue
            if not isinstance(path, str) or same_directory:
                raise untrusted.UntrustedFileError(
                    f"the checkpoint's ModelCheckpoint state names {key}={path!r}, outside its directory {directory}: "
                    "lit-ddp's checkpoints never do, and the next save would remove that path; the checkpoint was "
                    "planted or edited: resume from another one (--ckpt_path), or move it away"
                )
        super().load_state_dict(state_dict)
        if self.best_model_path and not untrusted.inside(self.best_model_path, directory):  # another run's directory
            self.best_model_path = ""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.last_save_time = time.monotonic()  # the time trigger counts from the start

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._save_by_triggers(trainer, pl_module, outputs, batch, batch_idx)
        if _at_max_steps(trainer) and not compat.validation_due(trainer):
            self._save_the_end(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)  # its own saves (top-k of the monitored value) come first
        if _at_max_steps(trainer) and not trainer.sanity_checking:
            self._save_the_end(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        max_epochs = trainer.max_epochs
        if max_epochs is not None and max_epochs != -1 and trainer.current_epoch + 1 >= max_epochs:
            self._save_the_end(trainer)

    def _save_the_end(self, trainer: Trainer) -> None:
        """``last.ckpt`` at the run's last step (``max_steps``, or the end of its last epoch) when no trigger saved
        it: the same command run again then finds the run finished instead of retraining the steps after the last
        trigger. After the last batch, or after the validation due at that step, or at the last epoch's end; not
        in ``on_train_end``: by then Lightning has counted the epoch as complete, and a longer run resumed from
        there would skip the rest of it."""
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self.save_last is True and compat.last_saved_step(self) != trainer.global_step:
            compat.save_last_checkpoint(self, trainer)

    def _save_by_triggers(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if compat.should_accumulate(trainer):
            return  # inside a gradient-accumulation window: a save would lose the partial gradients (every rank alike)
        interval = self.train_time_interval
        time_due = False
        if interval is not None and pl_module.automatic_optimization:
            time_due = self._time_due_last_step()
            self._start_time_broadcast(trainer, interval)
        steps = self.every_n_train_steps
        due = time_due or self._due_after_boundary or (steps >= 1 and trainer.global_step % steps == 0)
        if not due:
            return
        if compat.validation_due(trainer) or batch_idx + 1 >= trainer.num_training_batches:
            self._due_after_boundary = True  # see the class docstring; every rank decides alike
            return
        self._due_after_boundary = False
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # saves: its trigger is every step
        self.last_save_time = time.monotonic()  # the time trigger counts from the last save

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._time_due_last_step()  # every rank ends at the same step: nothing left in flight
        super().on_train_end(trainer, pl_module)

    def _start_time_broadcast(self, trainer: Trainer, interval: timedelta) -> None:
        last = self.last_save_time
        due = last is not None and time.monotonic() - last >= interval.total_seconds()  # rank zero's counts
        self._time_due.start(int(due), trainer.strategy.root_device, trainer.world_size)

    def _time_due_last_step(self) -> bool:
        return bool(self._time_due.result())


def _at_max_steps(trainer: Trainer) -> bool:
    return trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps
