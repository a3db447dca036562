"""lit_ddp.models.kv_cache: the cached sampler draws GPT.generate's tokens (fp32, same generator), greedy, top-k and
from the whole distribution, with learned and rotary positions, within block_size and past it (the window slides),
from a prompt shorter or longer than block_size; its logits are GPT.forward's at every step."""

from __future__ import annotations

import pytest
import torch

from lit_ddp.models import kv_cache
from lit_ddp.models.gpt import GPT, GPTConfig

BLOCK = 8


def sharp(rope: bool) -> GPT:
    """A tiny GPT in eval mode whose attention and logits depend clearly on the context: its matrices at 10x GPT-2's
    init (at 0.02 the logits are nearly uniform and a wrong position could still pick the same tokens)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=BLOCK, vocab_size=11, rope=rope, dropout=0.1))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(10)
    return model.eval()


@pytest.mark.parametrize("rope", [False, True], ids=["learned", "rope"])
@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.0}, {"top_k": 3}, {"temperature": 0.8}], ids=["greedy", "top_k", "all"]
)
@pytest.mark.parametrize("prompt", [3, BLOCK, BLOCK + 2], ids=["short", "block_size", "longer"])
def test_the_cached_sampler_draws_the_tokens_of_generate(rope: bool, sampling: dict, prompt: int) -> None:
    model = sharp(rope)
    idx = torch.randint(0, 11, (2, prompt), generator=torch.Generator().manual_seed(1))
    new = 3 * BLOCK  # well past block_size: the window slides for most of them
    want = model.generate(idx, new, generator=torch.Generator().manual_seed(2), **sampling)
    got = kv_cache.generate(model, idx, new, generator=torch.Generator().manual_seed(2), **sampling)
    assert got.shape == (2, prompt + new)
    assert torch.equal(got, want)
    if sampling.get("temperature") != 0:  # not one token repeated (as greedy may): the comparison says something
        assert len(set(want[0, prompt:].tolist())) > 2


@pytest.mark.parametrize("rope", [False, True], ids=["learned", "rope"])
def test_cached_logits_are_those_of_the_whole_context(rope: bool) -> None:
    """Token by token up to block_size: the logits from the cache are GPT.forward's over the whole context."""
    model = sharp(rope)
    idx = torch.randint(0, 11, (2, BLOCK), generator=torch.Generator().manual_seed(3))
    cache: kv_cache.Cache = []
    with torch.no_grad():
        for t in range(3, BLOCK + 1):  # a prompt of 3, then one token at a time
            cached = kv_cache._forward(model, idx[:, (t - 1 if cache else 0) : t], cache)
            whole = model(idx[:, :t])[0][:, -1, :]  # (B, V)
            torch.testing.assert_close(cached, whole, rtol=1e-5, atol=1e-5)
            assert [k.size(2) for k, _ in cache] == [t] * len(model.transformer.h)


def test_no_new_tokens_returns_the_prompt() -> None:
    idx = torch.randint(0, 11, (1, 4))
    assert torch.equal(kv_cache.generate(sharp(True), idx, 0), idx)
