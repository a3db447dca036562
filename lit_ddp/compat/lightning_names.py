"""Lightning's private functions and methods that the package uses, and what it composes from the private
attributes (:mod:`lit_ddp.compat.lightning`, which also states the conventions): strategies' timeouts, threads
and how ``DDPStrategy`` wraps the model; the loop position a resume restores; the precision plugin's dtype; object
stores."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf
from lightning.pytorch.strategies import DDPStrategy

from lit_ddp.compat.imports import private
from lit_ddp.compat.lightning import fix_last_batch_restart, restore_train_loaders, undo_epoch_end_recount


def strategy_timeout(strategy: Any) -> timedelta | None:
    """The timeout a strategy creates its process group with (Lightning keeps ``DDPStrategy(timeout=...)`` in
    ``_timeout``, as FSDPStrategy and ModelParallelStrategy do, and has no getter); None for one without."""
    timeout = getattr(strategy, "_timeout", None)
    return timeout if isinstance(timeout, timedelta) else None


def process_group_backend(strategy: Any) -> str:
    """The backend a Lightning strategy creates its process group with (its ``process_group_backend`` argument,
    else gloo on CPU and NCCL on CUDA): its private ``_get_process_group_backend`` (DDPStrategy, FSDPStrategy and
    ModelParallelStrategy alike; no public getter before the group exists)."""
    return str(getattr(strategy, "_get_process_group_backend")())  # noqa: B009 - one home for private names


def threads_like_rank_zero(num_processes: int) -> None:
    """Gives this process the intra-op threads Lightning's launcher gave rank zero: ``OMP_NUM_THREADS``, else
    this machine's CPUs over ``num_processes`` (Lightning's private ``_set_num_threads_if_needed``).

    A Lightning bug, not reported upstream yet (no issue found, 2026-11-26): ``ModelParallelStrategy`` sets up its
    launcher, which sets the threads, only in the process the user started (``_configure_launcher`` skips it where
    the environment ``creates_processes_externally``), so rank zero computes with CPUs / processes threads and the
    others with every CPU (``DDPStrategy`` configures its launcher in every process). The ranks' kernels then
    reduce in different orders: under tensor parallelism the parameters every rank holds whole drift apart, and a
    sharded checkpoint, which keeps one rank's copy, resumed off the uninterrupted run. Where the launcher set
    ``OMP_NUM_THREADS`` (torchrun, ``slurm/*.sbatch``), or a fixed Lightning's launcher did, nothing changes.
    Measured on Lightning 2.6.6."""
    private("lightning.fabric.utilities.distributed", "_set_num_threads_if_needed")(num_processes=num_processes)


class DDPOnTheTrainingStream(DDPStrategy):
    """Lightning's ``DDPStrategy`` that builds ``DistributedDataParallel`` on the current CUDA stream, the one every
    forward and backward then runs on (its private ``_setup_model``).

    Lightning (up to 2.6.6 at least) builds it under a new side stream (for whole-network CUDA graph capture,
    which nothing here does). DDP's reducer keeps the parameters' AccumulateGrad nodes it creates then, each
    bound to that side stream, while the gradients arrive from the default stream: torch >= 2.10 warns at the
    first backward ("The AccumulateGrad node's stream does not match the stream of the node that produced the
    incoming gradient", asking for DDP to be built "under the same stream as subsequent forwards"), and each
    backward may wait on the side stream. Lightning-AI/pytorch-lightning#21567, fixed by #21746 (after 2.6.6).
    On CPU (``device_ids`` None) Lightning opens no stream, and this builds what it builds.
    """

    def _setup_model(self, model: Any) -> Any:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)


# ---- the loops, the precision plugin and file systems


def compute_dtype(trainer: Trainer) -> Any:
    """The dtype the trainer's precision plugin computes matrix products in (bf16 under ``bf16-mixed``), as Lightning's
    ThroughputMonitor picks its peak FLOP/s by; Lightning keeps the mapping private."""
    plugin_dtype = private("lightning.pytorch.callbacks.throughput_monitor", "_plugin_to_compute_dtype")
    return plugin_dtype(trainer.precision_plugin)


def show_resumed_epoch(trainer: Trainer, batch_idx: int) -> None:
    """Give the progress bar of an epoch resumed mid-way its epoch, total and ETA, starting at ``batch_idx``.

    Lightning from 2.5 (2.6.6 measured) skips ``on_train_epoch_start`` when it resumes mid-epoch, and that hook is where
    ``TQDMProgressBar`` sets the epoch's total and description, so the resumed epoch shows ``Training: | 160/?``
    without an ETA (Lightning-AI/pytorch-lightning#20603; fix proposed in #21806). Call it at the resumed
    epoch's first batch; it does nothing where the hook ran (the bar has a total) or another bar is used. The
    bar starts at ``batch_idx``, so its rate and ETA count this run's batches only.
    """
    callback = trainer.progress_bar_callback
    if not isinstance(callback, TQDMProgressBar) or callback.is_disabled:
        return
    bar = callback.train_progress_bar
    if bar.total is not None:
        return
    total = callback.total_train_batches  # by max_steps: the steps left, as if the epoch began at this batch
    if trainer.max_epochs == -1 and trainer.max_steps > 0:
        total = min(trainer.num_training_batches, batch_idx + total)
    bar.reset(total=convert_inf(total))
    bar.initial = bar.n = batch_idx
    bar.set_description(f"Epoch {trainer.current_epoch}")


def restore_loop_position(trainer: Trainer, loader_states: list[dict[str, Any]]) -> tuple[bool, bool]:
    """Puts the fit loop where the checkpoint left it, at ``on_train_start`` of a resume (a fresh fit is left as it
    is): :func:`fix_last_batch_restart`, then on a mid-epoch restart the train loaders rebuilt from this rank's
    ``loader_states`` (:func:`restore_train_loaders`; none: Lightning's restore stands), then
    :func:`undo_epoch_end_recount`. The one call through which a resume reaches the loops' private state.
    Returns ``(mid_epoch, epoch_over)``: whether Lightning restarted mid-epoch, and whether that epoch had ended
    (the checkpoint was written after its last batch)."""
    fit_loop = trainer.fit_loop
    mid_epoch = fit_loop.restarted_mid_epoch
    epoch_over = fix_last_batch_restart(trainer)
    if loader_states and mid_epoch:
        # Lightning annotates `current` as a _ReadyCompletedTracker; the fit loop's is a _ProcessedTracker.
        restore_train_loaders(trainer, loader_states, fit_loop.epoch_progress.current.processed)  # type: ignore[attr-defined]
    undo_epoch_end_recount(trainer)
    return mid_epoch, epoch_over


def is_object_storage(fs: Any) -> bool:
    """Whether an fsspec filesystem is an object store (s3, gs, az...): Lightning's own test."""
    return bool(private("lightning.fabric.utilities.cloud_io", "_is_object_storage")(fs))
