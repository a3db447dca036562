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
from lit_ddp.errors import LitDDPError, UsageError
from lit_ddp.ft import data, membership, transport
from lit_ddp.ft.heal import PeerState
from lit_ddp.ft.progress import PROGRESS_ENV, ProgressWriter
from lit_ddp.launch import secret
from lit_ddp.strategies import DDPStrategy, loopback

EXTRA = 'torchft is not installed: pip install -e ".[torchft]" (the torchft extra)'
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
REPLICA_ENV = "REPLICA_GROUP_ID"
REPLICA_GROUPS_ENV = "TORCHFT_REPLICA_GROUPS"
MIN_REPLICAS_ENV = "TORCHFT_MIN_REPLICAS"
"""The launcher's ``--min_replicas`` (the sbatch's ``MIN_REPLICAS``), which its lighthouse has too: one source."""
COLD_START_ENV = "TORCHFT_COLD_START"
"""``1`` on the first start of every group of a job (the launcher's, the sbatch's), unset on a group's restart."""
CHECKPOINT_KEY = "torchft"
"""Where a checkpoint holds the manager's ``state_dict()`` (its committed steps and batches)."""
QUORUM_RETRY_S = 0.2  # between a step's quorums while it waits for its quorum to settle
NO_PEER_EXIT = 3
"""The exit status of a restarted group that found no live group to heal from (:class:`NoLivePeer`)."""


class NoLivePeer(LitDDPError):
    """A restarted replica group found no live group to heal from within ``quorum_timeout``: it exits without
    training (it would train alone on a stale state). Exit status :data:`NO_PEER_EXIT`."""

    exit_code = NO_PEER_EXIT


