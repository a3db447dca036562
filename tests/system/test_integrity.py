"""Issue 62, no silent corruption: one bit flipped inside a tensor of a run's newest checkpoints (single files, and a
shard of FSDP2's sharded ones on 2 processes) is skipped by the automatic resume, which ends bit-identical to the
run that was not interrupted, and refused as ``--ckpt_path`` in one line; a bit flipped on one DDP rank's parameter
stops the run within the replica check's interval, its last checkpoint from before the flip. In one process:
``tests/unit/run_dir/test_integrity.py``, ``tests/unit/resilience/test_replica_check.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lit_ddp.resilience.resume import choose_checkpoint
from lit_ddp.run_dir import sharded
from lit_ddp.run_dir.checkpoints import checkpoint_step, ranked_checkpoints
from tests.callbacks import FlipBit
from tests.helpers import Runner, callback, flip_payload_bit, usage_error, write_callbacks_config
from tests.system.test_fault_tolerance import one_process, regression_args
from tests.system.test_fsdp import mingpt


def skip_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "falling back to an older one" in line]


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("lit-ddp: error:")]


def newest_valid(root: Path) -> str:
    """What the next resume of ``root`` would take. (A resume from an older checkpoint than the run directory's newest
    files saves beside them: Lightning's ModelCheckpoint names its next files ``last-v1.ckpt``, ... where the names
    are taken by files its restored state does not know, here the damaged ones, which every resume skips.)"""
    path = choose_checkpoint(str(root))
    assert path is not None
    return path


def assert_same_state(a: dict, b: dict) -> None:
    """Bit for bit: the step, every parameter and every optimizer state tensor."""
    assert a["global_step"] == b["global_step"]
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for name, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][name]), name
    flat = [torch.utils._pytree.tree_flatten(s["optimizer_states"])[0] for s in (a, b)]
    assert len(flat[0]) == len(flat[1])
    for x, y in zip(*flat, strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def damage_newest(root: Path, step: int) -> tuple[dict, Path, list[str]]:
    """The run in ``root`` has saved its step ``step`` checkpoint and last.ckpt (of the same step): keeps their
    state (read before), flips one bit in a tensor of each. Returns the state, the step checkpoint and the names of
    the changed tensors."""
    ckpts = root / "checkpoints"
    newest = Path(next(p for s, p in ranked_checkpoints(str(root)) if s == step and "step=" in p))
    before = sharded.read_whole(ckpts / "last.ckpt")
    assert before["global_step"] == step
    return before, newest, [flip_payload_bit(p) for p in (newest, ckpts / "last.ckpt")]


def assert_refused(capsys: pytest.CaptureFixture, args: list[str], damaged: Path, name: str, elsewhere: Path) -> None:
    """``--ckpt_path`` to the damaged checkpoint: one line naming the tensor, exit 2, the files left as they were."""
    files = sorted(damaged.iterdir()) if damaged.is_dir() else [damaged]
    contents = [f.read_bytes() for f in files]
    capsys.readouterr()
    line = usage_error(capsys, "fit", *args, "--trainer.default_root_dir", str(elsewhere), "--ckpt_path", str(damaged))
    assert "is damaged" in line and name in line and "does not match the CRC-32" in line, line
    assert [f.read_bytes() for f in files] == contents, "the refused checkpoint is left as it was"


@pytest.mark.slow
@pytest.mark.timeout(300)  # 25-31 s here beside other work
def test_a_flipped_bit_in_the_newest_checkpoints_is_skipped_and_refused(
    tmp_path: Path, runner: Runner, capsys: pytest.CaptureFixture
) -> None:
    """One process, step checkpoints every 10 steps: after 30 steps one bit flips in a tensor of
    ``epoch=...-step=30.ckpt`` and of ``last.ckpt`` (both of step 30; each still loads with torch.load). The same
    command again skips both, one line each naming the record and the tensor, resumes from step 20 and ends at step
    30 with the state the run had, bit for bit; each damaged file as ``--ckpt_path`` is refused in one line."""
    root = tmp_path / "run"
    args = one_process(regression_args(30, 10))
    first = runner.fit(*args, "--trainer.default_root_dir", str(root), timeout=120)
    assert first.returncode == 0, first.stdout[-3000:]
    before, newest, names = damage_newest(root, 30)
    again = runner.fit(*args, "--trainer.default_root_dir", str(root), timeout=120)
    assert again.returncode == 0, again.stdout[-3000:]
    lines = skip_lines(again.stdout)
    assert len(lines) == 2, again.stdout[-3000:]
    for line, name in zip(sorted(lines), sorted(names), strict=True):  # epoch=0-step=30.ckpt, then last.ckpt
        assert "is damaged" in line and "does not match the CRC-32" in line and name in line, line
    assert "at global_step 20," in again.stdout, again.stdout[-3000:]
    assert_same_state(before, sharded.read_whole(newest_valid(root)))
    assert_refused(capsys, args, newest, names[0], tmp_path / "other")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(450)  # 75-100 s here beside other work
def test_a_flipped_bit_in_a_shard_is_skipped_and_refused(
    tmp_path: Path, runner: Runner, capsys: pytest.CaptureFixture, tiny_text: Path
) -> None:
    """FSDP2 on 2 processes, sharded checkpoints every 5 steps: after 10 steps one bit flips in a tensor entry of a
    ``.distcp`` shard of the step-10 checkpoint and of last.ckpt. The resume skips both (the shard and the tensor
    named), resumes from step 5 and ends with the run's step-10 state bit for bit; ``--ckpt_path`` refuses the
    directory in one line."""
    root = tmp_path / "run"
    args = [*mingpt("fsdp", 10, tiny_text), "--trainer.limit_val_batches", "0", "--checkpoint.every_n_train_steps", "5"]
    first = runner.fit(*args, "--trainer.default_root_dir", str(root), timeout=150)
    assert first.returncode == 0, first.stdout[-3000:]
    before, newest, names = damage_newest(root, 10)
    again = runner.fit(*args, "--trainer.default_root_dir", str(root), timeout=150)
    assert again.returncode == 0, again.stdout[-3000:]
    lines = skip_lines(again.stdout)
    assert len(lines) == 2, again.stdout[-3000:]
    for line in lines:
        assert "is damaged" in line and ".distcp: its entry of " in line and names[0] in line, line
    assert "at global_step 5," in again.stdout, again.stdout[-3000:]
    assert_same_state(before, sharded.read_whole(newest_valid(root)))
    assert_refused(capsys, args, newest, names[0], tmp_path / "other")
    assert (root / "checkpoints" / "last.ckpt" / "digest.json").is_file()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)  # 24-36 s here beside other work
def test_a_flipped_bit_on_one_rank_stops_the_run(tmp_path: Path, runner: Runner) -> None:
    """DDP on 2 processes, the replicas compared every 5 steps, checkpoints every 10: at step 13 rank 1's first
    parameter has its lowest mantissa bit flipped. The check at step 15 names both ranks (two that differ: no
    majority) and the tensor, every rank stops with a non-zero exit, and the newest checkpoint is step 10's."""
    root = tmp_path / "run"
    flip = write_callbacks_config(tmp_path / "flip.yaml", callback(FlipBit, step=13, rank=1))
    result = runner.fit(*regression_args(40, 10), "--trainer.default_root_dir", str(root), "--config", str(flip),
                        "--replica_check.every_n_steps", "5", timeout=150)  # fmt: skip
    assert result.returncode not in (0, 2), result.stdout[-3000:]
    [line] = {line.split(": ", 2)[-1] for line in error_lines(result.stdout)}  # each rank may report it, the same
    assert "the DDP replicas differ at global_step 15: rank 0 (host " in line and "and rank 1 (host " in line, line
    assert "first in net.weight" in line, line
    assert [s for s, _ in ranked_checkpoints(str(root))] == [10, 10], "last.ckpt and step 10's, nothing later"
    assert checkpoint_step(str(root / "checkpoints" / "last.ckpt")) == 10
    assert "Traceback" not in result.stdout, result.stdout[-3000:]
