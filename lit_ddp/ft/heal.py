"""What a replica group that (re)joins the quorum takes from a live peer: :class:`PeerState`.

torchft's manager asks a state function of the peer it heals from and hands the result to a load function on the
healing group, both registered once (``Manager.register_state_dict_fn``). :class:`PeerState` is that pair for a
Lightning fit, and a heal is a resume in memory: the peer sends the training state a checkpoint file holds (the same
dictionary, :func:`lit_ddp.resilience.state.capture`, taken at the start of the step), and the healing group puts it
back at one point, in a resume's steps, checked by a resume's restore check (:func:`lit_ddp.resilience.state.take`).
The heal arrives inside the healing group's step, after its loop fetched a batch from its own position: the loaders
are set to the start of the peer's batch and the step trains this group's share of it (:mod:`lit_ddp.ft.data`).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer

from lit_ddp import compat
from lit_ddp.ft.data import BatchStart
from lit_ddp.resilience import state


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
        """The fit's state at the start of the step under way (called on the peer, in torchft's quorum thread, while
        its main thread waits for the quorum): the checkpoint dictionary a save would write now, this rank's
        loaders at the start of the step, and the loop's counts there."""
        trainer = self.trainer
        start = self.batch_start.state(trainer)
        in_step = {
            "optimizer_steps": compat.optimizer_steps(trainer),
            "batches_that_stepped": compat.batches_that_stepped(trainer),
            "progress": compat.loop_progress(trainer),
            "epoch": start["epoch"],
        }
        return state.capture(trainer, start["loaders"], in_step)

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Puts a peer's :meth:`state_dict` into this fit, at the start of a step (before its forward), in a resume's
        steps (:func:`lit_ddp.resilience.state.take`); its position step sets the loop's step and batch counts to the
        peer's and the train loaders to the start of the peer's batch, and reads this group's share of it
        (:meth:`take_batch`).

        Raises:
            RestoreMismatchError: what was put back differs from what the peer sent, bit for bit (a loading bug, a
                hook that edits the state).
        """
        trainer = self.trainer

        def position(in_step: dict[str, Any]) -> None:
            compat.set_optimizer_steps(trainer, int(in_step["optimizer_steps"]))
            compat.set_batches_that_stepped(trainer, int(in_step["batches_that_stepped"]))
            start = {"epoch": in_step["epoch"], "loaders": in_step["loaders"]}
            self.batch = self.batch_start.heal(trainer, start, in_step["progress"])

        state.take(trainer, checkpoint, position, source="a peer group")

    def take_batch(self) -> tuple[Any, int] | None:
        """The batch a heal read for the step under way and its index in the epoch (None where this step did not
        heal), once."""
        batch, self.batch = self.batch, None
        return batch
