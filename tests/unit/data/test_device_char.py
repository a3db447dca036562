""":class:`~lit_ddp.data.device_char.DeviceCharDataModule` (gpu.yaml's): the batches of
:class:`~lit_ddp.data.char.CharDataModule`, bit for bit and in the same order, through a resume, with window starts
in its loaders and the windows gathered after the transfer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from lit_ddp.data.char import CharDataModule
from lit_ddp.data.device_char import DeviceCharDataModule

ARGS = {"block_size": 8, "batch_size": 4, "train_split": 0.75}


def modules(text_file: Path) -> tuple[CharDataModule, DeviceCharDataModule]:
    plain, device = CharDataModule(path=str(text_file), **ARGS), DeviceCharDataModule(path=str(text_file), **ARGS)
    plain.setup("fit")
    device.setup("fit")
    return plain, device


def gathered(dm: DeviceCharDataModule, loader: Iterator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for starts in loader:
        assert starts.ndim == 1 and len(starts) <= ARGS["batch_size"] and starts.dtype == torch.int64
        yield dm.on_after_batch_transfer(starts, 0)


def assert_same(batches: Iterator, theirs: Iterator) -> int:
    n = 0
    for (x, y), (x0, y0) in zip(batches, theirs, strict=True):
        assert x.dtype == x0.dtype == torch.int64 and x.is_contiguous() and y.is_contiguous()
        assert torch.equal(x, x0) and torch.equal(y, y0)
        n += 1
    return n


def test_train_and_validation_batches_are_char_data_modules(text_file: Path) -> None:
    plain, device = modules(text_file)
    assert device.vocab == plain.vocab
    assert assert_same(gathered(device, iter(device.train_dataloader())), iter(plain.train_dataloader())) > 100
    assert assert_same(gathered(device, iter(device.val_dataloader())), iter(plain.val_dataloader())) > 5
    loader = device.train_dataloader()
    loader.sampler.set_epoch(1)  # type: ignore[attr-defined]
    theirs = plain.train_dataloader()
    theirs.sampler.set_epoch(1)  # type: ignore[attr-defined]
    assert assert_same(gathered(device, iter(loader)), iter(theirs)) > 100


def test_a_resume_continues_as_char_data_modules_either_way(text_file: Path) -> None:
    """A loader state saved mid-epoch by either module resumes the other one at the same batch: checkpoints of the
    plain module resume under gpu.yaml's, and back."""
    plain, device = modules(text_file)
    for saver, loader_of in ((plain, device), (device, plain)):
        saved = saver.train_dataloader()
        batches = iter(saved)
        for _ in range(7):
            next(batches)
        state = saved.state_dict()
        rest = list(batches)
        resumed = loader_of.train_dataloader()
        resumed.load_state_dict(state)
        mine = gathered(device, iter(resumed)) if loader_of is device else iter(resumed)
        expected = gathered(device, iter(rest)) if saver is device else iter(rest)
        assert assert_same(mine, expected) == len(rest) > 0


def test_windows_are_gathered_where_the_starts_are(text_file: Path) -> None:
    _, device = modules(text_file)
    starts = torch.tensor([0, 5, len(device.train_set) - 1])  # type: ignore[arg-type]
    x, y = device.on_after_batch_transfer(starts, 0)
    for row, s in enumerate(starts.tolist()):
        window = device.train_set[s]  # type: ignore[index]
        assert torch.equal(x[row], window[0]) and torch.equal(y[row], window[1])
    batch = (torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    assert device.on_after_batch_transfer(batch, 0) is batch  # a batch of windows passes as it is
