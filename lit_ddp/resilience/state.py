"""A fit's training state: what it is, how it is captured, and how it is put back at one point, whether it comes
from a checkpoint file (a resume) or from a live peer's bytes (a torchft heal).

The state, part by part, and who captures and puts back each (the numbers are :func:`put_back`'s steps):

=====  ====================================================  ==================================  =======================
step   part                                                  captured by                         put back by
=====  ====================================================  ==================================  =======================
1      the module's weights and its ``on_save_checkpoint``   Lightning's checkpoint dictionary   Lightning's connector
       extras
2      the precision plugin (a GradScaler's scale)           Lightning                           Lightning's connector
3      the callbacks' states                                 Lightning                           Lightning's connector
4      the optimizers and LR schedulers                      Lightning                           Lightning's connector
5      the loop's position and each train loader's, with     Lightning (loops); :class:`RankState` the loop restore, then
       the epoch's batches remapped to a new global batch    (this rank's loaders)               this module
6      the torchmetrics running sums of the epoch            :class:`RankState`                  this module
7      the RNG streams (torch, CUDA, numpy, Python)          :class:`RankState`                  this module
8      the restore check of all of the above                 -                                   :mod:`~lit_ddp.resilience.restore_check`
=====  ====================================================  ==================================  =======================

Lightning's checkpoint holds rank zero's loader state, and no RNG or metric state; each rank's
:class:`RankState` fills the gap, under the checkpoint's ``"exact_resume"`` entry (:func:`rank_entry`, which
:class:`~lit_ddp.resilience.exact_resume.ExactResume` adds at every save). A resume from disk: Lightning's checkpoint
connector loads the file and does steps 1-5 (the loops) itself, ``ExactResume`` keeps what the file holds
(:func:`loaded`) and calls :func:`put_back` at ``on_train_start`` for the rest. A heal: the peer's
:func:`capture` (the same checkpoint dictionary, this rank's entry only, taken at the step boundary and sent as
bytes: a copy) and :func:`take`, all eight steps inside the healing step. torchtitan's checkpointer does the same with
one ``states`` dictionary of ``Stateful`` objects that serves ``dcp.save`` and torchft's heal
(``components/checkpoint.py``, ``components/ft/manager.py``); here Lightning's checkpoint dictionary is that object.

Lightning's own gaps, which step 5 closes: on a mid-epoch resume it rebuilds the loader iterator before it sets the
sampler's epoch, so under DDP the rest of the epoch is drawn from epoch 0's permutation (torchdata's
``BatchSampler`` iterates the sampler eagerly); when ``trainer.estimated_stepping_batches`` is called before the
restore, the loader state is not restored at all (Lightning issue 20550); it restores rank zero's loader state on
every rank. (Under DDP, Lightning would wrap a ``StatefulDataLoader(shuffle=True)``'s own sampler in a
``DistributedSamplerWrapper`` whose inner generator is saved nowhere: :class:`lit_ddp.data.samplers.GlobalOrderSampler`
replaces it.) Which checkpoint is restored is :mod:`lit_ddp.resilience.resume`; what a resume says it did,
:mod:`lit_ddp.resilience.report`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from lit_ddp import compat
from lit_ddp.data.samplers import GlobalOrderSampler
from lit_ddp.errors import UsageError
from lit_ddp.resilience import restore_check

CHECKPOINT_KEY = "exact_resume"
"""The checkpoint's entry of every rank's :class:`RankState` (:func:`rank_entry`)."""
IN_STEP_KEY = "in_step"
"""A heal's snapshot's: the loop's counts at the start of the step under way (a file is written between steps)."""


