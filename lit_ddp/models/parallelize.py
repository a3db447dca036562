"""FSDP2, tensor and pipeline parallelism for the GPT: which modules :func:`torch.distributed.fsdp.fully_shard` wraps,
in which dtypes, how each block's matrices are split over a tensor-parallel group, and how the blocks are split into
pipeline stages.

The FSDP2 layout follows torchtitan's ``parallelize_llama`` (``apply_fsdp``): one FSDP unit per transformer block,
so a block's parameters are all-gathered just before its forward and backward and freed after, and one for the
root, which holds what is left (for the GPT: the embeddings, the final norm and the tied head). The tensor-parallel
plan is Megatron-LM's (Shoeybi et al., arXiv:1909.08053; torchtitan's ``apply_tp``). Plain torch: the meshes come
from the caller (:class:`lit_ddp.strategies.FSDP2Strategy`), so this works in a plain loop too.

The pipeline split is torchtitan's (``pipeline_module_split``): each stage holds consecutive blocks, the first the
embeddings too and the last the final norm and the head, and every module keeps the name it has in the GPT
(``transformer.h.3`` is block 3 on whichever stage holds it), so a checkpoint of the stages is keyed as the GPT's.
The GPT ties the head's weight to the token embedding; split, the first stage holds it as ``transformer.wte.weight``
and the last as ``lm_head.weight``, two copies that stay equal when the caller sums their gradients
(:class:`lit_ddp.strategies.PipelineStrategy`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lit_ddp.models.gpt import GPT, Block, GPTConfig


def shard(
    model: nn.Module,
    mesh: DeviceMesh,
    units: tuple[type[nn.Module], ...] = (),
    param_dtype: torch.dtype | None = None,
    by_columns: Iterable[nn.Parameter] = (),
    reshard_after_forward: bool | None = None,
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
        reshard_after_forward: None: FSDP2's default (the units free their gathered parameters after forward, the
            root keeps its own); False: every unit keeps them until its backward, as a pipeline stage wants (it runs
            several microbatches' forwards before their backwards: torchtitan's choice under PP).

    Raises:
        ValueError: ``mesh`` is not 1-D.
    """
    if mesh.ndim != 1:
        raise ValueError(f"shard takes a 1-D mesh of data-parallel ranks, got mesh_dim_names={mesh.mesh_dim_names}")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    columns = {id(p) for p in by_columns}

    def placement(param: nn.Parameter) -> Shard | None:  # None: FSDP2's rows
        return Shard(1) if id(param) in columns else None

    options: dict[str, Any] = {"mesh": mesh, "mp_policy": policy, "shard_placement_fn": placement}
    if reshard_after_forward is not None:
        options["reshard_after_forward"] = reshard_after_forward
    for module in [m for m in model.modules() if isinstance(m, units) and m is not model]:
        fully_shard(module, **options)
    fully_shard(model, **options)
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


def clip_grad_norm_(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    uncounted: Iterable[nn.Parameter] = (),
    group: Any = None,
) -> torch.Tensor:
    """Scales the gradients of ``parameters`` in place so that their joint 2-norm is at most ``max_norm``, by the
    formula of ``torch.nn.utils.clip_grad_norm_``, for a model that mixes whole parameters and ``DTensor`` ones on
    different meshes (tensor parallelism, with FSDP2 or without), which torch's refuses: each ``DTensor`` gradient's
    norm is reduced to a whole scalar (one small all-reduce per parameter) before they are joined. Ours because
    torch has no such function (torchtitan's assumes one mesh for every parameter).

    Args:
        parameters: the parameters whose gradients are scaled.
        max_norm: the largest joint norm left.
        uncounted: those of ``parameters`` left out of the norm (scaled all the same): a copy of a parameter that
            another counts, as a pipeline's last stage holds the tied weight the first stage counts.
        group: a process group whose ranks hold the other parameters of the model (a pipeline's stages): the
            squared norms are summed over it, so every rank clips by the norm of the whole model.

    Returns:
        The joint norm before clipping, a 0-dim tensor.
    """
    params = [p for p in parameters if p.grad is not None]
    skip = {id(p) for p in uncounted}
    grads = [p.grad for p in params]
    norms = [torch.linalg.vector_norm(p.grad) for p in params if id(p) not in skip]
    if norms:
        total = torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
    else:
        total = torch.zeros((), device=params[0].device if params else None)
    if group is not None:
        squared = (total.float() ** 2).reshape(1)
        dist.all_reduce(squared, group=group)
        total = squared.sqrt().reshape(()).to(total.dtype)
    if not grads:
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    scale = coef.item()  # for DTensor gradients, which take no plain tensor operand: one host sync, not one each
    for g in grads:
        g.mul_(scale if isinstance(g, DTensor) else coef)  # type: ignore[union-attr]
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


