""":class:`lit_ddp.compat.BatchedMuon` against ``torch.optim.Muon``: the same updates within bf16 rounding, the same
state (a ``state_dict`` of either loads into the other), DTensors stepped as torch steps them, and the aten ops one
optimizer step of ``configs/mingpt/gpu.yaml``'s model dispatches (829 with the recipe's own optimizer on a CPU)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from bench.harness.ops import AtenOps, recipe_model
from lit_ddp.callbacks.batched_step import batch_optimizer_step
from lit_ddp.compat import BatchedMuon
from lit_ddp.recipe import OptimizerChain, build_optimizer
from lit_ddp.tasks.mingpt import GPTModule
from tests.helpers import TEST_DATA

# Tall, wide and square; several of a shape and one alone; a (32, 96) and a (96, 32) share a stack.
SHAPES = [(96, 32), (32, 96), (32, 32), (32, 32), (128, 32), (32, 128), (64, 32), (48, 48)]
# The blocks' matrices of gpu.yaml's 6 x 6 x 384 GPT, one of each: the sizes where tall ones round differently.
GPU_SHAPES = [(1152, 384), (384, 384), (1536, 384), (384, 1536)]
BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2**-7


def matrices(shapes: list[tuple[int, int]], seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(0.02 * torch.randn(shape, generator=gen)) for shape in shapes]


def set_grads(params: list[torch.Tensor], gen: torch.Generator) -> None:
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def step_both(
    ours: Any, reference: Any, mine: list[torch.Tensor], torchs: list[torch.Tensor], seed: int, steps: int
) -> None:
    """``steps`` steps of both optimizers, each on the same gradients drawn from ``seed + 1``."""
    gen, gen_torch = torch.Generator().manual_seed(seed + 1), torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        set_grads(mine, gen)
        set_grads(torchs, gen_torch)
        ours.step()
        reference.step()


def assert_same_updates(mine: list[torch.Tensor], torchs: list[torch.Tensor], start: list[torch.Tensor]) -> None:
    """Each matrix moved as torch's did within bf16 rounding: a bf16 ulp (2**-7) of its movement, in norm. On this
    CPU the wide and square ones move bit for bit; a tall one's Newton-Schulz runs on another memory layout than
    torch's (its transpose stacked, not a transposed view), which rounds to a few 1e-3 of the movement."""
    for i, (a, b, p0) in enumerate(zip(mine, torchs, start, strict=True)):
        moved = (b.detach() - p0).norm()
        assert (a.detach() - b.detach()).norm() <= BF16_EPS * moved, f"matrix {i} {tuple(a.shape)}"


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_updates_are_torch_muons(seed: int, nesterov: bool, weight_decay: float, adjust_lr_fn: str | None) -> None:
    """Four steps of both on the same matrices and gradients: the same momentum buffers, bit for bit, and updates
    within bf16 rounding."""
    settings: dict[str, Any] = {"lr": 0.02, "nesterov": nesterov, "weight_decay": weight_decay}
    mine, torchs = matrices(SHAPES, seed), matrices(SHAPES, seed)
    start = [p.detach().clone() for p in mine]
    ours = BatchedMuon(mine, adjust_lr_fn=adjust_lr_fn, **settings)
    reference = torch.optim.Muon(torchs, adjust_lr_fn=adjust_lr_fn, **settings)
    step_both(ours, reference, mine, torchs, seed, steps=4)
    for a, b in zip(mine, torchs, strict=True):
        assert torch.equal(ours.state[a]["momentum_buffer"], reference.state[b]["momentum_buffer"])
    assert_same_updates(mine, torchs, start)


def test_updates_are_torch_muons_at_the_gpu_jobs_sizes(seed: int) -> None:
    mine, torchs = matrices(GPU_SHAPES, seed), matrices(GPU_SHAPES, seed)
    start = [p.detach().clone() for p in mine]
    ours, reference = BatchedMuon(mine, lr=0.02, weight_decay=0.0), torch.optim.Muon(torchs, lr=0.02, weight_decay=0.0)
    step_both(ours, reference, mine, torchs, seed, steps=2)
    assert_same_updates(mine, torchs, start)


