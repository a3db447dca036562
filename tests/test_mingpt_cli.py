"""minGPT through the CLI: a fit, `lit-ddp generate` without the data, usage errors, 2-process DDP, and the
step configs' callbacks (text samples, throughput)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lightning
import pytest
import torch
import yaml
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from lit_ddp.cli import cli_main
from lit_ddp.data.char import build_vocab
from lit_ddp.generate import DEFAULT_PROMPT, generate, load_gpt, sample
from lit_ddp.tasks.mingpt import GPTModule
from tests.helpers import CONFIGS, TINY_GPT_ARGS, Runner, compose

CPU = ("trainer/ddp", "mingpt/cpu")  # as `make train` composes them

TEXT = "ROMEO:\nBut, soft! what light through yonder window breaks?\n" * 40


def tiny_module() -> GPTModule:
    return GPTModule(model_type="gpt-nano", n_layer=1, n_head=2, n_embd=16, block_size=16, vocab=build_vocab(TEXT))


def save_like_lightning(module: GPTModule, path: Path) -> Path:
    """The keys of a Lightning checkpoint that ``GPTModule.load_from_checkpoint`` reads."""
    checkpoint = {
        "state_dict": module.state_dict(),
        "hyper_parameters": dict(module.hparams),
        "pytorch-lightning_version": lightning.__version__,
    }
    torch.save(checkpoint, path)
    return path


@pytest.mark.parametrize("name", ["cpu", "ddp", "torchrun", "slurm", "tutorial"])
def test_step_configs_sample_and_measure_throughput(name: str) -> None:
    """Text samples and throughput/MFU are trainer callbacks of every minGPT step config, not model
    hyperparameters: what TensorBoard shows (``samples``, ``train/device/items_per_sec``...) stays."""
    config = yaml.safe_load((CONFIGS / "mingpt" / f"{name}.yaml").read_text())
    paths = [c["class_path"] for c in config["trainer"]["callbacks"]]
    assert paths[-1] == "lit_ddp.callbacks.text_samples.TextSampleCallback"  # last: --trainer.callbacks.init_args
    assert any(p.endswith(".TokenThroughputMonitor") for p in paths)
    assert not {"sample_tokens", "sample_prompt", "available_flops"} & set(config["model"].get("init_args") or {})


def test_default_prompt_is_the_module_s() -> None:
    """``sample(module)`` without a prompt continues DEFAULT_PROMPT, less the characters the vocabulary lacks."""
    module = tiny_module()
    assert sample(module, max_new_tokens=0) == "".join(c for c in DEFAULT_PROMPT if c in module.vocab)
    assert "sample_tokens" not in module.hparams and "configure_callbacks" not in GPTModule.__dict__


def test_generate_from_hparams_and_weights_only(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ckpt = save_like_lightning(tiny_module(), tmp_path / "tiny.ckpt")
    hparams = torch.load(ckpt, weights_only=True)["hyper_parameters"]  # primitive hparams only
    assert hparams["vocab"] == build_vocab(TEXT) and hparams["betas"] == (0.9, 0.95)
    cli_main(["generate", "--ckpt_path", str(ckpt), "--prompt", "ROMEO:", "--max_new_tokens", "30", "--seed", "3"])
    out = capsys.readouterr().out
    assert out.startswith("ROMEO:") and len(out.rstrip("\n")) >= 36
    assert generate(str(ckpt), "ROMEO:", 30, seed=3) == generate(str(ckpt), "ROMEO:", 30, seed=3)
    assert generate(str(ckpt), "RO", 0) == "RO"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max_new_tokens", "-1"], "--max_new_tokens=-1 must be >= 0"),
        (["--top_k", "0"], "--top_k=0 must be >= 1"),
        (["--prompt", "ROMEO@"], "'@'"),
        (["--max_new_tokens", "many"], "max_new_tokens"),
    ],
)
def test_generate_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str], message: str) -> None:
    ckpt = save_like_lightning(tiny_module(), tmp_path / "tiny.ckpt")
    with pytest.raises(SystemExit) as exc:
        cli_main(["generate", "--ckpt_path", str(ckpt), *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_generate_rejects_other_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    other = tmp_path / "regression.ckpt"
    torch.save({"state_dict": {"net.weight": torch.zeros(1, 20)}, "hyper_parameters": {"num_features": 20}}, other)
    pickled = tmp_path / "pickled.ckpt"
    torch.save({"state_dict": {}, "payload": Path("x")}, pickled)  # needs unpickling code: refused
    for path, message in [
        (other, f"--ckpt_path {other} is not a minGPT checkpoint"),
        (pickled, "cannot be loaded with torch.load(weights_only=True)"),
        (tmp_path / "missing.ckpt", "no such file"),
    ]:
        with pytest.raises(SystemExit) as exc:
            cli_main(["generate", "--ckpt_path", str(path)])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


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
    assert "best val/loss: " in printed and "checkpoint: " in printed and "sample:\nO God, O God!" in printed
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
