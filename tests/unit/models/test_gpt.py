"""The plain-PyTorch GPT: shapes, causality, initialization, learning, sampling, and its one option, rotary
position embeddings. Its training recipe: test_recipe.py."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from lit_ddp.models.gpt import GPT, PRESETS, GPTConfig, Rotary


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


def test_residual_projections_scaled(seed: int) -> None:
    torch.manual_seed(seed)  # any initialization: the standard deviations hold for every draw
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


def overfit_loss(**options: Any) -> float:
    """The training loss after 150 AdamW steps on one short sentence (a working model memorizes it)."""
    text = "to be or not to be, that is the question. "
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text])
    model = tiny(vocab_size=len(vocab), n_embd=32, **options).train()
    x = torch.stack([data[i : i + 16] for i in range(len(data) - 16)])
    y = torch.stack([data[i + 1 : i + 17] for i in range(len(data) - 16)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def test_overfits_tiny_text(one_thread: None) -> None:
    assert overfit_loss() < 0.1


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


def test_presets_and_validation() -> None:
    cfg = GPTConfig.from_preset("tutorial", block_size=128, vocab_size=65)
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd) == (8, 8, 512)
    assert set(PRESETS) >= {"gpt-nano", "gpt-micro", "gpt-mini", "tutorial"}
    with pytest.raises(ValueError, match="unknown GPT preset 'gpt-huge'"):
        GPTConfig.from_preset("gpt-huge")
    with pytest.raises(ValueError, match="n_embd=10 must be divisible by n_head=3"):
        GPTConfig(n_embd=10, n_head=3)


# ---- the option: rotary position embeddings


def randomized(model: GPT) -> GPT:
    """The model with every parameter redrawn, so that zero-initialized layers take part in the checks."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def test_rope_shapes_and_causality() -> None:
    model = randomized(tiny(rope=True))
    idx = torch.randint(0, 11, (2, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, 11) and loss.shape == () and torch.isfinite(loss)
    assert model(idx[:, :5])[0].shape == (2, 5, 11)
    for t in (0, 7, 15):
        changed = idx.clone()
        changed[:, t] = (idx[:, t] + 1) % 11
        with torch.no_grad():
            a, _ = model(idx)
            b, _ = model(changed)
        assert torch.equal(a[:, :t], b[:, :t]), f"position < {t} saw token {t}"
        assert not torch.allclose(a[:, t], b[:, t])


def test_default_options_are_bit_identical() -> None:
    """The option off is the GPT-2 model as before it existed: same parameters, same initialization (the
    values below were recorded from the model before the options were added), tied head."""
    model, again = tiny(), tiny(rope=False)
    assert model.transformer.wte.weight is model.lm_head.weight
    names = [n for n, _ in model.named_parameters()]
    assert names[:2] == ["transformer.wte.weight", "transformer.wpe.weight"] and len(names) == 28
    for (n, p), (_, q) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(p, q), n
    assert sum(p.double().sum().item() for p in model.parameters()) == pytest.approx(78.56411334625454, abs=1e-9)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=11))
    idx = torch.randint(0, 11, (4, 16))
    assert model(idx, idx.roll(1, 1))[1].item() == pytest.approx(2.4300832748413086, abs=1e-5)
    assert (model.num_parameters(), model.flops_per_token()) == (6768, 46752)


def test_rope_replaces_position_embedding() -> None:
    model = tiny(rope=True)
    assert "wpe" not in model.transformer
    assert not any("rotary" in k for k in model.state_dict())  # the tables follow from the sizes
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="rope needs an even head size"):
        GPTConfig(n_embd=12, n_head=4, rope=True)


def test_rotary_scores_depend_on_relative_position() -> None:
    """RoFormer's property: <R(m) q, R(n) k> depends on m - n only."""
    rotary = Rotary(head_size=8, max_len=16)
    torch.manual_seed(0)
    q, k = torch.randn(8), torch.randn(8)
    rq = rotary(q.expand(1, 1, 16, 8))[0, 0]  # (T, hs): q at every position
    rk = rotary(k.expand(1, 1, 16, 8))[0, 0]
    assert torch.allclose(rq[0], q) and not torch.allclose(rq[1], q)
    assert torch.allclose(rq[5] @ rk[2], rq[12] @ rk[9], atol=1e-5)
    assert torch.allclose(rq.norm(dim=-1), q.norm().expand(16), atol=1e-5)  # rotations keep lengths


def test_rope_learns(one_thread: None) -> None:
    assert overfit_loss(rope=True) < 0.1
