"""Replicas that stay identical, checked: under DDP every rank must hold the same parameters and optimizer states,
bit for bit, and a rank whose copy changed (a device that computes wrong, memory that flips a bit) would train on
apart from the others unseen, its difference hidden in rank zero's checkpoints.

DDP averages gradients and never compares parameters. Silent data corruption on one device is measured in fleets
(Dixit et al., "Silent Data Corruptions at Scale", Meta 2021; Hochschild et al., "Cores that don't count", Google,
HotOS 2021) and counted among Llama 3's training interruptions (Meta, "The Llama 3 Herd of Models", 2024).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_debug
from torch.nn.parallel import DistributedDataParallel

from lit_ddp.errors import ReplicaMismatchError

EVERY_N_STEPS = 100
"""Optimizer steps between two checks by default (docs/fault_tolerance.md, "What is verified": its cost)."""


class ReplicaCheck(Callback):
    """Under DDP, compares a fingerprint of every rank's parameters and optimizer states every ``every_n_steps``
    optimizer steps and before every checkpoint save; where they differ, names the ranks (and hosts) that differ from
    the others and stops every rank, before the checkpoint is written.

    The fingerprint is one integer per tensor: its bytes read as 64-bit integers and summed, modulo 2^64, on the
    tensor's device (:func:`fingerprint`). Integer sums are exact and do not depend on the order of the reduction,
    so replicas that are bit-identical, as DDP's are (every rank applies the same averaged gradient to the same
    parameters), give identical fingerprints on any device; one changed bit changes its tensor's sum. The ranks exchange them in one ``all_gather`` of ``(world_size, tensors)`` integers;
    steps that do not check do nothing on the device and never wait on it. Skipped where nothing is replicated:
    one process, and a model that DDP does not wrap whole (FSDP2 and tensor parallelism shard the parameters;
    torchft's replica groups are left to torchft). Buffers are not compared (DDP does not keep them equal
    unless it broadcasts them).

    Args:
        every_n_steps: optimizer steps between checks; 0: no check at all, not even before a save.

    Raises:
        ReplicaMismatchError: on every rank at once, from ``on_train_batch_end`` or ``on_save_checkpoint`` (the
            checkpoint is then not written; the last one saved before the difference stays the newest).
        ValueError: ``every_n_steps`` < 0.
    """

    def __init__(self, every_n_steps: int = EVERY_N_STEPS) -> None:
        if every_n_steps < 0:
            raise ValueError(f"replica_check.every_n_steps={every_n_steps}: give 0 (off) or a number of steps >= 1")
        self.every_n_steps = every_n_steps
        self._active = False
        self._checked_step = -1  # the global_step last checked: a save right after a check is not checked twice

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After the strategy's set-up: replicas are a module DDP wraps, on more than one process (not torchft's groups,
        # whose steps the quorum may discard on some; not a strategy that gives each rank other parameters).
        strategy = trainer.strategy
        self._active = (
            self.every_n_steps > 0
            and trainer.world_size > 1
            and isinstance(strategy, DDPStrategy)
            and type(strategy).__name__ != "TorchFTStrategy"
            and isinstance(strategy.model, DistributedDataParallel)
        )
        self._checked_step = -1
        if not self._active and trainer.world_size > 1:
            rank_zero_debug(f"replica check: off under {type(strategy).__name__} (no DDP replicas to compare)")

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self._active and step % self.every_n_steps == 0 and step != self._checked_step:
            self.check(trainer, pl_module)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if self._active and trainer.global_step != self._checked_step:
            self.check(trainer, pl_module, before_save=True)

    def check(self, trainer: Trainer, pl_module: LightningModule, before_save: bool = False) -> None:
        """Compares this rank's fingerprint with every other rank's (collective: every rank calls it at the same
        step).

        Raises:
            ReplicaMismatchError: on every rank, where any two fingerprints differ.
        """
        names, tensors = zip(*replicated_tensors(pl_module, trainer.optimizers), strict=True)
        local = fingerprint(tensors, trainer.strategy.root_device)
        everyone = [torch.empty_like(local) for _ in range(trainer.world_size)]
        dist.all_gather(everyone, local)
        self._checked_step = trainer.global_step
        rows = torch.stack(everyone).tolist()  # the one wait on the device, on a step that checks
        if all(row == rows[0] for row in rows):
            return
        hosts: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(hosts, socket.gethostname())
        raise ReplicaMismatchError(_difference(rows, hosts, names, trainer, before_save))


def replicated_tensors(
    pl_module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of ``pl_module`` and every tensor of the ``optimizers``' states, by name
    (``model.lm_head.weight``, ``model.lm_head.weight: exp_avg``), in the same order on every rank."""
    named = {id(p): name for name, p in pl_module.named_parameters()}
    for name, p in pl_module.named_parameters():
        yield name, p
    for i, optimizer in enumerate(optimizers):
        prefix = f"optimizer {i}, " if len(optimizers) > 1 else ""
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p) or {}
                for key in sorted(state, key=str):
                    if isinstance(state[key], torch.Tensor):
                        yield f"{prefix}{named.get(id(p), 'a parameter')}: {key}", state[key]


