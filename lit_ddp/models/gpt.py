"""A character-level GPT in plain PyTorch: config, presets, blocks, model, sampling, FLOPs. Architecture only;
how it is trained is :mod:`lit_ddp.recipe`.

Sources: Karpathy's nanoGPT ``model.py`` (structure, GPT-2 init, ``generate``) and minGPT (presets), MIT; the DDP
tutorial's ``minGPT-ddp/mingpt/model.py`` (its sizes). One option, off by default (then this is GPT-2 bit for
bit): ``rope``, rotary position embeddings, record 2 of the NanoGPT speedrun (github.com/KellerJordan/modded-nanogpt).

The tutorial's model adds a float 0/1 ``tril`` mask to the attention scores, which blocks nothing: it sees the
future. Here ``F.scaled_dot_product_attention(is_causal=True)``: position ``t`` attends to positions ``<= t``.

Shape legend: B batch, T sequence (<= block_size), C n_embd, nh n_head, hs head size C // nh, V vocab_size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# (n_layer, n_head, n_embd): minGPT's gpt-nano/micro/mini; "tutorial" is the DDP tutorial's gpt2_train_cfg.yaml.
PRESETS: dict[str, dict[str, int]] = {
    "gpt-nano": {"n_layer": 3, "n_head": 3, "n_embd": 48},
    "gpt-micro": {"n_layer": 4, "n_head": 4, "n_embd": 128},
    "gpt-mini": {"n_layer": 6, "n_head": 6, "n_embd": 192},
    "tutorial": {"n_layer": 8, "n_head": 8, "n_embd": 512},
}


@dataclass
class GPTConfig:
    """Sizes of a :class:`GPT`.

    Raises:
        ValueError: a non-positive size, ``n_embd`` not divisible by ``n_head``, ``dropout`` outside [0, 1),
            or ``rope`` with an odd head size.
    """

    n_layer: int = 3
    """Transformer blocks."""
    n_head: int = 3
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 48
    """Embedding width C."""
    block_size: int = 128
    """Longest context T, in tokens."""
    vocab_size: int = 65
    """Token ids V (Tiny Shakespeare has 65 distinct characters)."""
    dropout: float = 0.0
    """Dropout on embeddings, attention weights and residual branches."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers (GPT-2 has them)."""
    rope: bool = False
    """Rotary position embeddings instead of the learned ``wpe`` (Su et al., "RoFormer", arXiv:2104.09864)."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive integer")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        if self.rope and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"rope needs an even head size; n_embd // n_head = {self.n_embd // self.n_head}")

    @classmethod
    def from_preset(cls, name: str, **overrides: int | float | bool | str) -> GPTConfig:
        """A named preset's config (``gpt-nano``, ``gpt-micro``, ``gpt-mini``, ``tutorial``) with ``overrides``;
        ValueError for an unknown preset."""
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; known: {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})  # type: ignore[arg-type]  # the fields check their types


class Rotary(nn.Module):
    """RoFormer's rotation of head dimensions ``(i, i + hs/2)`` at position ``t`` by ``t * base**(-2i/hs)``, for
    an even ``head_size`` and up to ``max_len`` positions; the tables are buffers outside the state_dict."""

    def __init__(self, head_size: int, max_len: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = base ** (-torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)  # (hs/2,)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # (max_len, hs/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """``(B, nh, T, hs) -> (B, nh, T, hs)``, the T at positions ``start, start + 1, ...`` (0 but in a KV cache)."""
        T = x.size(-2)
        cos, sin = self.cos[start : start + T].to(x.dtype), self.sin[start : start + T].to(x.dtype)  # (T, hs/2)
        x1, x2 = x.chunk(2, dim=-1)  # 2 x (B, nh, T, hs/2)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position ``t`` attends only to positions ``<= t``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v together
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.rotary = Rotary(config.n_embd // config.n_head, config.block_size) if config.rope else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, C) -> (B, T, C)``."""
        B, T, C = x.shape
        # chunk(3) and -1 heads, not split(C) and n_head: under tensor parallelism c_attn yields this rank's heads only
        q, k, v = [
            t.view(B, T, -1, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
            for t in self.c_attn(x).chunk(3, dim=2)  # 3 x (B, T, C)
        ]
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: ``C -> 4C -> GELU -> C``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, C) -> (B, T, C)``."""
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, C) -> (B, T, C)``."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2 style decoder-only transformer over token ids, initialized as GPT-2: normal(0, 0.02) weights, zero
    biases, residual projections (``*.c_proj.weight``) at std ``0.02 / sqrt(2 * n_layer)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        modules: dict[str, nn.Module] = {"wte": nn.Embedding(config.vocab_size, config.n_embd)}
        if not config.rope:  # rotary embeddings encode positions inside attention instead
            modules["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        modules["drop"] = nn.Dropout(config.dropout)
        modules["h"] = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        modules["ln_f"] = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.transformer = nn.ModuleDict(modules)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying (Press & Wolf, arXiv:1608.05859)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self, non_embedding: bool = True) -> int:
        """Parameter count; ``non_embedding`` leaves out the position embedding, as nanoGPT reports it (the token
        embedding is the head's weight: it counts)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs (forward + backward) per token at context ``seq_len`` (default ``block_size``): nanoGPT's
        ``6 N + 12 L C T`` (PaLM, appendix B), N the non-embedding parameters."""
        T = seq_len or self.config.block_size
        return 6 * self.num_parameters() + 12 * self.config.n_layer * self.config.n_embd * T

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``idx (B, T)`` int64 ids, ``T <= block_size`` -> ``(logits (B, T, V), loss)``: the mean cross-entropy
        in nats per token against ``targets (B, T)`` (id -1 ignored), or None without targets.

        Raises:
            ValueError: ``T`` longer than ``block_size``.
        """
        B, T = idx.shape
        if idx.size(1) > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        x = self.transformer.wte(idx)  # (B, T, C)
        if "wpe" in self.transformer:
            pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
            x = x + self.transformer.wpe(pos)  # (B, T, C)
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x)  # (B, T, C)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(B * T, -1).float(), targets.reshape(B * T), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """``idx (B, T) -> (B, T + max_new_tokens)``: the prompt followed by sampled ids, each fed back in (the
        last ``block_size`` are the context). ``temperature > 0`` divides the logits (0: greedy); ``top_k >= 1``
        keeps the most likely; ``generator`` makes samples reproducible. Call ``eval()`` first for dropout-free
        sampling. The arguments are checked where they come in: :func:`lit_ddp.generate.check_sampling`.
        """
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.config.block_size :]  # (B, <=block_size)
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :].float()  # (B, V)
            if temperature == 0:
                idx_next = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("inf")
                probs = F.softmax(logits, dim=-1)  # (B, V)
                idx_next = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
