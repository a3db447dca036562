""":mod:`lit_ddp.callbacks.batched_step`: the recipe's optimizer made to step in fewer kernels, in place, the schedule
still driving it; the callback in a fit. gpu.yaml's whole job with it on a CPU:
``tests/unit/test_configs.py::test_gpu_main_job_dry_run_on_cpu``; the op count: ``tests/unit/test_muon.py``."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer

from lit_ddp.callbacks.batched_step import BatchedOptimizerStep, batch_optimizer_step
from lit_ddp.compat import BatchedMuon
from lit_ddp.data.char import build_vocab
from lit_ddp.models.gpt import GPT, GPTConfig
from lit_ddp.recipe import build_optimizer, warmup_cosine_schedule
from lit_ddp.tasks.mingpt import GPTModule


def tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=11, dropout=0.0))


@pytest.mark.parametrize("adamw_fused", [True, False, None])
def test_muon_becomes_batched_over_the_same_groups(adamw_fused: bool | None) -> None:
    """The chain's Muon becomes a BatchedMuon over the very group dicts the chain and its scheduler hold; AdamW steps
    fused where asked (None: where every parameter is on CUDA, so not here), else as built."""
    model = tiny()
    chain = build_optimizer(model, "muon", muon_learning_rate=0.05)
    schedule = warmup_cosine_schedule(chain, warmup_steps=2, decay_steps=10, min_lr_ratio=0.1)
    groups = [id(g) for g in chain.param_groups]
    assert batch_optimizer_step(chain, adamw_fused) is chain
    muon, adamw = chain.optimizers  # type: ignore[attr-defined]
    assert type(muon) is BatchedMuon
    assert [id(g) for o in (muon, adamw) for g in o.param_groups] == groups
    assert all(bool(g["fused"]) is bool(adamw_fused) for g in adamw.param_groups)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    chain.step()
    schedule.step()
    assert muon.param_groups[0]["lr"] == chain.param_groups[0]["lr"] != 0.05 / 3  # the schedule moved it
    assert set(chain.state) == set(model.parameters())


def test_only_an_optimizer_that_has_not_stepped() -> None:
    model = tiny()
    adamw = build_optimizer(model, "adamw")
    assert batch_optimizer_step(adamw, adamw_fused=True) is adamw and all(g["fused"] for g in adamw.param_groups)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    adamw.step()
    with pytest.raises(ValueError, match="before the first step"):
        batch_optimizer_step(adamw)
    alone = torch.optim.Muon([model.transformer.h[0].attn.c_attn.weight])
    assert type(batch_optimizer_step(alone)) is torch.optim.Muon  # outside a chain: the scheduler would hold it


def test_the_callback_batches_the_fits_optimizer(tmp_path) -> None:
    torch.manual_seed(0)
    module = GPTModule(model_type="gpt-nano", n_layer=1, n_head=2, n_embd=16, block_size=8, dropout=0.0,
                       vocab=build_vocab("abcdefgh "), optimizer="muon", warmup_steps=1)  # fmt: skip
    loader = torch.utils.data.DataLoader([(torch.arange(8) % 9, (torch.arange(8) + 1) % 9)] * 8, batch_size=4)
    quiet = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "enable_progress_bar": False,
    }
    trainer = Trainer(
        accelerator="cpu", max_steps=2, callbacks=[BatchedOptimizerStep()], default_root_dir=tmp_path, **quiet
    )
    trainer.fit(module, loader)
    assert trainer.global_step == 2
    assert type(trainer.optimizers[0].optimizers[0]) is BatchedMuon  # type: ignore[attr-defined]
