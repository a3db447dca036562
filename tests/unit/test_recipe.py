"""The GPT's training recipe (:mod:`lit_ddp.recipe`): parameter groups, the optimizers (AdamW, Muon + AdamW as one
:class:`OptimizerChain`), and the warmup + cosine schedule against nanoGPT's ``get_lr``, step by step."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from lit_ddp.data.char import build_vocab
from lit_ddp.models.gpt import GPT, GPTConfig
from lit_ddp.recipe import (
    OptimizerChain,
    adamw_param_groups,
    build_optimizer,
    muon_param_groups,
    warmup_cosine_schedule,
)
from lit_ddp.tasks.mingpt import GPTModule


def tiny(tie_weights: bool = True, **overrides) -> GPT:
    """A small GPT; ``tie_weights=False`` gives its head a weight of its own, as a model with an untied head has
    (the recipe takes any such model, not only lit_ddp's tied GPT)."""
    torch.manual_seed(0)
    cfg = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16, "vocab_size": 11, "dropout": 0.0}
    model = GPT(GPTConfig(**{**cfg, **overrides})).eval()
    if not tie_weights:
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    return model


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


# ---- parameter groups


def test_adamw_param_groups() -> None:
    """minGPT's split: Linear weights decay; biases, LayerNorm and (untied) embeddings do not."""
    model = tiny()
    decay, no_decay = adamw_param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    assert not decayed & kept
    assert decayed | kept == set(names.values())
    # the token embedding is tied to the Linear head (named once, as wte): it decays, as in minGPT
    assert all(n.endswith("weight") and ("c_" in n or n == "transformer.wte.weight") for n in decayed)
    assert "transformer.wpe.weight" in kept
    assert any(n.endswith("ln_1.weight") for n in kept) and any(n.endswith("bias") for n in kept)


def test_adamw_param_groups_untied_head() -> None:
    """With its own weight the head is a Linear (decays); the embedding is not (does not decay)."""
    model = tiny(tie_weights=False)
    decay, no_decay = adamw_param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert "lm_head.weight" in {names[id(p)] for p in decay["params"]}
    assert "transformer.wte.weight" in {names[id(p)] for p in no_decay["params"]}


@pytest.mark.parametrize("tie_weights", [True, False])
def test_muon_param_groups(tie_weights: bool) -> None:
    model = tiny(tie_weights=tie_weights).train()
    hidden, others = muon_param_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert len(hidden) + len(others) == len(names) == len({id(p) for p in hidden + others})
    assert {names[id(p)].rsplit(".", 2)[-2] for p in hidden} == {"c_attn", "c_proj", "c_fc"}
    assert all(p.ndim == 2 and names[id(p)].startswith("transformer.h.") for p in hidden)
    other_names = {names[id(p)] for p in others}
    assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight"} <= other_names
    assert ("lm_head.weight" in other_names) is not tie_weights  # tied: named once, as wte
    muon = torch.optim.Muon(hidden, lr=0.02, weight_decay=0.0)
    adamw = torch.optim.AdamW(others, lr=1e-3)
    before = [p.detach().clone() for p in hidden]
    idx = torch.randint(0, 11, (2, 16))
    model(idx, idx)[1].backward()
    muon.step()
    adamw.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, hidden, strict=True))


# ---- build_optimizer


def test_build_adamw() -> None:
    """AdamW over minGPT's two unnamed groups (LearningRateMonitor: lr-AdamW/pg1, lr-AdamW/pg2)."""
    model = tiny()
    opt = build_optimizer(model, "adamw", learning_rate=1e-3, weight_decay=0.2, betas=(0.8, 0.9))
    assert type(opt) is torch.optim.AdamW and len(opt.param_groups) == 2
    assert [g["weight_decay"] for g in opt.param_groups] == [0.2, 0.0]
    assert all(g["lr"] == 1e-3 and g["betas"] == (0.8, 0.9) and "name" not in g for g in opt.param_groups)
    expected = adamw_param_groups(model, 0.2)
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == [[id(p) for p in g["params"]] for g in expected]
    with pytest.raises(ValueError, match="optimizer='lion' must be one of 'adamw', 'muon'"):
        build_optimizer(model, "lion")