class RankState:
    """One rank's part of the state, which a Lightning checkpoint lacks.

    - ``rng``: the RNG states of torch, numpy, Python and this rank's CUDA device (:func:`capture_rng`);
    - ``train_loaders``: this rank's ``state_dict()`` of every train loader;
    - ``positions``: each train loader's global position and next global batch, as the restore check compares them
      (:func:`loader_positions`);
    - ``metrics``: the torchmetrics states of the module, an epoch's running sums (:func:`metric_states`).

    ``state_dict()`` / ``load_state_dict()`` give and take these four entries (plain tensors, lists and numbers: a
    checkpoint of them loads with ``torch.load(weights_only=True)``).
    """

    def __init__(
        self,
        rng: dict[str, Any] | None = None,
        train_loaders: list[dict[str, Any]] | None = None,
        positions: list[dict[str, Any] | None] | None = None,
        metrics: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self.rng = rng
        self.train_loaders = train_loaders or []
        self.positions = positions
        self.metrics = metrics

    @classmethod
    def capture(
        cls, trainer: Trainer, pl_module: LightningModule, loaders: list[dict[str, Any]] | None = None
    ) -> RankState:
        """This rank's state now; ``loaders``: the train loaders' states to record in place of their states now (a
        heal's: those at the start of the step under way)."""
        loaders = compat.train_loader_states(trainer) if loaders is None else loaders
        return cls(
            rng=capture_rng(trainer.strategy.root_device),
            train_loaders=loaders,
            positions=loader_positions(trainer, loaders),
            metrics=metric_states(pl_module),
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": self.rng,
            "train_loaders": self.train_loaders,
            "positions": self.positions,
            "metrics": self.metrics,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes :meth:`state_dict`'s entries; those a checkpoint written before them lacks (``positions``,
        ``metrics``) stay None."""
        self.rng, self.positions, self.metrics = state.get("rng"), state.get("positions"), state.get("metrics")
        self.train_loaders = state.get("train_loaders") or []


_for_peer: contextvars.ContextVar[bool] = contextvars.ContextVar("lit_ddp_capture_for_peer", default=False)


def for_a_peer() -> bool:
    """Whether the checkpoint dictionary being built or restored now is a heal's (:func:`capture`, :func:`take`), not
    a file's: then only this rank's state is in it, nothing is gathered from the other ranks, nothing is logged."""
    return _for_peer.get()


@contextlib.contextmanager
def _peer() -> Iterator[None]:
    token = _for_peer.set(True)
    try:
        yield
    finally:
        _for_peer.reset(token)


def rank_entry(trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
    """The checkpoint's :data:`CHECKPOINT_KEY` entry: every rank's :class:`RankState` (one ``all_gather_object``;
    collective), the world size and global batch it was written with. For a heal (:func:`for_a_peer`), this rank's
    alone, its loaders at the start of the step under way, and the loop's counts there (:data:`IN_STEP_KEY`)."""
    if for_a_peer():
        heal = _heal_capture.get()
        assert heal is not None, "capture() sets the start of the step under way"
        local = RankState.capture(trainer, pl_module, loaders=heal["loaders"]).state_dict()
        return {"world_size": 1, "global_batch": global_batch(trainer), "per_rank": [local], IN_STEP_KEY: heal}
    local = RankState.capture(trainer, pl_module).state_dict()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, local)
    else:
        per_rank = [local]
    return {"world_size": len(per_rank), "global_batch": global_batch(trainer), "per_rank": per_rank}


_heal_capture: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("lit_ddp_heal", default=None)


@dataclass
class Loaded:
    """What a resume found in its checkpoint, kept from Lightning's load to the put-back at ``on_train_start``:
    this rank's :class:`RankState` (its loaders only where the fit continues within an epoch), the leaves the restore
    check compares (:func:`lit_ddp.resilience.restore_check.saved_leaves`), the global batch and the model
    hyperparameters it was written with."""

    rank: RankState
    saved: dict[str, Any] | None  # None: nothing to compare (a fresh fit, a checkpoint without this rank's entry)
    global_batch: int | None
    hyperparameters: dict[str, Any]
    world_size: int


