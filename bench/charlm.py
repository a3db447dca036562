"""Plain-PyTorch pieces shared by the GPT benchmarks: Tiny Shakespeare as token ids, nanoGPT-style random
batches, and loss estimates. Only torch, numpy and the standard library: the loops that use them measure
PyTorch, not this package's Lightning code. The optimizers and the learning-rate schedule are the job's own,
:mod:`lit_ddp.recipe`.

The text is the package's embedded copy (:func:`lit_ddp.data.sources.read_embedded_text`, sha256-checked;
that module imports no Lightning, so the reference loop's start-up stays a plain PyTorch one's).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from lit_ddp.data.sources import read_embedded_text


def load_splits(train_fraction: float = 0.9) -> tuple[str, torch.Tensor, torch.Tensor]:
    """Tiny Shakespeare as nanoGPT's ``shakespeare_char/prepare.py`` makes it: the vocabulary is the sorted
    distinct characters of the whole text; the first ``train_fraction`` of the characters train, the rest
    validate.

    Returns:
        ``(vocab, train_ids (N_train,), val_ids (N_val,))``, ids int64; character ``vocab[i]`` is id ``i``.

    Raises:
        ValueError: the embedded file is damaged (sha256 mismatch).
    """
    text = read_embedded_text()
    vocab = "".join(sorted(set(text)))
    table = np.zeros(max(map(ord, vocab)) + 1, dtype=np.int64)
    table[[ord(c) for c in vocab]] = np.arange(len(vocab))
    ids = torch.from_numpy(table[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)])
    n = int(len(ids) * train_fraction)
    return vocab, ids[:n], ids[n:]


def get_batch(
    data: torch.Tensor, block_size: int, batch_size: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` windows at uniformly random starts, as nanoGPT's ``get_batch``:
    ``ix = randint(len(data) - block_size, (batch_size,))``.

    Returns:
        ``(x, y)``, both ``(B, T)`` int64, ``y`` shifted by one token.
    """
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([data[i : i + block_size] for i in ix.tolist()])  # (B, T)
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix.tolist()])  # (B, T)
    return x, y


@torch.no_grad()
def estimate_loss(
    model: nn.Module,
    data: torch.Tensor,
    block_size: int,
    batch_size: int,
    iters: int,
    device: torch.device | str | None = None,
) -> float:
    """Mean loss (nats per token) over ``iters`` random batches of ``data`` (nanoGPT's ``estimate_loss``),
    in eval mode; the global RNG draws the batches, which go to ``device`` (None: where ``data`` is)."""
    was_training = model.training
    model.eval()
    losses = []
    for _ in range(iters):
        x, y = get_batch(data, block_size, batch_size)  # (B, T) each
        if device is not None and torch.device(device).type == "cuda":  # through pinned memory, as nanoGPT
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        elif device is not None:
            x, y = x.to(device), y.to(device)
        losses.append(model(x, y)[1].item())
    model.train(was_training)
    return sum(losses) / len(losses)


@torch.no_grad()
def full_loss(model: nn.Module, data: torch.Tensor, block_size: int, batch_size: int = 256) -> float:
    """Token-weighted mean loss over all disjoint windows of ``data`` (stride ``block_size``), as the
    Lightning job's ``val/loss`` measures it; deterministic."""
    n = (len(data) - 1) // block_size
    x = data[: n * block_size].view(n, block_size)  # (n, T)
    y = data[1 : n * block_size + 1].view(n, block_size)  # (n, T)
    was_training = model.training
    model.eval()
    total = sum(
        model(x[i : i + batch_size], y[i : i + batch_size])[1].item() * len(x[i : i + batch_size])
        for i in range(0, n, batch_size)
    )
    model.train(was_training)
    return total / n
