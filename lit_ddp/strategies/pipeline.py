"""Pipeline parallelism for Lightning: the GPT split into stages by blocks, one stage (or a few) per rank, each
microbatch's activations handed from stage to stage by ``torch.distributed.pipelining``.

:class:`PipelineStrategy` is the fourth API of the torch.distributed overview ("when FSDP2 reaches its scaling limit,
use TP and/or PP"), which Lightning does not have (Lightning-AI/pytorch-lightning#17180) and torchtitan has without
tied weights. ``configs/trainer/pp.yaml`` names it in place of DDP; the LightningModule stays the one DDP trains
(:class:`lit_ddp.tasks.mingpt.GPTModule`): its ``self.model`` becomes this rank's stages
(:class:`lit_ddp.models.parallelize.GPTStages`), whose call runs the schedule.

How a step runs, and why each piece is where it is:

- ``training_step`` calls the model: the schedule runs every microbatch's forward and backward there, in the order
  the schedule says (``scale_grads=False``; the loss of a microbatch divided by microbatches x
  ``accumulate_grad_batches``, as torchtitan scales it, so the gradients are those of the mean over the batch).
  The loss it returns is the batch's mean, computed on the last stage and sent to every rank, for logging and the
  NaN guard. Lightning's closure then zeroes the gradients before it calls ``backward``: the step's gradients are
  set aside after the schedule and put back in :meth:`PipelineStrategy.backward` (no autograd backward there; the
  ``on_before_backward`` / ``on_after_backward`` hooks still fire around it).
- The tied weight (the first stage's ``transformer.wte.weight``, the last's ``lm_head.weight``): its two gradients
  are summed over the ranks holding them before anything reads them, both copies sit in the head's optimizer group
  (its weight decay), the gradient norm counts it once, and checkpoints hold its optimizer state once, under the
  first stage's name, as the unsplit GPT's.
- Gradient clipping: the norm over every stage (each rank's squares summed over the pipeline group).
- Checkpoints: torch's distributed checkpoint, keyed by the unsplit GPT's names, the optimizer state flattened
  (``flatten_optimizer_state_dict``: Lightning's nested layout numbers each stage's parameter groups alike, and the
  stages' entries collide), written and read as :class:`~lit_ddp.strategies.FSDP2Strategy` writes and reads them.
- Evaluation: a forward-only pass of its own over the stages (torch's schedules size a stage's buffers at its first
  batch, and their V schedules run backward actions in ``eval()``), so batches of any size run, neither padded nor
  dropped; FSDP2 gathers each stage's parameters once for the whole evaluation.
- Text samples: every stage's parameters gathered on rank zero, which samples from a plain GPT
  (:meth:`PipelineStrategy.full_model_state`).
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from lit_ddp.models.gpt import GPT
from lit_ddp.models.parallelize import (
    SINGLE_STAGE,
    V_SHAPED,
    GPTStages,
    check_schedule,
    clip_grad_norm_,
    shard,
    split_stages,
    stage_indices,
    stages_per_rank_for,
)
from lit_ddp.run_dir import sharded
from lit_ddp.strategies.fsdp import FSDP2Strategy, is_strided

SCHEDULES: dict[str, type] = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "LoopedBFS": ScheduleLoopedBFS,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
}
"""The schedules ``schedule`` names (:data:`lit_ddp.models.parallelize.SCHEDULE_NAMES`), torch's classes."""
PIPELINE = "pipeline_parallel"
"""The pipeline dimension of the device_mesh (outermost), beside Lightning's ``data_parallel`` and
``tensor_parallel``."""


