"""The GPU main job's character windows, built on the device: the text's tokens go to the device once, the loaders
yield only where each window starts, and the windows are gathered there.

:class:`~lit_ddp.data.char.CharDataModule`'s loaders collate ``batch_size`` windows of ``block_size + 1`` tokens
on the host and copy them to the device at every step (two ``(B, T)`` int64 tensors); here a step sends ``B``
integers and gathers ``x`` and ``y`` on the device in two indexing kernels. The batches are bit for bit the same, in
the same order: the samplers (:class:`~lit_ddp.data.samplers.GlobalOrderSampler` and its resumable state, the
evaluation sampler) are the same and see datasets of the same length. ``configs/mingpt/gpu.yaml`` names it; the
tutorial reads :mod:`lit_ddp.data.char`.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lit_ddp.data.char import CharDataModule, CharWindows
from lit_ddp.data.samplers import GlobalOrderSampler, evaluation_sampler, this_process


class WindowStarts(Dataset):
    """Where the windows of ``windows`` start in a text that holds its tokens from ``offset`` on: item ``i`` is
    ``offset + i * windows.stride`` (an int), as long as ``windows``."""

    def __init__(self, windows: CharWindows, offset: int) -> None:
        self.windows = windows
        self.offset = offset

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> int:
        return self.offset + i * self.windows.stride


class DeviceCharDataModule(CharDataModule):
    """:class:`~lit_ddp.data.char.CharDataModule` whose batches are built on the device: its loaders yield the
    window starts ``(B,)`` int64 (positions in the text, training and validation split one after the other), and
    ``on_after_batch_transfer`` turns them into ``(x, y)``, both ``(B, T)`` int64, gathered from the text's tokens,
    which go to the device at the first batch there. Its arguments are CharDataModule's.
    """

    tokens: torch.Tensor | None = None  # (N,) the training split, then the validation split
    _windows: torch.Tensor | None = None  # (N - T + 1, T): every T-token window, a view of the tokens on the device

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if self.tokens is None:
            assert self.train_set is not None and self.val_set is not None
            self.tokens = torch.cat([self.train_set.data, self.val_set.data])

    def train_dataloader(self) -> StatefulDataLoader:
        assert self.train_set is not None, "train_dataloader() is called after setup()"
        hp = cast(Any, self.hparams)
        sampler = GlobalOrderSampler(self.train_set, **this_process(self.trainer))  # CharDataModule's
        starts = WindowStarts(self.train_set, 0)
        return StatefulDataLoader(
            starts, batch_size=hp.batch_size, sampler=sampler, drop_last=True, num_workers=hp.num_workers
        )

    def val_dataloader(self) -> StatefulDataLoader:
        assert self.train_set is not None and self.val_set is not None, "val_dataloader() is called after setup()"
        hp = cast(Any, self.hparams)
        sampler = evaluation_sampler(self.val_set, self.trainer)  # CharDataModule's
        starts = WindowStarts(self.val_set, self.train_set.data.numel())
        return StatefulDataLoader(starts, batch_size=hp.batch_size, sampler=sampler, num_workers=hp.num_workers)

    test_dataloader = val_dataloader

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """``starts (B,)`` on the device -> ``(x, y)``: ``x[b] = tokens[starts[b] : starts[b] + T]``, ``y`` one
        token on, each ``(B, T)`` int64 (another batch, e.g. one a test hands in, as it comes)."""
        if not (isinstance(batch, torch.Tensor) and batch.ndim == 1):
            return batch
        windows = self._windows
        if windows is None or windows.device != batch.device:
            assert self.tokens is not None, "on_after_batch_transfer() is called after setup()"
            block_size = cast(Any, self.hparams).block_size
            windows = self._windows = self.tokens.to(batch.device).unfold(0, block_size, 1)
        return windows[batch], windows[batch + 1]
