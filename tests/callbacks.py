"""Test-only callbacks that CLI runs in subprocesses load by class path, through a YAML fragment
(``tests.helpers.write_callbacks_config`` with ``tests.helpers.callback``): the training processes themselves
record what each rank saw, or die / wait at chosen points; the tests read the files back.

Schedules that must survive the restart of the process they kill keep their state in files.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision

from lit_ddp.resilience import signals


def _write(directory: str, name: str, text: str) -> None:
    os.makedirs(directory, exist_ok=True)
    Path(directory, name).write_text(text)


def _kills_so_far(state_dir: str) -> int:
    """How many kills the schedule in ``state_dir`` has done so far (its ``killed_<i>`` markers)."""
    return len(list(Path(state_dir).glob("killed_*")))


def _slurm_restart_count() -> int:
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def _sleep(seconds: float, until_signal: bool = False) -> None:
    """Sleeps in short slices, so that Python-level signal handlers run between them; with ``until_signal``,
    returns as soon as a preemption signal has been recorded (:mod:`lit_ddp.resilience.signals`)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (until_signal and signals.requested() is not None):
        time.sleep(0.05)


class RecordRun(Callback):
    """Writes ``<out_dir>/rank<R>.pt`` at the end of fit: what this process saw of the run.

    Fields: ``world_size``, ``global_rank``, ``cluster_environment`` (class name), ``epochs`` (epoch -> the
    training inputs ``batch[0]`` this rank was fed, concatenated), ``start_step`` (the global step this
    process started training at), ``optimizer_steps`` (steps it took), ``global_step`` (final) and ``params``
    (the final state_dict).

    Args:
        out_dir: where to write; created if missing.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.epochs: dict[int, list[torch.Tensor]] = {}
        self.start_step = -1
        self.optimizer_steps = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start_step = trainer.global_step

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self.epochs.setdefault(trainer.current_epoch, []).append(batch[0].detach().cpu().clone())

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        self.optimizer_steps += 1

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        record = {
            "world_size": trainer.world_size,
            "global_rank": trainer.global_rank,
            "cluster_environment": type(getattr(trainer.strategy, "cluster_environment", None)).__name__,
            "epochs": {e: torch.cat(xs) for e, xs in self.epochs.items()},
            "start_step": self.start_step,
            "optimizer_steps": self.optimizer_steps,
            "global_step": trainer.global_step,
            "params": {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()},
        }
        torch.save(record, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


class RecordMetrics(Callback):
    """Writes ``<out_dir>/rank<R>.json`` after every validation (not the sanity check) and test: the global step and
    the trainer's ``callback_metrics`` as floats, as this rank sees them.

    Args:
        out_dir: where to write; created if missing.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        record = {
            "global_rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        }
        _write(self.out_dir, f"rank{trainer.global_rank}.json", json.dumps(record))

    on_test_end = on_validation_end


class RecordStart(Callback):
    """Writes ``<out_dir>/start_r<S>_t<T>_rank<R>.json`` when fit starts: where this (re)run begins, with
    ``S`` = ``$SLURM_RESTART_COUNT`` (requeues) and ``T`` = ``$TORCHELASTIC_RESTART_COUNT`` (0 when unset).

    Args:
        out_dir: where to write; created if missing.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        record = {
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "restart_count": os.environ.get("SLURM_RESTART_COUNT"),
            "torchelastic_restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
            "world_size": trainer.world_size,
            "cluster_environment": type(trainer.strategy.cluster_environment).__name__,
            "num_threads": torch.get_num_threads(),
            "cpus_per_task": os.environ.get("SLURM_CPUS_PER_TASK"),
            "cpus": sorted(os.sched_getaffinity(0)),  # the CPUs this process may run on (Slurm's binding)
        }
        name = f"start_r{_slurm_restart_count()}_t{record['torchelastic_restart_count'] or 0}"
        _write(self.out_dir, f"{name}_rank{trainer.global_rank}.json", json.dumps(record))


class PauseForSignal(Callback):
    """On the first run of a Slurm job only, stops every rank after training step ``step`` and waits there.

    Each rank writes ``<out_dir>/paused_rank<R>`` and then sleeps in short slices until its handler has recorded
    a preemption signal (:mod:`lit_ddp.resilience.signals`), so the test can send ``scancel --signal=USR1`` at a known step
    and the ranks save (``PreemptionCheckpoint``, after this callback in the same hook) at that step. Gives up
    (and trains on) after ``max_wait`` seconds.

    Args:
        step: the global step after which to wait.
        out_dir: where the marker files go.
        max_wait: seconds to wait for the signal at most.
    """

    def __init__(self, step: int, out_dir: str, max_wait: float = 120.0) -> None:
        self.step, self.out_dir, self.max_wait = step, out_dir, max_wait

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step or _slurm_restart_count() != 0:
            return
        _write(self.out_dir, f"paused_rank{trainer.global_rank}", str(os.getpid()))
        _sleep(self.max_wait, until_signal=True)


class PoisonAtStep(Callback):
    """Sets the first parameter to NaN once ``global_step`` reaches ``step`` (the loss becomes NaN).

    Args:
        step: the global step before whose training step to poison.
    """

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                next(pl_module.parameters()).fill_(float("nan"))


class MarkTrainStart(Callback):
    """On global rank zero, writes ``<state_dir>/started_<n>`` when training starts, ``n`` counting the starts
    so far (one per launch or restart), so that a test can time a fault from each start.

    Args:
        state_dir: where the markers go; created if missing.
    """

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            _write(self.state_dir, f"started_{len(list(Path(self.state_dir).glob('started_*')))}", str(os.getpid()))


class _OnceAfterResume(Callback):
    """For callbacks that act once in a fit that resumed from a checkpoint: :meth:`take` is True at its first call
    after such a fit's start, False after that and in a fit that started fresh."""

    def __init__(self) -> None:
        self.pending = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.pending = bool(trainer.ckpt_path)

    def take(self) -> bool:
        pending, self.pending = self.pending, False
        return pending


class NudgeOnResume(_OnceAfterResume):
    """Breaks exactness on purpose, for ``lit-ddp chaos`` to catch: a fit that resumes from a checkpoint adds
    1e-3 to its first parameter after its first step (what a lost RNG or loader state does, made plain). Before the
    first step, the restore check would stop the run instead (``tests/unit/resilience/test_restore_check.py``)."""

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: object) -> None:
        if self.take():
            with torch.no_grad():
                next(pl_module.parameters()).add_(1e-3)


