"""DDP with one buffer setting on every torch, and without a process group when the job is one process.

:class:`DDPStrategy` is Lightning's with the per-step buffer broadcast chosen by one argument, which torch spells
differently across the supported range (:func:`ddp_buffer_kwargs`).
"""

from __future__ import annotations

import inspect
from typing import Any

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from torch.nn.parallel import DistributedDataParallel

from lit_ddp import compat
from lit_ddp.launch import loopback


def ddp_buffer_kwargs(sync_buffers: bool) -> dict[str, Any]:
    """``DistributedDataParallel`` keyword arguments that make it broadcast rank zero's buffers before every forward
    (``sync_buffers``) or not, on this torch.

    torch >= 2.13 calls it ``forward_sync_buffers`` and deprecates ``broadcast_buffers`` with a warning; before 2.13
    only ``broadcast_buffers`` exists. Either way the buffers are still broadcast once when DDP wraps the model,
    except with ``broadcast_buffers=False`` before 2.13, which skips that too: harmless for models whose buffers are
    the same on every rank from the start (the GPT's rotary tables, computed from the config).
    """
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": sync_buffers}
    return {"broadcast_buffers": sync_buffers}


class DDPStrategy(compat.DDPOnTheTrainingStream):
    """Lightning's ``DDPStrategy`` with the per-step buffer broadcast chosen by ``sync_buffers`` on every supported
    torch (:func:`ddp_buffer_kwargs`), so that one YAML (``configs/trainer/ddp.yaml``) runs without a warning or a
    rejected option from torch 2.9 to 2.15, and DDP built on the stream that trains
    (:class:`lit_ddp.compat.DDPOnTheTrainingStream`). A run on one machine listens on loopback only
    (:mod:`lit_ddp.launch.loopback`); a run of one process (:attr:`one_process`) creates no process group and trains
    the module unwrapped, so the same config trains one GPU without DDP's costs and several with DDP.

    Args:
        sync_buffers: True: DDP broadcasts every buffer from rank zero before each forward, a blocking collective per
            step, which a model whose training changes its buffers (BatchNorm's running statistics) wants, or
            SyncBatchNorm. False (the default): no per-step broadcast; this project's models have no buffer that
            training changes.
        **kwargs: Lightning's ``DDPStrategy`` arguments (``timeout``, ``process_group_backend``, ...) and
            ``DistributedDataParallel``'s, except its buffer arguments.

    Raises:
        ValueError: ``forward_sync_buffers`` or ``broadcast_buffers`` among ``kwargs`` (say ``sync_buffers``).
    """

    def __init__(self, sync_buffers: bool = False, **kwargs: Any) -> None:
        for name in ("forward_sync_buffers", "broadcast_buffers"):
            if kwargs.pop(name, None) is not None:  # the CLI lists DDP's own arguments too, each None
                raise ValueError(
                    f"DDPStrategy({name}=...): say sync_buffers instead "
                    f"(lit_ddp.strategies.DDPStrategy passes it to DDP under the name this torch knows)"
                )
        super().__init__(**kwargs, **ddp_buffer_kwargs(sync_buffers))

    @property
    def one_process(self) -> bool:
        """Whether the job is one process (one device, one node): then it runs as Lightning's ``SingleDeviceStrategy``
        would, without a process group or DDP's wrapper (whose reducer would copy every gradient into buckets and
        all-reduce them over one rank at every step); ranks, seeding, checkpoints and hooks are DDP's."""
        return self.num_nodes * self.num_processes == 1

    def setup_environment(self) -> None:
        if self.one_process:  # DDP's set-up but its process group (Lightning's setup_distributed)
            reset_seed()  # as setup_distributed: the model is built from the same random state as under DDP
            self.set_world_ranks()
            super(LightningDDPStrategy, self).setup_environment()  # the device's set-up
            return
        loopback.init_process_group(self)  # a one-machine run listens on loopback only
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        if self.one_process:  # the strategy's plain set-up: the model on its device, unwrapped (compat's DDP builder)
            super(LightningDDPStrategy, self).setup(trainer)
        else:
            super().setup(trainer)
