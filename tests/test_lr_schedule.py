"""GPTModule's learning-rate schedule (torch's SequentialLR of LinearLR warmup, CosineAnnealingLR and a flat
floor) against nanoGPT's ``get_lr``, step by step."""

from __future__ import annotations

import math

import pytest
import torch

from lit_ddp.tasks.mingpt import warmup_cosine_schedule


def nanogpt_factor(step: int, warmup: int, decay_steps: int | None, min_ratio: float) -> float:
    """nanoGPT's get_lr / learning_rate (warmup reaching the peak after ``warmup`` steps, cosine to the floor)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if decay_steps is None:
        return 1.0
    if step >= decay_steps:
        return min_ratio
    progress = (step - warmup) / (decay_steps - warmup)
    return min_ratio + 0.5 * (1.0 - min_ratio) * (1.0 + math.cos(math.pi * progress))


@pytest.mark.parametrize(
    ("warmup", "decay_steps", "min_ratio"),
    [(10, 110, 0.1), (0, 50, 0.1), (100, 2000, 0.1), (5, None, 0.1), (0, None, 0.1), (3, 20, 0.0)],
)
def test_schedule_follows_nanogpt(warmup: int, decay_steps: int | None, min_ratio: float) -> None:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]}, {"params": [torch.nn.Parameter(torch.zeros(2))]}]
    optimizer = torch.optim.AdamW(groups, lr=3e-3)
    scheduler = warmup_cosine_schedule(optimizer, warmup, decay_steps, min_ratio)
    for step in range(int((decay_steps or 40) * 1.5)):  # past the end of the decay: flat at the floor
        want = 3e-3 * nanogpt_factor(step, warmup, decay_steps, min_ratio)
        for group in optimizer.param_groups:
            assert group["lr"] == pytest.approx(want, rel=1e-12, abs=1e-15), f"step {step}"
        optimizer.step()
        scheduler.step()


def test_schedule_state_round_trips() -> None:
    """The scheduler's state_dict restores the same rates (what a resumed run relies on)."""

    def make():
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
        return opt, warmup_cosine_schedule(opt, 5, 30, 0.1)

    opt, sched = make()
    for _ in range(12):
        opt.step()
        sched.step()
    opt2, sched2 = make()
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    for _ in range(25):
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
        for o, s in ((opt, sched), (opt2, sched2)):
            o.step()
            s.step()
