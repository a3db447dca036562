"""FSDP2: which modules :func:`torch.distributed.fsdp.fully_shard` wraps, and in which dtypes.

The layout follows torchtitan's ``parallelize_llama`` (``apply_fsdp``): one FSDP unit per transformer block, so a
block's parameters are all-gathered just before its forward and backward and freed after, and one for the root,
which holds what is left (for the GPT: the embeddings, the final norm and the tied head). Plain torch: the mesh
comes from the caller (:class:`lit_ddp.strategies.FSDP2Strategy`), so this works in a plain loop too.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def shard(
    model: nn.Module, mesh: DeviceMesh, units: tuple[type[nn.Module], ...] = (), param_dtype: torch.dtype | None = None
) -> nn.Module:
    """Shards ``model`` in place over the 1-D ``mesh`` (FSDP2, "ZeRO-3": each rank holds ``1/mesh.size()`` of every
    parameter, its gradient and its optimizer state) and returns it.

    Args:
        model: the model, on its device, before its optimizer is built (the optimizer must see the sharded
            parameters, ``DTensor``).
        mesh: the data-parallel ranks to shard over.
        units: module classes that each become an FSDP unit (e.g. the GPT's ``Block``); the root is one too.
        param_dtype: the dtype of the all-gathered parameters the forward and backward compute with (``bf16``
            under ``bf16-mixed``); gradients are reduce-scattered in fp32 and the optimizer steps fp32 shards
            either way. None: fp32 throughout.

    Raises:
        ValueError: ``mesh`` is not 1-D.
    """
    if mesh.ndim != 1:
        raise ValueError(f"shard takes a 1-D mesh of data-parallel ranks, got mesh_dim_names={mesh.mesh_dim_names}")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for module in [m for m in model.modules() if isinstance(m, units) and m is not model]:
        fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