SCHEDULE_NAMES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
"""torch.distributed.pipelining's schedules by their names (``Schedule<name>``), which the pipeline's rules below
follow (torch's own checks run only once every process has started)."""
SINGLE_STAGE = ("GPipe", "1F1B")
"""One stage per rank."""
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
"""Two stages per rank in a V: rank r holds stages r and 2p - 1 - r (the first and the last on rank 0); the others
hold theirs in a loop (r, r + p, ...)."""


def stages_per_rank_for(schedule: str, stages_per_rank: int | None) -> int:
    """The stages each rank holds under ``schedule``: 1 for GPipe and 1F1B, 2 for the V schedules, else
    ``stages_per_rank`` (2 when None).

    Raises:
        ValueError: an unknown schedule, or a number of stages per rank the schedule cannot run.
    """
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"schedule={schedule!r} is not one of {', '.join(SCHEDULE_NAMES)}")
    need = 1 if schedule in SINGLE_STAGE else 2 if schedule in V_SHAPED else None
    if stages_per_rank is None:
        return need or 2
    if (need is not None and stages_per_rank != need) or stages_per_rank < 1:
        right = f"exactly {need}" if need is not None else "1 or more"
        raise ValueError(f"stages_per_rank={stages_per_rank}: the {schedule} schedule runs {right} stage(s) per rank")
    return stages_per_rank


def check_schedule(schedule: str, pipeline_parallel_size: int, n_microbatches: int, stages_per_rank: int) -> None:
    """Refuses the microbatch counts torch's schedule would refuse once every process has started (1F1B: at least one
    per stage; DualPipeV: one per stage of all; the interleaved ones: a multiple of their rounds).

    Raises:
        ValueError: ``n_microbatches`` < 1, or one the schedule cannot run, naming what it can.
    """
    p, m = pipeline_parallel_size, n_microbatches
    if m < 1:
        raise ValueError(f"n_microbatches={m} must be >= 1")
    n_stages = p * stages_per_rank
    if schedule == "1F1B" and m < p:
        raise ValueError(f"n_microbatches={m}: 1F1B needs at least one per stage (>= {p}); GPipe runs fewer")
    if schedule == "DualPipeV" and m < n_stages:
        raise ValueError(f"n_microbatches={m}: DualPipeV needs at least one per stage (>= {n_stages})")
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, m // p)  # torch's number of rounds, which must divide the microbatches
        if m % rounds:
            raise ValueError(
                f"n_microbatches={m}: {schedule} over {p} ranks runs them in {rounds} rounds (n_microbatches // {p}), "
                f"which must divide them: give a multiple of {p}, or fewer than {2 * p}"
            )


def stage_indices(schedule: str, pipeline_parallel_size: int, pp_rank: int, stages_per_rank: int) -> list[int]:
    """The stages rank ``pp_rank`` of the pipeline holds: ``r, r + p, ...`` (a loop), or ``r`` and ``2p - 1 - r``
    (a V)."""
    p = pipeline_parallel_size
    if schedule in V_SHAPED:
        return [pp_rank, 2 * p - 1 - pp_rank]
    return [pp_rank + i * p for i in range(stages_per_rank)]


