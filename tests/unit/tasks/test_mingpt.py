"""GPTModule's forward: with ``compile``, training goes through the compiled function and validation does not (a
compiled graph per evaluation shape would cost a compile at the first validation, and another for a short last
batch)."""

from __future__ import annotations

import torch

from lit_ddp.data.char import build_vocab
from lit_ddp.tasks.mingpt import GPTModule


def test_compiled_forward_trains_and_the_plain_module_validates(monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch, "compile", lambda fn: lambda *a, **k: (calls.append("compiled"), fn(*a, **k))[1])
    module = GPTModule(
        model_type="gpt-nano", n_layer=1, n_head=2, n_embd=16, block_size=8, vocab=build_vocab("abcdefgh"), compile=True
    )
    module.configure_model()
    idx = torch.zeros(2, 8, dtype=torch.long)
    module.train()
    module(idx, idx)
    assert calls == ["compiled"]
    module.eval()
    module(idx, idx)
    assert calls == ["compiled"], "validation ran the compiled function"
