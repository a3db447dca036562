"""The restore check: the state a resume or a torchft heal put back, compared with the one it was given, before the
first step (step 8 of :func:`lit_ddp.resilience.state.put_back`). A loading bug, a callback that edits the weights on
resume: the run stops with one line naming the first entry that differs, instead of training on from a state nobody
saved.

Compared, as named leaves (:func:`saved_leaves` of the checkpoint, :func:`live_leaves` of the fit; a comparison
only: what a fit's state is, and how it is captured, is :mod:`lit_ddp.resilience.state`): the global step,
each LR scheduler's state, the precision plugin's (a GradScaler's scale and growth tracker), this rank's RNG streams
(torch, CUDA, numpy, Python; on another world size not, where rank r restores rank r mod n's by design), and where the
checkpoint holds them as plain tensors (DDP, one device, on any world size: the same global state on every rank)
every tensor of the module's ``state_dict()`` and each optimizer's state and param groups; under FSDP2, tensor and
pipeline parallelism from a sharded checkpoint, which torch's distributed checkpoint loads in place, this rank's shard
(or pipeline stages) of each of them, against the checkpoint read a second time into copies (:func:`sharded_leaves`); on a resume mid-epoch, each train
loader's :class:`~lit_ddp.data.samplers.GlobalOrderSampler` position (epoch and global sample), the dataset indices
of the global batch that follows it and, for a loader with workers, the seed their RNGs start from, which each save
records. Tensors bit for bit (``torch.equal``), other values by ``==``. Callbacks' states are restored (their
``load_state_dict``) but not compared: a callback need not give back what it was given.

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

from lit_ddp.errors import RestoreMismatchError
from lit_ddp.run_dir import events, sharded


def saved_leaves(
    checkpoint: dict[str, Any], rng: dict[str, Any] | None, tensors: bool, precision: str | None = None
) -> dict[str, Any]:
    """What a checkpoint (a file's, or the one a peer sent a healing group) says a resume puts back, as named leaves
    (``global_step``, ``scheduler0/last_epoch``, ``precision/scale``, ``rng/torch``,
    ``parameters/model.lm_head.weight``, ``optimizer0/state/3/exp_avg``...): its values, not copies. ``rng``: this
    rank's RNG states from its ExactResume entry (None: not compared); ``tensors``: the module and optimizers too;
    ``precision``: the class name the precision plugin's state is filed under (Lightning's key for it)."""
    leaves: dict[str, Any] = {}
    if "global_step" in checkpoint:
        leaves["global_step"] = checkpoint["global_step"]
    if "lr_schedulers" in checkpoint:
        _add(leaves, "scheduler", checkpoint["lr_schedulers"])
    if precision is not None and checkpoint.get(precision):
        _add(leaves, "precision", checkpoint[precision])
    if rng is not None:
        _add(leaves, "rng", rng)
    if tensors and "state_dict" in checkpoint:
        _add(leaves, "parameters", dict(checkpoint["state_dict"]))
    if tensors and "optimizer_states" in checkpoint:
        _add(leaves, "optimizer", checkpoint["optimizer_states"])
    return leaves


def live_leaves(trainer: Trainer, pl_module: LightningModule, rng: dict[str, Any], tensors: bool) -> dict[str, Any]:
    """The same leaves as :func:`saved_leaves`, read from the live trainer and module; ``rng``: this rank's states
    now."""
    leaves: dict[str, Any] = {"global_step": trainer.global_step}
    _add(leaves, "scheduler", [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs])
    if precision := trainer.precision_plugin.state_dict():
        _add(leaves, "precision", precision)
    _add(leaves, "rng", rng)
    if tensors:
        _add(leaves, "parameters", pl_module.state_dict())
        _add(leaves, "optimizer", [o.state_dict() for o in trainer.optimizers])
    return leaves


def sharded_leaves(trainer: Trainer) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``(saved, live)`` leaves of a resume from a sharded checkpoint (``shards/state_dict/...``,
    ``shards/optimizer_0/...``): this rank's local shard of every tensor, read again from the checkpoint and from the
    live module and optimizers; None where the strategy reads no sharded state or the checkpoint is a single file.
    Collective (every rank takes the same branch: the same strategy and checkpoint)."""
    strategy: Any = trainer.strategy  # lit_ddp.strategies.FSDP2Strategy, or any strategy with read_sharded_state
    path = trainer.ckpt_path
    if path is None or not hasattr(strategy, "read_sharded_state") or not sharded.is_sharded(Path(path)):
        return None
    saved: dict[str, Any] = {}
    live: dict[str, Any] = {}
    _add(saved, "shards", _local(strategy.read_sharded_state(path)))
    _add(live, "shards", _local(strategy.sharded_state()))
    return saved, live


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


