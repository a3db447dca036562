"""The data across torchft's replica groups: each group's share of every global batch, and where a step's batch began.

- **Shares.** The R groups read one global order (:class:`lit_ddp.data.samplers.GlobalOrderSampler`, shuffled by
  seed and epoch): group ``i`` is reader ``i`` of ``R`` (:func:`share`), so a step's global batch is ``R x B``
  samples, of which group ``i`` trains samples ``i, i + R, ...``. Every group's sampler moves by the whole global
  batch at each batch it reads, whichever groups are up: the share of a group that is down is not trained, and no
  group that is up reads it.
- **A discarded step** (torchft's ``should_commit()`` False) is not counted: its batch is read again at the next
  step, by the groups then in the quorum (:meth:`BatchStart.rewind`).
- **A healed group** continues at its peer's position: the heal arrives inside the healing group's step, after its
  loop fetched a batch from its own (stale) position; the group's loop counts and loaders are set to the peer's, at
  the start of the peer's batch, and the step trains this group's share of that batch (:meth:`BatchStart.heal`).

So a group's position after ``s`` committed steps is ``s`` whole global batches into the order (by epochs), on every
group, whatever faults happened; the steps take the same global batches as an uninterrupted run's, each trained by
the groups that were up. docs/torchft.md ("A group that is down") says what it does to the batch.
"""

from __future__ import annotations

import re
from typing import Any

from lightning.pytorch import Trainer

from lit_ddp import compat
from lit_ddp.resilience.state import loader_sampler


def group_index(replica_id: str, replica_groups: int) -> int:
    """The index ``i`` of a group named ``group_<i>`` (the launcher's ``$REPLICA_GROUP_ID``; torchft too reads a
    replica's rank from its name's trailing digits).

    Raises:
        ValueError: the name ends in no number, or in one outside ``[0, replica_groups)``.
    """
    found = re.search(r"(\d+)$", replica_id)
    if found is None or int(found.group(1)) >= replica_groups:
        raise ValueError(
            f"replica group {replica_id!r}: the groups are group_0 ... group_{replica_groups - 1} "
            f"({replica_groups} groups: strategy.init_args.replica_groups or $TORCHFT_REPLICA_GROUPS)"
        )
    return int(found.group(1))


def share(dataloader: object, replica_groups: int, index: int) -> None:
    """Makes ``dataloader``'s :class:`~lit_ddp.data.samplers.GlobalOrderSampler`, if it has one (train loaders),
    reader ``index`` of ``replica_groups`` (its ``num_replicas`` and ``rank``, which it reads at every ``len()``,
    ``iter()`` and ``state_dict()``): before Lightning reads the loader's length. Other loaders stay: in evaluation
    every group scores the whole split (the groups' weights are the same)."""
    sampler = loader_sampler(dataloader)
    if sampler is not None:
        sampler.num_replicas, sampler.rank = replica_groups, index


def check_train_loaders(trainer: Trainer) -> None:
    """Raises ValueError where a train loader reads without a GlobalOrderSampler: its groups would not share the
    global batches (each would read the whole of its own order)."""
    for i, loader in enumerate(compat.train_loaders(trainer)):
        if loader_sampler(loader) is None:
            raise ValueError(
                f"TorchFTStrategy: train loader {i} has no lit_ddp.data.samplers.GlobalOrderSampler, through which "
                "each replica group reads its share of every global batch: give it "
                "`sampler=GlobalOrderSampler(dataset)`"
            )


class BatchStart:
    """Where the batch of the step under way began: the train loaders' states between the last step and this one
    (:meth:`mark`), and the epoch they were taken in. A discarded step goes back there (:meth:`rewind`); a healing
    peer starts there (:meth:`state`, :meth:`heal`)."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.loaders: list[dict[str, Any]] | None = None

    def mark(self, trainer: Trainer) -> None:
        """Between two steps (at the start of training, at the end of a step): the next batch starts here."""
        self.epoch, self.loaders = trainer.current_epoch, compat.train_loader_states(trainer)

    def state(self, trainer: Trainer) -> dict[str, Any]:
        """``{"epoch", "loaders"}``: the start of the batch under way; ``loaders`` None where it is its epoch's first
        (marked in an epoch that has ended since)."""
        epoch = trainer.current_epoch
        return {"epoch": epoch, "loaders": self.loaders if self.epoch == epoch else None}

    def rewind(self, trainer: Trainer) -> None:
        """Inside a discarded step: the batch is taken out of the loop's counts and the loaders go back to its start,
        so that the next step reads it again (the batch index, the epoch's end and the position as if it had not been
        read)."""
        start = self.state(trainer)
        compat.uncount_batch(trainer)
        read = int(compat.loop_progress(trainer)["batch"]["current"]["ready"])
        compat.reposition_train_loaders(trainer, start["loaders"], start["epoch"], read)

    def heal(self, trainer: Trainer, start: dict[str, Any], progress: dict[str, Any]) -> tuple[Any, int]:
        """Inside a healing step: the loop's epoch and batch counts set to the peer's ``progress``
        (:func:`lit_ddp.compat.loop_progress`), the loaders to the start of the peer's batch (``start``: the peer's
        :meth:`state`), and this group's share of that batch read. Returns it, prepared for the step as the loop
        prepares a batch, and its index in the epoch: the step trains it in place of the one the loop fetched."""
        compat.set_loop_progress(trainer, progress)
        read = int(progress["batch"]["current"]["ready"]) - 1  # the peer's batch under way is not read here yet
        compat.reposition_train_loaders(trainer, start["loaders"], int(start["epoch"]), read)
        self.epoch, self.loaders = int(start["epoch"]), start["loaders"]
        return compat.next_train_batch(trainer), read
