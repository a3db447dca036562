"""lit_ddp.run_dir.events: a run's records, appended whole, read back in order; a planted record file is refused
without blocking, a line that is not a record skipped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lit_ddp.run_dir import events
from lit_ddp.run_dir.layout import EVENTS
from lit_ddp.run_dir.untrusted import UntrustedFileError


def test_records_are_read_back_in_order_by_kind(tmp_path: Path) -> None:
    events.record(tmp_path, events.RESUMED, path="a.ckpt", global_step=50, epoch=1, restart=1)
    events.record(tmp_path, events.RESTORE_CHECK, path="a.ckpt", passed=True, entries=26)
    events.record(tmp_path, events.RESUMED, path="b.ckpt", global_step=100, epoch=3, restart=2)
    with open(tmp_path / EVENTS, "a") as f:
        f.write('{"event": "resumed", "global_st')  # cut short by a kill mid-write
    assert [e["global_step"] for e in events.read(tmp_path, events.RESUMED)] == [50, 100]
    assert [e["event"] for e in events.read(tmp_path)] == ["resumed", "restore_check", "resumed"]
    assert events.read(tmp_path / "elsewhere") == []


def test_no_record_where_the_run_directory_is_not_local_or_missing(tmp_path: Path) -> None:
    events.record("s3://bucket/run", events.RESUMED, global_step=1)
    events.record(tmp_path / "missing", events.RESUMED, global_step=1)
    assert not (tmp_path / "missing").exists()


def test_a_planted_record_file_is_refused_and_a_fifo_blocks_neither_side(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / EVENTS)
    events.record(tmp_path, events.RESUMED, global_step=1)  # no reader: the write is given up, not waited for
    with pytest.raises(UntrustedFileError, match="is a FIFO"):
        events.read(tmp_path)
    (tmp_path / EVENTS).unlink()
    os.symlink(tmp_path / "elsewhere.jsonl", tmp_path / EVENTS)
    with pytest.raises(UntrustedFileError, match="symbolic link"):
        events.read(tmp_path)
