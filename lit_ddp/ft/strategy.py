"""The Lightning strategy of one torchft replica group: :class:`TorchFTStrategy` (``configs/trainer/torchft.yaml``).

A group is one process, or W processes that train as DDP does (one torchrun job per group: ``python -m
lit_ddp.ft.launch --nproc_per_group W``). Each gradient is averaged over the group's processes, then across the
quorum's groups, rank ``r`` of each group with rank ``r`` of the others (torchft's manager, one per process); rank
``r`` of a healing group takes the state of rank ``r`` of a live peer.

At each optimizer step it (1) asks torchft's manager for the step's quorum, healing from a live peer where the quorum
says so (:class:`lit_ddp.ft.heal.PeerState`, before the forward); (2) runs Lightning's closure (forward,
``zero_grad``, backward), whose backward averages the gradients across the quorum's groups in torchft's DDP hook
(:func:`lit_ddp.compat.fault_tolerant_ddp`; W processes: :func:`group_then_quorum`); (3) steps the optimizer only
where ``should_commit()`` says the whole quorum's all-reduce succeeded. A discarded step is not counted:
``trainer.global_step`` and the logger's step stay where they were, so that ``global_step`` is torchft's committed
step count, and its batch is read again at the next step. Group ``i`` of ``R`` trains share ``i`` of each global batch
of the one global order, rank ``r`` of its W processes the ``r``-th part of that share (:mod:`lit_ddp.ft.data`: the
train loader's ``GlobalOrderSampler`` is made reader ``i x W + r`` of ``R x W``). Lightning's automatic optimization
passes the closure; torchft's ``OptimizerWrapper`` takes none: the strategy runs the closure itself and hands the
optimizer a closure that returns its loss.

Every group lost: each resumes from its own run directory's newest checkpoint (the usual automatic resume). torchft's
manager counts the committed steps too (``Manager.current_step``), and a quorum heals every group from one whose count
is the highest: a resumed group's manager starts at the restored ``global_step`` (its committed batches from the
checkpoint, key ``"torchft"``), and the group's first step waits for a quorum of every group (at most
``quorum_timeout``), so that a group whose checkpoint is older heals from the newest instead of training alone up to
the newer group's step (two groups at one step with different states, which no quorum would heal).

The timeouts (docs/torchft.md, "Timeouts"): a lost group costs the survivors about one
heartbeat timeout of the lighthouse (``python -m lit_ddp.ft.launch --heartbeat_timeout_ms``), a frozen one at most
``timeout`` (the cross-group collectives, ``should_commit`` and the checkpoint transfer).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lit_ddp import compat
from lit_ddp.errors import UsageError
from lit_ddp.ft import data
from lit_ddp.ft.heal import PeerState
from lit_ddp.strategies import DDPStrategy, loopback

EXTRA = 'torchft is not installed: pip install -e ".[torchft]" (the torchft extra)'
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
REPLICA_ENV = "REPLICA_GROUP_ID"
REPLICA_GROUPS_ENV = "TORCHFT_REPLICA_GROUPS"
CHECKPOINT_KEY = "torchft"
"""Where a checkpoint holds the manager's ``state_dict()`` (its committed steps and batches)."""
QUORUM_RETRY_S = 0.2  # between a resumed group's quorums while it waits for every group


def require_torchft() -> None:
    """Raises UsageError, in one line naming the extra, where torchft is not installed."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise UsageError(f"configs/trainer/torchft.yaml: {EXTRA}") from None


def group_then_quorum(state: tuple[Any, int], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's communication hook of a group of several processes: the gradient bucket averaged over the group's
    ``world_size`` processes (the default process group), then across the quorum's groups through torchft's
    ``manager`` (:func:`lit_ddp.compat.comm_hook`). ``state``: ``(manager, world_size)``."""
    manager, world_size = state
    dist.all_reduce(bucket.buffer().div_(world_size))
    return compat.comm_hook(manager, bucket)


