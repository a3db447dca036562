"""torch's private internals that the package uses, each where torch has no public API for it: torchdata's loader
state, the c10d store and timeout, distributed checkpoint metadata and planner, DTensor's strided shards. (Muon's
batched step: :mod:`lit_ddp.compat.muon`.)

Tested on torch 2.9.1, 2.13.0 and 2.15.0 (``make test-torch TORCH=X``). Private names are imported by
:func:`~lit_ddp.compat.imports.private` inside the function that uses them, and the public API is taken where a
version has one (``torch.distributed.set_timeout`` from 2.14).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lit_ddp.compat.imports import private


def _main_process_state(loader_state: dict[str, Any]) -> dict[str, Any]:
    """A torchdata ``StatefulDataLoader`` state's main-process part: the state itself without workers, its
    ``_snapshot/_main_snapshot`` with them (torchdata 0.11 names no public accessor for either)."""
    snapshot = loader_state.get("_snapshot")
    return (snapshot.get("_main_snapshot") or {}) if isinstance(snapshot, dict) else loader_state


def sampler_state(loader_state: dict[str, Any]) -> dict[str, Any]:
    """The sampler's ``state_dict()`` inside a torchdata ``StatefulDataLoader`` state (its iterator's
    ``_sampler_iter_state``, with or without workers); empty where there is none."""
    return (_main_process_state(loader_state).get("_sampler_iter_state") or {}).get("sampler_state") or {}


def loader_workers(loader_state: dict[str, Any]) -> int:
    """The worker processes of the torchdata ``StatefulDataLoader`` whose state this is (0: none)."""
    return int(_main_process_state(loader_state).get("_num_workers", 0))  # a state without workers has no count


def worker_seed(loader_state: dict[str, Any]) -> int | None:
    """The seed every worker's RNGs start from (torch's ``base_seed + worker_id``, and Python's and numpy's derived
    from it) in a torchdata ``StatefulDataLoader`` state of a loader with workers; None without workers."""
    seed = _main_process_state(loader_state).get("_base_seed")
    return None if seed is None else int(seed)


def default_store() -> Any:
    """The default process group's store (torch's ``_get_default_store``, private on 2.9 to 2.15): a key-value
    exchange that works while collectives cannot (a peer died).

    Raises:
        RuntimeError: no default process group exists.
        ImportError: this torch has no ``_get_default_store``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("no default process group")
    return private("torch.distributed.distributed_c10d", "_get_default_store")()


def set_process_group_timeout(timeout: timedelta) -> None:
    """Sets the default process group's timeout for the collectives that follow (gloo and NCCL; a no-op without a
    group): ``torch.distributed.set_timeout`` where torch has it (2.14 on, where the private ``_set_pg_timeout`` it
    replaces warns of its deprecation), ``_set_pg_timeout`` before."""
    if dist.is_available() and dist.is_initialized():
        set_timeout = getattr(dist, "set_timeout", None) or private(
            "torch.distributed.distributed_c10d", "_set_pg_timeout"
        )
        set_timeout(timeout)


def dcp_storage_extents(metadata: Any) -> dict[str, int]:
    """The bytes each storage file of a Distributed Checkpoint must hold at least: its entries' ``offset + length``
    (DCP's ``Metadata.storage_data`` maps each tensor to a private ``_StorageInfo``), by file name."""
    extents: dict[str, int] = {}
    for info in metadata.storage_data.values():
        extents[info.relative_path] = max(extents.get(info.relative_path, 0), info.offset + info.length)
    return extents


def dcp_entries(storage_data: Any) -> list[tuple[Any, str, int, int]]:
    """A Distributed Checkpoint's entries as ``(index, file name, offset, length)``: ``storage_data`` (its
    ``Metadata.storage_data``, or a reader's) maps each tensor chunk's ``MetadataIndex`` to a private
    ``_StorageInfo``."""
    return [(index, info.relative_path, info.offset, info.length) for index, info in storage_data.items()]


def dcp_private_metadata_classes() -> dict[tuple[str, str], Any]:
    """The private classes a Distributed Checkpoint's ``.metadata`` pickle holds besides its public dataclasses, by
    ``(module, name)``: the file system writer's ``_StorageInfo`` (each entry's file, offset and length); empty where
    this torch lacks it (torch 2.9 to 2.15 have it). The pickle also names ``torch.serialization._get_layout`` (a
    layout pickled by name), which :mod:`lit_ddp.run_dir.untrusted` replaces with a reader of layout names only."""
    found = {}
    for module, name in (("torch.distributed.checkpoint.filesystem", "_StorageInfo"),):
        try:
            found[(module, name)] = private(module, name)
        except ImportError:
            continue
    return found


def dcp_full_state_planner() -> type:
    """DCP's private ``_EmptyStateDictLoadPlanner``: a load planner that builds the state dict from the checkpoint's
    metadata (what ``dcp_to_torch_save`` reads with), for reading a sharded checkpoint whole without a model. torch
    has no public planner for it (its own converter constructs this one and a plain reader inside)."""
    return private("torch.distributed.checkpoint.default_planner", "_EmptyStateDictLoadPlanner")


def strided_shard(dim: int, split_factor: int) -> Any:
    """DTensor's private ``_StridedShard`` placement: ``dim`` cut into ``split_factor`` equal parts, each sharded over
    the mesh dimension, every rank holding its slice of each part. The tensor-parallel layout of a fused q, k, v
    projection (a rank's heads of q, of k and of v); the only placement torch 2.9 to 2.15 has for it, made for
    FSDP2 + TP.

    Raises:
        ImportError: this torch has no ``_StridedShard``.
    """
    return private("torch.distributed.tensor.placement_types", "_StridedShard")(dim, split_factor=split_factor)


def is_strided_shard(placement: Any) -> bool:
    """Whether ``placement`` is DTensor's private ``_StridedShard`` (:func:`strided_shard`): its class is private, and
    it is no ``Shard`` subclass (``is_shard()`` is False for it)."""
    return isinstance(placement, private("torch.distributed.tensor.placement_types", "_StridedShard"))


def strided_rows_survive_linear(mesh: Any) -> bool:
    """Whether this torch's DTensor keeps :func:`strided_shard`'s rows through ``F.linear``: the output split by
    strided columns, as the rows of q, k and v are. torch 2.9.1 labels the output a plain ``Shard`` (and the weight's
    and bias's gradients too): a whole bias is then added from other heads' rows, and the gradients of q, k and v
    are gathered into other rows (pytorch/pytorch#166598: DTensor's matmul rules took ``_StridedShard`` for the
    ``Shard`` it subclassed there; #167887 made it no ``Shard``); 2.13.0 and 2.15.0 keep the strided placement.
    DTensor's sharding rules on a tiny input over ``mesh`` (1-D), in this process alone: no collective."""
    from torch.distributed.tensor import DTensor, Replicate

    def on_mesh(local: torch.Tensor, placement: Any) -> Any:
        return DTensor.from_local(local, mesh, [placement], run_check=False)

    tp = mesh.size()
    weight = on_mesh(torch.zeros(3, 1, device=mesh.device_type), strided_shard(0, split_factor=3))  # (3 tp, 1) whole
    bias = on_mesh(torch.zeros(3 * tp, device=mesh.device_type), Replicate())
    x = on_mesh(torch.zeros(1, 1, device=mesh.device_type), Replicate())
    out: Any = torch.nn.functional.linear(x, weight, bias)  # a DTensor
    return is_strided_shard(out.placements[-1])
