"""lit_ddp.run_dir.checkpoints: headers read once per file, pruning the run directory's preemption checkpoints
(their listing and ranking are tested through the resume point: ``tests/unit/resilience/test_resume.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lit_ddp.resilience.resume import choose, list_candidates
from lit_ddp.run_dir import inert
from lit_ddp.run_dir.checkpoints import checkpoint_header, checkpoint_step, remove_older_hpc_checkpoints


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per header actually read from a file."""
    count: list[int] = []
    read = inert.read

    def counted(*args: object, **kwargs: object) -> object:
        count.append(1)
        return read(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(inert, "read", counted)
    return count


def save(path: Path, step: int, note: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    hparams = {"lr": 0.1, "note": note}
    torch.save({"global_step": step, "state_dict": {"w": torch.zeros(2)}, "hyper_parameters": hparams}, path)
    return path


def test_a_resume_reads_each_header_once(tmp_path: Path, reads: list[int]) -> None:
    """Listing the run directory's checkpoints (once per resume) reads each file's header once; choosing the resume
    point reads none again (it passes on the step it listed), and an explicit path's header, read when the arguments
    are parsed, gives the resume its step."""
    for step in (10, 20, 30):
        save(tmp_path / "checkpoints" / f"epoch=0-step={step}.ckpt", step)
    save(tmp_path / "checkpoints" / "last.ckpt", 30)
    chosen = choose(list_candidates(str(tmp_path)), str(tmp_path))
    assert chosen is not None and chosen[0] == 30 and chosen[1].endswith("last.ckpt")
    assert len(reads) == 4


def test_a_header_is_read_afresh(tmp_path: Path, reads: list[int]) -> None:
    """Nothing is cached: an atomic replace and a rewrite in place are both seen, and what a caller does to the
    returned dictionary stays out of the next call's."""
    path = save(tmp_path / "last.ckpt", 1)
    header = checkpoint_header(str(path))
    header["global_step"] = 99
    assert checkpoint_step(str(path)) == 1
    os.replace(save(tmp_path / "tmp.ckpt", 2), path)
    assert checkpoint_step(str(path)) == 2
    save(path, 3, note="rewritten")
    assert checkpoint_step(str(path)) == 3 and len(reads) == 4
    path.unlink()
    with pytest.raises(ValueError, match="is not a readable checkpoint"):
        checkpoint_header(str(path))


def test_a_preemption_checkpoint_removes_the_older_ones(tmp_path: Path) -> None:
    """Each ``hpc_ckpt_N.ckpt`` is a whole state at a later step than those before it: they go (issue 26,
    item 7); other checkpoints and files stay."""
    names = [
        "hpc_ckpt_1.ckpt",
        "hpc_ckpt_2.ckpt",
        "hpc_ckpt_10.ckpt",
        "hpc_ckpt_3.ckpt",
        "last.ckpt",
        "hpc_ckpt_x.ckpt",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "hpc_ckpt_0.ckpt").mkdir()  # a sharded checkpoint (FSDP2) is a directory
    (tmp_path / "hpc_ckpt_0.ckpt" / "meta.pt").write_bytes(b"x")
    remove_older_hpc_checkpoints(str(tmp_path / "hpc_ckpt_3.ckpt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "hpc_ckpt_10.ckpt",
        "hpc_ckpt_3.ckpt",
        "hpc_ckpt_x.ckpt",
        "last.ckpt",
    ]
