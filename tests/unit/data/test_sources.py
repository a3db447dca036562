"""lit_ddp.data.sources: where the text comes from. The Tiny Shakespeare embedded in the package by default
(package data, checked by size and sha256), ``$LIT_DDP_DATA`` or a path over it, a URL downloaded once into a
sha256-checked cache (no network: ``file://`` and ``memory://``), and the bad paths and checksums refused."""

from __future__ import annotations

import hashlib
from pathlib import Path

import fsspec
import pytest

from lit_ddp.data.char import CharDataModule, decode
from lit_ddp.data.sources import (
    DATA_ENV,
    EMBEDDED,
    TINY_SHAKESPEARE_SHA256,
    read_embedded_text,
)
from tests.helpers import PACKAGE, REPO, SHORT_TEXT, compose, usage_error


def test_embedded_text_is_tiny_shakespeare() -> None:
    data = read_embedded_text().encode("utf-8")
    assert len(data) == 1_115_394  # char-rnn's input.txt
    assert hashlib.sha256(data).hexdigest() == TINY_SHAKESPEARE_SHA256


def test_embedded_text_is_package_data() -> None:
    """Shipped with the package (pyproject's package-data), so a wheel carries it too."""
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"lit_ddp.data" = ["tinyshakespeare.txt.gz"]' in pyproject
    assert (PACKAGE / "data" / "tinyshakespeare.txt.gz").stat().st_size < 500_000


def test_source_precedence(monkeypatch: pytest.MonkeyPatch, text_file: Path) -> None:
    monkeypatch.delenv(DATA_ENV, raising=False)
    assert CharDataModule().source == EMBEDDED
    assert CharDataModule().text_source.sha256 == TINY_SHAKESPEARE_SHA256
    monkeypatch.setenv(DATA_ENV, str(text_file))
    dm = CharDataModule()
    assert dm.source == str(text_file) and dm.text_source.sha256 is None
    other = text_file.with_name("other.txt")
    other.write_text("other text")
    assert CharDataModule(path=str(other)).source == str(other)


def files_holding(directory: Path, data: bytes) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file() and p.read_bytes() == data]


def test_url_downloaded_once_and_verified(tmp_path: Path, text_file: Path) -> None:
    """A file:// URL goes through the download path: copied into the cache, sha256-checked, reused."""
    sha = hashlib.sha256(SHORT_TEXT.encode()).hexdigest()
    cache = tmp_path / "cache"
    dm = CharDataModule(path=text_file.as_uri(), sha256=sha, cache_dir=str(cache), block_size=8)
    dm.prepare_data()
    assert len(files_holding(cache, SHORT_TEXT.encode())) == 1
    text_file.unlink()  # offline from now on: the cache serves
    dm2 = CharDataModule(path=text_file.as_uri(), sha256=sha, cache_dir=str(cache), block_size=8)
    dm2.prepare_data()
    dm2.setup("fit")
    assert decode(dm2.train_set.data[:10], dm2.vocab) == "A Citizen:"


def test_sha256_mismatch_rejected(tmp_path: Path) -> None:
    url = "memory://lit_ddp_test/corrupt.txt"
    with fsspec.open(url, "wb") as f:
        f.write(b"not the text you are looking for")
    cache = tmp_path / "cache"
    dm = CharDataModule(path=url, sha256="0" * 64, cache_dir=str(cache))
    with pytest.raises(ValueError, match=f"sha256 mismatch for {url}: expected {'0' * 64}"):
        dm.prepare_data()
    assert files_holding(cache, b"not the text you are looking for") == []  # no unverified copy is left behind
    fsspec.filesystem("memory").rm(url)


def test_checksum_mismatch(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("hello world\n" * 100)
    dm = CharDataModule(path=str(text), sha256="0" * 64, block_size=8)
    with pytest.raises(ValueError, match=f"sha256 mismatch for {text}: expected 0000.*got {hashlib.sha256(text.read_bytes()).hexdigest()}"):  # fmt: skip
        dm.prepare_data()


def test_data_path_that_is_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    line = usage_error(capsys, "fit", *compose("trainer/ddp", "mingpt/cpu"), "--data.init_args.path", str(tmp_path))
    assert f"data path {tmp_path} is a directory" in line
