"""FSDP2 sized by config, and the GPT's tensor-parallel plan for it.

:class:`FSDP2Strategy` is the step after DDP in the torch.distributed overview: when the parameters, gradients and
optimizer state of a model no longer fit on one device, FSDP2 (``fully_shard``) keeps ``1/world_size`` of each on
every rank and all-gathers a block's parameters only while it computes. ``configs/trainer/fsdp.yaml`` names it in
place of DDP; the LightningModule stays the one DDP trains. With ``tensor_parallel_size`` > 1 it splits each layer
over a tensor-parallel mesh dimension too (:func:`gpt_tensor_parallel`, ``configs/trainer/tp.yaml``).
"""

from __future__ import annotations

import copy
import importlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from lit_ddp import compat
from lit_ddp.models.parallelize import GPTStages, clip_grad_norm_, shard, tensor_parallel
from lit_ddp.run_dir import sharded, untrusted
from lit_ddp.strategies import loopback


def forward_is_collective(module: nn.Module) -> bool:
    """Whether ``module`` holds FSDP2 units, tensor-parallel parameters (``DTensor``) or pipeline stages
    (:class:`~lit_ddp.models.parallelize.GPTStages`): then each forward all-gathers, all-reduces or passes
    activations between ranks, so every rank must run it (a text sample too: the same tokens everywhere, from a
    seeded generator)."""
    return any(isinstance(m, FSDPModule | GPTStages) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` that applies FSDP2 and tensor parallelism itself, after
    ``configure_model``, on a ``world_size / tensor_parallel_size`` x ``tensor_parallel_size`` device_mesh.

    Lightning's ``ModelParallelStrategy`` leaves the sharding to each LightningModule's ``configure_model`` and
    sizes its mesh ``num_nodes`` x devices per node (tensor parallel within a node); ``FSDPStrategy``, which
    shards by a policy, is FSDP1 and refuses CPUs (Lightning issue 21812). Here the modules DDP trains
    are sharded unchanged, by the ``units`` named in YAML (torchtitan's layout: a unit per block, the rest in the
    root), and the same config runs on 2 CPU processes and on 8 GPUs. The sizes are set through
    :func:`lit_ddp.compat.set_model_parallel_sizes`.

    Args:
        units: class paths of the modules that each become an FSDP unit (``lit_ddp.models.gpt.Block``); each of
            the LightningModule's child modules with parameters is sharded as a root around them.
        tensor_parallel_size: ranks per tensor-parallel group (a divisor of the world size); 1: FSDP2 alone. The
            ranks of a group read the same batches; FSDP2 shards over the groups (when there is more than one).
        tensor_parallel_plan: class path of the function that splits a model over the tensor-parallel mesh,
            ``(module, mesh) -> module`` (:func:`gpt_tensor_parallel` for the GPT); needed
            when ``tensor_parallel_size`` > 1.
        save_distributed_checkpoint: True: a directory of shards per checkpoint (torch's Distributed
            Checkpoint: each rank writes its own, and a checkpoint of N processes resumes on any number), put in
            place atomically (:mod:`lit_ddp.run_dir.sharded`); False: one file with the full state, gathered on
            rank zero, as DDP writes.
        async_save: with ``save_distributed_checkpoint``: DCP's ``async_save`` copies the shards to host memory
            and writes them in a background thread (its collectives on a process group of their own) while
            training goes on. A checkpoint appears (is committed) once every rank has written it, which the
            strategy checks at the next save, at a preemption's save and at the end of the run; until then
            resume picks the one before. Costs host memory for one more copy of each rank's shards.
        process_group_backend: None: gloo on CPU, NCCL on CUDA.
        timeout: the timeout of the process group's collectives.

    Raises:
        ValueError: ``tensor_parallel_size`` < 1, or > 1 without a plan; ``async_save`` without
            ``save_distributed_checkpoint``; a unit that is not a module class, a plan that is not a function; at
            set-up, a world size that ``tensor_parallel_size`` does not divide, a LightningModule whose ``compile``
            is set (``True``, ``"model"`` or ``"blocks"`` alike; a compiled whole forward would skip the hooks that
            gather the shards).
    """

    def __init__(
        self,
        units: list[str] | None = None,
        tensor_parallel_size: int = 1,
        tensor_parallel_plan: str | None = None,
        save_distributed_checkpoint: bool = False,
        async_save: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        if tensor_parallel_size < 1 or (tensor_parallel_size > 1 and tensor_parallel_plan is None):
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size}: give 1 (FSDP2 alone), or a size > 1 with "
                "tensor_parallel_plan (e.g. lit_ddp.strategies.gpt_tensor_parallel)"
            )
        if async_save and not save_distributed_checkpoint:
            raise ValueError(
                "async_save=true writes sharded checkpoints in the background: give save_distributed_checkpoint: "
                "true with it (single-file checkpoints: the plugin lit_ddp.resilience.checkpoint_io.AsyncAtomicCheckpointIO)"
            )
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.tensor_parallel_size = tensor_parallel_size
        self.save_distributed_checkpoint = save_distributed_checkpoint
        self.async_save = async_save
        self._writing: tuple[Any, str, str] | None = None  # async_save's (future, directory written, its path)
        self._checkpoint_group: Any = None
        self.units = tuple(_module_class(path) for path in units or [])
        self.plan = _function(tensor_parallel_plan) if tensor_parallel_plan else None

    def setup_environment(self) -> None:
        if self.world_size % self.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} does not divide the world size {self.world_size} "
                "(nodes x devices): give a divisor of it"
            )
        compat.set_model_parallel_sizes(self, self.world_size // self.tensor_parallel_size, self.tensor_parallel_size)
        compat.threads_like_rank_zero(self.num_processes)  # every rank as many as rank zero (compat says why)
        loopback.init_process_group(self)  # a one-machine run listens on loopback only
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        module = self.lightning_module
        assert module is not None
        if compile_choice := module.hparams.get("compile"):
            raise ValueError(f"compile={compile_choice} does not work with {type(self).__name__} yet: give false")
        dtype = {"bf16": torch.bfloat16, "16": torch.float16}.get(str(trainer.precision).split("-")[0])
        self.parallelize(module, dtype)
        super().setup(trainer)  # then the optimizers, over the shards
        if self.async_save and self._checkpoint_group is None:  # every rank, in step: a collective
            self._checkpoint_group = dist.new_group(backend="gloo", timeout=compat.strategy_timeout(self))

    def parallelize(self, module: Any, param_dtype: torch.dtype | None) -> None:
        """Splits each of the LightningModule's child modules over the tensor-parallel mesh (with a plan) and shards
        it over the data-parallel one, in place, before the optimizers are built; ``param_dtype``: the dtype FSDP2
        gathers parameters in (bf16 under ``bf16-mixed``)."""
        if self.plan is not None:  # torch's clip_grad_norm_ refuses a mix of split (DTensor) and whole parameters
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        mesh = self.device_mesh
        for child in module.children():
            if any(p.requires_grad for p in child.parameters()) and not forward_is_collective(child):
                if self.plan is not None:
                    self.plan(child, mesh["tensor_parallel"])
                if self.plan is None or mesh["data_parallel"].size() > 1:  # FSDP2 over one rank would only add hooks
                    strided = [p for p in child.parameters() if p.ndim == 2 and is_strided(p)]
                    shard(child, mesh["data_parallel"], self.units, param_dtype=param_dtype, by_columns=strided)

    def _clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        """The precision plugin's ``clip_grad_by_norm`` under tensor parallelism (Lightning's calls torch's)."""
        clip_grad_norm_(self.precision_plugin.main_params(optimizer), clip_val)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Lightning's save; a sharded checkpoint goes to a hidden directory first, and rank zero swaps it into place
        once every rank has written its shards (a kill mid-save leaves the previous checkpoint chosen)."""
        if not self.save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        self.finish_checkpoint_writes()  # one write in flight at most: the one before is committed first
        path = self.broadcast(str(filepath))
        written: str = self.broadcast(sharded.temporary_directory(path) if self.is_global_zero else "")
        for key in ("state_dict", "optimizer_states"):  # DCP writes one box per rank: strided rows as contiguous ones
            if key in checkpoint:
                checkpoint[key] = _mapped(checkpoint[key], _contiguous)
        if self.async_save:  # as Lightning's save lays it out, through DCP's async_save
            states = {"state_dict": checkpoint.pop("state_dict")}
            states |= {f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))}
            future = dcp.async_save(states, checkpoint_id=written, process_group=self._checkpoint_group)
            if self.is_global_zero:
                torch.save(checkpoint, Path(written) / sharded.META)
            self._writing = (future, written, path)
            return
        super().save_checkpoint(checkpoint, written, storage_options)  # every rank its shards, rank zero meta.pt
        self._commit(written, path)

    def finish_checkpoint_writes(self) -> None:
        """Waits for the checkpoint ``async_save`` is writing, on every rank, and puts it in place; nothing without
        one. Every rank calls it at the same point (a barrier).

        Raises:
            Exception: the background write's error (the checkpoint is not committed).
        """
        if self._writing is None:
            return
        (future, written, path), self._writing = self._writing, None
        future.result()
        self._commit(written, path)

    def _commit(self, written: str, path: str) -> None:
        self.barrier("lit_ddp_sharded_checkpoint_written")
        if self.is_global_zero:
            sharded.commit(written, path)
        self.barrier("lit_ddp_sharded_checkpoint_committed")

    def on_train_end(self) -> None:
        """The last checkpoint goes into place before the run ends (after the callbacks' ``on_train_end``)."""
        self.finish_checkpoint_writes()
        super().on_train_end()

    def teardown(self) -> None:
        # A run that failed leaves an async write uncommitted: waiting would wait on the rank that failed, and
        # resume never picks a temporary directory.
        self._writing = None
        super().teardown()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's load for a single-file checkpoint, its optimizer state (DDP's) read in the optimizer's order
        (:func:`lit_ddp.compat.rekey_optimizer_states_by_groups`). A sharded checkpoint is read as Lightning reads
        one (the module's shards, then each optimizer's, then ``meta.pt``), but through
        :mod:`lit_ddp.run_dir.untrusted`'s reader (no code from its files runs) and, for strided parameters (tensor
        parallelism's q, k, v rows), through contiguous rows (as :meth:`save_checkpoint` wrote them), which then go
        back to the strided layout.

        Every file is verified against its digests before anything of it is restored (a single file's CRC-32s;
        each shard entry this rank reads, and the ``.metadata``'s digest record: :mod:`lit_ddp.run_dir.integrity`).

        Raises:
            DamagedCheckpointError: a file's bytes differ from their digests (the file and tensor named).
            ValueError: a single-file (full-state) checkpoint for a model with strided parameters: Lightning loads
                it with torch's ``set_model_state_dict(broadcast_from_rank0=True)``, whose
                ``_state_dict_utils._distribute_tensors`` gives each rank a contiguous block of rows, not its rows
                of q, of k and of v (torch 2.13; a resumed run's c_attn weights ended 1.1 apart, relative, from the
                uninterrupted run's). No upstream issue found yet; ``tests/system/test_fsdp.py`` shows it.
            UntrustedFileError: a file of the checkpoint holds more than its own classes, tensors and plain data.
        """
        model = self.model
        if model is None:
            return super().load_checkpoint(checkpoint_path, weights_only)
        path = Path(self.broadcast(str(checkpoint_path)))
        strided = any(is_strided(p) for p in model.parameters())
        if not sharded.is_sharded(path):
            if strided:
                raise ValueError(
                    f"{path} is a single-file checkpoint, which cannot be loaded into tensor-parallel parameters yet "
                    "(c_attn's rows would land in the wrong places): resume from a sharded one "
                    "(save_distributed_checkpoint: true, as configs/trainer/tp.yaml writes), or train on without "
                    "tensor parallelism"
                )
            untrusted.verify_path(path)  # Lightning's reader memory-maps it unchecked
            with compat.rekey_optimizer_states_by_groups(model, self.optimizers):  # DDP's numbers its parameters
                return super().load_checkpoint(checkpoint_path, weights_only)
        # Read here rather than by Lightning's, whose DCP reader unpickles the metadata with pickle.load; no more than
        # this model can hold (untrusted.bounded_by).
        with untrusted.bounded_by(model):
            untrusted.verify_path(path / sharded.META)  # before any shard is read into the model
            for key, restored in self.read_sharded_state(path, copy=False).items():
                self.apply_sharded_state(key, restored)
            return untrusted.load(path / sharded.META)

    def apply_sharded_state(self, key: str, restored: dict[str, Any]) -> None:
        """Puts one entry of :meth:`read_sharded_state` (``state_dict``, ``optimizer_<i>``) into the module or that
        optimizer."""
        model = self.model
        assert model is not None and self.lightning_module is not None
        if key == "state_dict":
            model.load_state_dict(restored, strict=self.lightning_module.strict_loading)
        else:
            optimizer = self.optimizers[int(key.split("_")[1])]
            set_optimizer_state_dict(model, optimizer, restored, options=StateDictOptions(cpu_offload=True))

    def full_model_state(self, model: nn.Module) -> dict[str, Any] | None:
        """``model``'s full state dict (whole CPU tensors) on global rank zero, None elsewhere: one all-gather per
        parameter. Collective."""
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.is_global_zero else None

    def sharded_state(self) -> dict[str, Any]:
        """The module's and optimizers' live state as a sharded checkpoint holds it: ``{"state_dict": ...,
        "optimizer_0": ...}`` (torch's ``get_model_state_dict`` / ``get_optimizer_state_dict``; this rank's
        ``DTensor`` shards)."""
        model = self.model
        assert model is not None, "the strategy's model is set up first"
        states: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
        return states | {f"optimizer_{i}": get_optimizer_state_dict(model, o) for i, o in enumerate(self.optimizers)}

    def read_sharded_state(self, path: Any, copy: bool = True) -> dict[str, Any]:
        """The sharded checkpoint at ``path`` read into :meth:`sharded_state`'s layout (resharded by torch's
        distributed checkpoint where the world size changed): into copies of the live tensors (``copy``; the restore
        check compares them with the live ones), or into the live tensors themselves (a load). Collective.
        """
        read = {}
        for key, state in self.sharded_state().items():  # each read on its own, as Lightning's _load_checkpoint
            staged = {key: _mapped(_mapped(state, _copied) if copy else state, _contiguous)}
            untrusted.dcp_load(staged, path)  # a refused file: one line, not DCP's CheckpointException
            read[key] = _mapped(staged[key], _strided_like, state)
        return read


def _copied(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _contiguous(value: Any) -> Any:
    """A ``DTensor`` split by strided rows, redistributed to the same rows split contiguously; others as they are."""
    if not is_strided(value):
        return value
    placements = [Shard(p.dim) if compat.is_strided_shard(p) else p for p in value.placements]
    return value.redistribute(value.device_mesh, placements)


def _strided_like(value: Any, like: Any) -> Any:
    """``value`` in ``like``'s placements when ``like`` is a ``DTensor`` that differs from it, else ``value``."""
    if isinstance(like, DTensor) and isinstance(value, DTensor) and value.placements != like.placements:
        return value.redistribute(like.device_mesh, like.placements)
    return value


def _mapped(tree: Any, fn: Any, *like: Any) -> Any:
    """``fn`` applied to each leaf of nested dicts and lists (with ``like``'s leaf beside it, when given).
    lightning_utilities' ``apply_to_collection(s)`` in its place fails the tensor-parallel resume test (0.82 apart;
    the cause is not known)."""
    if isinstance(tree, dict):
        return {k: _mapped(v, fn, *(x[k] for x in like)) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_mapped(v, fn, *(x[i] for x in like)) for i, v in enumerate(tree))
    return fn(tree, *like)


def gpt_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """The GPT's tensor-parallel plan for ``tensor_parallel_plan`` (:func:`lit_ddp.models.parallelize.tensor_parallel`),
    with q, k and v split by rows of each (``lit_ddp.compat.strided_shard``).

    Raises:
        ValueError: this torch's DTensor loses those rows' layout in a linear layer
            (:func:`lit_ddp.compat.strided_rows_survive_linear`: torch 2.9.1), which would train wrong.
    """
    if not compat.strided_rows_survive_linear(mesh):
        raise ValueError(
            f"tensor parallelism (tensor_parallel_size > 1) needs a torch whose DTensor keeps q, k and v's strided rows "
            f"through a linear layer, and torch {torch.__version__}'s does not (2.9.1's labels them a plain Shard: "
            "the attention's bias and gradients would land in other heads' rows; 2.13.0 and 2.15.0 keep them). "
            "Install torch >= 2.13, or train without it: tensor_parallel_size 1 (FSDP2 alone) or DDP"
        )
    return tensor_parallel(model, mesh, compat.strided_shard(0, split_factor=3))


def is_strided(tensor: Any) -> bool:
    """Whether tensor parallelism split ``tensor`` (a parameter, or its optimizer state) by strided rows (c_attn's
    q, k and v)."""
    return isinstance(tensor, DTensor) and any(compat.is_strided_shard(p) for p in tensor.placements)


def _function(path: str) -> Any:
    found = _named(path)
    if not callable(found) or isinstance(found, type):
        raise ValueError(
            f"tensor_parallel_plan: {path!r} is not a function (e.g. lit_ddp.strategies.gpt_tensor_parallel)"
        )
    return found


def _module_class(path: str) -> type[nn.Module]:
    found = _named(path)
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise ValueError(f"units: {path!r} is not a torch.nn.Module class (e.g. lit_ddp.models.gpt.Block)")
    return found


def _named(path: str) -> Any:
    """What the class path ``package.module.name`` names; None for a bare name or a missing attribute."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name, None) if module else None
