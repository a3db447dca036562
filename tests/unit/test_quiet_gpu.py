"""No noise on GPU commands (issue 43), checked as far as a CPU allows: the float32 matmul precision the CLI chooses,
and DDP built on the stream that trains. The model summary under bf16 autocast is checked by the GPU main job's dry
run (tests/unit/test_configs.py); tests/system/test_gpu.py runs the GPU main job where a GPU is."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch import strategies as lightning_strategies
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from torch import nn

from lit_ddp import cli, strategies
from tests.helpers import REPO


@pytest.fixture
def chosen(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The precisions passed to ``torch.set_float32_matmul_precision`` (recorded, not set: it is process-wide)."""
    calls: list[str] = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", calls.append)
    return calls


def test_tf32_on_cuda_where_nothing_chose_a_precision(chosen: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    cli.set_float32_matmul_precision(None, CUDAAccelerator())
    assert chosen == ["high"]
    cli.set_float32_matmul_precision(None, CPUAccelerator())  # CPU results stay torch's
    assert chosen == ["high"]
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "medium")  # this process chose already
    cli.set_float32_matmul_precision(None, CUDAAccelerator())
    assert chosen == ["high"]


def test_a_configured_precision_is_set_on_any_device(chosen: list[str]) -> None:
    cli.set_float32_matmul_precision("highest", CUDAAccelerator())
    cli.set_float32_matmul_precision("medium", CPUAccelerator())
    assert chosen == ["highest", "medium"]


def test_the_cli_takes_a_float32_matmul_precision(capsys: pytest.CaptureFixture) -> None:
    config = ["--config", str(REPO / "configs/regression/single_device.yaml")]
    with pytest.raises(SystemExit):
        cli.cli_main(["fit", *config, "--float32_matmul_precision", "medium", "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out)["float32_matmul_precision"] == "medium"
    with pytest.raises(SystemExit) as exc:
        cli.cli_main(["fit", *config, "--float32_matmul_precision", "tf32"])
    assert exc.value.code == 2 and "float32_matmul_precision" in capsys.readouterr().err


@contextlib.contextmanager
def recorded_ddp(monkeypatch: pytest.MonkeyPatch, module: Any) -> Iterator[list[tuple[bool, dict[str, Any]]]]:
    """``module.DistributedDataParallel`` replaced by a recorder of (under a side stream?, its keyword arguments), and
    ``torch.cuda.Stream`` / ``torch.cuda.stream`` by stand-ins that mark the side stream, so that a strategy's
    ``_setup_model`` runs on a CPU as it would on GPU 0."""
    built: list[tuple[bool, dict[str, Any]]] = []
    side = {"open": False}

    @contextlib.contextmanager
    def stream(_: object) -> Iterator[None]:
        side["open"] = True
        yield
        side["open"] = False

    monkeypatch.setattr(torch.cuda, "Stream", object)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(module, "DistributedDataParallel", lambda **kwargs: built.append((side["open"], kwargs)))
    yield built


def test_ddp_is_built_on_the_stream_that_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning builds DDP under a side stream, whose AccumulateGrad nodes DDP's reducer keeps: torch warns on GPUs
    ("The AccumulateGrad node's stream does not match ..."). lit_ddp's DDPStrategy builds the same DDP on the current
    stream. When Lightning stops opening the stream (Lightning-AI/pytorch-lightning#21746), the first assertion fails:
    lit_ddp.compat.DDPOnTheTrainingStream can go."""
    net = nn.Linear(2, 2)
    for cls, module, side_stream in (
        (lightning_strategies.DDPStrategy, lightning_strategies.ddp, True),
        (strategies.DDPStrategy, torch.nn.parallel, False),  # compat imports it when it builds
    ):
        strategy = cls(find_unused_parameters=True)
        monkeypatch.setattr(strategy, "determine_ddp_device_ids", lambda: [0])
        with recorded_ddp(monkeypatch, module) as built:
            strategy._setup_model(net)
        assert [under for under, _ in built] == [side_stream], cls
        assert built[0][1]["device_ids"] == [0] and built[0][1]["find_unused_parameters"] is True
