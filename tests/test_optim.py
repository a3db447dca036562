"""OptimizerChain: Muon + AdamW driven as one optimizer (GPTModule's ``optimizer="muon"``)."""

from __future__ import annotations

import copy

import pytest
import torch

from lit_ddp.data.char import build_vocab
from lit_ddp.optim import OptimizerChain
from lit_ddp.tasks.mingpt import GPTModule


def module(**kwargs) -> GPTModule:
    torch.manual_seed(0)
    return GPTModule(
        model_type="gpt-nano", n_layer=1, n_head=2, n_embd=16, block_size=16, vocab=build_vocab("abcdefgh "),
        optimizer="muon", muon_learning_rate=0.05, learning_rate=1e-2, warmup_steps=2, cosine_decay=True,
        decay_steps=10, dropout=0.0, **kwargs,
    )  # fmt: skip


def train(m: GPTModule, optimizer, scheduler, steps: int, seed: int = 1) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 9, (4, 16), generator=gen)
        optimizer.zero_grad()

        def closure(x: torch.Tensor = x) -> torch.Tensor:
            _, loss = m(x, x)
            loss.backward()
            return loss

        losses.append(float(optimizer.step(closure).detach()))
        scheduler.step()
    return losses


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest() -> None:
    m = module()
    opt = m.configure_optimizers()["optimizer"]
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    in_adamw = {id(p) for g in adamw.param_groups for p in g["params"]}
    assert in_muon.isdisjoint(in_adamw) and in_muon | in_adamw == {id(p) for p in m.parameters()}
    assert all(p.ndim == 2 for g in muon.param_groups for p in g["params"])
    assert id(m.model.transformer.wte.weight) in in_adamw  # the (tied) embedding and head
    assert [g["lr"] for g in opt.param_groups][0] < 0.05  # the schedule's warmup applies to Muon's group too


def test_state_round_trip_resumes_exactly() -> None:
    """Stopping after 4 steps and restoring model + chain state gives the same next losses as going on."""
    m = module()
    conf = m.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    train(m, opt, sched, 4)
    saved = copy.deepcopy((m.state_dict(), opt.state_dict(), sched.state_dict()))
    straight = train(m, opt, sched, 4, seed=2)

    m2 = module()
    conf2 = m2.configure_optimizers()
    opt2, sched2 = conf2["optimizer"], conf2["lr_scheduler"]["scheduler"]
    m2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved[2])
    assert train(m2, opt2, sched2, 4, seed=2) == straight
    assert len(opt2.state) == sum(1 for _ in m2.parameters())  # both optimizers' states, every parameter


def test_errors_name_the_problem() -> None:
    p = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="in two optimizers"):
        OptimizerChain([torch.optim.SGD([p], lr=1.0), torch.optim.SGD([p], lr=1.0)])
    chain = OptimizerChain([torch.optim.SGD([p], lr=1.0)])
    with pytest.raises(ValueError, match="resume with the same model.optimizer"):
        chain.load_state_dict(torch.optim.SGD([p], lr=1.0).state_dict())
    with pytest.raises(ValueError, match="optimizer='lion'"):
        GPTModule(optimizer="lion")
