"""How ``lit-ddp chaos`` compares its two runs: the final checkpoints entry by entry, then the TensorBoard scalars."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from lit_ddp.run_dir import layout, sharded

# Scalars that measure the machine, not the training: they differ between any two runs.
TIMING_SCALARS = ("per_sec", "tokens/s", "mfu", "time")


def first_difference(a: Any, b: Any, where: str = "", rtol: float = 0.0) -> str | None:
    """The path of the first entry where two checkpoint trees differ (tensors bit for bit, or within ``rtol``),
    or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
        if same and (torch.equal(a, b) or (rtol > 0 and a.is_floating_point() and torch.allclose(a, b, rtol=rtol))):
            return None
        return where
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                return f"{where}/{key}"
            if (found := first_difference(a[key], b[key], f"{where}/{key}", rtol)) is not None:
                return found
        return None
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if (found := first_difference(x, y, f"{where}[{i}]", rtol)) is not None:
                return found
        return None
    if isinstance(a, float) and isinstance(b, float) and rtol > 0:
        return None if math.isclose(a, b, rel_tol=rtol) else where
    return None if a == b else where


def scalar_points(run: Path) -> dict[str, dict[int, float]]:
    """The run's TensorBoard scalars, timing scalars left out: ``{tag: {step: value}}``, the last value logged at
    each step (a resumed run logs the steps it redoes again)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    found: dict[str, dict[int, float]] = {}
    for tag in acc.Tags().get("scalars", []):
        if not any(t in tag for t in TIMING_SCALARS):
            found[tag] = {e.step: e.value for e in sorted(acc.Scalars(tag), key=lambda e: e.wall_time)}
    return found


def compare_scalars(reference: Path, faulted: Path, rtol: float = 0.0) -> str | None:
    """The first TensorBoard scalar (tag and step) where the runs differ (:func:`scalar_points`); None when they
    agree."""
    a, b = scalar_points(reference), scalar_points(faulted)
    for tag in sorted(set(a) | set(b)):
        for step in sorted(set(a.get(tag, {})) | set(b.get(tag, {}))):
            x, y = a.get(tag, {}).get(step), b.get(tag, {}).get(step)
            if x is None or y is None or not (x == y or (rtol > 0 and math.isclose(x, y, rel_tol=rtol))):
                return f"tensorboard/{tag} at step {step} ({x} vs {y})"
    return None


def compare(reference: Path, faulted: Path, rtol: float = 0.0) -> str | None:
    """The first differing entry of the two runs: ``last.ckpt``'s global_step, weights, optimizer and schedulers,
    then the TensorBoard scalars. A sharded ``last.ckpt/`` is consolidated first."""
    paths = (Path(layout.last_checkpoint(str(r))) for r in (reference, faulted))
    a, b = (sharded.read_whole(p) for p in paths)
    for key in ("global_step", "state_dict", "optimizer_states", "lr_schedulers"):
        if (found := first_difference(a.get(key), b.get(key), key, rtol)) is not None:
            return found
    return compare_scalars(reference, faulted, rtol)
