"""lit_ddp.resilience.replica_check: the fingerprint (exact, the same in any order of the reduction, changed by any
one bit), what it covers, when the callback checks and what it says. Two DDP processes, a bit flipped on one:
``tests/system/test_integrity.py``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from torch.nn.parallel import DistributedDataParallel

from lit_ddp.resilience import replica_check
from lit_ddp.resilience.replica_check import ReplicaCheck, _difference, fingerprint, replicated_tensors

CPU = torch.device("cpu")


def test_one_flipped_bit_changes_the_fingerprint(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(1000, generator=generator), torch.randn(3, 7, generator=generator).bfloat16()]
    before = fingerprint(tensors, CPU)
    assert torch.equal(before, fingerprint([t.clone() for t in tensors], CPU))
    for which in range(2):
        element = int(torch.randint(tensors[which].numel(), (), generator=generator))
        changed = [t.clone() for t in tensors]
        bits = changed[which].view(-1).view(torch.int32 if which == 0 else torch.int16)
        bits[element] ^= 1  # the lowest mantissa bit
        after = fingerprint(changed, CPU)
        assert after[which] != before[which] and after[1 - which] == before[1 - which]


def test_the_fingerprint_is_the_same_in_any_order_of_the_reduction(seed: int) -> None:
    """Integer sums are exact: the sums of a tensor's parts (cut at 8-byte boundaries) add up to the whole's, in any
    order, where a float sum would round differently (what makes it safe to compare devices that reduce in other
    orders)."""
    t = torch.randn(10_002, generator=torch.Generator().manual_seed(seed)) * 1e6
    whole = int(fingerprint([t], CPU))
    parts = fingerprint([t[6000:], t[:2000], t[2000:6000]], CPU).tolist()
    assert (sum(parts) + (1 << 63)) % (1 << 64) - (1 << 63) == whole


def words(tensor: torch.Tensor) -> int:
    """The fingerprint computed apart: the tensor's bytes as little-endian signed 64-bit words and its last bytes
    one by one, summed modulo 2^64 (as a signed integer)."""
    data = (
        tensor.detach().contiguous().numpy().tobytes()
        if tensor.dtype != torch.bfloat16
        else bytes(tensor.detach().contiguous().view(torch.int16).numpy().tobytes())
    )
    whole = len(data) // 8 * 8
    total = sum(int.from_bytes(data[i : i + 8], "little", signed=True) for i in range(0, whole, 8))
    total += sum(data[whole:])
    total %= 1 << 64
    return total - (1 << 64) if total >= 1 << 63 else total


def test_every_kind_of_tensor_has_a_fingerprint(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    big = torch.randn(1003, generator=generator) * 1e30  # words near the top: the sum wraps around 2^64
    tensors = [torch.ones(3, dtype=torch.bool), torch.arange(5), torch.randn(3, generator=generator).bfloat16(),
               torch.ones(2, dtype=torch.float16), big, torch.tensor(7.0)]  # fmt: skip
    expected = [words(t) for t in tensors]
    assert fingerprint(tensors, CPU).tolist() == expected
    complex_ones = torch.ones(2, dtype=torch.complex64)
    assert fingerprint([complex_ones], CPU).tolist() == [words(torch.view_as_real(complex_ones))]
    assert fingerprint([big.reshape(17, 59).t()], CPU).tolist() == [words(big.reshape(17, 59).t())]  # a copy
    assert fingerprint([big[1:]], CPU).tolist() == [words(big[1:])], "bytes off an 8-byte boundary"


def test_it_covers_every_parameter_and_optimizer_state() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    optimizer = torch.optim.AdamW(module.parameters())
    assert [name for name, _ in replicated_tensors(module, [optimizer])] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    module(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    names = [name for name, _ in replicated_tensors(module, [optimizer])]
    assert names[4:7] == ["0.weight: exp_avg", "0.weight: exp_avg_sq", "0.weight: step"] and len(names) == 16


def test_the_line_names_the_ranks_that_differ_and_their_hosts() -> None:
    trainer = SimpleNamespace(global_step=15, checkpoint_callback=SimpleNamespace(last_model_path="/r/last.ckpt"))
    names = ("a", "b", "c")
    three = _difference([[1, 2, 3], [1, 2, 3], [1, 9, 9]], ["n0", "n0", "n1"], names, trainer, before_save=False)
    assert three.startswith(
        "the DDP replicas differ at global_step 15: rank 2 (host n1) holds other parameters or optimizer states than "
        "the others, first in b and 1 more tensor(s) (a device or its memory changed them). Training stopped; the last "
        "one saved before is kept (/r/last.ckpt)"
    )
    two = _difference([[1, 2], [1, 3]], ["n0", "n1"], names[:2], trainer, before_save=True)
    assert "rank 0 (host n0) and rank 1 (host n1) hold different parameters or optimizer states, first in b (" in two
    assert "the checkpoint about to be saved was not written, and the last one saved before is kept" in two


@pytest.mark.parametrize(
    ("strategy", "world_size", "wrapped", "active"),
    [
        (DDPStrategy(), 2, True, True),
        (DDPStrategy(), 1, False, False),  # one process: lit-ddp's DDPStrategy trains the module unwrapped
        (DDPStrategy(), 2, False, False),  # a DDPStrategy whose ranks hold other parameters (not DDP-wrapped)
        (SingleDeviceStrategy(CPU), 1, False, False),
        (ModelParallelStrategy(), 2, False, False),  # FSDP2 and tensor parallelism: sharded, not replicated
    ],
    ids=["ddp", "ddp-one-process", "ddp-unwrapped", "one-device", "fsdp2"],
)
def test_it_checks_only_replicas(
    strategy: Any, world_size: int, wrapped: bool, active: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = torch.nn.Linear(2, 2)
    if wrapped:  # a DistributedDataParallel without a process group: its class is what counts
        module = object.__new__(DistributedDataParallel)
    monkeypatch.setattr(type(strategy), "model", property(lambda self: module), raising=False)
    check = ReplicaCheck(every_n_steps=5)
    check.on_fit_start(SimpleNamespace(strategy=strategy, world_size=world_size), None)  # type: ignore[arg-type]
    assert check._active is active


def test_it_checks_every_n_steps_and_before_a_save_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps that do not check do nothing but compare two integers; a save right after a check is not checked
    again; a step reached again (gradient accumulation) is not checked twice."""
    checks: list[tuple[int, bool]] = []
    check = ReplicaCheck(every_n_steps=5)
    check._active = True

    def record(trainer: SimpleNamespace, pl_module: object, before_save: bool = False) -> None:
        checks.append((trainer.global_step, before_save))
        check._checked_step = trainer.global_step

    monkeypatch.setattr(check, "check", record)
    for step in (1, 2, 3, 4, 5, 5, 6):
        trainer = SimpleNamespace(global_step=step)
        check.on_train_batch_end(trainer, None, None, None, 0)  # type: ignore[arg-type]
        if step in (5, 6):
            check.on_save_checkpoint(trainer, None, {})  # type: ignore[arg-type]
    assert checks == [(5, False), (6, True)]


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(ValueError, match=r"replica_check.every_n_steps=-1: give 0 \(off\)"):
        ReplicaCheck(every_n_steps=-1)
    assert replica_check.EVERY_N_STEPS >= 1