def fingerprint(tensors: Any, device: torch.device) -> torch.Tensor:
    """The ``(len(tensors),)`` ``int64`` fingerprint on ``device``: each tensor's bytes read as little-endian 64-bit
    words (its last bytes, past a multiple of 8, one by one), summed modulo 2^64. The sum is exact and the same in any
    order of the reduction; a changed bit changes its word by a power of two, which changes the sum. (Words, not
    elements: the CPU's sum of ``int64`` is vectorized, its sum of ``int32`` into ``int64`` is not, 70 times slower
    measured here.)"""
    sums = [_word_sum(tensor).to(device, non_blocking=True) for tensor in tensors]
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64, device=device)


def _word_sum(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    raw = t.reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    try:
        total = raw[:whole].view(torch.int64).sum()
    except RuntimeError:  # bytes that do not start on an 8-byte boundary (a view into a larger tensor)
        total = raw[:whole].view(-1, 8).to(torch.int64).mul(_BYTE_WEIGHTS.to(raw.device)).sum()
    return total + raw[whole:].to(torch.int64).sum() if whole < raw.numel() else total


_BYTE_WEIGHTS = torch.tensor([1 << (8 * i) for i in range(8)], dtype=torch.int64)
"""Each byte's place in a little-endian 64-bit word (products past 2^63 wrap, as the word's sign bit does)."""


def _difference(
    rows: list[list[int]], hosts: list[Any], names: tuple[str, ...], trainer: Trainer, before_save: bool
) -> str:
    """The one line that names which ranks differ from the others, the first tensor that differs, and what was
    kept."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, row in enumerate(rows):
        groups.setdefault(tuple(row), []).append(rank)
    ordered = sorted(groups.values(), key=lambda ranks: (-len(ranks), ranks[0]))

    def who(ranks: list[int]) -> str:
        return ", ".join(f"rank {r} (host {hosts[r]})" for r in ranks)

    if len(ordered[0]) > len(rows) // 2:  # a majority: the others differ from it
        odd = [r for ranks in ordered[1:] for r in ranks]
        first = next(i for i, (a, b) in enumerate(zip(rows[odd[0]], rows[ordered[0][0]], strict=True)) if a != b)
        what = f"{who(odd)} {'holds' if len(odd) == 1 else 'hold'} other parameters or optimizer states than the others"
    else:  # no majority (two ranks that differ): every group named
        first = next(i for i in range(len(names)) if len({row[i] for row in rows}) > 1)
        what = " and ".join(who(ranks) for ranks in ordered) + " hold different parameters or optimizer states"
    differing = sum(1 for i in range(len(names)) if len({row[i] for row in rows}) > 1)
    more = f" and {differing - 1} more tensor(s)" if differing > 1 else ""
    not_written = "the checkpoint about to be saved was not written, and " if before_save else ""
    last = getattr(trainer.checkpoint_callback, "last_model_path", "") or ""
    kept = f"the last one saved before is kept ({last})" if last else "the checkpoints saved before are kept"
    return (
        f"the DDP replicas differ at global_step {trainer.global_step}: {what}, first in {names[first]}{more} (a "
        f"device or its memory changed them). Training stopped; {not_written}{kept}: resume from it on other devices, "
        "and check the named hosts"
    )
