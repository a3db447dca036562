"""FSDP2, tensor and pipeline parallelism (:mod:`lit_ddp.models.parallelize`, :class:`lit_ddp.strategies.FSDP2Strategy`)
in one process: which modules are sharded, that a sharded GPT computes what the plain one does, the strategy's bad
arguments, the split into pipeline stages. The tensor-parallel split on two processes, and through the CLI against
DDP, one process and under faults: ``tests/system/test_fsdp.py``; pipelines: ``tests/system/test_pipeline.py``."""

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
from lit_ddp.models.parallelize import GPTStages, clip_grad_norm_, shard, split_stages, stage_blocks, tensor_parallel
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


@pytest.mark.parametrize(
    ("n_layer", "n_stages", "blocks"),
    [(4, 2, [[0, 1], [2, 3]]), (3, 2, [[0, 1], [2]]), (5, 3, [[0, 1], [2, 3], [4]]), (4, 4, [[0], [1], [2], [3]])],
)
def test_stage_blocks_are_consecutive_and_as_even_as_they_go(n_layer: int, n_stages: int, blocks: list) -> None:
    assert [list(r) for r in stage_blocks(n_layer, n_stages)] == blocks


@pytest.mark.parametrize("n_stages", [0, 5])
def test_more_stages_than_blocks_are_refused(n_stages: int) -> None:
    with pytest.raises(ValueError, match=rf"{n_stages} pipeline stages for 4 blocks: give 1 to n_layer=4 stages"):
        stage_blocks(4, n_stages)


def tiny_gpt(rope: bool = False) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=8, vocab_size=11, dropout=0.0, rope=rope))


@pytest.mark.parametrize("rope", [False, True])
def test_stages_chained_compute_the_gpt_and_keep_its_names(rope: bool) -> None:
    """The stages of a 4-block GPT, run one after the other, give its logits bit for bit; their state dicts hold the
    GPT's entries under the GPT's names (the tied weight as both, a copy on the last stage), and the gradients of the
    two copies sum to the GPT's one."""
    plain = tiny_gpt(rope)
    stages = split_stages(copy.deepcopy(plain), 3, [0, 1, 2])
    assert [list(s.transformer["h"].keys()) for s in stages] == [["0", "1"], ["2"], ["3"]]
    idx = torch.randint(0, 11, (3, 8), generator=torch.Generator().manual_seed(1))
    x = idx
    for stage in stages:
        x = stage(x)
    logits, loss = plain(idx, idx)
    torch.testing.assert_close(x, logits, rtol=0, atol=0)
    names = {k for s in stages for k in s.state_dict()}
    assert names == set(plain.state_dict())
    head, embedding = stages[-1].lm_head.weight, stages[0].transformer["wte"].weight
    assert head is not embedding and torch.equal(head, embedding)
    torch.nn.functional.cross_entropy(x.view(24, -1), idx.view(24)).backward()
    loss.backward()
    torch.testing.assert_close(head.grad + embedding.grad, plain.lm_head.weight.grad, rtol=1e-6, atol=1e-8)
    grads = {n: p.grad for s in stages for n, p in s.named_parameters()}
    for name, p in plain.named_parameters():
        if name != "transformer.wte.weight":
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-8, msg=name)


def test_a_rank_s_stages_read_as_the_gpt_restricted_to_them() -> None:
    """A V schedule's rank 0 of 2 holds stages 0 and 3 of 4: one module with the GPT's names for what it holds
    (both copies of the tied weight), in the GPT's order; the ranks' FLOPs per token sum to the GPT's."""
    plain = tiny_gpt()
    mine = GPTStages(plain.config, split_stages(copy.deepcopy(plain), 4, [3, 0]))
    assert [s.index for s in mine.stages] == [0, 3]
    assert list(mine.state_dict()) == [k for k in plain.state_dict() if not re.match(r"transformer\.h\.[12]\.", k)]
    assert mine.transformer["wte"].weight is not mine.lm_head.weight
    other = GPTStages(plain.config, split_stages(copy.deepcopy(plain), 4, [1, 2]))
    assert mine.flops_per_token(8) + other.flops_per_token(8) == plain.flops_per_token(8)
    with pytest.raises(RuntimeError, match="runs through a pipeline schedule"):
        mine(torch.zeros(1, 8, dtype=torch.long))


def test_the_last_stage_gets_a_copy_and_a_single_stage_keeps_the_tie() -> None:
    plain = tiny_gpt()
    [whole] = split_stages(copy.deepcopy(plain), 1, [0])
    assert whole.lm_head.weight is whole.transformer["wte"].weight
    with pytest.raises(ValueError, match=r"stage indices \[2\] outside \[0, 2\)"):
        split_stages(plain, 2, [2])


def test_clip_grad_norm_leaves_a_copy_out_of_the_norm_and_clips_it_too() -> None:
    """The norm without the parameters given as ``uncounted`` (a pipeline's second copy of the tied weight), all of
    them scaled by the same factor."""
    a, b, copy_of_a = (torch.nn.Parameter(torch.zeros(3)) for _ in range(3))
    a.grad, b.grad, copy_of_a.grad = torch.tensor([3.0, 0, 0]), torch.tensor([0, 4.0, 0]), torch.tensor([3.0, 0, 0])
    norm = clip_grad_norm_([a, b, copy_of_a], 1.0, uncounted=[copy_of_a])
    torch.testing.assert_close(norm, torch.tensor(5.0))
    torch.testing.assert_close(copy_of_a.grad, a.grad)
    torch.testing.assert_close(a.grad.norm(), torch.tensor(3.0 / (5.0 + 1e-6)))


def test_a_rank_with_one_end_of_the_tie_holds_it_as_the_gpt_does() -> None:
    """The rank of the first of 2 stages and the rank of the last each hold one copy of the tied weight, under both
    of the GPT's names and named ``transformer.wte.weight`` (the optimizer state's key); the recipe's groups decay
    it and come out as the GPT's (Muon's too: AdamW's decay group is not left out on the first stage)."""
    from lit_ddp.recipe import adamw_param_groups, build_optimizer

    plain = tiny_gpt()
    for indices in ([0], [1]):
        mine = GPTStages(plain.config, split_stages(copy.deepcopy(plain), 2, indices))
        assert {"transformer.wte.weight", "lm_head.weight"} <= set(mine.state_dict())
        assert mine.transformer["wte"].weight is mine.lm_head.weight
        names = {id(p): n for n, p in mine.named_parameters()}
        assert names[id(mine.lm_head.weight)] == "transformer.wte.weight"
        decay, _ = adamw_param_groups(mine, 0.1)
        assert any(p is mine.lm_head.weight for p in decay["params"])
        groups = [g["name"] for g in build_optimizer(mine, "muon").param_groups]
        assert groups == ["muon", "adamw_decay", "adamw_no_decay"], indices
