"""lit_ddp.launch.model_size: a checkpoint whose hyperparameters ask for a model its tensors do not fit is refused in
one line naming the sizes, before the model takes memory: in ``fit`` / ``validate`` / ``test --ckpt_path``, whose
hyperparameters LightningCLI puts into the model's arguments (``generate``'s: tests/unit/test_generate.py)
(issue 50, item 7)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lit_ddp.errors import UsageError
from lit_ddp.launch.model_size import check_model_fits, state_shapes
from lit_ddp.tasks.mingpt import GPTModule
from tests.helpers import QUIET, TEST_DATA, compose, usage_error

SAVED = TEST_DATA / "mingpt_last_696c9f9.ckpt"  # a 1-layer, width-16 GPT with rotary positions


def crafted(tmp_path: Path, **hparams: object) -> Path:
    """The saved minGPT checkpoint with some hyperparameters replaced."""
    checkpoint = torch.load(SAVED, weights_only=True)
    checkpoint["hyper_parameters"].update(hparams)
    path = tmp_path / "crafted.ckpt"
    torch.save(checkpoint, path)
    return path


@pytest.mark.parametrize("command", ["validate", "fit"])
def test_a_ckpt_path_asking_for_a_huge_model_is_refused_before_it_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture, no_big_gpt: None, command: str
) -> None:
    ckpt = crafted(tmp_path, n_layer=10000, n_embd=100000, n_head=1)
    line = usage_error(capsys, command, *compose("trainer/ddp", "mingpt/cpu"), "--ckpt_path", str(ckpt),
                       "--trainer.devices", "1", "--trainer.default_root_dir", str(tmp_path / "run"), *QUIET)  # fmt: skip
    assert (
        f"--ckpt_path {ckpt}: the config and its hyperparameters build a GPTModule of more than 1,064 tensors, " in line
    )
    assert "but the checkpoint's state_dict holds 16; refused before building it" in line


def test_a_wider_model_is_named_with_both_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture, no_big_gpt: None
) -> None:
    ckpt = crafted(tmp_path, n_embd=100000, n_head=1)
    line = usage_error(capsys, "validate", *compose("trainer/ddp", "mingpt/cpu"), "--ckpt_path", str(ckpt),
                       "--trainer.devices", "1", "--trainer.default_root_dir", str(tmp_path / "run"), *QUIET)  # fmt: skip
    assert (
        f"--ckpt_path {ckpt} does not fit the GPTModule the config and its hyperparameters build: "
        "model.transformer.wte.weight is (65, 100000) in the model, (65, 16) in the checkpoint; the model would hold "
        "120,014,500,000 values (447.1 GiB), the checkpoint holds 5,392" in line
    ), line


def test_the_checkpoint_s_own_hyperparameters_fit_it() -> None:
    hparams = torch.load(SAVED, weights_only=True)["hyper_parameters"]
    check_model_fits(GPTModule, hparams, state_shapes(SAVED), "saved", "its hyperparameters")


def test_memory_outside_the_state_dict_is_bounded_too() -> None:
    """Rotary tables are buffers outside the state_dict, sized by ``block_size``: 10**9 positions are 30 GiB."""
    hparams = {**torch.load(SAVED, weights_only=True)["hyper_parameters"], "block_size": 10**9}
    with pytest.raises(UsageError, match=r"would hold 29.8 GiB outside its state_dict \(buffers\)"):
        check_model_fits(GPTModule, hparams, state_shapes(SAVED), "saved", "its hyperparameters")


def test_hyperparameters_that_build_nothing_are_named() -> None:
    hparams = {**torch.load(SAVED, weights_only=True)["hyper_parameters"], "n_head": 3}
    with pytest.raises(UsageError, match=r"its hyperparameters do not build a GPTModule \(ValueError: n_embd=16 must"):
        check_model_fits(GPTModule, hparams, state_shapes(SAVED), "saved", "its hyperparameters")