def test_the_stacks_follow_the_parameters_with_gradients(seed: int) -> None:
    """A matrix without a gradient is left out of its stack, as torch leaves it out of its loop."""
    mine, torchs = matrices(SHAPES, seed), matrices(SHAPES, seed)
    ours, reference = BatchedMuon(mine, lr=0.02), torch.optim.Muon(torchs, lr=0.02)
    gen, gen_torch = torch.Generator().manual_seed(seed + 1), torch.Generator().manual_seed(seed + 1)
    for without in (None, 2, None):
        set_grads(mine, gen)
        set_grads(torchs, gen_torch)
        if without is not None:
            mine[without].grad = torchs[without].grad = None
        ours.step()
        reference.step()
    assert_same_updates(mine, torchs, [p.detach() for p in matrices(SHAPES, seed)])


def test_a_state_goes_from_torchs_muon_to_ours_and_back(seed: int) -> None:
    """torch's state loads into ours and ours into torch's, every tensor and setting the same; the loaded ones go on
    as the one they were saved from."""
    torchs = matrices(SHAPES, seed)
    reference = torch.optim.Muon(torchs, lr=0.02, weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(2):
        set_grads(torchs, gen)
        reference.step()
    saved = copy.deepcopy(reference.state_dict())

    mine = [torch.nn.Parameter(p.detach().clone()) for p in torchs]
    ours = BatchedMuon(mine, lr=0.02, weight_decay=0.1)
    ours.load_state_dict(copy.deepcopy(saved))
    assert_same_state(ours.state_dict(), saved)
    back = torch.optim.Muon([torch.nn.Parameter(p.detach().clone()) for p in mine], lr=0.02, weight_decay=0.1)
    back.load_state_dict(copy.deepcopy(ours.state_dict()))
    assert_same_state(back.state_dict(), saved)

    start = [p.detach().clone() for p in mine]
    gen_mine = copy.deepcopy(gen)
    set_grads(torchs, gen)
    set_grads(mine, gen_mine)
    reference.step()
    ours.step()
    assert_same_updates(mine, torchs, start)


def assert_same_state(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys()
    for i, state in expected["state"].items():
        assert got["state"][i].keys() == state.keys() == {"momentum_buffer"}
        assert torch.equal(got["state"][i]["momentum_buffer"], state["momentum_buffer"])


def test_a_checkpoint_of_torchs_muon_loads_into_the_chain() -> None:
    """tests/data/mingpt_last_696c9f9.ckpt was written with torch's Muon: its optimizer state loads into the GPU
    job's chain (BatchedMuon + AdamW) with every tensor and setting, steps, and its state loads into the recipe's
    chain (torch's Muon) again. (A resume of it: tests/system/test_resume_old_checkpoint.py.)"""
    ckpt = torch.load(TEST_DATA / "mingpt_last_696c9f9.ckpt", weights_only=False)
    saved = ckpt["optimizer_states"][0]
    hp = {k: v for k, v in ckpt["hyper_parameters"].items() if not k.startswith("_")}
    chains = []
    for batched in (True, False):
        module = GPTModule(**hp)
        module.load_state_dict(ckpt["state_dict"])
        assert module.model is not None
        chain = build_optimizer(module.model, "muon")
        if batched:
            batch_optimizer_step(chain)
        assert isinstance(chain, OptimizerChain)
        assert type(chain.optimizers[0]) is (BatchedMuon if batched else torch.optim.Muon)
        chain.load_state_dict(copy.deepcopy(saved))
        chains.append((module, chain))
    (module, chain), (_, torchs) = chains
    got = chain.state_dict()
    assert got["param_groups"] == saved["param_groups"]
    for i, state in saved["state"].items():
        assert all(torch.equal(got["state"][i][k], v) for k, v in state.items())
    idx = torch.randint(0, len(hp["vocab"]), (2, 16), generator=torch.Generator().manual_seed(0))
    module(idx, idx)[1].backward()
    chain.step()
    torchs.load_state_dict(chain.state_dict())
    back = torchs.state_dict()["state"]
    assert all(torch.equal(back[i][k], v) for i, s in chain.state_dict()["state"].items() for k, v in s.items())


@pytest.fixture
def one_process_group(tmp_path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_dtensors_step_as_torchs_muon_steps_them(one_process_group: None, seed: int) -> None:
    """Parameters sharded by FSDP2 or tensor parallelism are DTensors, which cannot be stacked as shards: ours steps
    them one matrix at a time, as torch's Muon does (torch's own code: bit for bit)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))

    def sharded() -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])) for p in matrices(SHAPES, seed)]

    mine, torchs = sharded(), sharded()
    ours, reference = BatchedMuon(mine, lr=0.02), torch.optim.Muon(torchs, lr=0.02)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(2):
        for a, b in zip(mine, torchs, strict=True):
            a.grad = distribute_tensor(torch.randn(a.shape, generator=gen), mesh, [Shard(0)])
            b.grad = a.grad.clone()
        ours.step()
        reference.step()
    for a, b in zip(mine, torchs, strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor())


class OpsByName(AtenOps):
    """The harness's aten-op counter (bench/harness/ops.py), each op counted under its name."""

    def counts(self, name: str, args: Any, kwargs: dict[str, Any]) -> bool:
        self.phase = name
        return True


@pytest.mark.parametrize("batched", [True, False])
def test_the_gpu_jobs_optimizer_step_dispatches_at_most_100_aten_ops(batched: bool) -> None:
    """gpu.yaml's optimizer as it steps on a GPU (its BatchedOptimizerStep callback; AdamW fused, as on CUDA),
    counted on this CPU over its second step: at most 100 aten ops. The recipe's own (torch's Muon, a loop of small
    kernels per matrix, and a CPU's AdamW, one parameter at a time): 829."""
    module, optimizer = recipe_model()  # gpu.yaml's model and its recipe's optimizer
    model = module.model
    if batched:
        batch_optimizer_step(optimizer, adamw_fused=True)
    gen = torch.Generator().manual_seed(0)
    set_grads(list(model.parameters()), gen)
    optimizer.step()  # the first step makes the state and the stacks
    with OpsByName() as count:
        optimizer.step()
    total = sum(count.ops.values())
    name = "BatchedMuon + fused AdamW" if batched else "torch.optim.Muon + AdamW (a CPU's loop)"
    print(f"{name}: {total} aten ops per optimizer step: {dict(count.ops.most_common())}")
    if batched:
        assert total <= 100, count.ops
    else:
        assert total >= 800, count.ops  # what the 100 is measured against: 24 matrices, 14 vectors, one at a time


def test_an_fsdp2_gpt_steps_as_with_torchs_muon(one_process_group: None) -> None:
    """A GPT sharded by FSDP2 (its parameters DTensors) with gpu.yaml's batched optimizer step: the same parameters
    as with the recipe's, bit for bit (Muon per matrix, AdamW as built)."""
    from torch.distributed.device_mesh import init_device_mesh

    from lit_ddp.models.gpt import GPT, Block, GPTConfig
    from lit_ddp.models.parallelize import shard

    torch.manual_seed(0)
    plain = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=11, dropout=0.0))
    idx = torch.randint(0, 11, (3, 8), generator=torch.Generator().manual_seed(1))
    models = []
    for batched in (True, False):
        model = shard(copy.deepcopy(plain), init_device_mesh("cpu", (1,)), units=(Block,))
        optimizer = build_optimizer(model, "muon", muon_learning_rate=0.05)
        if batched:
            assert type(batch_optimizer_step(optimizer).optimizers[0]) is BatchedMuon  # type: ignore[attr-defined]
        for _ in range(2):
            model(idx, idx)[1].backward()
            optimizer.step()
            optimizer.zero_grad()
        models.append(model)
    for a, b in zip(*(m.parameters() for m in models), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor())
