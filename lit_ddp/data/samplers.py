"""The samplers: DDP's ``DistributedSampler`` role (each rank its own shard), independent of the world size. Training:
at a position a checkpoint restores exactly on any number of processes (the idea of Megatron-LM's
``MegatronPretrainingSampler``: the state is the samples the whole job consumed); torchdata's
``StatefulDistributedSampler`` extended, so Lightning injects no sampler of its own. Evaluation: each item once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import Dataset
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler


class GlobalOrderSampler(StatefulDistributedSampler):
    """One permutation per epoch, shuffled by ``(seed, epoch)`` only: rank ``r`` of ``W`` takes every ``W``-th index
    from the job's position, so the ranks' batches at step ``s`` together are ``perm[s*W*B : (s+1)*W*B]``, what one
    process with batch ``W*B`` takes. The state is ``{"epoch", "consumed", "world_size"}``: a run stopped on ``W``
    processes continues on ``W'`` from the same sample, with the same global batches when ``W*B == W'*B'``. The
    index streams equal torch's ``DistributedSampler`` with ``drop_last=True`` (the last ``len mod W`` left out).

    Args:
        dataset: the map-style training dataset.
        num_replicas: the world size ``W``; None: from the process group (1 without one).
        rank: this process's rank; None: from the process group (0 without one).
        shuffle: a new permutation every epoch; False keeps the dataset order.
        seed: the permutation's seed (the same on every rank); None: ``seed_everything``'s (``PL_GLOBAL_SEED``).
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int | None = None,
    ) -> None:
        here = this_process()
        num_replicas = here["num_replicas"] if num_replicas is None else num_replicas
        rank = here["rank"] if rank is None else rank
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else seed
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.start = 0  # global samples of this epoch consumed before the current iterator began
        self.pending: dict[str, Any] | None = None  # a loaded state, until the next iter()
        self._order: tuple[int, torch.Tensor] | None = None

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        self.start = self._resume_position()
        self.yielded = 0
        end = self.start + (n - self.start) // self.num_replicas * self.num_replicas
        for index in self.order(self.epoch)[self.start + self.rank : end : self.num_replicas].tolist():
            self.yielded += 1
            yield index

    def __len__(self) -> int:
        """Indices of a whole epoch for this rank (the loop counts batches of whole epochs)."""
        return len(self.dataset) // self.num_replicas

    def order(self, epoch: int) -> torch.Tensor:
        """``(len(dataset),)``: ``epoch``'s global order of the indices (the last one asked is kept, for saves)."""
        if self._order is None or self._order[0] != epoch:
            n, generator = len(self.dataset), torch.Generator().manual_seed(self.seed + epoch)
            self._order = (epoch, torch.randperm(n, generator=generator) if self.shuffle else torch.arange(n))
        return self._order[1]

    def _resume_position(self) -> int:
        resume, self.pending = self.pending, None
        if resume is None or resume["epoch"] != self.epoch:
            return 0  # a fresh epoch (a checkpoint written at an epoch's end resumes into the next one)
        saved_world = resume.get("world_size", self.num_replicas)
        if saved_world != self.num_replicas:
            rank_zero_warn(
                f"Resuming on {self.num_replicas} process(es) from a checkpoint of {saved_world}: the data continues "
                f"from sample {resume['consumed']} of epoch {self.epoch} in the same global order. The steps "
                "draw the same samples only if processes x batch_size is unchanged; otherwise no sample is lost "
                "or repeated, but batches and the number of steps per epoch differ.",
            )
        return min(int(resume["consumed"]), len(self.dataset))

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "consumed", "world_size"}``: the global position, valid for any world size."""
        consumed = self.start + self.yielded * self.num_replicas
        return {"epoch": self.epoch, "consumed": consumed, "world_size": self.num_replicas}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict["consumed"]`` at the next ``iter()`` of the same epoch; ValueError for another
        sampler's state (e.g. torchdata's per-rank ``{"yielded": ...}``, which maps to no global position)."""
        if "consumed" not in state_dict or "epoch" not in state_dict:
            raise ValueError(
                f"not a {type(self).__name__} state (keys {sorted(state_dict)}); the checkpoint was written by "
                "another sampler: resume it with the lit_ddp version that wrote it, or start a new run"
            )
        if int(state_dict["consumed"]) < 0:
            raise ValueError(f"consumed={state_dict['consumed']} must be >= 0")
        self.pending = dict(state_dict)


def this_process(trainer: Any = None) -> dict[str, Any]:
    """``{"num_replicas", "rank"}``: the data-parallel ranks of the trainer's device_mesh (tensor-parallel peers share
    each batch), else the process group's (nodes may run different numbers of processes); 1 and 0 without one."""
    if (mesh := getattr(getattr(trainer, "strategy", None), "device_mesh", None)) is not None:
        return {"num_replicas": mesh["data_parallel"].size(), "rank": mesh["data_parallel"].get_local_rank()}
    if dist.is_available() and dist.is_initialized():
        return {"num_replicas": dist.get_world_size(), "rank": dist.get_rank()}
    return {"num_replicas": 1, "rank": 0}


def evaluation_sampler(dataset: Dataset, trainer: Any = None) -> UnrepeatedDistributedSampler:
    """Lightning's unpadded sampler: rank ``r`` of ``W`` takes items ``r, r + W, ...``, each once, so a metric summed over
    the ranks is the same on any ``W`` (a ``DistributedSampler`` repeats items); safe with no collective per batch."""
    return UnrepeatedDistributedSampler(dataset, shuffle=False, **this_process(trainer))
