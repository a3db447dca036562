"""lit_ddp.launch.text_check: a local text that is not UTF-8 is refused before any process starts, in one line naming
the file and the byte offset (issue 50, item 7)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_ddp.errors import UsageError
from lit_ddp.launch.text_check import check_text_data, check_utf8
from tests.helpers import compose, usage_error


def test_text_that_is_not_utf8_is_named_with_its_byte_before_any_process_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A Latin-1 file failed in every rank's setup, after the processes started, with Python's "'utf-8' codec can't
    decode byte 0xe9 in position 3" and no file name; now refused before anything is built (no run directory
    written)."""
    latin = tmp_path / "latin.txt"
    latin.write_bytes("Caf\u00e9 au lait\n".encode("latin-1") * 300)
    run = tmp_path / "run"
    line = usage_error(capsys, "fit", *compose("trainer/ddp", "mingpt/cpu"), "--data.init_args.path", str(latin),
                       "--trainer.devices", "1", "--trainer.default_root_dir", str(run))  # fmt: skip
    assert f"data {latin} is not UTF-8 text: byte 3 (0xe9): invalid continuation byte" in line, line
    assert not (run / "config.yaml").exists()


@pytest.mark.parametrize(
    "class_path", ["lit_ddp.data.char.CharDataModule", "lit_ddp.data.device_char.DeviceCharDataModule"]
)
def test_the_environment_s_text_is_checked_too(tmp_path: Path, class_path: str) -> None:
    """CharDataModule's text and gpu.yaml's (its batches built on the device), from ``$LIT_DDP_DATA``."""
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"ok \xff")
    config = {"class_path": class_path, "init_args": {"path": None}}
    with pytest.raises(UsageError, match=r"byte 3 \(0xff\): invalid start byte"):
        check_text_data(config, {"LIT_DDP_DATA": str(latin)})
    check_text_data({"class_path": "lit_ddp.data.regression.RegressionDataModule"}, {"LIT_DDP_DATA": str(latin)})
    check_text_data(config, {})  # the embedded Tiny Shakespeare


@pytest.mark.parametrize("cut", [0, 1, 2])
def test_the_byte_offset_counts_across_reads(tmp_path: Path, cut: int) -> None:
    """Read 16 bytes at a time: a character split between two reads is whole, and the offset of a bad byte after
    the first read counts from the start of the file."""
    head = b"a" * (16 - cut) + "\u20ac".encode()  # a 3-byte character across the first read's end
    path = tmp_path / "text.txt"
    path.write_bytes(head + b"ok")
    check_utf8(path, chunk_bytes=16)
    path.write_bytes(head + b"ok\xff")
    with pytest.raises(UsageError, match=rf"byte {len(head) + 2} \(0xff\): invalid start byte"):
        check_utf8(path, chunk_bytes=16)
    path.write_bytes(head[:-1])  # cut short inside the last character
    with pytest.raises(UsageError, match=rf"byte {len(head) - 3} \(0xe2\): unexpected end of data"):
        check_utf8(path, chunk_bytes=16)
