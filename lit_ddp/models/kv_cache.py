"""Sampling from a :class:`~lit_ddp.models.gpt.GPT` with a key-value cache: :func:`generate` takes
:meth:`GPT.generate`'s arguments and draws the same tokens (up to the float rounding of the logits), but each new
token's forward computes that one position, its attention reading the keys and values that the earlier positions
left in the cache, where ``GPT.generate`` recomputes the whole context for every token.

The context is the last ``block_size`` tokens, as in ``GPT.generate``. Once the text is longer, each step drops the
oldest token, which changes what every position attends to and so every block's keys and values after the first
(with learned position embeddings every position's, from the first block on: they all move down one). No cached
value stays exact, so from there on each step recomputes the window as ``GPT.generate`` does, at the same cost.

Kept apart from ``gpt.py``, which stays nanoGPT's reading: :func:`_forward` traces ``GPT.forward`` and
``Block.forward`` through the model's own submodules (its weights, its :class:`~lit_ddp.models.gpt.Rotary` at the
cached positions). Shape legend as in ``gpt.py``, plus L: positions in the cache.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from lit_ddp.models.gpt import GPT, Block, CausalSelfAttention

Cache = list[tuple[torch.Tensor, torch.Tensor]]
"""Per block, the keys and the values of the positions so far, ``(B, nh, L, hs)`` each."""


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``idx (B, T) -> (B, T + max_new_tokens)``: :meth:`GPT.generate` with a key-value cache (same arguments, same
    tokens for the same ``generator``). Call ``model.eval()`` first, as for ``GPT.generate``."""
    return GPT.generate(cast(GPT, _Cached(model)), idx, max_new_tokens, temperature, top_k, generator)


class _Cached:
    """What :meth:`GPT.generate` calls as ``self``: the model's ``config`` and a forward over the context it is given
    that computes only the positions the cache lacks, so that ``GPT.generate``'s own loop chooses every token."""

    def __init__(self, model: GPT) -> None:
        self.model, self.config, self.cache = model, model.config, cast(Cache, [])

    def __call__(self, idx: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``idx (B, T)``, the context (the last ``block_size`` tokens) -> ``(logits (B, 1, V), None)`` of its last
        position: through the cache where ``idx`` is the cached positions plus one new token (or the cache is empty),
        else (the window slid: every cached key and value is stale, module docstring) the whole window again."""
        cached = self.cache[0][0].size(2) if self.cache else 0
        if self.cache and idx.size(1) != cached + 1:
            return self.model(idx)[0][:, -1:, :], None
        return _forward(self.model, idx[:, cached:], self.cache)[:, None, :], None


def _forward(model: GPT, idx: torch.Tensor, cache: Cache) -> torch.Tensor:
    """``idx (B, T)``, the tokens at positions ``L .. L + T - 1`` after the ``L`` in ``cache`` (``T`` of them with an
    empty cache, else 1) -> the logits ``(B, V)`` of the last, as ``GPT.forward`` computes them over all ``L + T``.
    Appends each block's keys and values of the ``T`` positions to ``cache``."""
    start = cache[0][0].size(2) if cache else 0
    parts = model.transformer  # wte, wpe (learned positions only), drop, h (the blocks), ln_f
    x = parts["wte"](idx)  # (B, T, C)
    if "wpe" in parts:
        pos = torch.arange(start, start + idx.size(1), dtype=torch.long, device=idx.device)  # (T,)
        x = x + parts["wpe"](pos)  # (B, T, C)
    x = parts["drop"](x)
    for i, block in enumerate(cast("list[Block]", parts["h"])):
        x = x + _attention(block.attn, block.ln_1(x), cache, i, start)  # (B, T, C)
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(parts["ln_f"](x[:, -1, :]))  # (B, V)


def _attention(attn: CausalSelfAttention, x: torch.Tensor, cache: Cache, i: int, start: int) -> torch.Tensor:
    """``CausalSelfAttention.forward`` of positions ``start ..`` given block ``i``'s cached ones: ``(B, T, C) ->
    (B, T, C)``, their keys and values appended to ``cache[i]`` (a new entry when ``start`` is 0)."""
    B, T, C = x.shape
    assert start == 0 or T == 1, "after the prompt, one token at a time"
    q, k, v = [
        t.view(B, T, -1, C // attn.n_head).transpose(1, 2)  # (B, nh, T, hs)
        for t in attn.c_attn(x).chunk(3, dim=2)  # 3 x (B, T, C)
    ]
    if attn.rotary is not None:
        q, k = attn.rotary(q, start), attn.rotary(k, start)
    if start:
        k, v = torch.cat((cache[i][0], k), dim=2), torch.cat((cache[i][1], v), dim=2)  # (B, nh, L + 1, hs)
        cache[i] = (k, v)
    else:
        cache.append((k, v))
    # The prompt attends causally within itself; a later token to every position so far, itself included.
    y = F.scaled_dot_product_attention(q, k, v, is_causal=start == 0)  # (B, nh, T, hs)
    y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, C)
    return attn.resid_dropout(attn.c_proj(y))