@pytest.mark.parametrize("tie_weights", [True, False])
def test_build_muon(tie_weights: bool) -> None:
    """Muon's named group, then AdamW's named non-empty groups, as LearningRateMonitor tags them."""
    model = tiny(tie_weights=tie_weights)
    opt = build_optimizer(
        model, "muon", learning_rate=1e-3, muon_learning_rate=0.05, muon_momentum=0.9, muon_weight_decay=0.01
    )
    muon, adamw = opt.optimizers
    assert isinstance(opt, OptimizerChain) and [type(o).__name__ for o in opt.optimizers] == ["Muon", "AdamW"]
    # decayed: the head (tied or not); not decayed: embeddings, norms, biases
    assert [g["name"] for g in opt.param_groups] == ["muon", "adamw_decay", "adamw_no_decay"]
    assert muon.param_groups[0]["lr"] == 0.05 and muon.param_groups[0]["momentum"] == 0.9
    assert muon.param_groups[0]["weight_decay"] == 0.01
    assert all(g["lr"] == 1e-3 for g in adamw.param_groups)
    hidden, _ = muon_param_groups(model)
    assert [id(p) for p in muon.param_groups[0]["params"]] == [id(p) for p in hidden]


def test_build_muon_leaves_out_an_empty_group() -> None:
    """AdamW's decay group holds the Linear weights outside the blocks (the head); with none it is left out."""
    model = tiny()
    opt = build_optimizer(model, "muon")
    decay = next(g for g in opt.param_groups if g["name"] == "adamw_decay")
    assert [id(p) for p in decay["params"]] == [id(model.lm_head.weight)]
    model.lm_head = nn.Identity()  # the tied weight stays, as the embedding's: no Linear weight outside the blocks
    assert [g["name"] for g in build_optimizer(model, "muon").param_groups] == ["muon", "adamw_no_decay"]


# ---- OptimizerChain


def test_chain_groups_are_the_inner_groups() -> None:
    """param_groups is a real list of the very same dicts (a scheduler scales both optimizers)."""
    p, q = nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(2))
    a, b = torch.optim.SGD([p], lr=1.0), torch.optim.AdamW([q], lr=0.5)
    chain = OptimizerChain([a, b])
    assert isinstance(chain.param_groups, list)
    assert [id(g) for g in chain.param_groups] == [id(a.param_groups[0]), id(b.param_groups[0])]
    chain.param_groups[1]["lr"] = 0.25
    assert b.param_groups[0]["lr"] == 0.25
    q.grad = torch.ones(2)
    chain.step()
    assert set(chain.state) == {q} and chain.state[q] is b.state[q]  # the union of the inner states


def test_chain_step_hooks_run() -> None:
    """Step hooks registered on the chain run around the whole chained step (torch's own hook registries)."""
    p = nn.Parameter(torch.zeros(2))
    chain = OptimizerChain([torch.optim.SGD([p], lr=1.0)])
    calls: list[tuple[str, float]] = []
    pre = chain.register_step_pre_hook(lambda opt, args, kwargs: calls.append(("pre", p[0].item())))
    post = chain.register_step_post_hook(lambda opt, args, kwargs: calls.append(("post", p[0].item())))
    p.grad = torch.ones(2)
    chain.step()
    assert calls == [("pre", 0.0), ("post", -1.0)]
    pre.remove()
    post.remove()
    chain.step()
    assert len(calls) == 2


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
    assert [id(g) for g in opt2.param_groups] == [id(g) for o in opt2.optimizers for g in o.param_groups]


def test_chain_state_dict_is_torchs_format_and_loads_the_old_one() -> None:
    """state_dict is torch's (parameter indices over all the groups in order, which torch's distributed state dict
    maps to names); a checkpoint of the format before it (one state_dict per optimizer) still loads."""
    m = module()
    conf = m.configure_optimizers()
    opt = conf["optimizer"]
    train(m, opt, conf["lr_scheduler"]["scheduler"], 2)
    sd = opt.state_dict()
    assert sd.keys() == {"state", "param_groups"}
    indices = [i for group in sd["param_groups"] for i in group["params"]]
    assert indices == list(range(len(indices))) and sorted(sd["state"]) == indices
    assert [g["name"] for g in sd["param_groups"]] == ["muon", "adamw_decay", "adamw_no_decay"]
    old_format = copy.deepcopy({"optimizers": [o.state_dict() for o in opt.optimizers]})
    for saved in (copy.deepcopy(sd), old_format):
        fresh = module().configure_optimizers()["optimizer"]
        fresh.load_state_dict(saved)
        assert torch.equal(
            torch.cat([s["exp_avg"].flatten() for s in fresh.optimizers[1].state.values()]),
            torch.cat([s["exp_avg"].flatten() for s in opt.optimizers[1].state.values()]),
        )
        assert torch.equal(
            torch.cat([s["momentum_buffer"].flatten() for s in fresh.optimizers[0].state.values()]),
            torch.cat([s["momentum_buffer"].flatten() for s in opt.optimizers[0].state.values()]),
        )


