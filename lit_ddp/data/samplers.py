"""The train sampler whose shuffling and position a checkpoint restores exactly, with or without DDP."""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.utils.data import Dataset, Sampler, SequentialSampler
from torchdata.stateful_dataloader.sampler import RandomSampler, StatefulDistributedSampler


def resumable_sampler(dataset: Dataset, shuffle: bool = True) -> Sampler:
    """A train sampler whose shuffling and position a checkpoint restores exactly, with or without DDP.

    Call it in ``train_dataloader`` (after Lightning has set up the process group) and pass it as the
    ``sampler`` of a ``StatefulDataLoader``. Under DDP: torchdata's ``StatefulDistributedSampler`` (a
    ``DistributedSampler``, so Lightning injects nothing), shuffled by ``(seed, epoch)`` with the seed of
    ``seed_everything``; its position is part of the loader state. In one process: torchdata's
    ``RandomSampler`` (what ``StatefulDataLoader(shuffle=True)`` uses), whose generator state is part of the
    loader state; ``SequentialSampler`` when ``shuffle`` is false. Lightning's own
    ``DistributedSamplerWrapper`` would lose the inner sampler's random state on resume.

    Args:
        dataset: the map-style training dataset.
        shuffle: draw a new permutation every epoch.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return StatefulDistributedSampler(
            dataset,
            num_replicas=dist.get_world_size(),
            rank=dist.get_rank(),
            shuffle=shuffle,
            seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
        )
    return RandomSampler(dataset) if shuffle else SequentialSampler(dataset)