class NudgeBeforeTheCheck(Callback):
    """A load-time breaker: a fit that resumes from a checkpoint adds 1e-3 to its first parameter (this rank's shard
    under FSDP2) in ``on_train_start``, where it runs before ExactResume's restore check, which then stops the run."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.ckpt_path:
            with torch.no_grad():
                next(pl_module.parameters()).add_(1e-3)


class GradientNoise(Callback):
    """Makes CPU training nondeterministic, as a GPU's fast kernels do: before each optimizer step, adds
    ``scale x |grad|.mean() x N(0, 1)`` to every gradient, from a generator seeded from the OS (printed, so that a
    run can be replayed by hand with ``seed``), never from torch's global RNG (which the resume restores)."""

    def __init__(self, scale: float = 1e-4, seed: int | None = None) -> None:
        self.scale = scale
        self.seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
        self.generator = torch.Generator().manual_seed(self.seed)
        print(f"GradientNoise: seed {self.seed}", flush=True)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: object) -> None:
        for p in pl_module.parameters():
            if p.grad is not None:
                noise = torch.randn(p.grad.shape, generator=self.generator).to(p.grad)
                p.grad.add_(noise * p.grad.abs().mean() * self.scale)


class ReseedOnResume(_OnceAfterResume):
    """Breaks a resume after its restore check, as a forgotten RNG does: at the first batch of a resumed fit,
    reseeds torch's global RNG (dropout masks then differ from the uninterrupted run's)."""

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: object) -> None:
        if self.take():
            torch.manual_seed(0)


class ForgetLoaderPosition(Callback):
    """Breaks a resume as a sampler without state does: a resumed fit drops the train loaders' positions from the
    checkpoint it loads (Lightning's and ExactResume's), so it starts its epoch over. With ``keep_promise`` it
    leaves the positions the restore check compares, which then stops the run; without, the check has nothing to
    compare (as for a sampler other than GlobalOrderSampler) and the calibrated chaos finds it."""

    def __init__(self, keep_promise: bool = False) -> None:
        self.keep_promise = keep_promise

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).pop("combined_loader", None)
        for entry in checkpoint.get("exact_resume", {}).get("per_rank", []):
            entry["train_loaders"] = []
            if not self.keep_promise:
                entry.pop("positions", None)


