"""lit_ddp.resilience.checkpoint_io: a run directory whose file system refuses a write (read-only, full) ends the run in
one line naming the directory, the file and the checkpoint kept, which stays as it was saved (issue 50, item 7).

A full disk is simulated where it cannot be made (a save whose ``torch.save`` fails as torch's writer reports a full
disk); as root, a real run in a small tmpfs, bind-mounted read-only, then filled."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lit_ddp.cli import cli_main
from lit_ddp.errors import RunDirectoryNotWritable
from lit_ddp.resilience import checkpoint_io
from lit_ddp.resilience.checkpoint_io import AtomicCheckpointIO
from tests.helpers import QUIET, compose


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_save_the_disk_refuses_names_the_directory_and_keeps_the_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Simulated: torch's zip writer turns the OSError of a full disk into a RuntimeError (its ``__context__``)."""
    ckpts = tmp_path / "checkpoints"
    AtomicCheckpointIO().save_checkpoint({"global_step": 7, "state_dict": {"w": torch.ones(2)}}, ckpts / "last.ckpt")
    before = digest(ckpts / "last.ckpt")

    def full_disk(obj: object, f: object) -> None:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None

    monkeypatch.setattr(checkpoint_io.torch, "save", full_disk)
    with pytest.raises(RunDirectoryNotWritable) as exc:
        AtomicCheckpointIO().save_checkpoint({"global_step": 9}, ckpts / "last.ckpt")
    assert str(exc.value) == (
        f"the checkpoint directory {ckpts} cannot be written: No space left on device: {ckpts / 'last.ckpt'}; its "
        f"newest checkpoint, {ckpts / 'last.ckpt'} (global_step 7), is kept as saved. Free space there or make it "
        "writable, or give another --trainer.default_root_dir, then run the same command again"
    )
    assert exc.value.exit_code == 1
    assert digest(ckpts / "last.ckpt") == before and os.listdir(ckpts) == ["last.ckpt"]


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs mounted at ``tmp_path/mnt`` (as root; skipped where mounting is not allowed: chmod does not
    stop root from writing)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root: the simulated test above covers the save")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_read_only_then_full_run_directory_ends_in_one_line(small_tmpfs: Path, capsys: pytest.CaptureFixture) -> None:
    """A real file system: a read-only run directory (the lock is the first write) and a full one (a checkpoint
    save), each one line and exit status 1 where a traceback was printed; the checkpoint saved before is kept."""
    run = small_tmpfs / "run"
    fit = ["fit", *compose("regression/single_device"), "--trainer.default_root_dir", str(run), *QUIET]
    cli_main([*fit, "--trainer.max_epochs", "1"])
    last = run / "checkpoints" / "last.ckpt"
    before = digest(last)
    kept = f"its newest checkpoint, {last} (global_step 56), is kept as saved."

    subprocess.run(["mount", "--bind", str(run), str(run)], check=True)  # the run directory seen read-only
    subprocess.run(["mount", "-o", "remount,ro,bind", str(run)], check=True)
    try:
        with pytest.raises(SystemExit) as exc:
            cli_main([*fit, "--trainer.max_epochs", "2"])
    finally:
        subprocess.run(["umount", "-l", str(run)], check=True)
    err = capsys.readouterr().err
    assert exc.value.code == 1 and "Traceback" not in err, err[-3000:]
    [line] = [line for line in err.splitlines() if line.startswith("lit-ddp: error:")]
    # a fresh process meets the lock first; this one holds it from the first fit, and meets the logger's file
    assert f"the run directory {run} cannot be written: Read-only file system: {run}/" in line and kept in line, line

    free = os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize
    (small_tmpfs / "filler").write_bytes(b"\0" * (free - 8192))  # room for the lock and logs, not a checkpoint
    with pytest.raises(SystemExit) as exc:
        cli_main([*fit, "--trainer.max_epochs", "2"])
    err = capsys.readouterr().err
    assert exc.value.code == 1 and "Traceback" not in err, err[-3000:]
    [line] = [line for line in err.splitlines() if line.startswith("lit-ddp: error:")]
    assert f"the checkpoint directory {run / 'checkpoints'} cannot be written: No space left on device: " in line
    assert kept in line, line
    assert digest(last) == before and sorted(os.listdir(last.parent)) == ["last.ckpt"]
