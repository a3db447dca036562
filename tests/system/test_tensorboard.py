"""What the README says is logged is in the event files, read back with tensorboard's own reader
(EventAccumulator) after a tiny in-process minGPT run, and a real ``tensorboard`` server serves the same values.
(The regression run's log: ``tests/unit/test_tensorboard.py``; its run: the ``regression_run`` fixture.)"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from lit_ddp.cli import cli_main
from lit_ddp.tensorboard import read_hparams, read_scalars, read_text, scalar_tags
from tests.helpers import TINY_GPT_ARGS, Runner, compose

# The exact scalar tags of a one-process minGPT run (the README's monitoring section lists them).
GPT_SCALARS = {
    "train/loss",
    "val/loss",
    "val/ppl",
    "lr-OptimizerChain/muon",  # cpu.yaml's optimizer: Muon for the blocks' matrices ...
    "lr-OptimizerChain/adamw_decay",  # ... AdamW for the rest: decayed (none in gpt-nano with a tied head)
    "lr-OptimizerChain/adamw_no_decay",  # not decayed (biases, LayerNorm, embeddings)
    "epoch",
    # ThroughputMonitor, per process; with DDP also train/{batches,samples,items,flops}_per_sec and train/mfu
    "train/time",
    "train/batches",
    "train/samples",
    "train/lengths",
    "train/device/batches_per_sec",
    "train/device/samples_per_sec",
    "train/device/items_per_sec",
    "train/device/flops_per_sec",
    "train/device/mfu",
}


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mingpt")
    cli_main(  # the packaged Tiny Shakespeare: no data path
        ["fit", *compose("trainer/ddp", "mingpt/cpu"), *TINY_GPT_ARGS]
        + ["--trainer.devices", "1", "--trainer.strategy", "auto", "--trainer.default_root_dir", str(root)]
        + ["--trainer.max_steps", "30", "--trainer.val_check_interval", "10", "--trainer.limit_val_batches", "2"]
        + ["--trainer.log_every_n_steps", "5"]
    )
    return root


@pytest.mark.slow
def test_mingpt_logs_ppl_lr_throughput_text_and_hparams(gpt_run: Path) -> None:
    assert set(scalar_tags(gpt_run)) == GPT_SCALARS
    val_loss = read_scalars(gpt_run, "val/loss")
    assert [s for s, _ in val_loss] == [9, 19, 29]  # Lightning logs at global_step - 1 inside the step
    for (_, loss), (_, ppl) in zip(val_loss, read_scalars(gpt_run, "val/ppl"), strict=True):
        assert ppl == pytest.approx(math.exp(loss), rel=1e-5)
    lrs = [lr for _, lr in read_scalars(gpt_run, "lr-OptimizerChain/muon")]
    assert max(lrs) <= 2e-2 and lrs[0] < lrs[-1]  # warmup (cpu.yaml: 100 steps) towards 2e-2
    assert all(v > 0 for _, v in read_scalars(gpt_run, "train/device/items_per_sec"))  # tokens/s
    samples = read_text(gpt_run, "samples")
    assert [s for s, _ in samples] == [10, 20, 30]  # global_step after the step
    assert all(text.strip().startswith("O God, O God!") for _, text in samples)
    hparams, metrics = read_hparams(gpt_run)
    assert hparams["model_type"] == "gpt-nano" and hparams["n_embd"] == 16 and hparams["block_size"] == 16
    assert metrics == ["val/loss"]


def get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tensorboard_server_serves_the_logged_val_loss(regression_run: Path, runner: Runner) -> None:
    """A real ``tensorboard`` process: its HTTP data API returns the val/loss points of the event files."""
    exe = Path(sys.executable).with_name("tensorboard")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tensorboard.main"]
    if shutil.which(cmd[0]) is None and not Path(cmd[0]).exists():
        pytest.skip("tensorboard is not installed")
    port = find_free_network_port()
    proc = runner.start([*cmd, "--logdir", str(regression_run), "--host", "127.0.0.1", "--port", str(port)])
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    runs: object = []
    while not runs:  # up, and done loading the log
        if proc.poll() is not None:
            raise AssertionError(f"tensorboard exited with {proc.returncode}:\n{proc.stdout.read()}")
        if time.monotonic() > deadline:
            raise AssertionError("tensorboard did not serve any run within 90 s")
        with contextlib.suppress(OSError):  # not listening yet
            runs = get_json(f"{base}/data/runs")
        if not runs:
            time.sleep(0.5)
    assert runs == ["."]  # the event files lie directly in the run directory
    query = urllib.parse.urlencode({"run": runs[0], "tag": "val/loss"})
    points = get_json(f"{base}/data/plugin/scalars/scalars?{query}")  # [[wall_time, step, value], ...]
    assert [(step, value) for _, step, value in points] == read_scalars(regression_run, "val/loss")
