"""Reading a run's TensorBoard event files back, with tensorboard's own reader.

Used by the tests, the notebooks and the README's plot script. A run directory holds one TensorBoard log,
continued across restarts, so all event files of the directory are read together.
"""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read_scalars(run_dir: str | Path, tag: str) -> list[tuple[int, float]]:
    """All ``(step, value)`` points of scalar ``tag`` (e.g. ``"val/loss"``) in ``run_dir``, by step.

    Raises:
        KeyError: ``tag`` was never logged in ``run_dir``; the message lists the tags that were.
    """
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags().get("scalars", [])
    if tag not in tags:
        raise KeyError(f"scalar {tag!r} not logged in {run_dir}; logged: {sorted(tags)}")
    return sorted((e.step, e.value) for e in acc.Scalars(tag))


def scalar_tags(run_dir: str | Path) -> list[str]:
    """The scalar tags logged in ``run_dir``."""
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return sorted(acc.Tags().get("scalars", []))
