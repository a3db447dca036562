"""minGPT through the CLI: a fit, then `lit-ddp generate` without the data; 2-process DDP with a text sample
logged. (Generation's usage errors and the step configs' callbacks: ``tests/unit/test_generate.py``,
``tests/unit/test_configs.py``.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from lit_ddp.cli import cli_main
from lit_ddp.generate import load_gpt
from tests.helpers import TINY_GPT_ARGS, Runner, compose

CPU = ("trainer/ddp", "mingpt/cpu")  # as `make train` composes them


@pytest.mark.slow
def test_fit_then_generate_without_data(tmp_path: Path, capsys: pytest.CaptureFixture, tiny_shakespeare: Path) -> None:
    """One process: train briefly, remove the text, generate from the checkpoint alone."""
    text = tmp_path / "input.txt"
    shutil.copy(tiny_shakespeare, text)
    root = tmp_path / "run"
    # fmt: off
    cli_main([
        "fit", *compose(*CPU), *TINY_GPT_ARGS,
        "--trainer.devices", "1", "--trainer.strategy", "auto",
        "--data.init_args.path", str(text),
        "--trainer.max_steps", "10", "--trainer.val_check_interval", "5",
        "--trainer.default_root_dir", str(root),
    ])
    # fmt: on
    printed = capsys.readouterr().out
    assert "best val/loss: " in printed and " at global_step " in printed and "last checkpoint: " in printed
    assert "sample:\nO God, O God!" in printed
    text.unlink()
    ckpt = root / "checkpoints" / "last.ckpt"
    raw = torch.load(ckpt, weights_only=True)  # the whole Lightning checkpoint is weights_only-safe
    assert raw["hyper_parameters"]["vocab"] and raw["hyper_parameters"]["block_size"] == 16
    module = load_gpt(ckpt)
    assert module.model.config.block_size == 16 and module.model.config.n_layer == 1
    cli_main(["generate", "--ckpt_path", str(ckpt), "--prompt", "KING:", "--max_new_tokens", "40"])
    assert capsys.readouterr().out.startswith("KING:")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_ddp_two_processes_agree(tmp_path: Path, runner: Runner) -> None:
    """2-process DDP (gloo) through the CLI on the packaged text (no data path): both ranks see the same
    val/loss, a text sample is logged (cpu.yaml's callbacks, to which the recorder is added)."""
    records = tmp_path / "records"
    root = tmp_path / "run"
    # fmt: off
    proc = runner.fit(
        *compose(*CPU), *TINY_GPT_ARGS,
        "--trainer.callbacks+=tests.callbacks.RecordMetrics", f"--trainer.callbacks.init_args.out_dir={records}",
        "--trainer.max_steps", "30", "--trainer.val_check_interval", "15", "--trainer.log_every_n_steps", "5",
        "--trainer.default_root_dir", str(root),
        timeout=120, cwd=tmp_path, MASTER_PORT=str(find_free_network_port()),
    )
    # fmt: on
    assert proc.returncode == 0, proc.stdout[-5000:]
    ranks = [json.loads((records / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 30
    assert ranks[0]["metrics"]["val/loss"] == ranks[1]["metrics"]["val/loss"]
    assert ranks[0]["metrics"]["val/ppl"] == pytest.approx(torch.tensor(ranks[0]["metrics"]["val/loss"]).exp().item())
    # Rank zero alone printed the summary and a sample.
    assert proc.stdout.count("best val/loss: ") == 1 and proc.stdout.count("sample:\nO God, O God!") == 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(root), size_guidance={"tensors": 0})
    acc.Reload()
    assert "samples/text_summary" in acc.Tags()["tensors"]
    assert {"train/loss", "val/loss", "val/ppl", "train/items_per_sec", "train/device/mfu"} <= set(
        acc.Tags()["scalars"]
    )
