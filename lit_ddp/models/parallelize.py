"""FSDP2 and tensor parallelism for the GPT: which modules :func:`torch.distributed.fsdp.fully_shard` wraps, in which
dtypes, and how each block's matrices are split over a tensor-parallel group.

The FSDP2 layout follows torchtitan's ``parallelize_llama`` (``apply_fsdp``): one FSDP unit per transformer block,
so a block's parameters are all-gathered just before its forward and backward and freed after, and one for the
root, which holds what is left (for the GPT: the embeddings, the final norm and the tied head). The tensor-parallel
plan is Megatron-LM's (Shoeybi et al., arXiv:1909.08053; torchtitan's ``apply_tp``). Plain torch: the meshes come
from the caller (:class:`lit_ddp.strategies.FSDP2Strategy`), so this works in a plain loop too.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lit_ddp.models.gpt import Block


def shard(
    model: nn.Module,
    mesh: DeviceMesh,
    units: tuple[type[nn.Module], ...] = (),
    param_dtype: torch.dtype | None = None,
    by_columns: Iterable[nn.Parameter] = (),
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
        by_columns: matrices to shard by columns (dim 1) instead of rows: those tensor parallelism already splits
            by strided rows (c_attn's rows of q, of k and of v), since FSDP2's row split over that one comes back
            out of order in the full state dict (torch 2.13). The columns must divide by ``mesh.size()``.

    Raises:
        ValueError: ``mesh`` is not 1-D.
    """
    if mesh.ndim != 1:
        raise ValueError(f"shard takes a 1-D mesh of data-parallel ranks, got mesh_dim_names={mesh.mesh_dim_names}")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    columns = {id(p) for p in by_columns}

    def placement(param: nn.Parameter) -> Shard | None:  # None: FSDP2's rows
        return Shard(1) if id(param) in columns else None

    for module in [m for m in model.modules() if isinstance(m, units) and m is not model]:
        fully_shard(module, mesh=mesh, mp_policy=policy, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, mp_policy=policy, shard_placement_fn=placement)
    return model


def tensor_parallel(model: nn.Module, mesh: DeviceMesh, stacked_rows: Placement) -> nn.Module:
    """Splits every GPT :class:`~lit_ddp.models.gpt.Block` of ``model`` in place over the 1-D tensor-parallel ``mesh``
    (``tp = mesh.size()`` ranks, which all read the same batch) and returns it.

    In each block, the first matrix of the attention (``c_attn``: q, k, v) and of the MLP (``c_fc``) is split by
    output columns, the second (``c_proj``) by input rows: a rank computes ``n_head / tp`` heads and ``4C / tp``
    hidden units from the whole ``(B, T, C)`` input, and one all-reduce per ``c_proj`` sums the partial ``(B, T, C)``
    outputs (another in the backward, for the input's gradient). ``c_attn`` holds q, k and v stacked, so each rank
    takes its rows of each (``stacked_rows``), not a contiguous third. Its bias stays whole on every rank (DTensor
    hands each rank its rows of it in the forward, and all-gathers its gradient): FSDP2 over tensor-parallel groups
    trains a strided bias wrong (torch 2.13: q's and v's rows drift off by whole optimizer steps), a whole one
    right. The embeddings, the norms and the head stay whole on every rank too. Parameters become ``DTensor``; the
    state dict holds whole tensors in the usual layout.

    Args:
        model: the model, on its device, before its optimizer is built.
        mesh: the tensor-parallel ranks.
        stacked_rows: the placement that gives a rank its rows of each of q, k and v: DTensor's strided shard,
            ``lit_ddp.compat.strided_shard(0, split_factor=3)`` (private in torch, so the caller passes it).

    Raises:
        ValueError: ``mesh`` is not 1-D, or ``n_head`` is not divisible by its size.
    """
    if mesh.ndim != 1:
        raise ValueError(f"tensor_parallel takes a 1-D mesh, got mesh_dim_names={mesh.mesh_dim_names}")
    for block in [m for m in model.modules() if isinstance(m, Block)]:
        if block.attn.n_head % mesh.size():
            raise ValueError(f"n_head={block.attn.n_head} must be divisible by tensor_parallel_size={mesh.size()}")
        plan = {"attn.c_proj": RowwiseParallel(), "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}
        parallelize_module(block, mesh, plan)
        # torch types input_fn / output_fn as returning None; what they return replaces the inputs / output (its docs)
        split_qkv = functools.partial(_split_rows, placement=stacked_rows)
        distribute_module(block.attn.c_attn, mesh, split_qkv, _replicated_input, _local_output)  # type: ignore[arg-type]
    return model


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scales the gradients of ``parameters`` in place so that their joint 2-norm is at most ``max_norm``, by the
    formula of ``torch.nn.utils.clip_grad_norm_``, for a model that mixes whole parameters and ``DTensor`` ones on
    different meshes (tensor parallelism, with FSDP2 or without), which torch's refuses: each ``DTensor`` gradient's
    norm is reduced to a whole scalar (one small all-reduce per parameter) before they are joined. Ours because
    torch has no such function (torchtitan's assumes one mesh for every parameter).

    Returns:
        The joint norm before clipping, a 0-dim tensor.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norms = [torch.linalg.vector_norm(g) for g in grads]
    total = torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    scale = coef.item()  # for DTensor gradients, which take no plain tensor operand: one host sync, not one each
    for g in grads:
        g.mul_(scale if isinstance(g, DTensor) else coef)
    return total


def _split_rows(name: str, module: nn.Module, mesh: DeviceMesh, placement: Placement) -> None:
    for key, param in list(module.named_parameters(recurse=False)):
        sharded = distribute_tensor(param.detach(), mesh, [placement if key == "weight" else Replicate()])
        module.register_parameter(key, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _replicated_input(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    # ColwiseParallel's input: the same (B, T, C) on every rank; its gradient is all-reduced in the backward.
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)


def _local_output(module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    # This rank's q, k and v heads, (B, T, 3C/tp), as a plain tensor: attention runs per head, locally.
    return output.to_local()
