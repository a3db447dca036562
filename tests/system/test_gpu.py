"""The GPU main job where a GPU is (skipped elsewhere): ``make train``'s composition on a machine where torch sees CUDA,
shortened, prints no line of the noise list (issue 43: Lightning's TF32 tip, its model summary's warning under
bf16-mixed, torch's AccumulateGrad stream warning, and the CPU ones)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, Runner, main_job, noise_lines

MAIN_JOB = main_job()
CPU_CONFIGS, GPU_CONFIGS, default_configs = MAIN_JOB.CPU_CONFIGS, MAIN_JOB.GPU_CONFIGS, MAIN_JOB.default_configs


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_main_job_makes_no_noise(tmp_path: Path, runner: Runner) -> None:
    """40 steps of configs/mingpt/gpu.yaml as configured (bf16 autocast, DDP over every GPU, its compile choice),
    validating at steps 20 and 40: it trains on the GPU, and its output holds no noise line (the model summary is on)."""
    assert default_configs() == GPU_CONFIGS  # what `make train` composes here
    configs = [a for c in GPU_CONFIGS for a in ("--config", str(REPO / c))]
    short = ["--trainer.max_steps", "40", "--trainer.val_check_interval", "20",
             "--trainer.enable_progress_bar", "false"]  # fmt: skip
    result = runner.fit(*configs, *short, "--trainer.default_root_dir", str(tmp_path), timeout=400)
    out = result.stdout
    assert result.returncode == 0, out[-5000:]
    assert "GPU available: True (cuda), used: True" in out, out[-5000:]
    assert "Total params" in out, "the model summary"
    loss = re.search(r"last validation: val/loss (\d+\.\d+)", out)
    assert loss is not None and float(loss[1]) < 4.0, out[-3000:]  # ln(65) = 4.17 untrained
    assert noise_lines(out) == [], out[-5000:]