def plain_tensors(pl_module: LightningModule) -> bool:
    """Whether the module's state is plain tensors (not FSDP2's or tensor parallelism's ``DTensor`` shards)."""
    return not any(isinstance(v, DTensor) for v in pl_module.state_dict().values())


def first_mismatch(saved: dict[str, Any], live: dict[str, Any]) -> str | None:
    """The first leaf of ``saved`` that ``live`` lacks or holds with another value; None when all agree. A module's
    entries the checkpoint has and the module lacks are strict loading's to refuse, not this."""
    for name, want in saved.items():
        if name not in live:
            if name.startswith("parameters/"):
                continue
            return name
        got = live[name]
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


def check(
    trainer: Trainer,
    pl_module: LightningModule,
    saved: dict[str, Any],
    rng: dict[str, Any],
    positions: tuple[list[Any], list[Any]] | None,
    mismatch: str,
    collective: bool = True,
) -> None:
    """The restore check: ``saved`` (:func:`saved_leaves`, taken when the state arrived) against the live state
    (:func:`live_leaves`, with ``rng`` this rank's RNG states now); under FSDP2 and tensor parallelism this rank's
    shards (a pipeline's stages) against the checkpoint read again (:func:`sharded_leaves`); ``positions``, ``(saved, live)``, the train
    loaders' positions where a resume continues an epoch (:func:`lit_ddp.resilience.state.loader_positions`).
    ``collective``: every rank compares and every rank raises alike (one ``all_gather_object``), so that no rank
    trains on while another stops; where all agree, rank zero says so in one line ("Restore check passed: ...",
    which ``lit-ddp chaos`` reports per resume). Not ``collective`` (a torchft heal, which each process of a group
    makes alone): this process only.

    Raises:
        RestoreMismatchError: some rank put back another state than the one it was given; the message begins with
            ``mismatch`` (what was restored from what).
    """
    plain = plain_tensors(pl_module)
    live = live_leaves(trainer, pl_module, rng, tensors=plain)
    saved = dict(saved)
    # A pipeline's stages may hold plain tensors; a heal's state came from a peer, not from trainer.ckpt_path.
    if collective and (shards := sharded_leaves(trainer)) is not None:
        saved.update(shards[0])
        live.update(shards[1])
    if positions is not None:
        add_positions(saved, positions[0])
        add_positions(live, positions[1])
    mine = first_mismatch(saved, live)
    found: list[Any] = [mine]
    if collective and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
    for rank, name in enumerate(found):
        if name is not None:
            rank = rank if collective else trainer.global_rank
            cause = (
                "the loader's workers were seeded anew: their state was not restored"
                if name.endswith("/worker_seed")
                else "the sampler's seed (seed_everything), its shuffle or the data differ from the saved run's, or "
                "its position was not restored"
                if name.startswith("loader")
                else "the load went wrong or something changed the state before the first step"
            )
            message = f"{mismatch}, first at {name} (rank {rank}): {cause}; nothing was trained"
            if collective and trainer.is_global_zero:
                fields = {"path": str(trainer.ckpt_path), "first": name, "rank": rank, "message": message}
                events.record(trainer.default_root_dir, events.RESTORE_CHECK, passed=False, **fields)
            raise RestoreMismatchError(message)
    if collective:
        path = trainer.ckpt_path
        entries = f"({len(saved)} entries on rank 0)"
        rank_zero_info(f"Restore check passed: the state restored from {path} is the one saved there {entries}")
        if trainer.is_global_zero:
            events.record(
                trainer.default_root_dir, events.RESTORE_CHECK, path=str(path), passed=True, entries=len(saved)
            )


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
