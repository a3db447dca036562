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


def test_validating_a_checkpoint_on_another_text_names_the_characters_apart(tmp_path, capsys) -> None:
    """LightningCLI puts a ``--ckpt_path``'s vocabulary into the model's arguments, where it silently replaced the
    data's: the text was encoded with one vocabulary and read with another (garbage, or an IndexError where the
    data had more characters). Now the data's is the module's, compared with the checkpoint's as it loads, before
    the first step, naming the characters (issue 50, item 7)."""
    from tests.helpers import QUIET, TEST_DATA, compose, usage_error

    text = tmp_path / "french.txt"
    text.write_text("\u00c7a va? Tr\u00e8s bien, merci! Zo\u00eb et No\u00ebl.\n" * 200, encoding="utf-8")
    line = usage_error(capsys, "validate", *compose("mingpt/cpu"),  # one process, no DDP in this one
                       "--ckpt_path", str(TEST_DATA / "mingpt_last_696c9f9.ckpt"), "--data.init_args.path", str(text),
                       "--trainer.devices", "1", "--trainer.default_root_dir", str(tmp_path / "run"), *QUIET)  # fmt: skip
    assert (
        "the checkpoint's vocabulary (65 characters) is not the data's (25): only in the data '\u00c7\u00e8\u00eb', "
        'only in the checkpoint "$&\'-3:;ABCDEFGHIJKLMOPQRSUVWXYdfghjkpquw": use it on the text it was trained on'
    ) in line, line


def test_resuming_on_another_text_names_the_characters_apart() -> None:
    """A resume of the run directory (the model built from the data's vocabulary)."""
    import pytest

    module = GPTModule(model_type="gpt-nano", n_layer=1, n_head=2, n_embd=16, block_size=8, vocab=build_vocab("abcz"))
    with pytest.raises(ValueError, match=r"is not the data's \(4\): only in the data 'z', only in the checkpoint 'y'"):
        module.on_load_checkpoint({"hyper_parameters": {"vocab": "abcy"}})
    module.on_load_checkpoint({"hyper_parameters": {"vocab": "abcz"}})