class PipelineStrategy(FSDP2Strategy):
    """Lightning's ``ModelParallelStrategy`` on a ``pipeline_parallel_size`` x data-parallel x
    ``tensor_parallel_size`` device_mesh (pipeline outermost): every rank holds some pipeline stages of the GPT,
    within a stage FSDP2 shards over the data-parallel ranks (when there are several) and tensor parallelism splits
    each block (when ``tensor_parallel_size`` > 1). The ranks of a pipeline read the same batches (the data-parallel
    coordinate decides them: :func:`lit_ddp.data.samplers.this_process`). How a step runs: the module docstring.

    Args:
        pipeline_parallel_size: ranks per pipeline (a divisor of the world size with ``tensor_parallel_size``); 1:
            one rank holds every stage (microbatches run one after the other, as gradient accumulation).
        schedule: the order of the microbatches' forwards and backwards, one of :data:`SCHEDULES` (torch's
            ``Schedule<name>``): ``GPipe`` (every forward, then every backward), ``1F1B`` (one forward, one backward:
            fewer activations held), ``Interleaved1F1B`` / ``LoopedBFS`` / ``InterleavedZeroBubble`` (several
            stages per rank in a loop: a smaller bubble), ``ZBVZeroBubble`` / ``DualPipeV`` (two per rank in a V,
            weight gradients computed apart to fill the bubble).
        n_microbatches: microbatches each batch is cut into (a divisor of the per-rank batch size): more of them, a
            smaller bubble ((p - 1) / (m + p - 1) of the time for GPipe and 1F1B) and smaller matrix products.
        stages_per_rank: stages each rank holds; None: 1 for GPipe and 1F1B, 2 for the others (the V schedules
            take exactly 2).
        units: class paths of the modules that each become an FSDP unit within a stage
            (``lit_ddp.models.gpt.Block``); each stage is sharded as a root around them. Used where the
            data-parallel size is more than 1.
        tensor_parallel_size: ranks per tensor-parallel group within a stage; 1: none.
        tensor_parallel_plan: as :class:`~lit_ddp.strategies.FSDP2Strategy`'s (``lit_ddp.strategies.gpt_tensor_parallel``).
        save_distributed_checkpoint: must be true: a single-file checkpoint would gather the whole state on rank
            zero, which holds one stage only.
        async_save: as :class:`~lit_ddp.strategies.FSDP2Strategy`'s.
        process_group_backend: None: gloo on CPU, NCCL on CUDA.
        timeout: the timeout of the process group's collectives.

    Raises:
        ValueError: an unknown schedule, a number of stages per rank or of microbatches it cannot run,
            ``save_distributed_checkpoint`` false, or :class:`~lit_ddp.strategies.FSDP2Strategy`'s; at set-up, a
            world size that ``pipeline_parallel_size`` x ``tensor_parallel_size`` does not divide, more stages than
            the GPT has blocks, ``compile`` set, fp16 precision (its loss scaler would not see the schedule's
            backward), a module whose ``model`` is not a GPT, a batch that the microbatches do not divide.
    """

    def __init__(
        self,
        pipeline_parallel_size: int = 2,
        schedule: str = "1F1B",
        n_microbatches: int = 4,
        stages_per_rank: int | None = None,
        units: list[str] | None = None,
        tensor_parallel_size: int = 1,
        tensor_parallel_plan: str | None = None,
        save_distributed_checkpoint: bool = True,
        async_save: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        if pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size={pipeline_parallel_size} must be >= 1")
        self.stages_per_rank = stages_per_rank_for(schedule, stages_per_rank)
        check_schedule(schedule, pipeline_parallel_size, n_microbatches, self.stages_per_rank)
        if not save_distributed_checkpoint:
            raise ValueError(
                "save_distributed_checkpoint=false: a single-file checkpoint gathers the full state on rank zero, "
                "which holds one pipeline stage; PipelineStrategy writes sharded ones (give true)"
            )
        super().__init__(
            units=units,
            tensor_parallel_size=tensor_parallel_size,
            tensor_parallel_plan=tensor_parallel_plan,
            save_distributed_checkpoint=True,
            async_save=async_save,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.pipeline_parallel_size = pipeline_parallel_size
        self.schedule_name = schedule
        self.n_microbatches = n_microbatches
        self.n_stages = pipeline_parallel_size * self.stages_per_rank
        self.pipeline_mesh: DeviceMesh | None = None
        self.schedule: Any = None
        self.stages: GPTStages | None = None
        self.tied_first: nn.Parameter | None = None  # this rank's copies of the tied weight: the first stage's
        self.tied_last: nn.Parameter | None = None  # and the last stage's (both here in a V; none on middle ranks)
        self.tie_group: Any = None  # the other rank holding a copy (None: both here, or none)
        self.last_stage_rank = 0  # the global rank of this pipeline's last stage
        self.set_aside: dict[nn.Parameter, torch.Tensor] = {}  # the step's gradients, through Lightning's zero_grad

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``pipeline_parallel`` x ``data_parallel`` x ``tensor_parallel`` mesh (Lightning's own is 2-D)."""
        if self.pipeline_mesh is None:
            raise RuntimeError("the device mesh is built when the processes have started (setup_environment)")
        return self.pipeline_mesh

    def setup_environment(self) -> None:
        pp, tp = self.pipeline_parallel_size, self.tensor_parallel_size
        if self.world_size % (pp * tp):
            raise ValueError(
                f"pipeline_parallel_size={pp} x tensor_parallel_size={tp} does not divide the world size "
                f"{self.world_size} (nodes x devices): give sizes whose product divides it"
            )
        super().setup_environment()  # the process group, and Lightning's (pp x dp) x tp mesh
        dims = (pp, self.world_size // (pp * tp), tp)
        self.pipeline_mesh = init_device_mesh(
            self.root_device.type, dims, mesh_dim_names=(PIPELINE, "data_parallel", "tensor_parallel")
        )

    def parallelize(self, module: Any, param_dtype: torch.dtype | None) -> None:
        """Replaces ``module.model`` (a GPT) by this rank's stages, each with tensor parallelism and FSDP2 as the
        sizes ask, and builds the schedule over them."""
        gpt = getattr(module, "model", None)
        if not isinstance(gpt, GPT):
            raise ValueError(f"PipelineStrategy splits a LightningModule's GPT (its .model), not {type(gpt).__name__}")
        if self.n_stages > gpt.config.n_layer:
            raise ValueError(
                f"{self.n_stages} pipeline stages ({self.pipeline_parallel_size} ranks x {self.stages_per_rank}) for "
                f"n_layer={gpt.config.n_layer} blocks: give at most one stage per block"
            )
        if module.trainer is not None and str(module.trainer.precision).startswith("16"):
            raise ValueError(f"precision={module.trainer.precision} under PipelineStrategy: use bf16-mixed or 32-true")
        self.precision_plugin.clip_grad_by_norm = self.clip_grad_by_norm  # type: ignore[method-assign]
        mesh = self.device_mesh
        pp_mesh, dp_mesh = mesh[PIPELINE], mesh["data_parallel"]
        pp_rank = pp_mesh.get_local_rank()
        indices = stage_indices(self.schedule_name, self.pipeline_parallel_size, pp_rank, self.stages_per_rank)
        stages = split_stages(gpt, self.n_stages, indices)
        for stage in stages:
            if self.plan is not None:
                self.plan(stage, mesh["tensor_parallel"])
            if dp_mesh.size() > 1:  # FSDP2 over one rank would only add hooks
                strided = [p for p in stage.parameters() if p.ndim == 2 and is_strided(p)]
                shard(stage, dp_mesh, self.units, param_dtype, by_columns=strided, reshard_after_forward=False)
        self.stages = GPTStages(gpt.config, stages)
        self.stages.pipeline = self.run_pipeline
        module.model = self.stages
        first, last = stages[0] if stages[0].is_first else None, stages[-1] if stages[-1].is_last else None
        if self.n_stages > 1:
            self.tied_first = first.get_parameter("transformer.wte.weight") if first is not None else None
            self.tied_last = last.get_parameter("lm_head.weight") if last is not None else None
        self.tie_group = self.tied_weight_group(pp_mesh)
        last_pp_rank = 0 if self.schedule_name in V_SHAPED else (self.n_stages - 1) % self.pipeline_parallel_size
        self.last_stage_rank = dist.get_global_rank(pp_mesh.get_group(), last_pp_rank)
        device = self.root_device
        pipeline_stages = [PipelineStage(s, s.index, self.n_stages, device, group=pp_mesh.get_group()) for s in stages]
        schedule_class = SCHEDULES[self.schedule_name]
        self.schedule = schedule_class(
            pipeline_stages[0] if self.schedule_name in SINGLE_STAGE else pipeline_stages,
            n_microbatches=self.n_microbatches,
            loss_fn=self.microbatch_loss,
            scale_grads=False,
        )

    def tied_weight_group(self, pp_mesh: DeviceMesh) -> Any:
        """The process group of the two ranks that hold the tied weight's copies in this pipeline (the first
        stage's and the last stage's), or None where one rank holds both or there is one stage. Every rank creates
        every pipeline's group (``new_group`` is collective)."""
        if self.n_stages == 1 or self.schedule_name in V_SHAPED or self.pipeline_parallel_size == 1:
            return None
        last_pp_rank = (self.n_stages - 1) % self.pipeline_parallel_size
        if last_pp_rank == 0:
            return None
        ranks = self.device_mesh.mesh  # (pp, dp, tp) global ranks
        mine = None
        for dp in range(ranks.size(1)):
            for tp in range(ranks.size(2)):
                pair = [int(ranks[0, dp, tp]), int(ranks[last_pp_rank, dp, tp])]
                group = dist.new_group(pair)
                if dist.get_rank() in pair:
                    mine = group
        return mine

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # parallelize, then the optimizers over the stages' parameters
        for optimizer in self.optimizers:
            self.tied_copies_in_one_group(optimizer)

    def tied_copies_in_one_group(self, optimizer: torch.optim.Optimizer) -> None:
        """On a rank holding both copies of the tied weight (a V schedule's first), moves the first stage's into the
        parameter group of the last stage's (the head's, a Linear weight's: weight decay), where the unsplit GPT's
        one parameter is. (A rank holding one copy holds it under the head's name too: its group is right.)"""
        first, last = self.tied_first, self.tied_last
        if first is None or last is None:
            return
        groups = optimizer.param_groups
        where = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
        source, target = where[id(first)], where[id(last)]
        if source != target:
            groups[source]["params"] = [q for q in groups[source]["params"] if q is not first]
            groups[target]["params"].append(first)

    def microbatch_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one microbatch, what the schedule differentiates: the mean cross-entropy as
        :meth:`GPT.forward <lit_ddp.models.gpt.GPT.forward>` computes it (``logits (b, T, V)``, ``targets (b, T)``),
        over microbatches x ``accumulate_grad_batches``."""
        B, T = targets.shape
        loss = F.cross_entropy(logits.view(B * T, -1).float(), targets.reshape(B * T), ignore_index=-1)
        return loss / (self.n_microbatches * self.accumulation)

    @property
    def accumulation(self) -> int:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return int(getattr(trainer, "accumulate_grad_batches", 1) or 1)

    def run_pipeline(self, idx: torch.Tensor, targets: torch.Tensor | None) -> tuple[None, torch.Tensor]:
        """The GPT's call under the schedule: ``idx (B, T)``, ``targets (B, T)`` -> ``(None, loss)``, the batch's mean
        cross-entropy on every rank (no logits: they stay on the last stage). Training: every microbatch's forward
        and backward, the gradients set aside for :meth:`backward`. Collective over the pipeline.

        Raises:
            ValueError: no targets, or (training) a batch size that ``n_microbatches`` does not divide.
        """
        if targets is None:
            raise ValueError("under PipelineStrategy the GPT is called with targets (its loss is what the stages send)")
        assert self.schedule is not None and self.stages is not None
        if not self.stages.training:
            return None, self.evaluate(idx, targets)
        if idx.size(0) % self.n_microbatches:
            raise ValueError(
                f"a batch of {idx.size(0)} does not split into n_microbatches={self.n_microbatches}: give a "
                "data.batch_size that is a multiple of it"
            )
        # The gradients there are the last step's (Lightning zeroes them after this, before backward) or, within
        # gradient accumulation, the earlier batches': this batch's are set aside for backward() to add.
        params = [p for p in self.stages.parameters() if p.requires_grad]
        earlier = {p: p.grad for p in params}
        for p in params:
            p.grad = None
        losses: list[torch.Tensor] = []  # the last stage's, as the schedule scaled them
        inputs = (idx,) if self.stages.stages[0].is_first else ()
        self.schedule.step(*inputs, target=targets, losses=losses, return_outputs=False)
        self.sum_tied_gradients()
        self.set_aside = {p: p.grad for p in params if p.grad is not None}
        for p in params:
            p.grad = earlier[p]
        scale = self.n_microbatches * self.accumulation
        mean = torch.stack(losses).detach().sum() * scale / self.n_microbatches if losses else None
        return None, self.from_last_stage(mean)

    def evaluate(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy over ``targets``' tokens (id -1 ignored), from a forward-only pass of its own over
        the stages (torch's V schedules run their backward actions in ``eval()`` too, torch 2.13): the batch cut
        into ``n_microbatches`` pieces (or one per row, when it has fewer), each stage's pieces in turn, sent on as
        they are done, so that the ranks overlap as in GPipe's forward. Any batch size runs, nothing is padded or
        dropped: the receiver learns each piece's shape from a header sent before it."""
        assert self.stages is not None
        group = self.device_mesh[PIPELINE].get_group()
        n = min(self.n_microbatches, idx.size(0))  # every rank of the pipeline has the batch: the same pieces
        pieces = list(zip(idx.tensor_split(n), targets.tensor_split(n), strict=True))
        here = {stage.index for stage in self.stages.stages}
        kept: dict[tuple[int, int], torch.Tensor] = {}  # (stage, piece) -> output, for this rank's next stage
        sends: list[Any] = []
        total = torch.zeros((), device=self.root_device)
        for stage in self.stages.stages:
            for j, (x, y) in enumerate(pieces):
                if stage.is_first:
                    inputs = x
                elif stage.index - 1 in here:
                    inputs = kept.pop((stage.index - 1, j))
                else:
                    inputs = _receive(self.stage_rank(stage.index - 1), group, self.root_device)
                out = stage(inputs)
                if stage.is_last:
                    flat = out.reshape(-1, out.size(-1)).float()
                    total = total + F.cross_entropy(flat, y.reshape(-1), ignore_index=-1, reduction="sum")
                elif stage.index + 1 in here:
                    kept[(stage.index, j)] = out
                else:
                    sends += _send(out, self.stage_rank(stage.index + 1), group)
        for work in sends:
            work.wait()
        mean = total / (targets != -1).sum() if self.stages.stages[-1].is_last else None
        return self.from_last_stage(mean)

    def on_validation_start(self) -> None:
        """FSDP2 gathers each stage's parameters once for the whole evaluation (:meth:`gather_stages`)."""
        super().on_validation_start()
        self.gather_stages(True)

    def on_validation_end(self) -> None:
        self.gather_stages(False)
        super().on_validation_end()

    def on_test_start(self) -> None:
        super().on_test_start()
        self.gather_stages(True)

    def on_test_end(self) -> None:
        self.gather_stages(False)
        super().on_test_end()

    def gather_stages(self, whole: bool) -> None:
        """Every FSDP2 unit of the stages all-gathered (``whole``) or back to its shards. Evaluation runs between
        the two, so that its forwards are no collective over the data-parallel ranks, whose evaluation sets may
        differ by a batch (each window once: ``UnrepeatedDistributedSampler``)."""
        for stage in self.stages.stages if self.stages is not None else ():
            for module in stage.modules():
                if isinstance(module, FSDPModule) and whole:
                    module.unshard()
                elif isinstance(module, FSDPModule):
                    module.reshard()

    def stage_rank(self, index: int) -> int:
        """The global rank, in this rank's pipeline, of the one that holds stage ``index``."""
        p = self.pipeline_parallel_size
        pp_rank = index % p if self.schedule_name not in V_SHAPED else min(index, 2 * p - 1 - index)
        return dist.get_global_rank(self.device_mesh[PIPELINE].get_group(), pp_rank)

    def from_last_stage(self, value: torch.Tensor | None) -> torch.Tensor:
        """``value`` (a scalar the last stage computed) on every rank of the pipeline."""
        out = value.detach().float().reshape(()) if value is not None else torch.zeros((), device=self.root_device)
        out = out.to(self.root_device).clone()
        if self.pipeline_parallel_size > 1:
            dist.broadcast(out, src=self.last_stage_rank, group=self.device_mesh[PIPELINE].get_group())
        return out

    def sum_tied_gradients(self) -> None:
        """Each copy of the tied weight gets the sum of both copies' gradients (the gradient of the one weight the
        unsplit GPT has), over the two ranks that hold them."""
        grads = [p.grad for p in (self.tied_first, self.tied_last) if p is not None]
        if not grads or any(g is None for g in grads):
            return
        local = [_local(g) for g in grads if g is not None]
        total = local[0] if len(local) == 1 else local[0] + local[1]
        if self.tie_group is not None:
            total = total.contiguous()
            dist.all_reduce(total, group=self.tie_group)
        for g in local:
            g.copy_(total)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Lightning's backward step after its ``zero_grad``: the schedule computed the gradients already (in
        ``training_step``); they go back in place here, between the ``on_before_backward`` and ``on_after_backward``
        hooks."""
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        for p, grad in self.set_aside.items():
            p.grad = grad if p.grad is None else p.grad + grad
        self.set_aside = {}
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        """The precision plugin's ``clip_grad_by_norm``: the norm over every stage's gradients, the tied weight
        counted once (:func:`lit_ddp.models.parallelize.clip_grad_norm_`)."""
        uncounted = [self.tied_last] if self.tied_last is not None else []  # the first stage's copy counts
        group = self.device_mesh[PIPELINE].get_group() if self.pipeline_parallel_size > 1 else None
        clip_grad_norm_(self.precision_plugin.main_params(optimizer), clip_val, uncounted=uncounted, group=group)

    # Checkpoints: the unsplit GPT's names, the optimizer state flattened, the tied weight's state once.

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer's
        return self.flat_optimizer_state(optimizer, StateDictOptions(cpu_offload=True))

    def flat_optimizer_state(self, optimizer: torch.optim.Optimizer, options: StateDictOptions) -> dict[str, Any]:
        """The optimizer's state flattened (``state.<name>.exp_avg``, ``param_groups.<name>.lr``, ...), the last
        stage's copy of the tied weight under the first stage's name (once, where one rank holds both)."""
        assert self.model is not None
        flat = get_optimizer_state_dict(
            self.model, optimizer, options=dataclasses.replace(options, flatten_optimizer_state_dict=True)
        )
        head, embedding = self.tied_names()
        if head is None:
            return flat
        out: dict[str, Any] = {}
        for key, value in flat.items():
            renamed = _rename(key, head, embedding)
            if renamed == key or renamed not in flat:
                out[renamed] = value
        return out

    def tied_names(self) -> tuple[str | None, str]:
        """The checkpoint names of the tied weight's last-stage copy (None: not held apart from the first stage's
        on this rank) and of the first stage's, as the LightningModule names them."""
        prefix = "model."
        embedding = prefix + "transformer.wte.weight"
        if self.tied_first is None or self.tied_last is None:  # one copy here (or none): named as the GPT's
            return None, embedding
        return prefix + "lm_head.weight", embedding

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """:class:`~lit_ddp.strategies.FSDP2Strategy`'s load of a sharded checkpoint, into this rank's stages.

        Raises:
            ValueError: a single-file checkpoint (DDP's, FSDP2's full state): its optimizer state is numbered in
                the whole model's order, which no stage has.
        """
        if self.model is not None and not sharded.is_sharded(Path(str(checkpoint_path))):
            raise ValueError(
                f"{checkpoint_path} is a single-file checkpoint, which PipelineStrategy does not load (its optimizer "
                "state is numbered in the whole model's order): resume it with the strategy that wrote it, or from a "
                "sharded checkpoint (a pipeline's, of any pipeline_parallel_size)"
            )
        return super().load_checkpoint(checkpoint_path, weights_only)

    def sharded_state(self) -> dict[str, Any]:
        assert self.model is not None
        states: dict[str, Any] = {"state_dict": get_model_state_dict(self.model)}
        options = StateDictOptions()
        return states | {f"optimizer_{i}": self.flat_optimizer_state(o, options) for i, o in enumerate(self.optimizers)}

    def apply_sharded_state(self, key: str, restored: dict[str, Any]) -> None:
        model = self.model
        assert model is not None and self.lightning_module is not None
        if key == "state_dict":
            model.load_state_dict(restored, strict=self.lightning_module.strict_loading)
            return
        optimizer = self.optimizers[int(key.split("_")[1])]
        head, embedding = self.tied_names()
        state = dict(restored)
        if head is not None:  # the last stage's copy, read under the first stage's name (flat_optimizer_state)
            live = get_optimizer_state_dict(
                model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
            )
            state = {}
            for name, value in restored.items():
                if name in live:
                    state[name] = value
                if (own := _rename(name, embedding, head)) != name and own in live:
                    state[own] = _copied(value) if name in live else value
        options = StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)
        set_optimizer_state_dict(model, optimizer, state, options=options)

    def full_model_state(self, model: nn.Module) -> dict[str, Any] | None:
        """The GPT's full state dict (the unsplit names, CPU tensors) on global rank zero, None elsewhere: each
        stage's gathered within its ranks, then every stage's sent to rank zero. Collective."""
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        state = {k: v.detach().cpu() for k, v in full.items() if isinstance(v, torch.Tensor)}
        mesh = self.device_mesh
        if self.pipeline_parallel_size == 1 or not (
            mesh["data_parallel"].get_local_rank() == 0 and mesh["tensor_parallel"].get_local_rank() == 0
        ):
            return state if self.is_global_zero else None
        group = mesh[PIPELINE].get_group()
        gathered: list[Any] | None = [None] * self.pipeline_parallel_size if self.is_global_zero else None
        dist.gather_object(state, gathered, dst=0, group=group)
        if not self.is_global_zero:
            return None
        assert gathered is not None
        return {k: v for part in gathered for k, v in part.items()}


def _rename(key: str, old: str, new: str) -> str:
    """A flattened optimizer-state key (``state.<name>.<entry>``, ``param_groups.<name>.<entry>``) with the parameter
    name ``old`` replaced by ``new``; others as they are."""
    for section in ("state", "param_groups"):
        if key.startswith(f"{section}.{old}."):
            return f"{section}.{new}." + key[len(section) + len(old) + 2 :]
    return key


def _copied(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The activation dtypes :func:`_send` announces, by index."""


def _send(tensor: torch.Tensor, dst: int, group: Any) -> list[Any]:
    """Sends ``tensor`` (an evaluation's activations, up to 3-D) to global rank ``dst``: a header ``[ndim, *shape,
    dtype]`` first, then the tensor; returns the sends to wait on."""
    tensor = tensor.detach().contiguous()
    shape = list(tensor.shape) + [0] * (3 - tensor.ndim)
    header = torch.tensor([tensor.ndim, *shape, DTYPES.index(tensor.dtype)], dtype=torch.int64, device=tensor.device)
    return [dist.isend(header, dst, group=group), dist.isend(tensor, dst, group=group)]


def _receive(src: int, group: Any, device: torch.device) -> torch.Tensor:
    """What :func:`_send` sent from global rank ``src``."""
    header = torch.empty(5, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    ndim, *shape, dtype = header.tolist()
    tensor = torch.empty(shape[:ndim], dtype=DTYPES[dtype], device=device)
    dist.recv(tensor, src, group=group)
    return tensor
