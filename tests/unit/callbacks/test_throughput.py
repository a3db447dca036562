"""The H200's peak: Lightning 2.6's table misses its reported name, ours fills it in (MFU on an H200)."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.utilities.throughput import get_available_flops

from lit_ddp.callbacks.throughput import peak_flops


@pytest.fixture
def h200(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    return torch.device("cuda", 0)


def test_h200_peak_is_the_h100_sxm_dense_figure(h200: torch.device) -> None:
    assert peak_flops(h200, "bf16-mixed") == 989.4e12
    assert peak_flops(h200, "32-true") is None  # no figure: Lightning's table decides
    assert peak_flops(torch.device("cpu"), "bf16-mixed") is None


def test_lightning_still_misses_the_h200(h200: torch.device) -> None:
    """When Lightning's table knows "NVIDIA H200", PEAK_FLOPS's entry can go."""
    with pytest.warns(UserWarning, match="FLOPs not found for 'NVIDIA H200'"):
        assert get_available_flops(h200, torch.bfloat16) is None