def test_errors_name_the_problem() -> None:
    p = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="in two optimizers"):
        OptimizerChain([torch.optim.SGD([p], lr=1.0), torch.optim.SGD([p], lr=1.0)])
    with pytest.raises(ValueError, match="at least one optimizer"):
        OptimizerChain([])
    q = torch.nn.Parameter(torch.zeros(2))
    chain = OptimizerChain([torch.optim.SGD([p], lr=1.0), torch.optim.SGD([q], lr=1.0)])
    with pytest.raises(
        ValueError, match=r"groups \[\[None\], \[\]\], this chain's \[\[None\], \[None\]\]: resume with"
    ):
        chain.load_state_dict(torch.optim.SGD([p], lr=1.0).state_dict())
    model = GPT(GPTConfig(vocab_size=11, block_size=8))
    adamw = build_optimizer(model, "adamw")  # a checkpoint of model.optimizer adamw, resumed with muon
    with pytest.raises(
        ValueError, match=r"groups \[\[None\], \[None\]\], this chain's \[\['muon'\], \['adamw_decay', 'adamw_no_"
    ):
        build_optimizer(model, "muon").load_state_dict(adamw.state_dict())
    with pytest.raises(ValueError, match="optimizer='lion'"):
        GPTModule(optimizer="lion")


# ---- the learning-rate schedule


def nanogpt_factor(step: int, warmup: int, decay_steps: int | None, min_ratio: float) -> float:
    """nanoGPT's get_lr / learning_rate (warmup reaching the peak after ``warmup`` steps, cosine to the floor)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if decay_steps is None:
        return 1.0
    if step >= decay_steps:
        return min_ratio
    progress = (step - warmup) / (decay_steps - warmup)
    return min_ratio + 0.5 * (1.0 - min_ratio) * (1.0 + math.cos(math.pi * progress))


@pytest.mark.parametrize(
    ("warmup", "decay_steps", "min_ratio"),
    [(10, 110, 0.1), (0, 50, 0.1), (100, 2000, 0.1), (5, None, 0.1), (0, None, 0.1), (3, 20, 0.0)],
)
@pytest.mark.parametrize("peaks", [(3e-3, 3e-3), (3e-3, 2e-2)], ids=["one_peak", "two_peaks"])
def test_schedule_follows_nanogpt(
    warmup: int, decay_steps: int | None, min_ratio: float, peaks: tuple[float, float]
) -> None:
    """Every group follows get_lr scaled to its own peak (Muon's and AdamW's differ)."""
    groups = [{"params": [nn.Parameter(torch.zeros(2))], "lr": lr} for lr in peaks]
    optimizer = torch.optim.AdamW(groups)
    scheduler = warmup_cosine_schedule(optimizer, warmup, decay_steps, min_ratio)
    for step in range(int((decay_steps or 40) * 1.5)):  # past the end of the decay: flat at the floor
        factor = nanogpt_factor(step, warmup, decay_steps, min_ratio)
        for group, peak in zip(optimizer.param_groups, peaks, strict=True):
            assert group["lr"] == pytest.approx(peak * factor, rel=1e-12, abs=1e-15), f"step {step}"
        optimizer.step()
        scheduler.step()


def test_schedule_state_round_trips() -> None:
    """The scheduler's state_dict restores the same rates (what a resumed run relies on)."""

    def make():
        opt = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=1e-3)
        return opt, warmup_cosine_schedule(opt, 5, 30, 0.1)

    opt, sched = make()
    for _ in range(12):
        opt.step()
        sched.step()
    opt2, sched2 = make()
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    for _ in range(25):
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
        for o, s in ((opt, sched), (opt2, sched2)):
            o.step()
            s.step()


def test_schedule_errors() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="decay_steps=5 must be > warmup_steps=5"):
        warmup_cosine_schedule(opt, 5, 5, 0.1)
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        warmup_cosine_schedule(opt, -1, None, 0.1)
    with pytest.raises(ValueError, match="min_lr_ratio=1.5"):
        warmup_cosine_schedule(opt, 0, 10, 1.5)
