"""scripts/compare_checkpoints.py: the docs' way to see a resumed run end where an uninterrupted one does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import compare_checkpoints  # noqa: E402


def save(path: Path, step: int, **weights: torch.Tensor) -> Path:
    torch.save({"global_step": step, "state_dict": weights}, path)
    return path


def test_identical_different_and_incomparable(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    w = torch.randn(3, 4)
    a = save(tmp_path / "a.ckpt", 7, weight=w, bias=torch.zeros(3))
    same = save(tmp_path / "same.ckpt", 7, weight=w.clone(), bias=torch.zeros(3))
    assert compare_checkpoints.main([str(a), str(same)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "global_step: 7 and 7; 2 weight tensors; max |a - b| = 0",
        "bit-identical",
    ]
    nudged = w.clone()
    nudged[1, 2] += 2.0**-20
    off = save(tmp_path / "off.ckpt", 7, weight=nudged, bias=torch.zeros(3))
    assert compare_checkpoints.main([str(a), str(off)]) == 1
    assert "max |a - b| = 9.53674e-07" in capsys.readouterr().out
    later = save(tmp_path / "later.ckpt", 8, weight=w.clone(), bias=torch.zeros(3))
    assert compare_checkpoints.main([str(a), str(later)]) == 1, "same weights at another step: not the same run"
    other = save(tmp_path / "other.ckpt", 7, weight=torch.randn(2, 4))
    assert compare_checkpoints.main([str(a), str(other)]) == 2
    assert "hold different weights" in capsys.readouterr().err
    assert compare_checkpoints.main([str(a), str(tmp_path / "missing.ckpt")]) == 2
    assert "not a readable checkpoint" in capsys.readouterr().err