def loaded(trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> Loaded | None:
    """What :func:`put_back` needs of a file ``checkpoint`` Lightning is restoring (called from
    ``on_load_checkpoint``), this rank's entry taken from it; None for a checkpoint written without it (a warning
    says the resume is not bit-exact). Lightning's own loader state (rank zero's, on every rank) is taken out of the
    loop's state where this rank's replaces it, so that Lightning does not load it into loaders of another shape."""
    entry = checkpoint.get(CHECKPOINT_KEY)
    if entry is None:
        rank_zero_warn(
            "The checkpoint holds no RNG states (it was written without ExactResume): the run resumes, but "
            "not bit-exactly."
        )
        return None
    per_rank = entry["per_rank"]
    if len(per_rank) != trainer.world_size:
        rank_zero_warn(
            f"The checkpoint was written by {len(per_rank)} processes, this run has {trainer.world_size}: the "
            "train data continues from the same global sample (GlobalOrderSampler), but each rank restores the "
            "RNG states of rank (rank mod saved world size), so random draws in the step (dropout masks) "
            "differ from those of an uninterrupted run; without them (e.g. the regression) the resume is exact."
        )
    rank = RankState()
    rank.load_state_dict(per_rank[trainer.global_rank % len(per_rank)])
    same_world_size = len(per_rank) == trainer.world_size
    if not same_world_size:  # another rank's running sums would count its batches twice (or never)
        rank.metrics = None
    # On another world size the RNG streams are not compared: rank r restores rank r mod n's by design (above).
    saved = restore_check.saved_leaves(
        checkpoint,
        rank.rng if same_world_size else None,
        tensors=restore_check.plain_tensors(pl_module),
        precision=type(trainer.precision_plugin).__qualname__,
    )
    loop_state = (checkpoint.get("loops", {}).get("fit_loop") or {}).get("state_dict")
    if rank.train_loaders and loop_state is not None:
        loop_state["combined_loader"] = []
    else:
        rank.train_loaders = []
    hyperparameters = dict(checkpoint.get("hyper_parameters") or {})
    return Loaded(rank, saved, entry.get("global_batch"), hyperparameters, len(per_rank))


def put_back(
    trainer: Trainer,
    pl_module: LightningModule,
    state: Loaded,
    source: str,
    position: Callable[[], None] | None = None,
) -> bool:
    """Puts ``state`` back into the live fit, checks it, and returns whether the fit continues within an epoch.
    Steps 1-4 are done by then (a resume from disk: Lightning's connector; a heal: :func:`take`):

    5. The loop's position and the train loaders: a heal's ``position`` (the peer's step continued); else a resume's
       (:func:`lit_ddp.compat.restore_loop_position`: on a mid-epoch resume the loaders from this rank's states, after
       their workers are checked, and Lightning 2.6's restart counts mended), the epoch's batches remapped where the
       global batch differs from the checkpoint's (:func:`remap_epoch_progress`).
    6. The metrics' running sums, of an epoch that goes on (a heal: always).
    7. The RNG streams, last: the loaders are built by now, and the next step draws what the uninterrupted run
       drew.
    8. The restore check (:func:`lit_ddp.resilience.restore_check.check`): one line naming the first entry that
       differs before any step; a heal's in this process alone, a resume's on every rank.

    Raises:
        UsageError: a train loader has another number of workers than the one whose position it would continue.
        RestoreMismatchError: the restore check found a difference.
    """
    rank = state.rank
    # 5. The loop's position and the train loaders.
    if position is not None:
        position()
        goes_on = True
    else:
        warn_unsaved_sampler(trainer)
        if trainer.fit_loop.restarted_mid_epoch:
            check_loader_workers(trainer, rank.train_loaders)
        mid_epoch, epoch_over = compat.restore_loop_position(trainer, rank.train_loaders)
        one_loader = mid_epoch and len(rank.train_loaders) == 1
        if one_loader and state.global_batch is not None and state.global_batch != global_batch(trainer):
            remap_epoch_progress(trainer, rank.train_loaders, state.global_batch)
        goes_on = mid_epoch and not epoch_over
    # 6. The metrics' running sums.
    if rank.metrics and goes_on:
        restore_metric_states(pl_module, rank.metrics)
    # 7. The RNG streams.
    if rank.rng is not None:
        restore_rng(rank.rng, trainer.strategy.root_device, trainer.local_rank)
    # 8. The restore check.
    if state.saved is not None:
        positions = None  # a new epoch starts at its first sample; a heal's step has read its batch already
        if goes_on and position is None and rank.positions:
            positions = (rank.positions, live_positions(trainer, rank.positions))
        mismatch = (
            f"the state restored from {source} differs from the one saved there"
            if position is None
            else f"torchft heal: the state put back differs from the one {source} sent"
        )
        rng = capture_rng(trainer.strategy.root_device)
        restore_check.check(trainer, pl_module, state.saved, rng, positions, mismatch, collective=position is None)
    return goes_on


def capture(trainer: Trainer, loaders: list[dict[str, Any]] | None, in_step: dict[str, Any]) -> dict[str, Any]:
    """A heal's snapshot of this rank's fit, at the start of the step under way (in torchft's quorum thread, while
    the main thread waits for the quorum): the checkpoint dictionary a save would write now
    (:func:`lit_ddp.compat.dump_checkpoint`: module and its extras, optimizers, schedulers, precision plugin, loops,
    callbacks), with this rank's :class:`RankState` whose train loaders are ``loaders`` (their states at the start of
    the step), and ``in_step``: the loop's counts there, which :func:`take`'s ``position`` puts back. Its tensors are
    the live ones: the transport serializes it at once (the copy a heal receives)."""
    token = _heal_capture.set({**in_step, "loaders": loaders})
    try:
        with _peer():
            checkpoint = compat.dump_checkpoint(trainer)
            checkpoint[CHECKPOINT_KEY] = rank_entry(trainer, trainer.lightning_module)  # with or without ExactResume
            return checkpoint
    finally:
        _heal_capture.reset(token)


def take(trainer: Trainer, checkpoint: dict[str, Any], position: Callable[[dict[str, Any]], None], source: str) -> None:
    """A heal: a peer's :func:`capture` put into this fit at one point, inside the step under way, in the steps of
    :func:`put_back`: 1-4 through Lightning's connector (:func:`lit_ddp.compat.restore_checkpoint_state`), then 5
    ``position(in_step)`` (the loop's counts and the loaders at the peer's step), 6 the metrics, 7 the RNG streams,
    8 the restore check against what the peer sent, bit for bit (in this process).

    Raises:
        RestoreMismatchError: what was put back differs from what the peer sent.
    """
    pl_module = trainer.lightning_module
    entry = checkpoint[CHECKPOINT_KEY]
    rank = RankState()
    rank.load_state_dict(entry["per_rank"][0])
    saved = restore_check.saved_leaves(
        checkpoint,
        rank.rng,
        tensors=restore_check.plain_tensors(pl_module),
        precision=type(trainer.precision_plugin).__qualname__,
    )
    # The checkpoint callbacks' states name the peer's own files: this group keeps the bookkeeping of its run directory.
    own_files = {cb.state_key for cb in trainer.checkpoint_callbacks}
    checkpoint = {
        **checkpoint,
        "callbacks": {k: v for k, v in checkpoint.get("callbacks", {}).items() if k not in own_files},
    }
    with _peer():
        compat.restore_checkpoint_state(trainer, checkpoint)
    in_step = entry[IN_STEP_KEY]
    state = Loaded(rank, saved, entry.get("global_batch"), {}, 1)
    put_back(trainer, pl_module, state, source, position=lambda: position(in_step))


def loader_sampler(loader: Any) -> GlobalOrderSampler | None:
    """The loader's :class:`~lit_ddp.data.samplers.GlobalOrderSampler` (its sampler, or its batch sampler's), if
    any."""
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if isinstance(sampler, GlobalOrderSampler):
            return sampler
    return None


def upcoming(sampler: GlobalOrderSampler, epoch: int, consumed: int, count: int) -> list[int]:
    """The dataset indices of the ``count`` samples after global sample ``consumed`` of ``epoch``, every rank's in
    the global order: with ``count`` = batch size x world size, the next step's global batch."""
    return sampler.order(epoch)[consumed : consumed + count].tolist()


def live_positions(trainer: Trainer, saved: list[dict[str, Any] | None]) -> list[dict[str, Any] | None]:
    """After a restore, what :func:`loader_positions` recorded at the save, read from the train loaders' samplers and
    iterators, with as many next indices as ``saved`` holds (the global batch may have changed with the world
    size)."""
    positions: list[dict[str, Any] | None] = []
    states = compat.train_loader_states(trainer)
    for i, (loader, recorded) in enumerate(zip(compat.train_loaders(trainer), saved, strict=False)):
        sampler = loader_sampler(loader)
        if sampler is None or recorded is None:
            positions.append(None)
            continue
        epoch, pending = sampler.epoch, sampler.pending  # a loaded state not iterated yet, or where iteration began
        consumed = sampler.start if pending is None else int(pending["consumed"]) * (pending["epoch"] == epoch)
        position = {
            "epoch": epoch,
            "consumed": consumed,
            "next_indices": upcoming(sampler, epoch, consumed, len(recorded["next_indices"])),
        }
        if "worker_seed" in recorded:
            position["worker_seed"] = compat.worker_seed(states[i]) if i < len(states) else None
        positions.append(position)
    return positions


# The parts of RankState: loaders, metrics, RNG.


def warn_unsaved_sampler(trainer: Trainer) -> None:
    """Warns where Lightning wrapped a train sampler in ``DistributedSamplerWrapper``, whose inner sampler's random
    state no checkpoint holds."""
    if any(
        isinstance(getattr(getattr(dl, "batch_sampler", None), "sampler", None), DistributedSamplerWrapper)
        or isinstance(getattr(dl, "sampler", None), DistributedSamplerWrapper)
        for dl in compat.train_loaders(trainer)
    ):
        rank_zero_warn(
            "Lightning wrapped a train sampler in DistributedSamplerWrapper, whose inner sampler's random "
            "state is in no checkpoint: a resume will not draw the same samples. Give the train loader "
            "`sampler=lit_ddp.data.samplers.GlobalOrderSampler(dataset)`."
        )


def loader_positions(trainer: Trainer, loader_states: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """At a save, for each train loader: ``{"epoch", "consumed", "next_indices"}``, the global position its saved
    state ``loader_states`` resumes at and the dataset indices of the next global batch (batch size x world size
    samples) from there, and for a loader with workers ``"worker_seed"``, the seed their RNGs start from; None for a
    loader without a GlobalOrderSampler position in its state. What the restore check compares a resume's live
    positions with (:func:`live_positions`)."""
    positions: list[dict[str, Any] | None] = []
    for loader, state in zip(compat.train_loaders(trainer), loader_states, strict=False):
        sampler, saved = loader_sampler(loader), compat.sampler_state(state)
        if sampler is None or "consumed" not in saved:
            positions.append(None)
            continue
        epoch, consumed = int(saved["epoch"]), int(saved["consumed"])
        count = int(loader.batch_size or 1) * trainer.world_size
        position = {"epoch": epoch, "consumed": consumed, "next_indices": upcoming(sampler, epoch, consumed, count)}
        if (seed := compat.worker_seed(state)) is not None:
            position["worker_seed"] = seed
        positions.append(position)
    return positions


def check_loader_workers(trainer: Trainer, loader_states: list[dict[str, Any]]) -> None:
    """Raises UsageError where a live train loader runs another number of worker processes than the one whose saved
    state (``loader_states``) a mid-epoch resume would continue: torchdata's ``StatefulDataLoader`` loads a position
    only into a loader with as many (else an ``AssertionError`` that Lightning's teardown hides)."""
    for i, (loader, state) in enumerate(zip(compat.train_loaders(trainer), loader_states, strict=False)):
        saved, live = compat.loader_workers(state), int(getattr(loader, "num_workers", 0) or 0)
        if saved != live:
            raise UsageError(
                f"{trainer.ckpt_path} stopped mid-epoch with train loader {i} running {saved} worker processes per "
                f"rank; this run's has {live} (data.init_args.num_workers): the loader continues its position only "
                f"with as many: resume with num_workers {saved} (it may change at a checkpoint from an epoch's end)"
            )


def metric_states(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """The state of every torchmetrics ``Metric`` in ``module`` (by module name), on the CPU. A metric logged per
    epoch (``self.log("train/loss", metric, on_epoch=True)``) sums its batches on each rank until the epoch ends;
    Lightning's checkpoint holds none of it (torchmetrics states are not persistent), so a mid-epoch resume
    would log an epoch value over the batches since the resume only."""
    from torchmetrics import Metric

    return {
        name: {attr: _to_device(value, torch.device("cpu")) for attr, value in metric.metric_state.items()}
        for name, metric in module.named_modules()
        if isinstance(metric, Metric)
    }


def restore_metric_states(module: torch.nn.Module, states: dict[str, dict[str, Any]]) -> None:
    """Sets each ``Metric`` of ``module`` named in ``states`` (:func:`metric_states`) back to its saved state,
    on the module's device."""
    from torchmetrics import Metric

    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    modules = dict(module.named_modules())
    for name, state in states.items():
        metric = modules.get(name)
        if isinstance(metric, Metric):
            for attr, value in state.items():
                setattr(metric, attr, _to_device(value, device))


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if isinstance(value, list):  # a "cat" state: one tensor per update
        return [_to_device(v, device) for v in value]
    return value


def global_batch(trainer: Trainer) -> int | None:
    """Samples per step over all ranks (``batch_size`` x world size) of the single train loader; None otherwise."""
    loaders = compat.train_loaders(trainer)
    if len(loaders) != 1 or not loaders[0].batch_size:
        return None
    return int(loaders[0].batch_size) * trainer.world_size


def remap_epoch_progress(trainer: Trainer, loader_states: list[dict[str, Any]], saved_global_batch: int) -> None:
    """On a resume with another global batch than the checkpoint's ``saved_global_batch``: sets the batches
    Lightning counts as done in the epoch to the samples the sampler consumed, in batches of this run's global batch,
    and warns.

    Lightning ends an epoch after ``len(train_dataloader)`` batches counted from the restored batch count, while
    the sampler (:class:`~lit_ddp.data.samplers.GlobalOrderSampler`) resumes at its sample position. With another
    global batch they disagree: stopped after 20 batches of 32 and resumed with 64, Lightning would run 8 of the
    18 batches the remaining 1,152 of 1,792 samples make. With ``consumed // global_batch`` batches done, the
    count never runs out before the data does, so the epoch ends on its last batch (Lightning's ``is_last_batch``).
    Only a single train loader whose saved state holds a ``consumed`` position is counted so.
    """
    now = global_batch(trainer)
    sampler_state = compat.sampler_state(loader_states[0])
    if now is None or "consumed" not in sampler_state:
        return
    consumed = int(sampler_state["consumed"])
    rank_zero_warn(
        f"Resuming with a global batch of {now} samples ({now // trainer.world_size} x {trainer.world_size} "
        f"processes); the checkpoint's was {saved_global_batch}: the epoch continues from its sample {consumed} and "
        "ends after all of its samples, none lost or repeated, but the steps (and a schedule counted in steps) "
        "differ from the uninterrupted run's."
    )
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    shift = consumed // now - progress.ready
    # By the same amount: a checkpoint saved in on_train_batch_end has completed = ready - 1, which Lightning's
    # restart accounts for.
    for counter in ("ready", "started", "processed", "completed"):  # Lightning's _ProcessedTracker
        setattr(progress, counter, getattr(progress, counter) + shift)


def capture_rng(device: torch.device) -> dict[str, Any]:
    """This rank's RNG states: torch, numpy (as a tensor), Python, and the CUDA generator of its own ``device``
    only. Lightning's collector saves every visible GPU's state, which a resume with fewer visible GPUs (one
    process for debugging, ``--gpus-per-task``) cannot restore (``set_rng_state_all`` raises IndexError)."""
    states = _rng_states_to_tensors(compat.collect_rng_states(include_cuda=False))
    if device.type == "cuda":
        states["cuda_device"] = torch.cuda.get_rng_state(device)
    return states


def restore_rng(states: dict[str, Any], device: torch.device, local_rank: int = 0) -> None:
    """Restores :func:`capture_rng`'s states on ``device``; an older checkpoint's every-GPU list
    (``"torch.cuda"``) gives the entry of this rank's ``local_rank`` where it has one."""
    states = dict(states)
    own, every_gpu = states.pop("cuda_device", None), states.pop("torch.cuda", None)
    compat.set_rng_states(_rng_states_from_tensors(states))
    if device.type != "cuda":
        return
    if own is None and every_gpu is not None and local_rank < len(every_gpu):
        own = every_gpu[local_rank]
    if own is not None:
        torch.cuda.set_rng_state(own, device)


def _rng_states_to_tensors(states: dict[str, Any]) -> dict[str, Any]:
    """numpy's state as a tensor, so that checkpoints still load with ``torch.load(weights_only=True)``."""
    if "numpy" in states:
        kind, keys, pos, has_gauss, cached = states["numpy"]
        states = {**states, "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached)}
    return states


def _rng_states_from_tensors(states: dict[str, Any]) -> dict[str, Any]:
    if "numpy" in states:
        kind, keys, pos, has_gauss, cached = states["numpy"]
        states = {**states, "numpy": (kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached)}
    return states
