"""lit_ddp.generate: ``lit-ddp generate`` from a checkpoint's hyperparameters and weights alone (no data), on a chosen
device, ``sample()``'s default prompt and its threads on a CPU, and the usage errors and foreign files it refuses."""

from __future__ import annotations

from pathlib import Path

import lightning
import pytest
import torch

from lit_ddp.callbacks.text_samples import TextSampleCallback
from lit_ddp.cli import cli_main
from lit_ddp.data.char import build_vocab
from lit_ddp.generate import DEFAULT_PROMPT, generate, sample, sampling_device
from lit_ddp.models import kv_cache
from lit_ddp.tasks.mingpt import GPTModule

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


def test_generate_on_a_chosen_device(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--device cpu`` loads and samples on the CPU, the same text as the default device does here (the CPU unless
    torch sees a GPU); the default is CUDA wherever torch sees one."""
    ckpt = save_like_lightning(tiny_module(), tmp_path / "tiny.ckpt")
    cli_main(["generate", "--ckpt_path", str(ckpt), "--prompt", "ROMEO:", "--max_new_tokens", "30", "--device", "cpu"])
    out = capsys.readouterr().out
    assert out.startswith("ROMEO:") and len(out.rstrip("\n")) == 36
    assert sampling_device() == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        assert out.rstrip("\n") == generate(str(ckpt), "ROMEO:", 30)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "gpu"], "--device 'gpu': "),
        (["--device", f"cuda:{torch.cuda.device_count()}"], "CUDA device(s)"),  # one past the last
        (["--max_new_tokens", "-1"], "--max_new_tokens=-1 must be >= 0"),
        (["--top_k", "0"], "--top_k=0 must be >= 1"),
        (["--prompt", "ROMEO@"], "'@'"),
        (["--max_new_tokens", "many"], "max_new_tokens"),
        # torch's multinomial error (a traceback) before issue 50; nan and inf spelled as YAML reads them
        (["--temperature", ".nan"], "--temperature=nan must be a finite number >= 0 (0: greedy)"),
        (["--temperature", ".inf"], "--temperature=inf must be a finite number >= 0"),
        (["--temperature", "1e-45"], "--temperature=1e-45 must be 0 (greedy) or >= 1e-06"),
    ],
)
def test_generate_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str], message: str) -> None:
    ckpt = save_like_lightning(tiny_module(), tmp_path / "tiny.ckpt")
    with pytest.raises(SystemExit) as exc:
        cli_main(["generate", "--ckpt_path", str(ckpt), *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_generate_names_the_task_of_another_task_s_checkpoint(
    regression_run: Path, capsys: pytest.CaptureFixture
) -> None:
    """A checkpoint from `lit-ddp fit` of the regression: one line naming its task, not torch's unpickling advice
    (issue 25, item 7)."""
    with pytest.raises(SystemExit) as exc:
        cli_main(["generate", "--ckpt_path", str(regression_run / "checkpoints" / "last.ckpt")])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert (
        "is not a minGPT checkpoint" in err and "it is a checkpoint of lit_ddp.tasks.regression.RegressionModule" in err
    )
    assert "If you trust" not in err


def test_generate_rejects_other_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    other = tmp_path / "regression.ckpt"
    torch.save({"state_dict": {"net.weight": torch.zeros(1, 20)}, "hyper_parameters": {"num_features": 20}}, other)
    pickled = tmp_path / "pickled.ckpt"
    torch.save({"state_dict": {}, "payload": Path("x")}, pickled)  # needs unpickling code: refused
    empty, text = tmp_path / "empty.ckpt", tmp_path / "notes.ckpt"  # an EOFError traceback before issue 50
    empty.write_bytes(b"")
    text.write_text("not a checkpoint\n")
    for path, message in [
        (other, f"--ckpt_path {other} is not a minGPT checkpoint"),
        (pickled, "holds objects other than tensors and plain data, which lit-ddp does not load"),
        (tmp_path / "missing.ckpt", "no such file"),
        (empty, f"--ckpt_path {empty} is empty (0 bytes), not a checkpoint"),
        (text, f"--ckpt_path {text} is not a readable checkpoint: File is not a zip file"),
    ]:
        with pytest.raises(SystemExit) as exc:
            cli_main(["generate", "--ckpt_path", str(path)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


def test_generate_accepts_only_this_package_s_gpt_module(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A checkpoint naming another ``GPTModule`` (any module path ending in the class name passed before issue 50)."""
    module = tiny_module()
    ckpt = save_like_lightning(module, tmp_path / "tiny.ckpt")
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint["hyper_parameters"]["_class_path"] = "elsewhere.GPTModule"
    torch.save(checkpoint, ckpt)
    with pytest.raises(SystemExit) as exc:
        cli_main(["generate", "--ckpt_path", str(ckpt)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--ckpt_path {ckpt} is not a minGPT checkpoint" in err and "a checkpoint of elsewhere.GPTModule" in err


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"n_layer": 10000, "n_embd": 100000, "n_head": 1}, "build a GPTModule of more than 1,"),
        ({"n_embd": 100000, "n_head": 1}, "model.transformer.wte.weight is (29, 100000) in the model, (29, 16) in the "
                                          "checkpoint; the model would hold 120,008,900,000 values (447.1 GiB)"),
    ],
)  # fmt: skip
def test_hyperparameters_the_tensors_do_not_fit_are_refused_before_the_model_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture, no_big_gpt: None, sizes: dict, message: str
) -> None:
    ckpt = save_like_lightning(tiny_module(), tmp_path / "tiny.ckpt")
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint["hyper_parameters"].update(sizes)
    torch.save(checkpoint, ckpt)
    with pytest.raises(SystemExit) as exc:
        cli_main(["generate", "--ckpt_path", str(ckpt)])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    [line] = [line for line in err.splitlines() if line.startswith("lit-ddp: error:")]
    assert line.startswith(f"lit-ddp: error: --ckpt_path {ckpt}") and message in line, line


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": -1}, "max_new_tokens=-1"),
        ({"temperature": -0.5}, "temperature=-0.5"),
        ({"temperature": float("nan")}, "temperature=nan must be a finite number"),
        ({"temperature": float("inf")}, "temperature=inf must be a finite number"),
        ({"top_k": 0}, "top_k=0"),
    ],
)
def test_bad_sampling_arguments_refused_by_sample_and_at_callback_construction(kwargs: dict, message: str) -> None:
    """The model's ``generate`` does not check its arguments: ``sample`` and the callback do, the callback when the
    config is instantiated (before any process starts), not at the first validation end."""
    with pytest.raises(ValueError, match=message):
        sample(tiny_module(), **kwargs)
    with pytest.raises(ValueError, match=message):
        TextSampleCallback(**kwargs)


def test_sample_on_a_cpu_uses_one_thread_and_restores_torch_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each token is a tiny forward: threads only wait on each other, badly when other jobs share the cores
    (tests/system/test_prompt_exit.py). ``cpu_threads=None`` keeps torch's setting."""
    seen: list[int] = []
    real = kv_cache.generate

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(kv_cache, "generate", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        sample(tiny_module(), max_new_tokens=3)
        assert torch.get_num_threads() == 2
        sample(tiny_module(), max_new_tokens=3, cpu_threads=None)
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2]
