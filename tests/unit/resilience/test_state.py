"""lit_ddp.resilience.state: RNG states per rank, the CUDA one of the rank's own device only (issue 21,
item 7), restored with fewer visible GPUs than were saved; simulated on CPU."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lit_ddp.resilience.state import (
    RankState,
    capture_rng,
    metric_states,
    restore_metric_states,
    restore_rng,
)


def test_cpu_states_roundtrip() -> None:
    states = capture_rng(torch.device("cpu"))
    assert "cuda_device" not in states and "torch.cuda" not in states
    expected = (torch.rand(2), np.random.rand(), random.random())
    restore_rng(states, torch.device("cpu"))
    got = (torch.rand(2), np.random.rand(), random.random())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


class FakeCuda:
    """One visible GPU: torch.cuda's state functions for device 0 only (device 3 raises, as a missing GPU)."""

    def __init__(self) -> None:
        self.set_calls: list[tuple[torch.Tensor, torch.device]] = []

    def get_rng_state(self, device: torch.device) -> torch.Tensor:
        assert device.index == 0
        return torch.arange(4, dtype=torch.uint8)

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        if device.index != 0:
            raise IndexError(f"no GPU {device.index}")
        self.set_calls.append((state, device))


def test_only_the_own_device_is_saved_and_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "get_rng_state", fake.get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", fake.set_rng_state)
    gpu0 = torch.device("cuda", 0)
    states = capture_rng(gpu0)
    assert torch.equal(states["cuda_device"], torch.arange(4, dtype=torch.uint8))
    restore_rng(states, gpu0)
    assert len(fake.set_calls) == 1 and fake.set_calls[0][1] == gpu0


def test_an_every_gpu_checkpoint_resumes_on_fewer_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint from 8 visible GPUs (Lightning's every-device list) on a process that sees one: its own
    rank's entry goes to its one device; Lightning's set_rng_state_all would index GPUs that do not exist."""
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "set_rng_state", fake.set_rng_state)
    old = capture_rng(torch.device("cpu"))
    old["torch.cuda"] = [torch.full((4,), i, dtype=torch.uint8) for i in range(8)]
    restore_rng(old, torch.device("cuda", 0), local_rank=5)
    [(state, device)] = fake.set_calls
    assert device.index == 0 and torch.equal(state, torch.full((4,), 5, dtype=torch.uint8))


def test_an_epoch_metric_continues_from_its_saved_sums() -> None:
    """A metric logged per epoch, saved mid-epoch and restored into a fresh module, ends the epoch with the value
    of the uninterrupted one (Lightning's checkpoint holds no torchmetrics state)."""
    from torchmetrics import MeanSquaredError

    def module() -> torch.nn.Module:
        m = torch.nn.Module()
        m.net, m.train_mse = torch.nn.Linear(1, 1), MeanSquaredError()
        return m

    batches = [(torch.randn(8), torch.randn(8)) for _ in range(4)]
    uninterrupted, first, resumed = module(), module(), module()
    for pred, target in batches:
        uninterrupted.train_mse.update(pred, target)
    for pred, target in batches[:2]:
        first.train_mse.update(pred, target)
    saved = metric_states(first)
    assert set(saved) == {"train_mse"} and all(v.device.type == "cpu" for v in saved["train_mse"].values())
    restore_metric_states(resumed, saved)
    for pred, target in batches[2:]:
        resumed.train_mse.update(pred, target)
    assert torch.equal(resumed.train_mse.compute(), uninterrupted.train_mse.compute())
    fresh = module()  # what a resume without the saved sums ends the epoch with: the batches since the resume
    for pred, target in batches[2:]:
        fresh.train_mse.update(pred, target)
    assert not torch.equal(fresh.train_mse.compute(), uninterrupted.train_mse.compute())


def test_state_dict_roundtrip_and_an_older_entry() -> None:
    """The four entries go into the checkpoint as they are and come back; an entry written before ``positions`` and
    ``metrics`` were recorded loads with them None (nothing to compare, nothing to restore)."""
    rng = capture_rng(torch.device("cpu"))
    state = RankState(rng, [{"_num_yielded": 3}], [{"epoch": 0, "consumed": 96, "next_indices": [4, 1]}], {})
    loaded = RankState()
    loaded.load_state_dict(state.state_dict())
    assert loaded.state_dict() == state.state_dict()
    older = RankState()
    older.load_state_dict({"rng": rng, "train_loaders": [{"_num_yielded": 3}]})
    assert older.positions is None and older.metrics is None and older.train_loaders == [{"_num_yielded": 3}]
