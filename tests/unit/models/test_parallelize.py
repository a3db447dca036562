"""FSDP2 and tensor parallelism (:mod:`lit_ddp.models.parallelize`, :class:`lit_ddp.strategies.FSDP2Strategy`) in one
process: which modules are sharded, that a sharded GPT computes what the plain one does, the strategy's bad
arguments. The tensor-parallel split on two processes, and through the CLI against DDP, one process and under faults:
``tests/system/test_fsdp.py``."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate

from lit_ddp.models.gpt import GPT, Block, GPTConfig
from lit_ddp.models.parallelize import clip_grad_norm_, shard, tensor_parallel
from lit_ddp.strategies import FSDP2Strategy, forward_is_collective


@pytest.fixture
def one_process_group(tmp_path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_each_block_and_the_root_are_sharded_and_compute_the_same(one_process_group: None) -> None:
    torch.manual_seed(0)
    plain = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=11, dropout=0.0))
    sharded = shard(copy.deepcopy(plain), init_device_mesh("cpu", (1,)), units=(Block,))
    assert forward_is_collective(sharded) and not forward_is_collective(plain)
    assert isinstance(sharded, FSDPModule) and all(isinstance(b, FSDPModule) for b in sharded.transformer.h)
    assert not any(isinstance(m, FSDPModule) for b in sharded.transformer.h for m in b.modules() if m is not b)
    idx = torch.randint(0, 11, (3, 8), generator=torch.Generator().manual_seed(1))
    (_, a), (_, b) = plain(idx, idx), sharded(idx, idx)
    torch.testing.assert_close(b, a, rtol=0, atol=0)
    b.backward()
    a.backward()
    for (name, p), q in zip(plain.named_parameters(), sharded.parameters(), strict=True):
        torch.testing.assert_close(q.grad.full_tensor(), p.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_clip_grad_norm_clips_a_mix_of_split_and_whole_parameters_as_torch_clips_whole_ones(
    one_process_group: None,
) -> None:
    """A GPT split by the tensor-parallel plan (over one rank: its blocks' parameters DTensors, the rest whole, the
    mix torch's clip_grad_norm_ refuses) clipped by ours: the norm and the clipped gradients of the plain model
    clipped by torch's. On two ranks: ``tests/system/test_fsdp.py``."""
    from lit_ddp import compat

    torch.manual_seed(0)
    plain = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=11, dropout=0.0))
    split = tensor_parallel(copy.deepcopy(plain), init_device_mesh("cpu", (1,)), compat.strided_shard(0, 3))
    idx = torch.randint(0, 11, (3, 8), generator=torch.Generator().manual_seed(1))
    for model in (plain, split):
        model(idx, idx)[1].backward()
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):  # why ours exists (it fails unchanged)
        torch.nn.utils.clip_grad_norm_(split.parameters(), 0.1)
    want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
    got = clip_grad_norm_(split.parameters(), 0.1)
    assert want > 0.1  # it clips
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for (name, p), q in zip(plain.named_parameters(), split.parameters(), strict=True):
        grad = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
        torch.testing.assert_close(grad, p.grad, rtol=1e-5, atol=1e-8, msg=name)


def test_a_two_dimensional_mesh_is_refused(one_process_group: None) -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=5))
    with pytest.raises(ValueError, match=r"1-D mesh of data-parallel ranks, got mesh_dim_names=\('data_parallel'"):
        shard(model, mesh)


@pytest.mark.parametrize(
    "kwargs,says",
    [
        (
            {"tensor_parallel_size": 2},
            "tensor_parallel_size=2: give 1 (FSDP2 alone), or a size > 1 with tensor_parallel_plan",
        ),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size=0: give 1"),
        (
            {"tensor_parallel_size": 2, "tensor_parallel_plan": "lit_ddp.models.gpt.Block"},
            "tensor_parallel_plan: 'lit_ddp.models.gpt.Block' is not a function",
        ),
        ({"units": ["lit_ddp.models.gpt.GPTConfig"]}, "units: 'lit_ddp.models.gpt.GPTConfig' is not a torch.nn.Module"),
        ({"units": ["Block"]}, "units: 'Block' is not a torch.nn.Module class"),
        ({"async_save": True}, "async_save=true writes sharded checkpoints in the background: give"),
    ],
)
def test_fsdp2_strategy_names_a_bad_argument(kwargs: dict, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        FSDP2Strategy(**kwargs)


def test_tensor_parallel_needs_heads_the_mesh_divides(one_process_group: None) -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    with pytest.raises(ValueError, match=r"tensor_parallel takes a 1-D mesh"):
        tensor_parallel(GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=5)), mesh, Replicate())
