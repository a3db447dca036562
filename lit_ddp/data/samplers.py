"""The train sampler whose order does not depend on the world size, and whose position a checkpoint restores
exactly on any number of processes.

The idea is Megatron-LM's ``MegatronPretrainingSampler`` (``megatron/legacy/data/data_samplers.py``): the
loader state is the number of samples the whole job has consumed, not each rank's own count. Built on
torchdata's ``StatefulDistributedSampler`` (the ``StatefulDataLoader`` protocol: ``state_dict`` /
``load_state_dict``, saved and restored with the loader's state), which it extends, so Lightning injects no
sampler of its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import Dataset
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler


class GlobalOrderSampler(StatefulDistributedSampler):
    """One permutation per epoch, shuffled by ``(seed, epoch)`` only, read in the same global order on any
    number of processes.

    Under DDP rank ``r`` of ``W`` takes every ``W``-th index of the epoch's permutation ``perm``, from the
    position where the job stands, so the union of the ranks' batches at step ``s`` is the contiguous slice
    ``perm[s*W*B : (s+1)*W*B]``: the same slice one process with batch ``W*B`` takes at step ``s``. The
    checkpointed state is ``{"epoch", "consumed"}``, where ``consumed`` counts the samples the whole job has
    drawn in the epoch. A run stopped on ``W`` processes therefore continues on ``W'`` from the same sample,
    and with ``W*B == W'*B'`` with the same global batches. With another global batch no sample is lost or
    repeated either, but the batches are cut differently, so an epoch has another number of optimizer steps
    (and an LR schedule by steps ends at another sample); a warning says so once.

    For one process and for ``W`` processes the index streams are those of torch's ``DistributedSampler``
    with the same seed and ``drop_last=True``: the last ``len(dataset) mod W`` samples of each epoch's
    permutation are left out so that every rank takes as many.

    Args:
        dataset: the map-style training dataset.
        num_replicas: the world size ``W``; None: from the process group (1 without one).
        rank: this process's rank; None: from the process group (0 without one).
        shuffle: a new permutation every epoch; False keeps the dataset order.
        seed: the permutation's seed (the same on every rank); None: ``seed_everything``'s (``PL_GLOBAL_SEED``).
    """

    _CONSUMED = "consumed"
    _EPOCH = "epoch"
    _WORLD_SIZE = "world_size"

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int | None = None,
    ) -> None:
        in_group = dist.is_available() and dist.is_initialized()
        num_replicas = num_replicas if num_replicas is not None else dist.get_world_size() if in_group else 1
        rank = rank if rank is not None else dist.get_rank() if in_group else 0
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else seed
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.start = 0  # global samples of this epoch consumed before the current iterator began
        self._resume: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        self.start = self._resume_position()
        self.yielded = 0
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=generator)
        else:
            order = torch.arange(n)
        end = self.start + (n - self.start) // self.num_replicas * self.num_replicas
        for index in order[self.start + self.rank : end : self.num_replicas].tolist():
            self.yielded += 1
            yield index

    def __len__(self) -> int:
        """Indices of a whole epoch for this rank (the loop counts batches of whole epochs)."""
        return len(self.dataset) // self.num_replicas

    def _resume_position(self) -> int:
        resume, self._resume = self._resume, None
        if resume is None or resume[self._EPOCH] != self.epoch:
            return 0  # a fresh epoch (a checkpoint written at an epoch's end resumes into the next one)
        saved_world = resume.get(self._WORLD_SIZE, self.num_replicas)
        if saved_world != self.num_replicas:
            rank_zero_warn(
                f"Resuming on {self.num_replicas} process(es) from a checkpoint of {saved_world}: the data continues "
                f"from sample {resume[self._CONSUMED]} of epoch {self.epoch} in the same global order. The steps "
                "draw the same samples only if processes x batch_size is unchanged; otherwise no sample is lost "
                "or repeated, but batches and the number of steps per epoch differ.",
            )
        return min(int(resume[self._CONSUMED]), len(self.dataset))

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "consumed", "world_size"}``: the global position, valid for any world size."""
        return {
            self._EPOCH: self.epoch,
            self._CONSUMED: self.start + self.yielded * self.num_replicas,
            self._WORLD_SIZE: self.num_replicas,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict["consumed"]`` at the next ``iter()`` of the same epoch.

        Raises:
            ValueError: not a state of this sampler (e.g. a per-rank ``{"yielded": ...}`` of torchdata's
                ``StatefulDistributedSampler``, whose position cannot be mapped to a global one).
        """
        if self._CONSUMED not in state_dict or self._EPOCH not in state_dict:
            raise ValueError(
                f"not a {type(self).__name__} state (keys {sorted(state_dict)}); the checkpoint was written by "
                "another sampler: resume it with the lit_ddp version that wrote it, or start a new run"
            )
        if int(state_dict[self._CONSUMED]) < 0:
            raise ValueError(f"consumed={state_dict[self._CONSUMED]} must be >= 0")
        self._resume = dict(state_dict)


def resumable_sampler(dataset: Dataset, shuffle: bool = True) -> GlobalOrderSampler:
    """The train sampler of both tasks (DDP's ``DistributedSampler`` role): a :class:`GlobalOrderSampler` for this
    process's rank and world size, seeded by ``seed_everything``. Call it in ``train_dataloader``, once Lightning
    has set up the process group; its position is part of the ``StatefulDataLoader``'s state."""
    return GlobalOrderSampler(dataset, shuffle=shuffle)