class QuorumNotSettled(RuntimeError):
    """A step's quorum did not settle (an intruder in it, a member's heal failed, a group missing at a cold start)
    within ``quorum_timeout``: reported to the manager, so that the step is not committed."""


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
        min_replicas: the fewest groups a step commits with; None: ``$TORCHFT_MIN_REPLICAS`` (the launcher's
            ``--min_replicas``, which its lighthouse has too), else 1. Given and different from that: refused.
        max_retries: how many steps in a row may be discarded before the group stops with one line (an impossible
            quorum: torchft's ``max_retries``).
        quorum_retries: how many times a quorum request is sent again where the lighthouse does not answer (it
            restarts: torchft's ``quorum_retries``).
        timeout: the cross-group all-reduce's, ``should_commit``'s and the live-state transfer's: what a frozen
            (not dead) peer can cost the others; also the group's own process group's (W > 1).
        quorum_timeout: how long a step waits for its quorum (more than a step takes, and more than the
            lighthouse's join timeout); also how long a group resumed from disk waits for every group at its first
            step.
        connect_timeout: to reach the lighthouse and a peer's manager.

    Raises:
        UsageError: torchft is not installed; at set-up, no job secret (``$LIT_DDP_JOB_SECRET``: the launcher and the
            sbatch create it), or ``min_replicas`` above the number of groups or not the launcher's; in a step,
            ``training_step`` returned None (Lightning's skip: the group would not join the step's all-reduce).
        ValueError: at set-up, a group over several nodes (``trainer.num_nodes`` > 1), manual optimization, or
            gradient accumulation, or a replica id that is not ``group_<i>`` with ``i`` below the number of groups;
            at the start of training, a train loader without a ``GlobalOrderSampler``.
        NoLivePeer: a restarted group found no live group to heal from at its first step.
        LitDDPError: ``max_retries`` steps in a row discarded.
    """

    def __init__(
        self,
        lighthouse: str | None = None,
        replica_id: str | None = None,
        replica_groups: int | None = None,
        min_replicas: int | None = None,
        max_retries: int = 10,
        quorum_retries: int = 5,
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
        self.max_retries, self.quorum_retries = max_retries, quorum_retries
        self.timeout, self.quorum_timeout, self.connect_timeout = timeout, quorum_timeout, connect_timeout
        self.manager: Any = None
        self.discarded_steps = 0
        self.groups = 1
        self.share: tuple[int, int] | None = None  # (readers, this process's reader) of the global order, in a fit
        self.batch_start = data.BatchStart()
        self.peer_state: PeerState | None = None
        self._store: Any = None
        self._loaded_manager_state: dict[str, int] | None = None  # a resumed checkpoint's, until training starts
        self._first_step = True  # a cold start waits for every group there; a restart for a live peer
        self._proof: membership.QuorumProof | None = None
        self._progress: ProgressWriter | None = None
        self._rng: tuple[Any, ...] | None = None  # the RNG streams at the start of the step under way
        self._discarded = False  # the step under way was discarded: its per-batch schedulers do not step
        self._refused: str | None = None  # the last heal refusal printed
        self._intruded: int | None = None  # the last quorum found to hold an intruder (printed once)

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
            self.min_replicas = self._min_replicas()
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
        from torchft import Manager

        lighthouse = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not lighthouse:
            raise ValueError(
                f"TorchFTStrategy: no lighthouse: give strategy.init_args.lighthouse or ${LIGHTHOUSE_ENV} "
                "(python -m lit_ddp.ft.launch sets it)"
            )
        job_secret = secret.job_secret()
        if job_secret is None:
            raise UsageError(
                f"TorchFTStrategy: no job secret (${secret.SECRET_ENV}), with which the groups tell each other from "
                "anyone else who reaches the lighthouse: start them with python -m lit_ddp.ft.launch or "
                "slurm/train_torchft.sbatch (both create it), or export one secret to every group yourself"
            )
        replica_id = self._replica_id()
        self._await_lighthouse(lighthouse)
        address = transport.own_address(lighthouse)  # every server of this process listens there only
        if address == loopback.LOOPBACK:
            loopback.use_loopback_interface()  # gloo's connections between the groups on loopback
        store_addr, store_port = self._group_store(address)
        compat.bind_manager_server(address)
        transport.quiet_refused_heals()
        pg = membership.quorum_gloo(self.timeout)
        self._proof = membership.QuorumProof(pg, job_secret, self.global_rank)
        assert self.peer_state is not None
        manager = Manager(
            pg=pg,
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
            hostname=address,
            checkpoint_transport=transport.SignedTransport(
                job_secret, address, self.timeout, f"{replica_id} rank {self.global_rank}"
            ),
            max_retries=self.max_retries,
            quorum_retries=self.quorum_retries,
        )
        rank_zero_info(
            f"torchft: replica group {replica_id!r} of {self.groups} ({self.world_size} process(es), share "
            f"{data.group_index(replica_id, self.groups)} of each global batch), lighthouse {lighthouse}"
        )
        return manager

    def _await_lighthouse(self, lighthouse: str) -> None:
        """Waits until the lighthouse accepts connections (for at most ``connect_timeout``): the launcher starts it
        beside the groups, and restarts it where it dies; then torchft's manager connects.

        Raises:
            LitDDPError: nothing listens at ``lighthouse`` within ``connect_timeout`` (a launcher may start the group
                again).
        """
        host, port = lighthouse.split("://")[-1].rstrip("/").rsplit(":", 1)
        deadline = time.monotonic() + self.connect_timeout.total_seconds()
        while True:
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise LitDDPError(
                        f"TorchFTStrategy: no lighthouse answers at {lighthouse} within connect_timeout "
                        f"{self.connect_timeout} (python -m lit_ddp.ft.launch starts one and prints its address)"
                    ) from None
                time.sleep(0.1)

    def _group_store(self, host: str) -> tuple[str, int]:
        """The group's TCPStore, where its processes' managers meet and whose address the quorum hands the other
        groups (their all-reduce's rendezvous): served by rank 0 on this process's address only (``host``: loopback
        when the lighthouse is); its address sent to the group's other ranks."""
        address: list[Any] = [None]
        if self.global_rank == 0:
            self._store = loopback.store(0, None, True, wait_for_workers=False, host=host)
            address = [(host, self._store.port)]
        if not self.one_process:
            dist.broadcast_object_list(address, src=0)
        return address[0]

    def _min_replicas(self) -> int:
        """The one ``min_replicas`` (the lighthouse's and the manager's).

        Raises:
            UsageError: the strategy's differs from ``$TORCHFT_MIN_REPLICAS``, or it is not in ``[1, groups]``.
        """
        launcher = os.environ.get(MIN_REPLICAS_ENV)
        value = self.min_replicas if self.min_replicas is not None else int(launcher or 1)
        if launcher is not None and int(launcher) != value:
            raise UsageError(
                f"TorchFTStrategy: strategy.init_args.min_replicas {value} is not the launcher's --min_replicas "
                f"{launcher} (its lighthouse's): give it once, to the launcher"
            )
        if not 1 <= value <= self.groups:
            raise UsageError(
                f"TorchFTStrategy: min_replicas {value} must be between 1 and the {self.groups} replica groups: "
                "no quorum could ever commit a step"
            )
        return value

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
        first quorum compares the groups' steps. Then the group's progress record (rank 0, where the launcher asks
        for one: :mod:`lit_ddp.ft.progress`), and per-batch schedulers held still in a discarded step."""
        super().on_train_start()
        if self.manager is not None:
            assert self.lightning_module is not None
            trainer = self.lightning_module.trainer
            data.check_train_loaders(trainer)
            self._mark(trainer)
            saved, self._loaded_manager_state = self._loaded_manager_state, None
            if trainer.ckpt_path is not None:
                batches = (saved or {}).get("batches_committed", 0)
                self.manager.load_state_dict({"step": trainer.global_step, "batches_committed": batches})
                rank_zero_info(f"torchft: the manager resumes at step {trainer.global_step} ({trainer.ckpt_path})")
            path = os.environ.get(PROGRESS_ENV)
            if path and self.global_rank == 0:
                self._progress = ProgressWriter(path, str(trainer.default_root_dir))
                self._progress.write(trainer.global_step)
            self._hold_schedulers_in_discarded_steps(trainer)

    def _hold_schedulers_in_discarded_steps(self, trainer: Trainer) -> None:
        """Lightning steps a per-batch scheduler after every batch, its optimizer stepped or not: in a discarded
        step the module's ``lr_scheduler_step`` hook (through which Lightning steps them) passes over those."""
        module = trainer.lightning_module
        step_scheduler = module.lr_scheduler_step
        per_batch = [c.scheduler for c in trainer.lr_scheduler_configs if c.interval == "step"]

        def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
            if not (self._discarded and any(scheduler is s for s in per_batch)):
                step_scheduler(scheduler, metric)

        module.lr_scheduler_step = lr_scheduler_step  # type: ignore[method-assign]

    def _mark(self, trainer: Trainer) -> None:
        """Between two steps: the next batch and its RNG streams start here (a discarded step goes back to both)."""
        self.batch_start.mark(trainer)
        self._rng = self._rng_streams()

    def _rng_streams(self) -> tuple[Any, ...]:
        """torch's RNG streams of this process (its CPU generator, this device's CUDA generator), taken at every step
        (a few microseconds). numpy's and Python's are not: their state copies cost 20 to 60 times as much, a few
        percent of a small model's step, and a step draws from torch's (dropout, sampling); the loaders' orders come
        from :class:`~lit_ddp.data.samplers.GlobalOrderSampler`, seeded by epoch."""
        cuda = torch.cuda.get_rng_state(self.root_device) if self.root_device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def _put_back_rng(self, streams: tuple[Any, ...]) -> None:
        cpu, cuda = streams
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.root_device)

    def on_train_end(self) -> None:
        """The progress record says the group finished; the record's cost, in one line."""
        super().on_train_end()
        if self._progress is not None and self.manager is not None:
            self._progress.write(self.manager.current_step(), finished=True)
            per_step = self._progress.seconds / max(1, self._progress.writes)
            rank_zero_info(
                f"torchft: group {self._replica_id()!r} finished at step {self.manager.current_step()} "
                f"({self.discarded_steps} step(s) discarded); its progress record {per_step * 1e6:.0f} us a step"
            )

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
        """The quorum (and a heal) until it settles (:meth:`_settle_quorum`), Lightning's closure, then the
        optimizer's step where the quorum commits; a discarded step is uncounted, its batch read again at the next
        step, its RNG streams and per-batch schedulers as before it."""
        if self.manager is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        self._discarded = False
        self.manager.start_quorum()  # heals here, where the quorum says so (PeerState.load_state_dict)
        self._settle_quorum()
        if self.peer_state is not None and self.peer_state.batch is not None:
            self._rng = self._rng_streams()  # healed: the peer's streams are the step's start
        loss = closure()
        if loss is None:
            raise UsageError(
                f"TorchFTStrategy: training_step returned None at step {trainer.global_step} (Lightning's skip): "
                "under torchft every group joins each step's all-reduce; return the loss (times 0 to skip a batch)"
            )
        try:
            commit = self.manager.should_commit()
        except RuntimeError as e:  # torchft's max_retries
            raise LitDDPError(
                f"torchft: {self.max_retries + 1} steps in a row discarded at step {trainer.global_step} "
                f"(strategy.init_args.max_retries {self.max_retries}): no quorum of min_replicas "
                f"{self.min_replicas} group(s) commits ({e})"
            ) from None
        if not commit:
            self.discarded_steps += 1
            self._discarded = True
            # Lightning completes the step (and counts a batch that stepped) after this returns: count one less.
            compat.set_optimizer_steps(trainer, compat.optimizer_steps(trainer) - 1)
            compat.set_batches_that_stepped(trainer, compat.batches_that_stepped(trainer) - 1)
            self.batch_start.rewind(trainer)
            if self._rng is not None:
                self._put_back_rng(self._rng)
            rank_zero_info(f"torchft: step {trainer.global_step + 1} discarded by the quorum; its batch is read again")
            return loss
        stepped = super().optimizer_step(optimizer, lambda: loss, model, **kwargs)
        self._mark(trainer)  # the next batch starts here
        if self._progress is not None:
            self._progress.write(self.manager.current_step())
        return stepped

    def _settle_quorum(self) -> None:
        """Asks for the step's quorum again (every :data:`QUORUM_RETRY_S`, for at most ``quorum_timeout``) until it
        is one the step can go on with: at a cold start's first step, every group there; at a restarted group's
        first step, another group there (nothing else would stop it training alone on a stale state); in a new
        quorum, every member holding the job's secret and its heal done (:class:`~lit_ddp.ft.membership.QuorumProof`).
        Each process's answer is agreed within the group and the deadline is rank 0's, so that its processes ask
        for as many quorums. Not settled in time: the step is not committed, or a restarted group alone raises
        :class:`NoLivePeer`."""
        first, self._first_step = self._first_step, False
        if not first and (self._proof is None or not self._proof.needed()):  # a quiet step, alike on every process
            self._say_refused()
            return
        cold = first and os.environ.get(COLD_START_ENV) == "1"
        deadline = time.monotonic() + self.quorum_timeout.total_seconds()
        waited = False
        while True:
            settled, why = self._quorum_settled(every_group=cold and not waited, a_peer=first and not cold)
            settled, stop = self._agree(settled, time.monotonic() > deadline)
            if settled:
                break
            if stop and cold and not waited:  # not every group came: go on with those there
                waited, deadline = True, time.monotonic() + self.quorum_timeout.total_seconds()
                continue
            if stop:
                break
            time.sleep(QUORUM_RETRY_S)
            self.manager.start_quorum()
        if cold:
            rank_zero_info(
                f"torchft: first quorum of the job: {self.manager.num_participants()} of {self.groups} groups"
            )
        if settled:
            return
        if why == "alone":
            raise NoLivePeer(
                f"torchft: {self._replica_id()} came back and found no live group to heal from within "
                f"quorum_timeout {self.quorum_timeout} (the others finished or are down): it exits without training"
            )
        self.manager.report_error(QuorumNotSettled(why))

    def _quorum_settled(self, every_group: bool, a_peer: bool) -> tuple[bool, str]:
        """Whether this process's quorum now is one the step can go on with (:meth:`_settle_quorum`), and why not;
        ``every_group``, ``a_peer``: whether it must hold every group, or another group."""
        participants = self.manager.num_participants()
        if every_group and participants < self.groups:
            return False, "waiting for every group"
        if a_peer and self.groups > 1 and participants < 2:
            return False, "alone"
        error = self._say_refused()
        if self._proof is None or not self._proof.needed():
            return True, ""  # an error now discards the step, as torchft does
        verdict = self._proof.prove(healthy=error is None)
        if verdict is None:
            return False, "the quorum's proof of membership failed (a member gone)"
        if not verdict.members:
            if self._intruded == self._proof.pg.quorum:
                return False, "a member without the job's secret"
            self._intruded = self._proof.pg.quorum
            print(
                f"torchft: quorum {self._proof.pg.quorum} ({verdict.size} members) holds a process without this job's "
                f"secret: no step commits in it, no state goes to it or comes from it ({self._replica_id()} rank "
                f"{self.global_rank})",
                flush=True,
            )
            return False, "a member without the job's secret"
        if not verdict.ready:
            return False, f"{verdict.size - verdict.healthy} member(s) failed to heal"
        return True, ""

    def _say_refused(self) -> Any:
        """The manager's error in this step, if any, its line printed where it is a refused heal (once each)."""
        error = self.manager.errored()
        if error is not None:
            cause = getattr(error, "original_exception", error)
            if isinstance(cause, transport.HealRefused) and str(cause) != self._refused:
                self._refused = str(cause)
                print(cause, flush=True)  # every rank its own: the heal is per rank
        return error

    def _agree(self, settled: bool, late: bool) -> tuple[bool, bool]:
        """(every process of the group settled, rank 0 is past its deadline), the same on every process."""
        if self.one_process:
            return settled, late
        votes = torch.tensor([0 if settled else 1, 1 if late and self.global_rank == 0 else 0], device=self.root_device)
        dist.all_reduce(votes)
        return int(votes[0]) == 0, int(votes[1]) > 0

    def teardown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        super().teardown()
