"""The plain-PyTorch GPT: shapes, causality, initialization, learning, sampling, optimizer groups."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lit_ddp.models.gpt import GPT, PRESETS, GPTConfig, adamw_param_groups
from lit_ddp.tasks.mingpt import lr_factor


def tiny(**overrides) -> GPT:
    torch.manual_seed(0)
    cfg = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16, "vocab_size": 11, "dropout": 0.0}
    return GPT(GPTConfig(**{**cfg, **overrides})).eval()


def test_output_shapes() -> None:
    model = tiny()
    idx = torch.randint(0, 11, (3, 7))
    logits, loss = model(idx)
    assert logits.shape == (3, 7, 11) and loss is None
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 7, 11) and loss.shape == ()
    with pytest.raises(ValueError, match="exceeds block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("t", [0, 5, 15])
def test_causal(t: int) -> None:
    """Changing token t never changes the logits at positions before t (and does change them at t)."""
    model = tiny()
    idx = torch.randint(0, 11, (2, 16))
    changed = idx.clone()
    changed[:, t] = (idx[:, t] + 1) % 11
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t], b[:, t])


def test_tutorial_float_mask_is_not_causal() -> None:
    """The defect our model avoids: the tutorial's float 0/1 tril mask is added to the scores, so
    nn.MultiheadAttention still attends to future positions."""
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    mask = torch.tril(torch.ones(6, 6))  # the tutorial's mask: float, 1 on and below the diagonal
    x = torch.randn(1, 6, 8)
    x2 = x.clone()
    x2[:, -1] += 1.0  # change only the last token
    with torch.no_grad():
        a, _ = attn(x, x, x, attn_mask=mask)
        b, _ = attn(x2, x2, x2, attn_mask=mask)
    assert not torch.allclose(a[:, 0], b[:, 0])  # position 0 saw the future


def test_initial_loss_is_uniform() -> None:
    """GPT-2 initialization: the untrained model predicts nearly uniformly, loss ~ ln(vocab_size)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3, n_head=3, n_embd=48, block_size=32, vocab_size=65))
    idx, targets = torch.randint(0, 65, (16, 32)), torch.randint(0, 65, (16, 32))
    _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(65)) < 0.1


def test_residual_projections_scaled() -> None:
    model = GPT(GPTConfig(n_layer=8, n_head=2, n_embd=64, block_size=8, vocab_size=11))
    std = model.transformer.h[0].attn.c_proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(16)) < 0.002
    assert abs(model.transformer.h[0].attn.c_attn.weight.std().item() - 0.02) < 0.002


@pytest.fixture
def one_thread():
    """Small models train faster on one thread, and do not stall when other processes share the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_overfits_tiny_text(one_thread: None) -> None:
    text = "to be or not to be, that is the question. "
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text])
    model = tiny(vocab_size=len(vocab), n_embd=32).train()
    x = torch.stack([data[i : i + 16] for i in range(len(data) - 16)])
    y = torch.stack([data[i + 1 : i + 17] for i in range(len(data) - 16)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1


def test_generate() -> None:
    model = tiny()
    idx = torch.randint(0, 11, (2, 3))
    out = model.generate(idx, 20, top_k=3, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 23) and torch.equal(out[:, :3], idx)
    again = model.generate(idx, 20, top_k=3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    greedy = model.generate(idx, 5, temperature=0)
    assert torch.equal(greedy, model.generate(idx, 5, temperature=0))
    assert model.generate(idx, 0).shape == (2, 3)
    with pytest.raises(ValueError, match="max_new_tokens=-1"):
        model.generate(idx, -1)
    with pytest.raises(ValueError, match="top_k=0"):
        model.generate(idx, 1, top_k=0)


def test_presets_and_validation() -> None:
    cfg = GPTConfig.from_preset("tutorial", block_size=128, vocab_size=65)
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd) == (8, 8, 512)
    assert set(PRESETS) >= {"gpt-nano", "gpt-micro", "gpt-mini", "tutorial"}
    with pytest.raises(ValueError, match="unknown GPT preset 'gpt-huge'"):
        GPTConfig.from_preset("gpt-huge")
    with pytest.raises(ValueError, match="n_embd=10 must be divisible by n_head=3"):
        GPTConfig(n_embd=10, n_head=3)


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


def test_lr_schedule() -> None:
    assert lr_factor(0, 10, False, None, 0.1) == pytest.approx(1 / 11)
    assert lr_factor(50, 10, False, None, 0.1) == 1.0
    assert lr_factor(10, 10, True, 110, 0.1) == pytest.approx(1.0)
    assert lr_factor(60, 10, True, 110, 0.1) == pytest.approx(0.55)
    assert lr_factor(200, 10, True, 110, 0.1) == pytest.approx(0.1)
