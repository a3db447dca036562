"""The restore check: a resumed fit compares the state it restored with the one its checkpoint holds, before its
first step (step 4 of :meth:`lit_ddp.resilience.restore.ResumeState.restore`, in ``ExactResume.on_train_start``,
after that hook of the callbacks listed before it in the trainer). A comparison only: what a save records for it is
:func:`lit_ddp.resilience.restore.saved_positions`. A loading bug, a callback that edits the weights on resume: the
run stops with one line naming the first entry that differs, instead of training on from a state nobody saved.

Compared on every rank: the global step, each LR scheduler's state, this rank's RNG streams as ExactResume saved
them (torch, CUDA, numpy, Python; on another world size not, where rank r restores rank r mod n's by design), and,
where the checkpoint holds them as plain tensors (DDP, one device, on any world size: the same global state on
every rank) every tensor of the module's ``state_dict()`` and each optimizer's state and param groups; under FSDP2,
tensor and pipeline parallelism from a sharded checkpoint, which torch's distributed checkpoint loads in place, this
rank's shard (or pipeline stages) of each of them, against the checkpoint read a second time into copies (``read_sharded_state``); on a resume
mid-epoch, each train loader's :class:`~lit_ddp.data.samplers.GlobalOrderSampler` position (epoch and global
sample), the dataset indices of the global batch that follows it and, for a loader with workers, the seed their
RNGs start from, which each save records: a lost position, another seed or other data shows there. Tensors bit for
bit (``torch.equal``), other values by ``==``.

It reads the checkpoint Lightning has loaded anyway (a sharded one a second time), so a save costs nothing more;
a resume costs one pass over the state (docs/fault_tolerance.md, "What is saved"). Lightning and torch's distributed
checkpoint load without comparing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed.tensor import DTensor

from lit_ddp import compat
from lit_ddp.data.samplers import GlobalOrderSampler
from lit_ddp.errors import RestoreMismatchError
from lit_ddp.run_dir import sharded


def promised(checkpoint: dict[str, Any], rng: dict[str, Any] | None, tensors: bool) -> dict[str, Any]:
    """What the checkpoint says a resume restores, as named leaves (``global_step``, ``scheduler0/last_epoch``,
    ``rng/torch``, ``parameters/model.lm_head.weight``, ``optimizer0/state/3/exp_avg``...): its values, not copies.
    ``rng``: this rank's RNG states from ExactResume's entry (None: not compared); ``tensors``: the module and
    optimizers too."""
    leaves: dict[str, Any] = {}
    if "global_step" in checkpoint:
        leaves["global_step"] = checkpoint["global_step"]
    if "lr_schedulers" in checkpoint:
        _add(leaves, "scheduler", checkpoint["lr_schedulers"])
    if rng is not None:
        _add(leaves, "rng", rng)
    if tensors and "state_dict" in checkpoint:
        _add(leaves, "parameters", dict(checkpoint["state_dict"]))
    if tensors and "optimizer_states" in checkpoint:
        _add(leaves, "optimizer", checkpoint["optimizer_states"])
    return leaves


def restored(trainer: Trainer, pl_module: LightningModule, rng: dict[str, Any], tensors: bool) -> dict[str, Any]:
    """The same leaves as :func:`promised`, read from the live trainer and module; ``rng``: this rank's states now."""
    leaves: dict[str, Any] = {"global_step": trainer.global_step}
    _add(leaves, "scheduler", [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs])
    _add(leaves, "rng", rng)
    if tensors:
        _add(leaves, "parameters", pl_module.state_dict())
        _add(leaves, "optimizer", [o.state_dict() for o in trainer.optimizers])
    return leaves


def live_positions(trainer: Trainer, saved: list[dict[str, Any] | None]) -> list[dict[str, Any] | None]:
    """After a restore, what :func:`lit_ddp.resilience.restore.saved_positions` recorded at the save, read from the
    train loaders' samplers and iterators, with as many next indices as ``saved`` holds (the global batch may have
    changed with the world size)."""
    positions: list[dict[str, Any] | None] = []
    states = compat.train_loader_states(trainer)
    for i, (loader, promise) in enumerate(zip(compat.train_loaders(trainer), saved, strict=False)):
        sampler = loader_sampler(loader)
        if sampler is None or promise is None:
            positions.append(None)
            continue
        epoch, pending = sampler.epoch, sampler.pending  # a loaded state not iterated yet, or where iteration began
        consumed = sampler.start if pending is None else int(pending["consumed"]) * (pending["epoch"] == epoch)
        following = upcoming(sampler, epoch, consumed, len(promise["next_indices"]))
        position = {"epoch": epoch, "consumed": consumed, "next_indices": following}
        if "worker_seed" in promise:
            position["worker_seed"] = compat.worker_seed(states[i]) if i < len(states) else None
        positions.append(position)
    return positions


