"""lit-ddp chaos --calibrated: the faulted run against K x the spread of two uninterrupted runs, on runs written
here (TensorBoard losses, parameter samples at each logged step and a last.ckpt each)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.tensorboard import SummaryWriter

from lit_ddp.chaos.calibrated import state_distance, verdict
from lit_ddp.chaos.sketch import SKETCH_DIR
from lit_ddp.cli import cli_main


def sample(step: int, scale: float = 1.0) -> torch.Tensor:
    """The parameter sample of the first run at ``step``, times ``scale`` (relative distance ``|scale - 1|``)."""
    return torch.linspace(1.0, 2.0, 8, dtype=torch.float64) * (1 + 0.01 * step) * scale


def write_run(root: Path, losses: dict[int, float], weight: float, scale: dict[int, float] | float = 1.0) -> Path:
    """A run's TensorBoard losses, its parameter sample at each of their steps (:func:`sample` times ``scale``, one
    for every step or per step) and a last.ckpt whose one weight is ``weight``."""
    with SummaryWriter(str(root)) as writer:
        for step, loss in losses.items():
            writer.add_scalar("train/loss", loss, step)
    (root / SKETCH_DIR).mkdir(parents=True)
    for step in losses:
        factor = scale.get(step, 1.0) if isinstance(scale, dict) else scale
        torch.save(sample(step, factor).float(), root / SKETCH_DIR / f"step_{step}.pt")
    (root / "checkpoints").mkdir(parents=True)
    torch.save(
        {"state_dict": {"w": torch.full((4,), weight), "count": torch.tensor(3)}}, root / "checkpoints" / "last.ckpt"
    )
    return root


BASE = {s: 3.0 - 0.1 * s for s in range(1, 11)}


def runs(
    tmp_path: Path, faulted: dict[int, float], faulted_weight: float, scale: dict[int, float] | float = 1.0
) -> tuple[Path, Path, Path]:
    """The first run, a second one 1e-3 apart in parameters at every step, and the faulted one."""
    first = write_run(tmp_path / "a", BASE, 1.0)
    second = write_run(tmp_path / "b", {s: v + (1e-3 if s >= 3 else 0.0) for s, v in BASE.items()}, 1.001, 1.001)
    return first, second, write_run(tmp_path / "f", faulted, faulted_weight, scale)


def test_a_faulted_run_within_k_times_the_spread_passes_and_reports_after_each_resume(tmp_path: Path) -> None:
    faulted = {s: v + (2e-3 if s >= 6 else 0.0) for s, v in BASE.items()}  # RMS 1.4e-3 against the spread's 9e-4
    failure, lines = verdict(*runs(tmp_path, faulted, 1.002, {s: 1.002 for s in range(6, 11)}), k=3.0, resumed=[5])
    assert failure is None, failure
    assert lines[0].startswith("two uninterrupted runs: train loss 0.000894 apart (RMS over 10 logged steps)"), lines
    assert "parameters 0.001 apart at step 10 (relative, 8 sampled coordinates)" in lines[0], lines
    assert lines[1].startswith("the faulted run: parameters at most 2 x the spread at each of 10 logged steps"), lines
    assert "train loss 0.00141 from the first run's" in lines[1], lines
    assert (
        "resumed from step 5: at step 6 the loss is 0.002 from the first run's (the two uninterrupted runs: 0.001); "
        "at step 6 the parameters 0.002 (theirs 0.001)" in lines
    ), lines


def test_parameters_outside_k_times_the_spread_at_one_step_fail_there(tmp_path: Path) -> None:
    """Within the spread at every step but the one after the resume, where the losses happen to agree."""
    failure, _ = verdict(*runs(tmp_path, dict(BASE), 1.0, {6: 1.005}), k=3.0, resumed=[2, 5])
    assert failure == (
        "parameters at step 6, the first logged step after the resume from step 5: 0.005 from the first run's, over "
        "3 x the spread 0.001"
    ), failure


def test_outside_k_times_the_spread_fails(tmp_path: Path) -> None:
    faulted = {s: v + (1e-2 if s >= 7 else 0.0) for s, v in BASE.items()}
    failure, _ = verdict(*runs(tmp_path, faulted, 1.0), k=3.0, resumed=[6])
    assert failure is not None and failure.startswith("tensorboard/train loss: 0.00632 from the first run, over 3 x"), (
        failure
    )


def test_deterministic_runs_leave_only_float_rounding(tmp_path: Path) -> None:
    """Two uninterrupted runs logged the same losses and parameters: the faulted run must too, its losses to within
    4 float32 ulps, its parameters bit for bit."""
    first, second = write_run(tmp_path / "a", BASE, 1.0), write_run(tmp_path / "b", BASE, 1.0)
    same = write_run(tmp_path / "f", {s: v * (1 + 2**-23) for s, v in BASE.items()}, 1.0)
    assert verdict(first, second, same, k=3.0, resumed=[])[0] is None
    off = write_run(tmp_path / "g", {**BASE, 2: BASE[2] + 1e-4}, 1.0)
    assert verdict(first, second, off, k=3.0, resumed=[])[0] is not None
    nudged = write_run(tmp_path / "h", BASE, 1.0, {7: 1 + 2**-20})
    failure = verdict(first, second, nudged, k=3.0, resumed=[])[0]
    assert failure is not None and failure.startswith("parameters at step 7: "), failure


def test_parameters_outside_k_times_their_spread_fail(tmp_path: Path) -> None:
    failure, _ = verdict(*runs(tmp_path, dict(BASE), 1.01), k=3.0, resumed=[])
    assert failure is not None and failure.startswith("last.ckpt's parameters: 0.01 from"), failure


def test_a_missing_point_fails(tmp_path: Path) -> None:
    failure, _ = verdict(*runs(tmp_path, {s: v for s, v in BASE.items() if s != 4}, 1.0), k=3.0, resumed=[])
    assert failure == "tensorboard/train loss: no point at step 4 in one of the runs"


def test_a_missing_or_absent_parameter_sample_fails(tmp_path: Path) -> None:
    first, second, faulted = runs(tmp_path, dict(BASE), 1.0)
    (faulted / SKETCH_DIR / "step_4.pt").unlink()
    assert verdict(first, second, faulted, k=3.0, resumed=[])[0] == (
        f"parameters: no sample at step 4 in one of the runs ({SKETCH_DIR}/)"
    )
    for path in (first / SKETCH_DIR).iterdir():
        path.unlink()
    failure = verdict(first, second, faulted, k=3.0, resumed=[])[0]
    assert failure is not None and failure.endswith(
        "no parameter samples (a run of an older lit-ddp chaos: run it again)"
    )


def test_state_distance() -> None:
    a = {"w": torch.tensor([3.0, 4.0], dtype=torch.float64)}
    assert state_distance(a, {"w": torch.tensor([3.0, 4.5], dtype=torch.float64)}) == pytest.approx(0.1)
    assert state_distance(a, {"v": a["w"]}) == float("inf")


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--calibrated", "0"], "--calibrated 0.0: give a factor > 0"),
        (["--calibrated", "3", "--rtol", "1e-3"], "without --rtol"),
    ],
)
def test_calibrated_needs_a_positive_factor_and_no_rtol(
    argv: list[str], says: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["chaos", *argv, "--", "--config", "x.yaml"])
    assert exit_.value.code == 2 and says in capsys.readouterr().err
