"""Characters of a text as next-token prediction windows, and their vocabulary (the minGPT task's data).

Source: pytorch/examples ``distributed/minGPT-ddp`` (``char_dataset.py``), after Karpathy's minGPT. The tutorial
splits overlapping windows with ``random_split`` (validation windows then overlap training text); here the text
is split contiguously first.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lit_ddp.data.samplers import GlobalOrderSampler, evaluation_sampler, this_process
from lit_ddp.data.sources import DEFAULT_CACHE_DIR, TextSource


def build_vocab(text: str) -> str:
    """The vocabulary of ``text``: its distinct characters, sorted; character ``vocab[i]`` is token ``i``."""
    return "".join(sorted(set(text)))


def encode(text: str, vocab: str) -> torch.Tensor:
    """Token ids ``(len(text),)`` int64 of ``text`` under a sorted ``vocab``, vectorized.

    Raises:
        ValueError: ``text`` holds characters outside ``vocab`` (named in the message).
    """
    if not text:
        return torch.zeros(0, dtype=torch.long)
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    table = np.frombuffer(vocab.encode("utf-32-le"), dtype=np.uint32)  # sorted, as build_vocab makes it
    ids = np.searchsorted(table, codes)
    bad = table[np.minimum(ids, len(table) - 1)] != codes
    if bad.any():
        missing = sorted({chr(c) for c in codes[bad][:1000]})
        raise ValueError(f"characters {missing!r} are not in the vocabulary of {len(vocab)} characters")
    return torch.from_numpy(ids.astype(np.int64))


def decode(ids: torch.Tensor | list[int], vocab: str) -> str:
    """Text of token ids ``(T,)``: the inverse of :func:`encode`."""
    return "".join(vocab[i] for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids))


class CharWindows(Dataset):
    """Windows of token ids ``data (N,)``: item ``i`` is ``(x, y) = (data[s : s + T], data[s + 1 : s + T + 1])``,
    both ``(T,)``, with ``s = i * stride``, ``T = block_size`` (stride 1: every position; T: disjoint windows).

    Raises:
        ValueError: ``data`` shorter than ``block_size + 1`` tokens.
    """

    def __init__(self, data: torch.Tensor, block_size: int, stride: int = 1) -> None:
        if data.numel() < block_size + 1:
            raise ValueError(f"{data.numel()} tokens are too few for one window of block_size={block_size} + 1")
        self.data = data
        self.block_size = block_size
        self.stride = stride

    def __len__(self) -> int:
        return (self.data.numel() - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = i * self.stride
        chunk = self.data[s : s + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CharDataModule(LightningDataModule):
    """Characters of a text as next-token prediction windows (the tutorial's ``CharDataset``).

    The text: ``path``, else ``$LIT_DDP_DATA``, else the embedded Tiny Shakespeare (:class:`TextSource`). In
    ``setup`` every rank builds the vocabulary of the whole text, encodes its first ``truncate`` fraction and
    splits it contiguously: ``train_split`` for training (windows at every position, as the tutorial), the rest
    for validation (disjoint windows: the same loss, ``block_size`` times cheaper). A batch is ``(x, y)``, both
    ``(B, T)`` int64. The train loader's sampler gives each rank its shard (:mod:`lit_ddp.data.samplers`).

    Args:
        path: path or fsspec URL of a UTF-8 text; None: ``$LIT_DDP_DATA``, else the embedded Tiny Shakespeare.
        sha256: expected hex sha256 of the file; None: checked only for Tiny Shakespeare's URL.
        cache_dir: where URLs are downloaded to.
        block_size: context length T in characters (linked to the model's ``block_size``).
        batch_size: windows per device and step (the tutorial's 216).
        train_split: fraction of the text used for training, in (0, 1).
        truncate: fraction of the text used at all, in (0, 1] (the tutorial's ``truncate: 0.05``).
        num_workers: DataLoader worker processes per rank.

    Raises:
        ValueError: a size or fraction out of range (at construction); a split too short for one window or a
            sha256 mismatch (``prepare_data`` / ``setup``).
        FileNotFoundError, IsADirectoryError: a bad local ``path`` (at construction, before any process starts).
    """

    def __init__(
        self,
        path: str | None = None,
        sha256: str | None = None,
        cache_dir: str = DEFAULT_CACHE_DIR,
        block_size: int = 128,
        batch_size: int = 64,
        train_split: float = 0.9,
        truncate: float = 1.0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("block_size", block_size), ("batch_size", batch_size)):
            if value < 1:
                raise ValueError(f"{name}={value} must be a positive integer")
        if not 0.0 < train_split < 1.0:
            raise ValueError(f"train_split={train_split} must be in (0, 1)")
        if not 0.0 < truncate <= 1.0:
            raise ValueError(f"truncate={truncate} must be in (0, 1]")
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be >= 0")
        self.save_hyperparameters()
        self.text_source = TextSource(path, sha256, cache_dir)  # a bad local path is reported now, before launch
        self.source = self.text_source.source  # the path or URL, or "embedded" for the package's Tiny Shakespeare
        self.vocab: str | None = None
        self.train_set: CharWindows | None = None
        self.val_set: CharWindows | None = None

    def prepare_data(self) -> None:
        self.text_source.read()  # a URL is downloaded once, by each node's local rank zero

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        hp = cast(Any, self.hparams)  # an AttributeDict of __init__'s arguments
        text = self.text_source.read()
        if not text:
            raise ValueError(f"data {self.source} is empty; give a text file with at least a few thousand characters")
        self.vocab = build_vocab(text)  # of the whole text: truncate never shrinks what a prompt may use
        text = text[: int(len(text) * hp.truncate)]
        data = encode(text, self.vocab)
        n_train = int(data.numel() * hp.train_split)
        if data.numel() - n_train <= hp.block_size:
            raise ValueError(
                f"block_size={hp.block_size} is at least as long as the validation split ({data.numel() - n_train} "
                f"characters of {self.source} with truncate={hp.truncate}, train_split={hp.train_split}); use "
                f"block_size < {data.numel() - n_train}, more text or a larger truncate"
            )
        self.train_set = CharWindows(data[:n_train], hp.block_size, stride=1)
        self.val_set = CharWindows(data[n_train:], hp.block_size, stride=hp.block_size)

    def train_dataloader(self) -> StatefulDataLoader:
        assert self.train_set is not None, "train_dataloader() is called after setup()"
        hp = cast(Any, self.hparams)
        # This rank's shard, resumed exactly. Keyword arguments: under DDP Lightning rebuilds the loader from them.
        sampler = GlobalOrderSampler(self.train_set, **this_process(self.trainer))  # this rank's shard of the data
        return StatefulDataLoader(
            self.train_set, batch_size=hp.batch_size, sampler=sampler, drop_last=True, num_workers=hp.num_workers
        )

    def val_dataloader(self) -> StatefulDataLoader:
        assert self.val_set is not None, "val_dataloader() is called after setup()"
        hp = cast(Any, self.hparams)
        sampler = evaluation_sampler(self.val_set, self.trainer)  # each window once, on any number of processes
        return StatefulDataLoader(self.val_set, batch_size=hp.batch_size, sampler=sampler, num_workers=hp.num_workers)

    test_dataloader = val_dataloader  # the text has no third split: `lit-ddp test` scores the held-out one
