"""Draws pipeline schedules as timelines: which rank runs which stage's forward or backward of which microbatch when.

    python scripts/plot_pipeline_schedule.py --out docs/pipeline_schedules.png

Each schedule's order of actions is the one every rank of ``lit_ddp.strategies.PipelineStrategy`` runs
(:func:`pipeline_order`); the times are simulated: a rank's forward of a microbatch takes 1 unit, its full backward
2 (a zero-bubble schedule's backward for the inputs and for the weights 1 each), a rank holding v stages runs each
stage's in 1/v of that (each holds 1/v of its blocks), communication takes nothing, and an action starts once its
rank is free and the action it depends on has ended (the previous stage's forward of the same microbatch; the next
stage's backward, or the last stage's own forward). The idle time left is the bubble; for GPipe and 1F1B it is
(p - 1) / (m + p - 1) of the time, p ranks and m microbatches (Huang et al., "GPipe", arXiv:1811.06965).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402
from torch.distributed.pipelining import PipelineStage  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without installing the package
from lit_ddp.models.parallelize import stages_per_rank_for  # noqa: E402
from lit_ddp.strategies.pipeline import SCHEDULES  # noqa: E402

DURATION = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
"""Simulated time of a forward, a full backward, a backward for the inputs and one for the weights."""
COLOR = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868"}
LABEL = {"F": "forward", "B": "backward", "I": "backward (inputs)", "W": "backward (weights)"}


@dataclass(frozen=True)
class Action:
    """One computation on one rank: ``kind`` F, B, I or W of ``stage`` for ``microbatch``, from ``start`` for
    ``duration`` (:data:`DURATION` over the stages a rank holds: each holds that share of the rank's blocks)."""

    rank: int
    kind: str
    stage: int
    microbatch: int
    start: float
    duration: float

    @property
    def end(self) -> float:
        return self.start + self.duration


def pipeline_order(schedule: str, p: int, m: int, stages_per_rank: int | None = None) -> list[list[tuple]]:
    """The order of actions of ``schedule`` on ``p`` ranks and ``m`` microbatches: per rank, ``(kind, stage,
    microbatch)`` for each forward and backward, in the order the rank runs them. GPipe's and 1F1B's as their
    ``step`` runs them (every forward, then every backward; 1F1B: rank r's first ``min(m, p - r)`` forwards, then a
    backward and a forward in turn): torch's ``pipeline_order`` of 1F1B names a microbatch m on the last rank (torch
    2.13). The others' is torch's ``pipeline_order``, which their runtime executes, built over stand-ins for the
    stages (``mock.create_autospec(PipelineStage)``, as torch's own schedule visualizer builds them).

    Raises:
        ValueError: a schedule, stages per rank or microbatch count torch's schedule refuses.
    """
    v = stages_per_rank_for(schedule, stages_per_rank)
    if schedule == "GPipe":
        return [[("F", r, j) for j in range(m)] + [("B", r, j) for j in range(m)] for r in range(p)]
    if schedule == "1F1B":
        orders = []
        for r in range(p):
            warmup = min(m, p - r)
            order = [("F", r, j) for j in range(warmup)]
            for j in range(m):
                order.append(("B", r, j))
                if warmup + j < m:
                    order.append(("F", r, warmup + j))
            orders.append(order)
        return orders
    stand_in = mock.create_autospec(PipelineStage, instance=True)
    stand_in.group_rank, stand_in.group_size, stand_in.submod = 0, p, None
    stand_in.num_stages = p * v
    order = SCHEDULES[schedule]([stand_in] * v, m).pipeline_order
    return [
        [(str(a.computation_type.value), a.stage_index, a.microbatch_index) for a in _flat(order[r])] for r in range(p)
    ]


def _flat(actions: list[Any]) -> list[Any]:
    """The computations of a rank's actions: DualPipeV's overlapped forward and backward one after the other (this
    simulation does not overlap them), idle steps and communication left out."""
    flat = []
    for action in actions:
        if action is not None and str(action.computation_type.value) == "OVERLAP_F_B":
            flat += list(action.sub_actions or ())
        elif action is not None and str(action.computation_type.value) in DURATION:
            flat.append(action)
    return flat


def timeline(schedule: str, p: int, m: int, stages_per_rank: int | None = None) -> list[Action]:
    """Every action of :func:`pipeline_order` with its simulated start (module docstring)."""
    order = pipeline_order(schedule, p, m, stages_per_rank)
    n_stages = 1 + max(stage for rank in order for _, stage, _ in rank)
    share = p / n_stages  # of a rank's blocks, in one of its stages
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    todo = [list(rank) for rank in order]
    placed: list[Action] = []
    while any(todo):
        progressed = False
        for rank in range(p):
            if not todo[rank]:
                continue
            kind, stage, mb = todo[rank][0]
            ready = _ready(kind, stage, mb, n_stages, done)
            if ready is None:
                continue
            action = Action(rank, kind, stage, mb, max(free[rank], ready), DURATION[kind] * share)
            placed.append(action)
            done[(kind, stage, mb)] = action.end
            free[rank] = action.end
            todo[rank].pop(0)
            progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule}: no rank can go on (its order waits on itself)")
    return placed


