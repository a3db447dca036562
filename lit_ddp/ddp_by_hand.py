"""DDP by hand, in plain PyTorch with two CPU processes: the workers that ``notebooks/00_what_is_ddp.ipynb``
spawns.

``torch.multiprocessing`` with the ``spawn`` start method pickles the function each worker runs by reference
(module and name), so a function defined in a notebook cannot be a worker; the workers live here. Each
worker joins a gloo process group, does its part, and writes ``<out_dir>/rank<R>.pt``; the notebook reads
the files back with :func:`load_results`.

Plain PyTorch for the DDP itself (Lightning only finds a free port): this is what Lightning's ``DDPStrategy`` does
for us.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

NUM_FEATURES = 20


def spawn(fn: Any, *args: Any, world_size: int = 2, timeout: float = 120.0) -> None:
    """Runs ``fn(rank, world_size, port, timeout / 2, *args)`` in ``world_size`` spawned processes and waits
    at most ``timeout`` seconds for them.

    ``fn`` must be importable (defined in a module). ``port`` is a free TCP port for the rendezvous; the
    workers bound every collective call by half the deadline, so a stuck collective fails with its own
    message (a ``ProcessRaisedException`` naming the rank) before the deadline kills the workers.

    Raises:
        TimeoutError: the workers did not all finish within ``timeout`` seconds (they are killed).
        torch.multiprocessing.ProcessRaisedException: a worker raised (its traceback is in the message).
    """
    ctx = mp.start_processes(
        fn,
        args=(world_size, find_free_network_port(), timeout / 2, *args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world_size} workers running {fn.__name__} did not finish in {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


def init_group(rank: int, world_size: int, port: int, timeout: float) -> None:
    """Joins the gloo process group of ``world_size`` processes rendezvousing on ``127.0.0.1:port``."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )


def load_results(out_dir: str | Path, world_size: int = 2) -> list[dict[str, Any]]:
    """The records the workers wrote, by rank.

    Raises:
        FileNotFoundError: a rank wrote nothing (it failed before the end).
    """
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=True) for r in range(world_size)]


# --------------------------------------------------------------------------------------------------------
# 1. How DistributedSampler shards the data


def shard_worker(
    rank: int, world_size: int, port: int, timeout: float, out_dir: str, dataset_size: int, epochs: int
) -> None:
    """Records the dataset indices this rank's ``DistributedSampler`` yields in each epoch.

    The record holds ``indices``, a list (one per epoch) of index lists, and ``all_indices``, every rank's
    lists as gathered over the process group (``all_gather_object``), to check that ranks are disjoint.
    """
    init_group(rank, world_size, port, timeout)
    try:
        dataset = range(dataset_size)  # a sampler only needs len(dataset)
        sampler: DistributedSampler[int] = DistributedSampler(
            dataset,  # type: ignore[arg-type]  # the stub asks for a Dataset; the sampler only calls len()
            num_replicas=world_size,
            rank=rank,
            shuffle=True,
            seed=0,
        )
        indices = []
        for epoch in range(epochs):
            sampler.set_epoch(epoch)  # reshuffle: the permutation is seeded by seed + epoch, same on all ranks
            indices.append(list(sampler))
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, indices)
        torch.save({"rank": rank, "indices": indices, "all_indices": gathered}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------------
# 2. DDP's gradient all-reduce


def make_model(seed: int) -> nn.Module:
    """A small MLP ``(B, 20) -> (B, 1)`` whose initial weights depend only on ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(NUM_FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))


def make_batch(batch_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed regression batch: inputs ``(B, 20)`` and targets ``(B, 1)``, float32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, NUM_FEATURES, generator=g)
    y = x.sum(dim=1, keepdim=True) / NUM_FEATURES**0.5 + 0.1 * torch.randn(batch_size, 1, generator=g)
    return x, y


def local_indices(global_batch: int, rank: int, world_size: int) -> list[int]:
    """The rows of a global batch that ``rank`` gets: DistributedSampler without shuffling (``rank``,
    ``rank + world_size``, ...)."""
    rows = range(global_batch)
    # The stub asks for a Dataset; the sampler only calls len().
    return list(DistributedSampler(rows, num_replicas=world_size, rank=rank, shuffle=False))  # type: ignore[arg-type]


def grad_worker(
    rank: int, world_size: int, port: int, timeout: float, out_dir: str, global_batch: int, lr: float
) -> None:
    """One DDP training step on this rank's shard of a fixed global batch.

    Every rank builds its model with a different seed (``make_model(rank)``): wrapping it in DDP broadcasts
    rank 0's parameters, so all replicas start equal. Each rank computes the mean loss of its own rows;
    ``backward()`` all-reduces (averages) the gradients; one SGD step keeps the replicas equal.

    The record holds ``params_before_ddp``, ``params_after_ddp``, ``grads`` (after the all-reduce),
    ``params_after_step`` (each a name -> tensor dict) and ``local_loss``.
    """
    init_group(rank, world_size, port, timeout)
    try:
        # The DDP wrapper lives only inside grad_step: it must be gone before destroy_process_group. If it
        # outlives the group, its Reducer holds the last reference to the gloo backend, whose destructor then
        # joins gloo's worker thread while holding the GIL, and that thread may be waiting for the GIL to free
        # its last work item: the process never exits (seen on torch 2.13 about one run in two; the blocking
        # destructor is pytorch/pytorch#56297).
        record = grad_step(rank, world_size, global_batch, lr)
        torch.save(record, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def grad_step(rank: int, world_size: int, global_batch: int, lr: float) -> dict[str, Any]:
    """The body of :func:`grad_worker` inside a joined process group: returns the record it saves."""
    model = make_model(seed=rank)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ddp = DDP(model)  # broadcasts rank 0's parameters and buffers to every rank
    after_wrap = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = make_batch(global_batch)
    rows = local_indices(global_batch, rank, world_size)
    loss = F.mse_loss(ddp(x[rows]), y[rows])  # the mean over this rank's rows only
    loss.backward()  # gradient hooks all-reduce (sum, then divide by world_size) bucket by bucket
    grads = {n: cast(torch.Tensor, p.grad).detach().clone() for n, p in model.named_parameters()}  # set by backward
    torch.optim.SGD(ddp.parameters(), lr=lr).step()
    after_step = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "rank": rank,
        "rows": rows,
        "local_loss": loss.item(),
        "params_before_ddp": before,
        "params_after_ddp": after_wrap,
        "grads": grads,
        "params_after_step": after_step,
    }


def reference_grads(global_batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Gradients of one process on the whole global batch, starting from ``make_model(seed)`` (rank 0's
    initial weights, which DDP broadcasts)."""
    model = make_model(seed)
    x, y = make_batch(global_batch)
    F.mse_loss(model(x), y).backward()
    return {n: cast(torch.Tensor, p.grad).detach().clone() for n, p in model.named_parameters()}  # set by backward


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute elementwise difference between two name -> tensor dicts with the same keys.

    Raises:
        ValueError: the dicts' keys differ.
    """
    if a.keys() != b.keys():
        raise ValueError(f"different keys: {sorted(a)} vs {sorted(b)}")
    return max((a[k] - b[k]).abs().max().item() for k in a)
