"""lit-ddp chaos --calibrated: the faulted run against K x the spread of two uninterrupted runs, on runs written
here (TensorBoard losses and a last.ckpt each)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.tensorboard import SummaryWriter

from lit_ddp.chaos.calibrated import relative_distance, verdict
from lit_ddp.chaos.cli import parse
from lit_ddp.errors import UsageError


def write_run(root: Path, losses: dict[int, float], weight: float) -> Path:
    with SummaryWriter(str(root)) as writer:
        for step, loss in losses.items():
            writer.add_scalar("train/loss", loss, step)
    (root / "checkpoints").mkdir(parents=True)
    torch.save(
        {"state_dict": {"w": torch.full((4,), weight), "count": torch.tensor(3)}}, root / "checkpoints" / "last.ckpt"
    )
    return root


BASE = {s: 3.0 - 0.1 * s for s in range(1, 11)}


def runs(tmp_path: Path, faulted: dict[int, float], faulted_weight: float) -> tuple[Path, Path, Path]:
    first = write_run(tmp_path / "a", BASE, 1.0)
    second = write_run(tmp_path / "b", {s: v + (1e-3 if s >= 3 else 0.0) for s, v in BASE.items()}, 1.001)
    return first, second, write_run(tmp_path / "f", faulted, faulted_weight)


def test_a_faulted_run_within_k_times_the_spread_passes_and_reports_after_each_resume(tmp_path: Path) -> None:
    faulted = {s: v + (2e-3 if s >= 6 else 0.0) for s, v in BASE.items()}  # RMS 1.4e-3 against the spread's 9e-4
    failure, lines = verdict(*runs(tmp_path, faulted, 1.002), k=3.0, resumed=[5])
    assert failure is None, failure
    assert lines[0].startswith("two uninterrupted runs: train loss 0.000894 apart (RMS over 10 logged steps)"), lines
    assert lines[1].startswith("the faulted run: train loss 0.00141 from the first run's"), lines
    assert (
        "resumed from step 5: at step 6 the loss is 0.002 from the first run's (the two uninterrupted runs: 0.001)"
        in lines
    )


def test_outside_k_times_the_spread_fails(tmp_path: Path) -> None:
    faulted = {s: v + (1e-2 if s >= 7 else 0.0) for s, v in BASE.items()}
    failure, _ = verdict(*runs(tmp_path, faulted, 1.0), k=3.0, resumed=[6])
    assert failure is not None and failure.startswith("tensorboard/train loss: 0.00632 from the first run, over 3 x"), (
        failure
    )


def test_deterministic_runs_leave_only_float_rounding(tmp_path: Path) -> None:
    """Two uninterrupted runs logged the same losses: the faulted run must too, to within 4 float32 ulps."""
    first, second = write_run(tmp_path / "a", BASE, 1.0), write_run(tmp_path / "b", BASE, 1.0)
    same = write_run(tmp_path / "f", {s: v * (1 + 2**-23) for s, v in BASE.items()}, 1.0)
    assert verdict(first, second, same, k=3.0, resumed=[])[0] is None
    off = write_run(tmp_path / "g", {**BASE, 2: BASE[2] + 1e-4}, 1.0)
    assert verdict(first, second, off, k=3.0, resumed=[])[0] is not None


def test_parameters_outside_k_times_their_spread_fail(tmp_path: Path) -> None:
    failure, _ = verdict(*runs(tmp_path, dict(BASE), 1.01), k=3.0, resumed=[])
    assert failure is not None and failure.startswith("last.ckpt's parameters: 0.01 from"), failure


def test_a_missing_point_fails(tmp_path: Path) -> None:
    failure, _ = verdict(*runs(tmp_path, {s: v for s, v in BASE.items() if s != 4}, 1.0), k=3.0, resumed=[])
    assert failure == "tensorboard/train loss: no point at step 4 in one of the runs"


def test_relative_distance() -> None:
    a = {"w": torch.tensor([3.0, 4.0], dtype=torch.float64)}
    assert relative_distance(a, {"w": torch.tensor([3.0, 4.5], dtype=torch.float64)}) == pytest.approx(0.1)
    assert relative_distance(a, {"v": a["w"]}) == float("inf")


def test_calibrated_needs_a_positive_factor_and_no_rtol() -> None:
    with pytest.raises(UsageError, match="--calibrated 0.0: give a factor > 0"):
        parse(["--calibrated", "0", "--", "--config", "x.yaml"])
    with pytest.raises(UsageError, match="without --rtol"):
        parse(["--calibrated", "3", "--rtol", "1e-3", "--", "--config", "x.yaml"])