def sharded_states(trainer: Trainer) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``(promised, restored)`` leaves of a resume from a sharded checkpoint (``shards/state_dict/...``,
    ``shards/optimizer_0/...``): this rank's local shard of every tensor, read again from the checkpoint and from the
    live module and optimizers; None where the strategy reads no sharded state or the checkpoint is a single file.
    Collective (every rank takes the same branch: the same strategy and checkpoint)."""
    strategy: Any = trainer.strategy  # lit_ddp.strategies.FSDP2Strategy, or any strategy with read_sharded_state
    path = trainer.ckpt_path
    if path is None or not hasattr(strategy, "read_sharded_state") or not sharded.is_sharded(Path(path)):
        return None
    promised_leaves: dict[str, Any] = {}
    restored_leaves: dict[str, Any] = {}
    _add(promised_leaves, "shards", _local(strategy.read_sharded_state(path)))
    _add(restored_leaves, "shards", _local(strategy.sharded_state()))
    return promised_leaves, restored_leaves


def _local(tree: Any) -> Any:
    """``tree`` with each ``DTensor`` as this rank's local shard."""
    if isinstance(tree, dict):
        return {k: _local(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [_local(v) for v in tree]
    return tree.to_local() if isinstance(tree, DTensor) else tree


def add_positions(leaves: dict[str, Any], positions: list[dict[str, Any] | None]) -> None:
    """``positions``' entries as leaves ``loader0/epoch``, ``loader0/consumed``, ``loader0/next_indices``, ..."""
    for i, position in enumerate(positions):
        for key, value in (position or {}).items():
            leaves[f"loader{i}/{key}"] = value


def upcoming(sampler: GlobalOrderSampler, epoch: int, consumed: int, count: int) -> list[int]:
    """The dataset indices of the ``count`` samples after global sample ``consumed`` of ``epoch``, every rank's in
    the global order: with ``count`` = batch size x world size, the next step's global batch."""
    return sampler.order(epoch)[consumed : consumed + count].tolist()


def loader_sampler(loader: Any) -> GlobalOrderSampler | None:
    """The loader's :class:`~lit_ddp.data.samplers.GlobalOrderSampler` (its sampler, or its batch sampler's), if any."""
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if isinstance(sampler, GlobalOrderSampler):
            return sampler
    return None


def plain_tensors(pl_module: LightningModule) -> bool:
    """Whether the module's state is plain tensors (not FSDP2's or tensor parallelism's ``DTensor`` shards)."""
    return not any(isinstance(v, DTensor) for v in pl_module.state_dict().values())


def first_mismatch(promised: dict[str, Any], restored: dict[str, Any]) -> str | None:
    """The first leaf of ``promised`` that ``restored`` lacks or holds with another value; None when all agree.
    A module's entries the checkpoint has and the module lacks are strict loading's to refuse, not this."""
    for name, want in promised.items():
        if name not in restored:
            if name.startswith("parameters/"):
                continue
            return name
        got = restored[name]
        if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
            same = (
                isinstance(want, torch.Tensor)
                and isinstance(got, torch.Tensor)
                and want.dtype == got.dtype
                and want.shape == got.shape
                and torch.equal(want.to(got.device), got)
            )
        else:
            same = bool(want == got)
        if not same:
            return name
    return None


def verify(
    trainer: Trainer,
    pl_module: LightningModule,
    promised: dict[str, Any],
    rng: dict[str, Any],
    positions: list[dict[str, Any] | None] | None,
) -> None:
    """The restore check of a resume, on every rank: ``promised`` (:func:`promised`, at load) against the live
    state (:func:`restored`, with ``rng`` this rank's RNG states now); from a sharded checkpoint (FSDP2, tensor and
    pipeline parallelism) this rank's shards against the checkpoint read again (:func:`sharded_states`); the loaders' ``positions`` as the save
    recorded them, where the resume continues an epoch. Collective.

    Raises:
        RestoreMismatchError: see :func:`check`.
    """
    plain = plain_tensors(pl_module)
    live = restored(trainer, pl_module, rng, tensors=plain)
    if (shards := sharded_states(trainer)) is not None:  # a pipeline's stages may hold plain tensors
        promised.update(shards[0])
        live.update(shards[1])
    if positions:
        add_positions(promised, positions)
        add_positions(live, live_positions(trainer, positions))
    check(promised, live, str(trainer.ckpt_path))


def check(promised: dict[str, Any] | None, restored: dict[str, Any], path: str) -> None:
    """Compares on every rank and raises on every rank alike (one ``all_gather_object``), so that no rank trains on
    while another stops; where all agree, rank zero says so in one line ("Restore check passed: ...", which
    ``lit-ddp chaos`` reports per resume).

    Raises:
        RestoreMismatchError: some rank restored a state other than the one the checkpoint at ``path`` holds.
    """
    mine = None if promised is None else first_mismatch(promised, restored)
    found: list[Any] = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
    for rank, name in enumerate(found):
        if name is not None:
            cause = (
                "the loader's workers were seeded anew: their state was not restored"
                if name.endswith("/worker_seed")
                else "the sampler's seed (seed_everything), its shuffle or the data differ from the saved run's, or "
                "its position was not restored"
                if name.startswith("loader")
                else "the load went wrong or something changed the state before the first step"
            )
            raise RestoreMismatchError(
                f"the state restored from {path} differs from the one saved there, first at {name} (rank {rank}): "
                f"{cause}; nothing was trained"
            )
    if promised is not None:
        entries = f"({len(promised)} entries on rank 0)"
        rank_zero_info(f"Restore check passed: the state restored from {path} is the one saved there {entries}")


def _add(leaves: dict[str, Any], name: str, value: Any) -> None:
    """``value``'s leaves under ``name/key/...`` (list items numbered); a list of plain values is one leaf."""
    if isinstance(value, dict):
        for key, item in value.items():
            _add(leaves, f"{name}/{key}", item)
    elif isinstance(value, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in value):
        for i, item in enumerate(value):
            _add(leaves, f"{name}{i}" if name in ("scheduler", "optimizer") else f"{name}/{i}", item)
    else:
        leaves[name] = value