class StepTrace(Callback):
    """Appends ``<unix time> <pid> <global_step>`` to ``<directory>/<$REPLICA_GROUP_ID>.txt`` (rank ``r`` > 0 of a
    group of several processes: ``<$REPLICA_GROUP_ID>.rank<r>.txt``) after every training batch (a torchft replica
    group's steps, across its restarts), after sleeping ``sleep[group]`` seconds before it (steps slow enough to kill
    a group mid-training; a slower group makes the other wait in the all-reduce).

    With ``indices`` (a regression fit), each line goes on with ``<step>:<epoch>:<i,j,...>``: the global step and
    epoch the batch was trained at and the train set's indices of its samples (its inputs found in the train set),
    read in ``training_step``: the batch the step trained, which a heal replaces, not the one the loop fetched.

    With ``hold_at`` and ``hold_until``, the batch of step ``hold_at`` waits until the file ``hold_until`` exists
    (a test's moment, such as another process ready, without racing the steps).

    With ``under``, only runs whose ``default_root_dir`` has a directory of that name sleep (chaos's faulted run,
    ``<root>/faulted/group_<i>``, and not its uninterrupted ones, whose pace nothing reads)."""

    def __init__(
        self,
        directory: str,
        sleep: dict[str, float] | None = None,
        indices: bool = False,
        hold_at: int | None = None,
        hold_until: str | None = None,
        under: str | None = None,
    ) -> None:
        self.group = os.environ.get("REPLICA_GROUP_ID", "group_0")
        rank = int(os.environ.get("RANK", "0"))  # a group of several processes (torchrun): one file per rank
        self.path = Path(directory, f"{self.group}.txt" if rank == 0 else f"{self.group}.rank{rank}.txt")
        self.sleep = (sleep or {}).get(self.group, 0.0)
        self.indices = indices
        self.hold_at, self.hold_until = hold_at, hold_until
        self.under = under
        self.trained = ""
        os.makedirs(directory, exist_ok=True)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.under is not None and self.under not in Path(trainer.default_root_dir).parts:
            self.sleep = 0.0
        if not self.indices or stage != "fit":
            return
        inputs = trainer.datamodule.train_set.tensors[0]
        where = {row.numpy().tobytes(): i for i, row in enumerate(inputs)}
        training_step = pl_module.training_step

        def traced(batch: tuple[torch.Tensor, torch.Tensor], *args: object, **kwargs: object) -> object:
            found = [where[row.numpy().tobytes()] for row in batch[0].detach().cpu()]
            self.trained = f" {trainer.global_step}:{trainer.current_epoch}:{','.join(map(str, found))}"
            return training_step(batch, *args, **kwargs)

        pl_module.training_step = traced  # type: ignore[method-assign]

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: object, batch_idx: int) -> None:
        time.sleep(self.sleep)
        if self.hold_until is not None and trainer.global_step == self.hold_at:
            while not os.path.exists(self.hold_until):
                time.sleep(0.05)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: object, batch: object, batch_idx: int
    ) -> None:
        with open(self.path, "a") as f:
            f.write(f"{time.time():.3f} {os.getpid()} {trainer.global_step}{self.trained}\n")


class StepsSeen(Callback):
    """A callback with a state of its own: the optimizer steps this fit has taken (``on_before_optimizer_step``, which
    a step torchft discards never reaches), carried through checkpoints and heals by its ``state_dict``. A process
    that started over without it counts from 0."""

    def __init__(self) -> None:
        self.steps = 0

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: object) -> None:
        self.steps += 1

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.steps = int(state_dict["steps"])


class ScalerLikePrecision(Precision):
    """Lightning's 32-bit precision with a GradScaler's kind of state on CPU: a ``scale`` that moves at every optimizer
    step it takes (doubled, and halved every third step, as a scaler grows and backs off) and the steps counted,
    saved and restored through ``state_dict`` / ``load_state_dict`` as Lightning's ``MixedPrecision`` saves its
    scaler's."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.tensor(1.0, dtype=torch.float64)
        self.steps = 0

    def optimizer_step(self, optimizer: object, model: object, closure: object, **kwargs: object) -> object:
        out = super().optimizer_step(optimizer, model, closure, **kwargs)  # type: ignore[arg-type]
        self.steps += 1
        self.scale = self.scale * (0.5 if self.steps % 3 == 0 else 2.0)
        return out

    def state_dict(self) -> dict[str, object]:
        return {"scale": self.scale.clone(), "steps": self.steps}

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        self.scale = torch.as_tensor(state_dict["scale"], dtype=torch.float64).clone()
        self.steps = int(state_dict["steps"])  # type: ignore[call-overload]


class FlipBit(Callback):
    """Silent data corruption on one device: at the end of optimizer step ``step`` (``trainer.global_step``), rank
    ``rank`` flips the lowest mantissa bit of element ``element`` of parameter number ``parameter`` (a float32
    tensor), in place; every other rank leaves its replica as it is."""

    def __init__(self, step: int, rank: int = 1, parameter: int = 0, element: int = 0) -> None:
        self.step, self.rank, self.parameter, self.element = step, rank, parameter, element

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            p = list(pl_module.parameters())[self.parameter]
            with torch.no_grad():
                p.view(-1).view(torch.int32)[self.element] ^= 1
            print(
                f"FlipBit: rank {self.rank} flipped a bit of parameter {self.parameter} at step {self.step}", flush=True
            )
            self.step = -1  # once


class RecordBackwardHooks(Callback):
    """Writes ``<out_dir>/rank<R>.pt`` at the end of training: for each call of ``on_before_backward``,
    ``on_after_backward`` and ``on_before_optimizer_step`` (in order), the hook's name and how many of this rank's
    parameters had a gradient then, of how many; the loss ``on_before_backward`` was given."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.calls: list[tuple[str, int, int, float | None]] = []

    def _record(self, name: str, pl_module: LightningModule, loss: torch.Tensor | None = None) -> None:
        params = list(pl_module.parameters())
        with_grad = sum(p.grad is not None for p in params)
        self.calls.append((name, with_grad, len(params), None if loss is None else float(loss)))

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._record("on_before_backward", pl_module, loss)

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._record("on_after_backward", pl_module)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: object) -> None:
        self._record("on_before_optimizer_step", pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        torch.save(self.calls, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))
