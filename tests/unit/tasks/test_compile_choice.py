"""``GPTModule(compile=...)``: none, each block (regional compilation) or the whole training forward; validation
runs eagerly whichever, so its batch shapes compile no graph (issue 52)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from lit_ddp.data.char import build_vocab
from lit_ddp.tasks.mingpt import GPTModule

TINY = {"model_type": "gpt-nano", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8, "dropout": 0.0}


def graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("compile", [False, "blocks", "model"])
def test_training_compiles_as_chosen_and_validation_never(compile: bool | str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo's graphs counted, compiled by its eager backend (Inductor's would only take longer here)."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model=None, **kwargs: real(model, **{**kwargs, "backend": "eager"}))
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    module = GPTModule(**TINY, vocab=build_vocab("abcdefgh"), compile=compile)
    eager = GPTModule(**TINY, vocab=build_vocab("abcdefgh"))
    eager.load_state_dict(module.state_dict())  # the same keys: compiling in place adds none
    x = torch.randint(0, 8, (4, 8), generator=torch.Generator().manual_seed(1))
    module.train(), eager.train()
    _, loss = module(x, x)
    loss.backward()
    _, eager_loss = eager(x, x)
    torch.testing.assert_close(loss, eager_loss)
    expected = {False: 0, "blocks": 1, "model": 1}[compile]  # one Block graph that both blocks reuse
    assert graphs() == expected
    assert (module._forward is not None) == (compile == "model"), "blocks: compiled in place, the forward as it is"
    module.eval()
    with torch.no_grad():
        for batch in (4, 3, 1):  # another batch size each: a compiled forward would make a graph (or a dynamic one)
            module(x[:batch], x[:batch])
    assert graphs() == expected, "validation compiled"
