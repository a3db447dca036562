"""A Lightning callback that times training steps, for comparing ``lit-ddp fit`` with a plain PyTorch loop.

A step's time is the wall time between ``on_train_batch_start`` of consecutive steps (the whole cycle:
fetching the batch, forward, backward with the gradient all-reduce, clipping, the optimizer step, logging
and callbacks), the same span that :mod:`bench.plain_ddp` times. An interval that contains a validation is
dropped, and so are the first ``warmup_steps`` intervals. Rank zero writes the JSON when training ends:
``{"step_times": [s, ...], "step_starts": [...], "tokens_per_step": ..., "procs": ..., ...}``
(``tokens_per_step`` over all processes). ``step_starts`` holds every step's start on the system-wide
``CLOCK_MONOTONIC`` (seconds), ``None`` where a validation came between two steps, so that
:mod:`bench.framework_overhead` can tell which steps ran while the process was not paused.

    lit-ddp fit --config configs/trainer/ddp.yaml --config configs/mingpt/cpu.yaml \\
        --trainer.callbacks+=bench.step_timer.StepTimer --trainer.callbacks.path=/tmp/steps.json
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer


class StepTimer(Callback):
    """Records the wall time of every training step after the first ``warmup_steps``.

    Args:
        path: where rank zero writes the JSON; None: ``$STEP_TIMER_JSON``, else ``step_times.json`` in
            ``trainer.default_root_dir``.
        warmup_steps: step intervals left out at the start (start-up, first allocations).
        started_path: a file rank zero creates when the first step begins (start-up is over), or None.
    """

    def __init__(self, path: str | None = None, warmup_steps: int = 30, started_path: str | None = None) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
        self.path = path
        self.started_path = started_path
        self.warmup_steps = warmup_steps
        self.step_times: list[float] = []
        self.tokens_per_step: int | None = None
        self.step_starts: list[float | None] = []
        self._last: float | None = None
        self._intervals = 0
        self._started = False

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        now = time.clock_gettime(time.CLOCK_MONOTONIC)  # one clock for every process: see bench.framework_overhead
        self.step_starts.append(now)
        if self.started_path and not self._started and trainer.is_global_zero:
            Path(self.started_path).touch()
        self._started = True
        if self._last is not None:
            self._intervals += 1
            if self._intervals > self.warmup_steps:
                self.step_times.append(now - self._last)
        self._last = now
        if self.tokens_per_step is None:
            self.tokens_per_step = int(batch[0].numel()) * trainer.world_size

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last = None  # the next interval would contain the validation
        self.step_starts.append(None)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        path = Path(
            self.path or os.environ.get("STEP_TIMER_JSON") or Path(trainer.default_root_dir) / "step_times.json"
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        model = getattr(pl_module, "model", None)
        flops = model.flops_per_token() if hasattr(model, "flops_per_token") else None
        result = {
            "step_times": self.step_times,
            "step_starts": self.step_starts,
            "warmup_steps": self.warmup_steps,
            "tokens_per_step": self.tokens_per_step,
            "procs": trainer.world_size,
            "threads_per_proc": torch.get_num_threads(),
            "flops_per_token": flops,
        }
        path.write_text(json.dumps(result))