def _ready(kind: str, stage: int, mb: int, n_stages: int, done: dict) -> float | None:
    """When the action's input is there: the end of the action it depends on (None: not run yet)."""
    if kind == "F":  # the previous stage's activations
        return 0.0 if stage == 0 else done.get(("F", stage - 1, mb))
    if kind in ("B", "I"):  # the loss (the last stage's own forward), or the next stage's gradient for its input
        given = [("F", stage, mb)] if stage == n_stages - 1 else [("B", stage + 1, mb), ("I", stage + 1, mb)]
        ends = [done[k] for k in given if k in done]
        return min(ends) if ends else None
    return done.get(("I", stage, mb))  # W: this stage's backward for the inputs, which kept what it needs


def bubble(actions: list[Action], p: int) -> float:
    """The fraction of the ranks' time from the first start to the last end that no rank computed."""
    span = max(a.end for a in actions)
    busy = sum(a.duration for a in actions)
    return 1.0 - busy / (span * p)


def plot(layouts: list[tuple[str, int, int]], out: Path) -> Path:
    """Draws one timeline per ``(schedule, p, m)`` of ``layouts`` into ``out``, one row per rank."""
    fig, axes = plt.subplots(len(layouts), 1, figsize=(11, 1.1 * sum(p for _, p, _ in layouts) + 1), dpi=110)
    for ax, (schedule, p, m) in zip(axes, layouts, strict=True):
        actions = timeline(schedule, p, m)
        for a in actions:
            ax.barh(a.rank, a.duration, left=a.start, color=COLOR[a.kind], edgecolor="white", height=0.8)
            ax.text(a.start + a.duration / 2, a.rank, f"s{a.stage}\nm{a.microbatch}", ha="center",
                    va="center", fontsize=6, color="white")  # fmt: skip
        ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
        ax.invert_yaxis()
        ax.set_title(f"{schedule}: {p} ranks, {m} microbatches, bubble {bubble(actions, p):.0%}", fontsize=9)
        ax.tick_params(labelsize=7)
    end = max(a.end for s, p, m in layouts for a in timeline(s, p, m))
    for ax in axes:
        ax.set_xlim(0, end)
    axes[-1].set_xlabel("time (a rank's forward of one microbatch = 1, its backward = 2)")
    kinds = sorted({a.kind for s, p, m in layouts for a in timeline(s, p, m)}, key=list(DURATION).index)
    fig.legend([plt.Rectangle((0, 0), 1, 1, color=COLOR[k]) for k in kinds], [LABEL[k] for k in kinds],
               loc="lower center", ncol=len(kinds), fontsize=8)  # fmt: skip
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(out)
    plt.close(fig)
    return out


LAYOUTS = [("GPipe", 2, 4), ("1F1B", 2, 4), ("Interleaved1F1B", 2, 4), ("ZBVZeroBubble", 2, 4)]
"""The schedules docs/tutorial.md shows: configs/trainer/pp.yaml's 2 ranks and 4 microbatches."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/pipeline_schedules.png"))
    args = parser.parse_args(argv)
    print(plot(LAYOUTS, args.out))
    for schedule, p, m in LAYOUTS:
        print(f"{schedule:16s} p={p} m={m}: bubble {bubble(timeline(schedule, p, m), p):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
