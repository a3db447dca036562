"""Atomic checkpoint writes under SIGKILL, and what the CLI does with corrupt checkpoints.

Lightning's ``_atomic_save`` is atomic only when ``$TMPDIR`` shares a filesystem with the checkpoint: the
first test shows a kill during its cross-filesystem copy destroying the previous checkpoint. Our
``AtomicCheckpointIO`` writes beside the target and renames; a process SIGKILLed while writing (a real race,
several times) leaves the previous checkpoint loadable. Which checkpoint a resume picks among valid and corrupt
ones: ``tests/unit/resilience/test_resume.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lit_ddp.resilience.checkpoint_io import AtomicCheckpointIO
from lit_ddp.run_dir.checkpoints import is_valid_checkpoint
from tests.helpers import Runner, compose, wait

OTHER_FS = Path("/dev/shm")


def other_filesystem(path: Path) -> bool:
    return OTHER_FS.is_dir() and os.access(OTHER_FS, os.W_OK) and os.stat(OTHER_FS).st_dev != os.stat(path).st_dev


def start_python(runner: Runner, code: str, tmp: Path) -> subprocess.Popen:
    """``python -c code`` with ``$TMPDIR`` on another filesystem than ``tmp`` (when there is one)."""
    tmpdir = str(OTHER_FS) if other_filesystem(tmp) else str(tmp)
    return runner.start([sys.executable, "-c", textwrap.dedent(code)], TMPDIR=tmpdir)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_lightning_default_save_is_not_atomic_across_filesystems(tmp_path: Path, runner: Runner) -> None:
    """Lightning's fsspec transaction: temp file in $TMPDIR, then shutil.move = a copy onto the target when
    $TMPDIR is another filesystem. Killed during that copy, the previous checkpoint is gone."""
    if not other_filesystem(tmp_path):
        pytest.skip(f"{OTHER_FS} is not a separate writable filesystem here")
    path = tmp_path / "last.ckpt"
    code = f"""
        import os, signal, torch
        from lightning.fabric.utilities.cloud_io import _atomic_save
        _atomic_save({{"w": torch.zeros(10)}}, {str(path)!r})  # the previous, good checkpoint
        real = os.sendfile
        def sendfile_then_die(out_fd, in_fd, offset, count):  # the kill lands inside the copy
            real(out_fd, in_fd, offset, min(count, 4096))
            os.kill(os.getpid(), signal.SIGKILL)
        os.sendfile = sendfile_then_die
        _atomic_save({{"w": torch.ones(1_000_000)}}, {str(path)!r})
    """
    out = wait(start_python(runner, code, tmp_path), 50)
    assert out.returncode == -signal.SIGKILL, out.stdout
    assert not is_valid_checkpoint(str(path))
    with pytest.raises(Exception):  # noqa: B017 - any failure to read is the point
        torch.load(path, weights_only=True)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_atomic_io_survives_kill_while_writing(tmp_path: Path, runner: Runner) -> None:
    """A process saving big checkpoints in a loop, SIGKILLed while its temporary file is being written (three
    times): last.ckpt is always the complete previous checkpoint; the next save clears the leftovers."""
    path = tmp_path / "checkpoints" / "last.ckpt"
    ready = tmp_path / "ready"
    code = f"""
        import os, torch
        from lit_ddp.resilience.checkpoint_io import AtomicCheckpointIO
        io = AtomicCheckpointIO()
        if not os.path.exists({str(path)!r}):
            io.save_checkpoint({{"w": torch.zeros(10), "n": -1}}, {str(path)!r})
        open({str(ready)!r}, "w").close()
        big = torch.randn(8_000_000)  # 32 MB per save
        n = 0
        while True:
            n += 1
            io.save_checkpoint({{"w": big, "n": n}}, {str(path)!r})
    """
    kills_mid_write = 0
    for _ in range(3):
        ready.unlink(missing_ok=True)
        proc = start_python(runner, code, tmp_path)
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline
            time.sleep(0.01)
        while True:  # wait until a temporary file is partly written, then kill
            partial = [p for p in path.parent.glob(".last.ckpt.*.tmp") if 0 < p.stat().st_size < 32_000_000]
            if partial:
                break
            assert time.monotonic() < deadline, "never saw a partial temporary file"
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
        wait(proc, 10)
        leftovers = list(path.parent.glob(".last.ckpt.*.tmp"))
        kills_mid_write += bool(leftovers)
        assert is_valid_checkpoint(str(path))
        assert "w" in torch.load(path, weights_only=True)
        assert [p.name for p in path.parent.glob("*.ckpt")] == ["last.ckpt"]
    assert kills_mid_write >= 1
    AtomicCheckpointIO().save_checkpoint({"w": torch.zeros(1)}, str(path))
    assert not list(path.parent.glob(".last.ckpt.*.tmp"))
    assert torch.load(path, weights_only=True)["w"].shape == (1,)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_refuses_to_start_over_garbage(tmp_path: Path, runner: Runner) -> None:
    """``fit`` on a run directory holding only unreadable checkpoints stops instead of training from scratch."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"\0" * 100)
    args = compose("trainer/ddp", "checkpoint/fault_tolerant", "regression/fault_tolerant")
    args += ["--trainer.devices", "1", "--trainer.strategy", "auto", "--trainer.default_root_dir", str(tmp_path)]
    out = runner.fit(*args, timeout=100)
    assert out.returncode != 0
    assert "None of the 1 checkpoint(s)" in out.stdout and "last.ckpt" in out.stdout, out.stdout[-3000:]
    assert "Epoch 0" not in out.stdout and not list(tmp_path.glob("events.out.*"))  # nothing trained
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["last.ckpt"]