# torch checks a hook's annotations as objects, not as the strings `from __future__ import annotations` leaves.
group_then_quorum.__annotations__["bucket"] = dist.GradBucket
group_then_quorum.__annotations__["return"] = torch.futures.Future[torch.Tensor]


class TorchFTStrategy(DDPStrategy):
    """One torchft replica group: one process, or W processes trained as DDP (``trainer.devices`` W, launched by
    torchrun), whose gradients are averaged with the other groups' through torchft's ``Manager`` (gloo), a step
    committed only where the quorum says so.

    Args:
        lighthouse: the lighthouse's address (``http://127.0.0.1:29510``); None: ``$TORCHFT_LIGHTHOUSE``, as
            ``python -m lit_ddp.ft.launch`` sets it.
        replica_id: this group's name in the quorum, ``group_<i>``; None: ``$REPLICA_GROUP_ID``, else ``group_0``.
        replica_groups: how many groups share each global batch (group ``i`` trains share ``i``); None:
            ``$TORCHFT_REPLICA_GROUPS`` (``python -m lit_ddp.ft.launch`` sets it), else 1.
        min_replicas: the fewest groups a step commits with.
        timeout: the cross-group all-reduce's, ``should_commit``'s and the live-state transfer's: what a frozen
            (not dead) peer can cost the others; also the group's own process group's (W > 1).
        quorum_timeout: how long a step waits for its quorum (more than a step takes, and more than the
            lighthouse's join timeout); also how long a group resumed from disk waits for every group at its first
            step.
        connect_timeout: to reach the lighthouse and a peer's manager.

    Raises:
        UsageError: torchft is not installed.
        ValueError: at set-up, a group over several nodes (``trainer.num_nodes`` > 1), manual optimization, or
            gradient accumulation, or a replica id that is not ``group_<i>`` with ``i`` below the number of groups;
            at the start of training, a train loader without a ``GlobalOrderSampler``.
    """

    def __init__(
        self,
        lighthouse: str | None = None,
        replica_id: str | None = None,
        replica_groups: int | None = None,
        min_replicas: int = 1,
        timeout: timedelta = timedelta(seconds=30),
        quorum_timeout: timedelta = timedelta(seconds=60),
        connect_timeout: timedelta = timedelta(seconds=10),
    ) -> None:
        require_torchft()
        # W > 1: the groups all-reduce DDP's flat buckets, so every group's must hold the same gradients in the same
        # order; DDP re-orders its buckets after its first backward, which a group that joins later would do steps
        # after the others, unless it looks for unused parameters (as torchft's own DDP wrapper does).
        super().__init__(timeout=timeout, find_unused_parameters=True)
        self.lighthouse = lighthouse
        self.replica_id = replica_id
        self.replica_groups = replica_groups
        self.min_replicas = min_replicas
        self.timeout, self.quorum_timeout, self.connect_timeout = timeout, quorum_timeout, connect_timeout
        self.manager: Any = None
        self.discarded_steps = 0
        self.groups = 1
        self.share: tuple[int, int] | None = None  # (readers, this process's reader) of the global order, in a fit
        self.batch_start = data.BatchStart()
        self.peer_state: PeerState | None = None
        self._store: Any = None
        self._loaded_manager_state: dict[str, int] | None = None  # a resumed checkpoint's, until training starts
        self._await_every_group = False  # resumed from disk: the first step waits for a quorum of every group

    def setup(self, trainer: Trainer) -> None:
        if trainer.num_nodes != 1:
            raise ValueError(
                f"TorchFTStrategy: a replica group's processes on one node (trainer.num_nodes 1, got "
                f"{trainer.num_nodes}); on Slurm, one group per node: slurm/train_torchft.sbatch"
            )
        if trainer.training:
            module = trainer.lightning_module
            if not module.automatic_optimization or trainer.accumulate_grad_batches != 1:
                raise ValueError(
                    "TorchFTStrategy: automatic optimization without gradient accumulation only "
                    "(accumulate_grad_batches 1)"
                )
            self.groups = self.replica_groups or int(os.environ.get(REPLICA_GROUPS_ENV, "1"))
            index = data.group_index(self._replica_id(), self.groups)
            self.share = (self.groups * self.world_size, index * self.world_size + self.global_rank)
            self.peer_state = PeerState(trainer, self.batch_start)
            self.manager = self._manager(trainer)
        super().setup(trainer)
        # In a fit, the backward averages each gradient across the quorum's groups: one process, in torchft's DDP
        # (compat.fault_tolerant_ddp); W, in the hook of the DDP over the group's processes (group_then_quorum).
        if self.manager is not None:
            assert self.model is not None
            if self.one_process:
                self.model = compat.fault_tolerant_ddp(self.manager, self.model)
            else:
                assert isinstance(self.model, DistributedDataParallel)
                self.model.register_comm_hook((self.manager, self.world_size), group_then_quorum)

    def _manager(self, trainer: Trainer) -> Any:
        """torchft's manager of this process: the group's store (:meth:`_group_store`), gloo across the groups, the
        peer state registered for healing, the quorum started by :meth:`optimizer_step` (not asynchronously: a heal
        lands before the forward)."""
        from torchft import Manager, ProcessGroupGloo

        lighthouse = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not lighthouse:
            raise ValueError(
                f"TorchFTStrategy: no lighthouse: give strategy.init_args.lighthouse or ${LIGHTHOUSE_ENV} "
                "(python -m lit_ddp.ft.launch sets it)"
            )
        replica_id = self._replica_id()
        on_loopback = loopback.is_loopback(lighthouse.split("://")[-1].rsplit(":", 1)[0])
        if on_loopback:
            loopback.use_loopback_interface()  # gloo's connections between the groups on loopback
        store_addr, store_port = self._group_store(on_loopback)
        compat.weights_only_transport()  # a peer's state is tensors and plain data: nothing of it may run code
        assert self.peer_state is not None
        manager = Manager(
            pg=ProcessGroupGloo(timeout=self.timeout),
            load_state_dict=self.peer_state.load_state_dict,
            state_dict=self.peer_state.state_dict,
            min_replica_size=self.min_replicas,
            use_async_quorum=False,
            timeout=self.timeout,
            quorum_timeout=self.quorum_timeout,
            connect_timeout=self.connect_timeout,
            rank=self.global_rank,
            world_size=self.world_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=lighthouse,
            replica_id=replica_id,
        )
        rank_zero_info(
            f"torchft: replica group {replica_id!r} of {self.groups} ({self.world_size} process(es), share "
            f"{data.group_index(replica_id, self.groups)} of each global batch), lighthouse {lighthouse}"
        )
        return manager

    def _group_store(self, on_loopback: bool) -> tuple[str, int]:
        """The group's TCPStore, where its processes' managers meet and whose address the quorum hands the other
        groups (their all-reduce's rendezvous): served by rank 0, on loopback when the lighthouse is (one machine),
        else on every interface under this host's name; its address sent to the group's other ranks."""
        address: list[Any] = [None]
        if self.global_rank == 0:
            if on_loopback:
                self._store = loopback.store(0, None, True, wait_for_workers=False)
                address = [(loopback.LOOPBACK, self._store.port)]
            else:
                self._store = dist.TCPStore(socket.gethostname(), 0, None, True, wait_for_workers=False)
                address = [(socket.gethostname(), self._store.port)]
        if not self.one_process:
            dist.broadcast_object_list(address, src=0)
        return address[0]

    def _replica_id(self) -> str:
        return self.replica_id or os.environ.get(REPLICA_ENV) or "group_0"

    def process_dataloader(self, dataloader: object) -> object:
        """A train loader's ``GlobalOrderSampler`` made this group's reader of the global order (before Lightning
        reads the loader's length)."""
        if self.share is not None:
            data.share(dataloader, *self.share)
        return super().process_dataloader(dataloader)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Lightning's, with the manager's committed steps and batches in the checkpoint (:data:`CHECKPOINT_KEY`)."""
        if self.manager is not None:
            checkpoint[CHECKPOINT_KEY] = self.manager.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's; the manager's state in it is kept for :meth:`on_train_start`."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._loaded_manager_state = checkpoint.get(CHECKPOINT_KEY)
        return checkpoint

    def on_train_start(self) -> None:
        """Checks that every train loader shares the global batches, marks where the first batch starts and, on a
        resume from disk, sets the manager's committed steps to the restored ``global_step`` (and its committed
        batches to the checkpoint's; none counted where a checkpoint was written without torchft), before the
        first quorum compares the groups' steps."""
        super().on_train_start()
        if self.manager is not None:
            assert self.lightning_module is not None
            trainer = self.lightning_module.trainer
            data.check_train_loaders(trainer)
            self.batch_start.mark(trainer)
            saved, self._loaded_manager_state = self._loaded_manager_state, None
            if trainer.ckpt_path is not None:
                batches = (saved or {}).get("batches_committed", 0)
                self.manager.load_state_dict({"step": trainer.global_step, "batches_committed": batches})
                self._await_every_group = True
                rank_zero_info(f"torchft: the manager resumes at step {trainer.global_step} ({trainer.ckpt_path})")

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's, on the batch a heal in this step read (this group's share of its peer's batch, with its
        index) where there is one, in place of the one the loop fetched from this group's stale position."""
        healed = self.peer_state.take_batch() if self.peer_state is not None else None
        if healed is not None:
            batch, batch_idx = healed
            if len(args) >= 2:  # Lightning passes (batch, batch_idx[, dataloader_idx])
                args = (batch, batch_idx, *args[2:])
            else:
                kwargs.update(batch=batch, batch_idx=batch_idx)
        return super().training_step(*args, **kwargs)

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """The quorum (and a heal), Lightning's closure, then the optimizer's step where the quorum commits; a
        discarded step is uncounted and its batch read again at the next step."""
        if self.manager is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        self.manager.start_quorum()  # heals here, where the quorum says so (PeerState.load_state_dict)
        if self._await_every_group:
            self._quorum_of_every_group()
        loss = closure()
        if not self.manager.should_commit():
            self.discarded_steps += 1
            assert self.lightning_module is not None
            trainer = self.lightning_module.trainer
            # Lightning completes the step (and counts a batch that stepped) after this returns: count one less.
            compat.set_optimizer_steps(trainer, compat.optimizer_steps(trainer) - 1)
            compat.set_batches_that_stepped(trainer, compat.batches_that_stepped(trainer) - 1)
            self.batch_start.rewind(trainer)
            rank_zero_info(f"torchft: step {trainer.global_step + 1} discarded by the quorum; its batch is read again")
            return loss
        stepped = super().optimizer_step(optimizer, lambda: loss, model, **kwargs)
        assert self.lightning_module is not None
        self.batch_start.mark(self.lightning_module.trainer)  # the next batch starts here
        return stepped

    def _quorum_of_every_group(self) -> None:
        """Asks for the quorum again until every group is in it (a group resumed from disk, before its first step),
        for at most ``quorum_timeout``; then the step goes on with the groups there."""
        groups, self._await_every_group = self.groups, False
        deadline = time.monotonic() + self.quorum_timeout.total_seconds()
        while self.manager.num_participants() < groups and time.monotonic() < deadline:
            time.sleep(QUORUM_RETRY_S)
            self.manager.start_quorum()
        rank_zero_info(f"torchft: first quorum after the resume: {self.manager.num_participants()} of {groups} groups")

    def teardown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
        super().teardown()
