"""lit_ddp.run_dir.checkpoints: pruning the run directory's preemption checkpoints (their listing, ranking and
headers are tested through the resume point: ``tests/unit/resilience/test_resume.py``)."""

from __future__ import annotations

from pathlib import Path

from lit_ddp.run_dir.checkpoints import remove_older_hpc_checkpoints


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
