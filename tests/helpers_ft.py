"""Test-only callbacks for the fault-tolerance tests: dying at chosen steps, and recording what a run did.

They reach a CLI run through a YAML fragment (``tests.helpers.write_callbacks_config``). The kill schedule
lives in files of a state directory, so it survives the restarts of the process that it kills.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer


def _mark(state_dir: str, name: str, text: str) -> None:
    os.makedirs(state_dir, exist_ok=True)
    Path(state_dir, name).write_text(text)


def _attempt(state_dir: str) -> int:
    """How many kills the schedule in ``state_dir`` has done so far."""
    return len(list(Path(state_dir).glob("killed_*")))


class KillAtSteps(Callback):
    """SIGKILLs its own process on rank ``rank`` before optimizer step ``steps[i] + 1`` of the i-th attempt.

    Args:
        steps: the global step at which to die, one per attempt; later attempts run to the end.
        state_dir: where ``killed_<i>`` markers are written (created if missing).
        rank: the global rank that dies.
    """

    def __init__(self, steps: list[int], state_dir: str, rank: int = 0) -> None:
        self.steps, self.state_dir, self.rank = list(steps), state_dir, rank

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        i = _attempt(self.state_dir)
        if trainer.global_rank == self.rank and i < len(self.steps) and trainer.global_step == self.steps[i]:
            _mark(self.state_dir, f"killed_{i}", str(trainer.global_step))
            os.kill(os.getpid(), signal.SIGKILL)


class PauseAtSteps(Callback):
    """On rank ``rank``, before optimizer step ``steps[i] + 1`` of the i-th attempt, writes
    ``<state_dir>/paused_<i>`` (its pid) and waits to be killed by the test (``os._exit(3)`` after
    ``max_wait`` seconds, so a broken test cannot leave it behind).

    Args:
        steps: the global step at which to wait, one per attempt.
        state_dir: where ``paused_<i>`` files are written; the test writes ``killed_<i>`` after killing.
        rank: the global rank that waits.
        max_wait: seconds before giving up.
    """

    def __init__(self, steps: list[int], state_dir: str, rank: int = 1, max_wait: float = 120.0) -> None:
        self.steps, self.state_dir, self.rank, self.max_wait = list(steps), state_dir, rank, max_wait

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        i = _attempt(self.state_dir)
        if trainer.global_rank == self.rank and i < len(self.steps) and trainer.global_step == self.steps[i]:
            _mark(self.state_dir, f"paused_{i}", f"{os.getpid()} {trainer.global_step}")
            deadline = time.monotonic() + self.max_wait
            while time.monotonic() < deadline:
                time.sleep(0.05)
            os._exit(3)


class RecordFinal(Callback):
    """Writes ``<out_dir>/rank<R>.pt`` at the end of fit: the step this process started training at, the
    optimizer steps it took, the final global step and parameters.

    Args:
        out_dir: where to write; created if missing.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.start_step = -1
        self.optimizer_steps = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start_step = trainer.global_step

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        self.optimizer_steps += 1

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        record = {
            "start_step": self.start_step,
            "optimizer_steps": self.optimizer_steps,
            "global_step": trainer.global_step,
            "world_size": trainer.world_size,
            "params": {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()},
        }
        torch.save(record, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def tensorboard_steps(run_dir: str | Path) -> dict[str, list[int]]:
    """Every scalar tag of a run directory and the steps it was logged at, as TensorBoard shows them
    (orphaned points of a killed run purged), in file order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def load_records(out_dir: str | Path) -> list[dict]:
    """The ``RecordFinal`` files of a run, by rank."""
    files = sorted(Path(out_dir).glob("rank*.pt"))
    return [torch.load(f, weights_only=False) for f in files]
