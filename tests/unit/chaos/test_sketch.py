"""ParameterSketch: the same coordinates in every run, written at each logged step, nothing drawn from the RNG the
run restores."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lit_ddp.chaos.sketch import SKETCH_DIR, ParameterSketch, relative_distance, sketches


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.LayerNorm(30), torch.nn.Linear(30, 5))


def test_the_same_coordinates_in_every_run_and_no_draw_from_the_global_rng() -> None:
    a, b = model(0), model(0)
    state = torch.get_rng_state()
    first, second = ParameterSketch(size=100).sample(a), ParameterSketch(size=100).sample(b)
    assert torch.equal(torch.get_rng_state(), state)  # the run's own random numbers are left as they were
    assert 100 <= len(first) <= 100 + 5  # each of the 5 tensors rounds its share up
    assert torch.equal(first, second)
    with torch.no_grad():
        a[2].weight.mul_(1.5)
    assert not torch.equal(ParameterSketch(size=100).sample(a), second)


def test_a_model_within_the_size_is_compared_whole() -> None:
    m = model(0)
    whole = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    assert torch.equal(ParameterSketch(size=whole.numel()).sample(m), whole)


def test_written_at_each_logged_step_once_on_rank_zero(tmp_path: Path) -> None:
    m, sketch = model(0), ParameterSketch(size=50)
    trainer = SimpleNamespace(global_step=0, is_global_zero=True, log_every_n_steps=2, default_root_dir=str(tmp_path))
    for step in (1, 2, 2, 3, 4):  # a step seen twice: gradient accumulation's second batch
        trainer.global_step = step
        sketch.on_train_batch_end(trainer, m)  # type: ignore[arg-type]
    assert sorted(p.name for p in (tmp_path / SKETCH_DIR).iterdir()) == ["step_2.pt", "step_4.pt"]
    assert torch.equal(sketches(tmp_path)[4].float(), sketch.sample(m))
    other = tmp_path / "other"
    trainer.is_global_zero, trainer.default_root_dir, trainer.global_step = False, str(other), 6
    sketch.on_train_batch_end(trainer, m)  # type: ignore[arg-type]
    assert not other.exists()


def test_relative_distance() -> None:
    a = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert relative_distance(a, torch.tensor([3.0, 4.5], dtype=torch.float64)) == pytest.approx(0.1)
    assert relative_distance(a, torch.zeros(3)) == float("inf")
    assert relative_distance(torch.zeros(2), torch.tensor([0.0, 2.0])) == 2.0
