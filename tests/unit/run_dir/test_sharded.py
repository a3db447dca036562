"""lit_ddp.run_dir.sharded: a sharded checkpoint's directory appears whole or not at all, resume selection
reads it like a file and skips a torn one, and it reads back whole. (Written by FSDP2 on 2 processes, resumed on 1
and 2, killed mid-save: ``tests/system/test_fsdp.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lit_ddp.resilience.resume import choose_checkpoint
from lit_ddp.run_dir import sharded
from lit_ddp.run_dir.checkpoints import checkpoint_step, is_valid_checkpoint


def _write(directory: Path, step: int) -> Path:
    """A sharded checkpoint as FSDP2Strategy writes one (single process: one shard file)."""
    weights = {"state_dict": {"w": torch.full((4, 3), float(step))}, "optimizer_0": {"state": {"w": {"step": step}}}}
    dcp.save(weights, checkpoint_id=str(directory), no_dist=True)
    torch.save({"global_step": step, "epoch": 0}, directory / sharded.META)
    return directory


def _save(path: Path, step: int) -> Path:
    written = Path(sharded.temporary_directory(path))
    sharded.commit(_write(written, step), path)
    return path


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_commit_replaces_the_checkpoint_whole_and_clears_killed_writers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    swaps: list[bool] = []
    real = sharded._exchange
    monkeypatch.setattr(sharded, "_exchange", lambda a, b: swaps.append(exchange and real(a, b)) or swaps[-1])
    last = tmp_path / "checkpoints" / "last.ckpt"
    _save(last, 10)
    killed = Path(sharded.temporary_directory(last))  # a writer killed halfway: some shards, no meta.pt
    dcp.save({"state_dict": {"w": torch.zeros(4, 3)}}, checkpoint_id=str(killed), no_dist=True)
    assert checkpoint_step(str(last)) == 10
    _save(last, 20)
    assert checkpoint_step(str(last)) == 20 and is_valid_checkpoint(str(last))
    assert swaps == [exchange]  # renameat2 works on this filesystem; the fallback is forced
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]  # no temporary or old directory left
    full = sharded.full_checkpoint(last)
    assert full["global_step"] == 20 and torch.equal(full["state_dict"]["w"], torch.full((4, 3), 20.0))
    assert full["optimizer_states"] == [{"state": {"w": {"step": 20}}}]


def test_a_file_checkpoint_becomes_a_directory(tmp_path: Path) -> None:
    """A run that saved single files and then sharded ones (save_distributed_checkpoint switched on)."""
    last = tmp_path / "last.ckpt"
    torch.save({"global_step": 5}, last)
    _save(last, 6)
    assert last.is_dir() and checkpoint_step(str(last)) == 6


def test_resume_skips_a_torn_directory_and_a_temporary_one(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The newest valid checkpoint wins: not a directory whose shard is cut short, not one missing meta.pt, and
    never a writer's hidden temporary directory however new its step."""
    ckpts = tmp_path / "checkpoints"
    _save(ckpts / "epoch=0-step=10.ckpt", 10)
    torn = _save(ckpts / "epoch=0-step=20.ckpt", 20)
    shard = next(torn.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    no_meta = _save(ckpts / "epoch=0-step=30.ckpt", 30)
    (no_meta / sharded.META).unlink()
    _write(Path(sharded.temporary_directory(ckpts / "last.ckpt")), 40)
    assert not is_valid_checkpoint(str(torn)) and not sharded.shards_complete(torn)
    assert choose_checkpoint(str(tmp_path)) == str(ckpts / "epoch=0-step=10.ckpt")
    assert "epoch=0-step=20.ckpt is truncated or unreadable" in caplog.text


def test_full_checkpoint_refuses_an_incomplete_directory(tmp_path: Path) -> None:
    (tmp_path / "x.ckpt").mkdir()
    with pytest.raises(ValueError, match="x.ckpt is not a complete sharded checkpoint"):
        sharded.full_checkpoint(tmp_path / "x.ckpt")
