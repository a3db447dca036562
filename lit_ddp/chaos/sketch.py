"""What ``lit-ddp chaos --calibrated`` compares at every logged step: a fixed sample of the parameters.

A checkpoint at every logged step would cost a save per step, so :class:`ParameterSketch` (added to every chaos
run) has rank zero write ``SKETCH_SIZE`` coordinates of the parameters at each logged step, the same coordinates
in every run (drawn from a generator of its own, never from the RNG the run restores), into
``.chaos_sketch/step_N.pt`` in the run directory; a step a resumed run trains again is written again. Two runs'
relative distance over these coordinates (:func:`relative_distance`) sums thousands of small differences, so at
one step it lies close to its mean, where a loss at one step is one random draw: it can be judged step by step.
Under FSDP2 or tensor parallelism the sample is of rank zero's shards.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

SKETCH_DIR = ".chaos_sketch"
SKETCH_SIZE = 16384  # coordinates: 64 KiB a logged step
_STEP_FILE = re.compile(r"step_(\d+)\.pt")


def _local(p: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local shard (FSDP2, tensor parallelism); a plain tensor as it is."""
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p


class ParameterSketch(Callback):
    """Rank zero writes the parameters' sample (a float32 vector of about ``size`` values) at each step that is a
    multiple of ``trainer.log_every_n_steps``. It changes nothing in the run and holds no state."""

    def __init__(self, size: int = SKETCH_SIZE) -> None:
        self.size = size
        self._indices: list[torch.Tensor] | None = None
        self._last_step: int | None = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        step = trainer.global_step
        every = max(1, trainer.log_every_n_steps)  # type: ignore[attr-defined]  # set by Lightning at runtime
        if not trainer.is_global_zero or step == self._last_step or step % every:
            return
        self._last_step = step
        folder = Path(str(trainer.default_root_dir)) / SKETCH_DIR
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step_{step}.pt"
        torch.save(self.sample(pl_module), str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)  # a kill mid-write leaves the previous file or none, never half of one

    @torch.no_grad()
    def sample(self, module: torch.nn.Module) -> torch.Tensor:
        """The floating-point parameters' sampled coordinates, in ``named_parameters`` order, on the CPU: shape
        ``(n,)``, ``n`` about ``size`` (each tensor gives its share by its number of elements, drawn with
        replacement), or every coordinate of a model with at most ``size``."""
        params = [_local(p).detach().reshape(-1) for _, p in module.named_parameters() if p.is_floating_point()]
        if self._indices is None:
            total = sum(p.numel() for p in params)
            generator = torch.Generator().manual_seed(0)
            self._indices = [
                torch.arange(p.numel())  # a model this small is compared whole
                if total <= self.size
                else torch.randint(p.numel(), (math.ceil(self.size * p.numel() / total),), generator=generator)
                for p in params
            ]
        return torch.cat([p[i.to(p.device)].float().cpu() for p, i in zip(params, self._indices, strict=True)])


def sketches(run: Path) -> dict[int, torch.Tensor]:
    """``{step: sample}`` of every sketch the run at ``run`` wrote (empty where it wrote none)."""
    folder = run / SKETCH_DIR
    found = {}
    for path in folder.glob("step_*.pt") if folder.is_dir() else []:
        if match := _STEP_FILE.fullmatch(path.name):
            found[int(match.group(1))] = torch.load(path, map_location="cpu", weights_only=True).double()
    return found


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||b - a|| / ||a||`` of two samples (``inf`` where their shapes differ: another model or sharding)."""
    if a.shape != b.shape:
        return math.inf
    norm = float(a.norm())
    diff = float((b - a).norm())
    return diff / norm if norm else diff
