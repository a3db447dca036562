"""torchrun restarts without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.

Since torch 2.5 torchrun's c10d rendezvous shares its TCPStore with the workers
(``TORCHELASTIC_USE_AGENT_STORE=True``): the store outlives a restart, and torch gives the workers' process
group no per-attempt prefix in it ("we create a new TCPStore for every retry", which sharing undid). A
restarted group then reads the keys the dead group wrote, e.g. gloo's peer addresses, and hangs or fails to
connect (pytorch/pytorch#135712). The workers avoid the stale keys themselves: the default process group is
created here, before Lightning's, on the shared store under the prefix ``lit_ddp/restart_<N>``, where ``N``
is ``TORCHELASTIC_RESTART_COUNT`` (the same for every worker of an attempt: torchrun restarts the whole group).
Lightning then finds the group initialized and uses it. No library does this, hence our code.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist
from lightning.fabric.utilities.distributed import log as lightning_log
from lightning.pytorch.utilities import rank_zero_info


def init_process_group_on_shared_store(backend: str, timeout: timedelta, env: Mapping[str, str] | None = None) -> bool:
    """Creates the default process group under a per-restart prefix of torchrun's shared store.

    Does nothing (returns False) outside torchrun, when the store is not shared, for one process, or when a
    group exists already.

    Args:
        backend: the process-group backend (``gloo``, ``nccl``).
        timeout: the collective timeout (also the store's).
        env: the environment; defaults to ``os.environ``.

    Returns:
        Whether the group was created here.
    """
    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not dist.is_available() or dist.is_initialized():
        return False
    world_size, rank = int(env.get("WORLD_SIZE", "1")), int(env.get("RANK", "0"))
    if world_size < 2:
        return False
    # Lightning's per-rank line, which it skips for a group that exists (users and tests look for it).
    lightning_log.info(f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{world_size}")
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"lit_ddp/restart_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout)
    # Lightning's closing line, likewise skipped.
    rank_zero_info(f"All distributed processes registered. Starting with {world_size} processes")
    return True
