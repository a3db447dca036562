"""``scripts/plot_pipeline_schedule.py``: the schedules' timelines docs/tutorial.md draws (the order each rank runs,
simulated times), their bubble against GPipe's formula, and the picture written."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
import plot_pipeline_schedule as plot  # noqa: E402


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (2, 2), (3, 5)])
def test_gpipe_and_1f1b_leave_the_bubble_the_formula_gives(schedule: str, p: int, m: int) -> None:
    """(p - 1) / (m + p - 1) of the ranks' time idle (GPipe, arXiv:1811.06965)."""
    assert plot.bubble(plot.timeline(schedule, p, m), p) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "ZBVZeroBubble", "DualPipeV"])
def test_every_stage_runs_each_microbatch_forward_and_backward_once(schedule: str) -> None:
    """Each stage's forward of each microbatch once, and its backward once: whole (B), or for its inputs (I) and its
    weights (W) apart."""
    order = plot.pipeline_order(schedule, 2, 4)
    n_stages = 2 if schedule in ("GPipe", "1F1B") else 4
    units = {"F": ("F", 1), "B": ("backward", 2), "I": ("backward", 1), "W": ("backward", 1)}
    done: Counter = Counter()
    for rank in order:
        for kind, stage, mb in rank:
            name, amount = units[kind]
            done[(name, stage, mb)] += amount
    assert done == {
        (name, s, j): need for s in range(n_stages) for j in range(4) for name, need in (("F", 1), ("backward", 2))
    }


def test_interleaving_and_zero_bubbles_shrink_the_bubble(tmp_path: Path) -> None:
    bubbles = {s: plot.bubble(plot.timeline(s, 2, 4), 2) for s in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")}
    assert bubbles["ZBVZeroBubble"] < bubbles["Interleaved1F1B"] < bubbles["1F1B"]
    out = plot.plot([("1F1B", 2, 4), ("ZBVZeroBubble", 2, 4)], tmp_path / "timeline.png")
    assert out.read_bytes().startswith(b"\x89PNG")
