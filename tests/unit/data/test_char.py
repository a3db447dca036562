"""lit_ddp.data.char: encoding, the windows, CharDataModule's contiguous train/val split, truncate, its batches
and bad arguments. Where the text comes from (embedded, path, URL, cache, checksums): test_sources.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from lit_ddp.data.char import CharDataModule, CharWindows, build_vocab, decode, encode
from lit_ddp.data.sources import TINY_SHAKESPEARE_SHA256, read_embedded_text
from tests.helpers import SHORT_TEXT


def test_encode_decode_round_trip() -> None:
    text = read_embedded_text()
    vocab = build_vocab(text)
    ids = encode(text, vocab)
    assert ids.dtype == torch.long and ids.shape == (len(text),)
    assert int(ids.max()) == len(vocab) - 1
    assert decode(ids, vocab) == text
    assert decode(encode("é→x", build_vocab("x→é")), build_vocab("x→é")) == "é→x"  # beyond ASCII
    with pytest.raises(ValueError, match=r"\['Z', 'q'\]"):
        encode("qZx", "x")


def test_packaged_text_is_tiny_shakespeare(tiny_shakespeare: Path) -> None:
    dm = CharDataModule(path=str(tiny_shakespeare), sha256=TINY_SHAKESPEARE_SHA256)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.vocab) == 65
    assert dm.train_set.data.numel() + dm.val_set.data.numel() == 1115394


def test_split_is_contiguous_and_disjoint(text_file: Path) -> None:
    dm = CharDataModule(path=str(text_file), block_size=8, batch_size=4, train_split=0.75)
    dm.setup("fit")
    full = encode(SHORT_TEXT, dm.vocab)
    n_train = int(len(SHORT_TEXT) * 0.75)
    assert torch.equal(dm.train_set.data, full[:n_train])
    assert torch.equal(dm.val_set.data, full[n_train:])
    # Every window (inputs and targets) stays inside its own split: no validation character is trained on.
    last_train = dm.train_set.data.storage_offset() + (len(dm.train_set) - 1) * dm.train_set.stride + 8 + 1
    assert last_train <= n_train
    assert dm.val_set.data.storage_offset() == n_train
    x, y = dm.train_set[len(dm.train_set) - 1]
    assert decode(torch.cat([x, y[-1:]]), dm.vocab) == SHORT_TEXT[n_train - 9 : n_train]
    # Validation windows are disjoint and cover the validation text.
    assert len(dm.val_set) == (len(SHORT_TEXT) - n_train - 1) // 8
    x0, y0 = dm.val_set[0]
    x1, _ = dm.val_set[1]
    assert torch.equal(y0[:-1], x0[1:]) and torch.equal(x1[0:1], y0[-1:])


def test_batches(text_file: Path) -> None:
    dm = CharDataModule(path=str(text_file), block_size=8, batch_size=4)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert isinstance(loader, StatefulDataLoader)
    x, y = next(iter(loader))
    assert x.shape == (4, 8) and y.shape == (4, 8) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    vx, _ = next(iter(dm.val_dataloader()))
    assert vx.shape == (4, 8)


def test_truncate(text_file: Path) -> None:
    dm = CharDataModule(path=str(text_file), block_size=8, truncate=0.5)
    dm.setup("fit")
    assert dm.train_set.data.numel() + dm.val_set.data.numel() == int(len(SHORT_TEXT) * 0.5)


def test_windows() -> None:
    data = torch.arange(20)
    w = CharWindows(data, block_size=4)
    assert len(w) == 16
    assert w[15][1].tolist() == [16, 17, 18, 19]
    assert len(CharWindows(data, 4, stride=4)) == 4
    with pytest.raises(ValueError, match="too few"):
        CharWindows(torch.arange(4), block_size=4)


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="train_split=1.0"):
        CharDataModule(train_split=1.0)
    with pytest.raises(ValueError, match="truncate=0"):
        CharDataModule(truncate=0)
    with pytest.raises(ValueError, match="batch_size=0"):
        CharDataModule(batch_size=0)
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        CharDataModule(path=str(tmp_path / "nope.txt")).prepare_data()
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(ValueError, match="block_size=8 is at least as long as the validation split"):
        CharDataModule(path=str(short), block_size=8).setup("fit")
