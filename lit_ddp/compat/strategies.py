"""Lightning's strategies: the process group's timeout and backend, threads per process, the stream DDP is built on,
the precision plugin's compute dtype, and ``ModelParallelStrategy``'s mesh sizes."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy

from lit_ddp.compat.imports import private


def strategy_timeout(strategy: Any) -> timedelta | None:
    """The timeout a strategy creates its process group with (Lightning keeps ``DDPStrategy(timeout=...)`` in
    ``_timeout``, as FSDPStrategy and ModelParallelStrategy do, and has no getter); None for one without."""
    timeout = getattr(strategy, "_timeout", None)
    return timeout if isinstance(timeout, timedelta) else None


def set_strategy_timeout(strategy: Any, timeout: timedelta) -> None:
    """Makes the strategy create its process group with ``timeout`` (before ``setup_environment``); Lightning
    takes one timeout, for the rendezvous and every collective alike."""
    strategy._timeout = timeout


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

    A job of one process (one device, one node) gets no wrapper: the module as it is, as Lightning's
    ``SingleDeviceStrategy`` trains it (:class:`lit_ddp.strategies.DDPStrategy` creates no process group then).
    """

    def _setup_model(self, model: Any) -> Any:
        from torch.nn.parallel import DistributedDataParallel

        if self.num_nodes * self.num_processes == 1:
            return model
        return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)


def compute_dtype(trainer: Trainer) -> Any:
    """The dtype the trainer's precision plugin computes matrix products in (bf16 under ``bf16-mixed``), as Lightning's
    ThroughputMonitor picks its peak FLOP/s by; Lightning keeps the mapping private."""
    plugin_dtype = private("lightning.pytorch.callbacks.throughput_monitor", "_plugin_to_compute_dtype")
    return plugin_dtype(trainer.precision_plugin)


def set_model_parallel_sizes(strategy: Any, data_parallel_size: int, tensor_parallel_size: int) -> None:
    """Gives a ``ModelParallelStrategy`` its mesh sizes before ``setup_environment`` builds the mesh: its "auto"
    data-parallel size is ``num_nodes`` (tensor parallel within a node), where FSDP2 alone wants every process,
    and the world size is known only once the Trainer has set the devices (no public setter)."""
    strategy._data_parallel_size = data_parallel_size
    strategy._tensor_parallel_size = tensor_parallel_size