def stage_blocks(n_layer: int, n_stages: int) -> list[range]:
    """The blocks of each of ``n_stages`` pipeline stages: consecutive, as even as they go (the first
    ``n_layer % n_stages`` stages one more), every stage at least one.

    Raises:
        ValueError: ``n_stages`` < 1 or more stages than blocks.
    """
    if not 1 <= n_stages <= n_layer:
        raise ValueError(f"{n_stages} pipeline stages for {n_layer} blocks: give 1 to n_layer={n_layer} stages")
    size, extra = divmod(n_layer, n_stages)
    starts = [i * size + min(i, extra) for i in range(n_stages + 1)]
    return [range(starts[i], starts[i + 1]) for i in range(n_stages)]


class GPTStage(nn.Module):
    """One pipeline stage of a :class:`~lit_ddp.models.gpt.GPT`: its blocks ``blocks``, with the embeddings on the
    first stage and the final norm and head on the last, each under its name in the GPT. The modules are the GPT's
    own (not copies), but for the last stage's head weight where the first stage is another: a copy of the tied
    weight (module docstring).

    ``forward``: the first stage takes ``idx (B, T)`` int64 ids, the others the previous stage's ``(B, T, C)``; the
    last returns ``logits (B, T, V)``, the others ``(B, T, C)``. Attention masks and positions follow ``T`` as in
    :meth:`GPT.forward <lit_ddp.models.gpt.GPT.forward>`.
    """

    def __init__(self, model: GPT, index: int, n_stages: int, blocks: range) -> None:
        super().__init__()
        self.index, self.n_stages = index, n_stages
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        gpt = cast(nn.ModuleDict, model.transformer)
        h = cast(nn.ModuleList, gpt["h"])
        modules: dict[str, nn.Module] = {}
        if self.is_first:
            modules |= {k: gpt[k] for k in ("wte", "wpe", "drop") if k in gpt}
        modules["h"] = nn.ModuleDict({str(i): h[i] for i in blocks})
        if self.is_last:
            modules["ln_f"] = gpt["ln_f"]
        self.transformer = nn.ModuleDict(modules)
        if self.is_last:
            self.lm_head: nn.Linear = model.lm_head
            if not self.is_first:  # the first stage's copy is the GPT's own Parameter
                self.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` ids (first stage) or ``(B, T, C)`` -> ``(B, T, C)``, or ``logits (B, T, V)`` (last stage)."""
        t = self.transformer
        if self.is_first:
            idx = x
            x = t["wte"](idx)  # (B, T, C)
            if "wpe" in t:
                x = x + t["wpe"](torch.arange(idx.size(1), dtype=torch.long, device=idx.device))
            x = t["drop"](x)
        for block in cast(nn.ModuleDict, t["h"]).values():
            x = block(x)  # (B, T, C)
        if self.is_last:
            x = self.lm_head(t["ln_f"](x))  # (B, T, V)
        return x


def split_stages(model: GPT, n_stages: int, indices: Sequence[int]) -> list[GPTStage]:
    """The stages ``indices`` (this rank's, ascending or not) of ``model`` split into ``n_stages`` by blocks
    (:func:`stage_blocks`). ``model`` gives its modules to them and is not to be used after.

    Raises:
        ValueError: more stages than blocks, or an index outside ``[0, n_stages)``.
    """
    blocks = stage_blocks(model.config.n_layer, n_stages)
    if any(not 0 <= i < n_stages for i in indices):
        raise ValueError(f"stage indices {list(indices)} outside [0, {n_stages})")
    return [GPTStage(model, i, n_stages, blocks[i]) for i in indices]


class GPTStages(nn.Module):
    """This rank's pipeline stages of a GPT as one module with the GPT's names: ``transformer.wte``, the blocks it
    holds as ``transformer.h.<i>``, ``lm_head``..., so that its ``state_dict``, its ``named_parameters`` and the
    optimizer groups built from it (:func:`lit_ddp.recipe.adamw_param_groups`) read as the GPT's, restricted to
    these stages. The stages themselves are :attr:`stages` (not submodules: the parameters are registered once,
    here). A rank holding one copy of the tied weight holds it as the GPT does, under both names (the other module
    a stand-in that never computes): as ``transformer.wte.weight`` first (the name of the GPT's one parameter) and
    as a Linear weight (weight decay). A rank holding both the first and the last stage (a V schedule's) holds both
    copies, one under each name. Build it after FSDP2 has sharded the stages, whose parameters it registers.

    Called as the GPT is, ``(idx (B, T), targets (B, T) | None) -> (logits | None, loss | None)``, it hands both to
    :attr:`pipeline`, the callable that runs the stages in step with the other ranks' (a pipeline schedule, which
    the caller sets). ``config`` is the GPT's.
    """

    def __init__(self, config: GPTConfig, stages: Sequence[GPTStage]) -> None:
        super().__init__()
        self.config = config
        self.stages: tuple[GPTStage, ...] = tuple(sorted(stages, key=lambda s: s.index))
        self.pipeline: Callable[..., tuple[torch.Tensor | None, torch.Tensor | None]] | None = None
        modules: dict[str, nn.Module] = {}
        blocks: dict[str, nn.Module] = {}
        for stage in self.stages:
            for name, module in stage.transformer.items():
                if name == "h":
                    blocks |= dict(cast(nn.ModuleDict, module).items())
                else:
                    modules[name] = module
        modules["h"] = nn.ModuleDict(dict(sorted(blocks.items(), key=lambda kv: int(kv[0]))))
        first, last = self.stages[0], self.stages[-1]
        if last.is_last and not first.is_first:  # the head's copy of the tied weight, under the embedding's name too
            modules["wte"] = _embedding_of(last.lm_head.weight)
        order = ("wte", "wpe", "drop", "h", "ln_f")  # the GPT's, so that named_parameters come in its order
        self.transformer = nn.ModuleDict({k: modules[k] for k in order if k in modules})
        if last.is_last:
            self.lm_head = last.lm_head
        elif first.is_first:  # the embedding's copy, under the head's name too (a Linear weight: it decays)
            self.lm_head = _linear_of(cast(nn.Embedding, modules["wte"]).weight)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``idx (B, T)``, ``targets (B, T)`` -> what :attr:`pipeline` returns for them.

        Raises:
            RuntimeError: no pipeline set.
        """
        if self.pipeline is None:
            raise RuntimeError("GPTStages runs through a pipeline schedule: set its pipeline first")
        return self.pipeline(idx, targets)

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """This rank's share of :meth:`GPT.flops_per_token <lit_ddp.models.gpt.GPT.flops_per_token>`: its blocks'
        parameters and attention, and the tied weight on the rank holding the first stage only, so that the
        ranks of a pipeline sum to the GPT's."""
        T = seq_len or self.config.block_size
        counted = {id(p): p for stage in self.stages for p in stage.parameters()}
        last = self.stages[-1]
        if last.is_last and not last.is_first:  # the first stage's copy of the tied weight counts
            counted.pop(id(last.lm_head.weight))
        if "wpe" in self.transformer:  # as GPT.num_parameters(non_embedding=True)
            counted.pop(id(self.transformer["wpe"].weight))
        n = sum(p.numel() for p in counted.values())
        return 6 * n + 12 * len(cast(nn.ModuleDict, self.transformer["h"])) * self.config.n_embd * T


def _embedding_of(weight: torch.Tensor) -> nn.Embedding:
    """An Embedding module holding ``weight`` (``(V, C)``), built on the meta device (nothing allocated)."""
    module = nn.Embedding(weight.shape[0], weight.shape[1], device="meta")
    module.weight = weight
    return module


def _linear_of(weight: torch.Tensor) -> nn.Linear:
    """A Linear module without bias holding ``weight`` (``(V, C)``: ``C -> V``), built on the meta device."""
    module = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    module.weight = weight
    return module
