"""lit_ddp.callbacks.text_samples: the sample ``lit-ddp fit`` prints is drawn before Lightning's teardown, on the
strategy's root device; samples run under the run's precision; where the forward is collective (FSDP2) rank zero
samples from one gathered copy, the sharded model never running a forward for it."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import Strategy
from torch.distributed.device_mesh import init_device_mesh

from lit_ddp.callbacks.text_samples import TextSampleCallback, sample_where_trained
from lit_ddp.cli import cli_main
from lit_ddp.data.char import build_vocab
from lit_ddp.generate import sample
from lit_ddp.models.gpt import Block
from lit_ddp.models.parallelize import shard
from lit_ddp.strategies import forward_is_collective
from lit_ddp.tasks.mingpt import GPTModule
from tests.helpers import TINY_GPT_ARGS, compose

TEXT = "ROMEO:\nBut, soft! what light through yonder window breaks?\n" * 40


def tiny_module() -> GPTModule:
    torch.manual_seed(0)
    return GPTModule(model_type="gpt-nano", n_layer=1, n_head=2, n_embd=16, block_size=16, vocab=build_vocab(TEXT))


def cpu_trainer(**kwargs: Any) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, **kwargs)


def test_the_end_of_fit_sample_is_drawn_before_teardown_on_the_root_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Every embedding forward and the strategy's teardown, in order: the last forward (the sample's last token)
    comes before the teardown, which moves the model to the CPU, and on the root device. Drawn in the CLI's
    ``after_fit`` (as before issue 43), it came after the teardown."""
    events: list[tuple[str, torch.device | None]] = []
    teardown, embed = Strategy.teardown, torch.nn.Embedding.forward

    def recorded_teardown(self: Strategy) -> None:
        events.append(("teardown", None))
        teardown(self)

    def recorded_embed(self: torch.nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
        events.append(("forward", self.weight.device))
        return embed(self, idx)

    monkeypatch.setattr(Strategy, "teardown", recorded_teardown)
    monkeypatch.setattr(torch.nn.Embedding, "forward", recorded_embed)
    # fmt: off
    cli = cli_main([
        "fit", *compose("mingpt/cpu"), *TINY_GPT_ARGS, "--trainer.devices", "1",
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
        "--trainer.default_root_dir", str(tmp_path),
    ])
    # fmt: on
    assert cli is not None
    assert "sample:\nO God, O God!" in capsys.readouterr().out
    kinds = [kind for kind, _ in events]
    assert "teardown" in kinds and "forward" in kinds
    last_forward = len(kinds) - 1 - kinds[::-1].index("forward")
    assert last_forward < kinds.index("teardown"), kinds[-5:]
    assert events[last_forward][1] == cli.trainer.strategy.root_device


def test_samples_run_under_the_run_s_precision() -> None:
    """Under bf16-mixed, the sample's forwards run in the precision plugin's autocast (bf16 on the CPU here)."""
    module = tiny_module()
    seen: list[tuple[bool, torch.dtype]] = []
    assert module.model is not None
    module.model.transformer.wte.register_forward_hook(
        lambda *_: seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
    )
    text = sample_where_trained(cpu_trainer(precision="bf16-mixed"), module, "ROMEO:", 10, seed=1)
    assert text is not None and text.startswith("ROMEO:") and len(text) == 16
    assert seen and set(seen) == {(True, torch.bfloat16)}
    seen.clear()
    sample_where_trained(cpu_trainer(), module, "ROMEO:", 10, seed=1)  # fp32: no autocast
    assert seen and not any(enabled for enabled, _ in seen)


@pytest.fixture
def one_process_group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_collective_forward_is_sampled_from_one_gathered_copy(one_process_group: None) -> None:
    """An FSDP2-sharded GPT (one process, but its forward all-gathers): the sample is the plain model's text, and no
    module of the sharded model runs a forward for it (no all-gather per token)."""
    plain = tiny_module()
    module = copy.deepcopy(plain)
    assert module.model is not None
    shard(module.model, init_device_mesh("cpu", (1,)), units=(Block,))
    assert forward_is_collective(module)
    calls: list[str] = []
    for name, m in module.model.named_modules():
        m.register_forward_pre_hook(lambda *_, name=name: calls.append(name))
    text = sample_where_trained(cpu_trainer(), module, "ROMEO:", 30, top_k=5, seed=3)
    assert text == sample(plain, "ROMEO:", 30, top_k=5, seed=3)
    assert calls == []


def test_validation_samples_are_logged_on_rank_zero(tmp_path: Path) -> None:
    callback = TextSampleCallback(prompt="ROMEO:", max_new_tokens=12)
    trainer = cpu_trainer(default_root_dir=str(tmp_path))
    callback.on_validation_end(trainer, tiny_module())
    assert callback.last_sample is not None and callback.last_sample.startswith("ROMEO:")
    assert len(callback.last_sample) == 18


def test_validation_samples_every_n_validations(tmp_path: Path) -> None:
    callback = TextSampleCallback(prompt="ROMEO:", max_new_tokens=4, every_n_validations=3)
    trainer, module = cpu_trainer(default_root_dir=str(tmp_path)), tiny_module()
    drawn = []
    for _ in range(7):
        callback.last_sample = None
        callback.on_validation_end(trainer, module)
        drawn.append(callback.last_sample is not None)
    assert drawn == [True, False, False, True, False, False, True]
    with pytest.raises(ValueError, match="every_n_validations"):
        TextSampleCallback(every_n_validations=0)
