"""One rank's resume state: what a Lightning checkpoint lacks for a bit-exact mid-epoch resume.

Lightning saves the model, optimizer, loops and (for loaders with ``state_dict``/``load_state_dict``, such as
torchdata's ``StatefulDataLoader``) rank zero's train-loader position. It does not save RNG states or the
torchmetrics running sums of an epoch, it restores rank zero's loader state on every rank, and on a mid-epoch resume
it rebuilds the loader iterator before it sets the sampler's epoch, so under DDP the rest of the epoch is drawn from
epoch 0's permutation (torchdata's ``BatchSampler`` iterates the sampler eagerly); when
``trainer.estimated_stepping_batches`` is called before the restore (e.g. in ``configure_optimizers`` for an LR
schedule), the loader state is not restored at all (Lightning issue 20550). :class:`ResumeState` holds what closes
these gaps, and puts it back at one point; :class:`lit_ddp.resilience.exact_resume.ExactResume` carries it in the
checkpoint. (Under DDP, Lightning would wrap a ``StatefulDataLoader(shuffle=True)``'s own sampler in a
``DistributedSamplerWrapper`` whose inner generator is saved nowhere: :class:`lit_ddp.data.samplers.GlobalOrderSampler`
replaces it.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from lit_ddp import compat
from lit_ddp.errors import UsageError
from lit_ddp.resilience import restore_check


class ResumeState:
    """One rank's state that a resume must restore and a Lightning checkpoint lacks.

    - ``rng``: the RNG states of torch, numpy, Python and this rank's CUDA device (:func:`collect_rng_states`);
    - ``train_loaders``: this rank's ``state_dict()`` of every train loader;
    - ``positions``: each train loader's global position and next global batch, as the restore check compares them
      (:func:`lit_ddp.resilience.restore_check.saved_positions`);
    - ``metrics``: the torchmetrics states of the module, an epoch's running sums (:func:`metric_states`).

    ``state_dict()`` / ``load_state_dict()`` give and take these four entries (plain tensors, lists and numbers: a
    checkpoint of them loads with ``torch.load(weights_only=True)``). :meth:`restore` puts them back, at
    ``on_train_start``, after Lightning's own restore. Our own code: Lightning has no per-rank resume state.
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
    def capture(cls, trainer: Trainer, pl_module: LightningModule) -> ResumeState:
        """This rank's state now (inside ``trainer.save_checkpoint``)."""
        loaders = compat.train_loader_states(trainer)
        return cls(
            rng=collect_rng_states(trainer.strategy.root_device),
            train_loaders=loaders,
            positions=restore_check.saved_positions(trainer, loaders),
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

    def restore(self, trainer: Trainer, pl_module: LightningModule, saved_global_batch: int | None) -> bool:
        """Puts this state back into the live fit, at ``on_train_start`` of a resume (of any fit: a fresh one is left
        as it is). First the fit loop's position (:func:`lit_ddp.compat.restore_loop_position`: on a mid-epoch
        resume the train loaders from ``train_loaders``, and Lightning 2.6's restart counts mended), with the epoch's
        batches remapped where the global batch differs from ``saved_global_batch`` (:func:`remap_epoch_progress`);
        then the metrics' running sums of an epoch that goes on; last the RNG states, after everything that draws
        from them while the loaders are built, so the next step draws what the uninterrupted run drew. Returns
        whether the run resumed within an epoch that goes on.

        Raises:
            UsageError: a train loader has another number of workers than the one whose position it would continue.
        """
        if trainer.fit_loop.restarted_mid_epoch:
            check_loader_workers(trainer, self.train_loaders)
        mid_epoch, epoch_over = compat.restore_loop_position(trainer, self.train_loaders)
        one_loader = mid_epoch and len(self.train_loaders) == 1
        if one_loader and saved_global_batch is not None and saved_global_batch != global_batch(trainer):
            remap_epoch_progress(trainer, self.train_loaders, saved_global_batch)
        goes_on = mid_epoch and not epoch_over
        if self.metrics and goes_on:
            restore_metric_states(pl_module, self.metrics)
        if self.rng is not None:
            restore_rng_states(self.rng, trainer.strategy.root_device, trainer.local_rank)
        return goes_on


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
    Lightning counts as done in the epoch to the samples the sampler consumed, in batches of today's global batch,
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


def collect_rng_states(device: torch.device) -> dict[str, Any]:
    """This rank's RNG states: torch, numpy (as a tensor), Python, and the CUDA generator of its own ``device``
    only. Lightning's collector saves every visible GPU's state, which a resume with fewer visible GPUs (one
    process for debugging, ``--gpus-per-task``) cannot restore (``set_rng_state_all`` raises IndexError)."""
    states = _rng_states_to_tensors(compat.collect_rng_states(include_cuda=False))
    if device.type == "cuda":
        states["cuda_device"] = torch.cuda.get_rng_state(device)
    return states


def restore_rng_states(states: dict[str, Any], device: torch.device, local_rank: int = 0) -> None:
    """Restores :func:`collect_rng_states`' states on ``device``; an older checkpoint's every-GPU list
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
