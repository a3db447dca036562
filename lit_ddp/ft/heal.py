"""What a replica group that (re)joins the quorum takes from a live peer: :class:`PeerState`.

torchft's manager asks a state function of the peer it heals from and hands the result to a load function on the
healing group, both registered once (``Manager.register_state_dict_fn``). :class:`PeerState` is that pair for a
Lightning fit: the training state a resume from disk restores (module, optimizers, schedulers, the loop's position
and the train loaders', RNG streams, metric sums; :class:`lit_ddp.resilience.restore.ResumeState`'s helpers for the
last two), taken live, put back at one point, at the start of the step the groups then take together. The heal
arrives inside the healing group's step, after its loop fetched a batch from its own position: the loaders are set
to the start of the peer's batch and the step trains this group's share of it (:mod:`lit_ddp.ft.data`). Then the
restore check of a resume compares what was put back with what the peer sent (:mod:`lit_ddp.resilience.restore_check`).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer

from lit_ddp import compat
from lit_ddp.errors import RestoreMismatchError
from lit_ddp.ft.data import BatchStart
from lit_ddp.resilience import restore, restore_check


class PeerState:
    """The state of one replica group's fit that a healing group takes from it.

    Args:
        trainer: the fit's Trainer (its strategy holds the optimizers, its loop the position).
        batch_start: where the batch of the step under way began (the strategy marks it between steps).
    """

    def __init__(self, trainer: Trainer, batch_start: BatchStart) -> None:
        self.trainer = trainer
        self.batch_start = batch_start
        self.batch: tuple[Any, int] | None = None  # a healed step's batch and its index, until the step takes it

    def state_dict(self) -> dict[str, Any]:
        """The fit's state now, at the start of a step (called on the peer, in torchft's quorum thread, while its
        main thread waits for the quorum)."""
        trainer = self.trainer
        module = trainer.lightning_module
        return {
            "module": module.state_dict(),
            "optimizers": [opt.state_dict() for opt in trainer.optimizers],
            "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "loop": {
                "optimizer_steps": compat.optimizer_steps(trainer),
                "batches_that_stepped": compat.batches_that_stepped(trainer),
                "progress": compat.loop_progress(trainer),
            },
            "data": self.batch_start.state(trainer),
            "rng": restore.capture_rng(trainer.strategy.root_device),
            "metrics": restore.metric_states(module),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Puts a peer's :meth:`state_dict` into this fit, at the start of a step (before its forward): module,
        optimizers, schedulers, the loop's step, epoch and batch counts, the train loaders at the start of the peer's
        batch and this group's share of it read (:meth:`take_batch`), the metrics' running sums, then the RNG
        streams (last: reading the batch may draw from them); then the restore check.

        Raises:
            RestoreMismatchError: the global step, a scheduler, the RNG streams, a parameter or an optimizer's state
                put back differs from the peer's, bit for bit (a loading bug, a hook that edits the state).
        """
        trainer = self.trainer
        module = trainer.lightning_module
        module.load_state_dict(state["module"])
        for opt, saved in zip(trainer.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(saved)
        for config, saved in zip(trainer.lr_scheduler_configs, state["schedulers"], strict=True):
            config.scheduler.load_state_dict(saved)
        compat.set_optimizer_steps(trainer, int(state["loop"]["optimizer_steps"]))
        compat.set_batches_that_stepped(trainer, int(state["loop"]["batches_that_stepped"]))
        self.batch = self.batch_start.heal(trainer, state["data"], state["loop"]["progress"])
        if state["metrics"]:
            restore.restore_metric_states(module, state["metrics"])
        restore.restore_rng(state["rng"], trainer.strategy.root_device, trainer.local_rank)
        self.check(state)

    def check(self, state: dict[str, Any]) -> None:
        """The restore check of a heal, on this process: ``state`` (the peer's) against the live state. Not
        collective: a group's processes heal at the same step, and a mismatch ends the process that found it, which
        its group's launcher starts again."""
        trainer = self.trainer
        module = trainer.lightning_module
        sent = {
            "global_step": int(state["loop"]["optimizer_steps"]),
            "lr_schedulers": state["schedulers"],
            "state_dict": state["module"],
            "optimizer_states": state["optimizers"],
        }
        tensors = restore_check.plain_tensors(module)
        promised = restore_check.promised(sent, state["rng"], tensors=tensors)
        live = restore_check.restored(trainer, module, restore.capture_rng(trainer.strategy.root_device), tensors)
        if (name := restore_check.first_mismatch(promised, live)) is not None:
            raise RestoreMismatchError(
                f"torchft heal: the state put back differs from the one a peer group sent, first at {name} "
                f"(rank {trainer.global_rank}): the load went wrong or something changed the state; nothing was trained"
            )

    def take_batch(self) -> tuple[Any, int] | None:
        """The batch a heal read for the step under way and its index in the epoch (None where this step did not
        heal), once."""
        batch, self.batch = self.batch, None
        return batch
