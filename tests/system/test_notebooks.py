"""The notebooks run top to bottom (nbclient, a real kernel, cwd = notebooks/) and compute what they claim.
(That the committed notebooks carry their outputs: ``tests/unit/test_notebooks.py``.)

Each notebook writes its key numbers to ``$LIT_DDP_NOTEBOOK_OUT/<name>.json``; the tests read them back.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from lit_ddp.data.sources import DATA_ENV
from tests.helpers import LAUNCH_ENV, NOTEBOOK_DIR

CELL_TIMEOUT = 240  # seconds per cell; the whole notebook is bounded by each test's pytest timeout


def execute(name: str, out_dir: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Runs ``notebooks/<name>.ipynb`` in a fresh kernel and returns the JSON it wrote."""
    monkeypatch.setenv("LIT_DDP_NOTEBOOK_OUT", str(out_dir))  # the kernel inherits the environment
    monkeypatch.setenv("MPLBACKEND", "Agg")
    for key in (*LAUNCH_ENV, DATA_ENV):  # no launcher variables; the packaged Tiny Shakespeare
        monkeypatch.delenv(key, raising=False)
    nb = nbformat.read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)
    client = NotebookClient(
        nb, timeout=CELL_TIMEOUT, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK_DIR)}}
    )
    client.execute()
    return json.loads((out_dir / f"{name}.json").read_text())


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_what_is_ddp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = execute("00_what_is_ddp", tmp_path, monkeypatch)
    shards = results["shards"]
    assert shards["disjoint"] and shards["reshuffled"]
    assert len(shards["indices"]) == 2 and all(len(epochs) == 2 for epochs in shards["indices"])
    grads = results["gradients"]
    assert grads["max_abs_diff_vs_single_process"] < 1e-6
    assert grads["max_grad"] > 1e-2  # a real gradient, not zeros
    assert grads["params_equal_after_wrap"] and grads["params_equal_after_step"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_regression_ddp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps 1 and 2: the module's code, the settings DDP changes (devices and the strategy among them), both runs."""
    results = execute("02_regression_ddp", tmp_path, monkeypatch)
    assert {"trainer.devices", "trainer.strategy.class_path"} <= set(results["differences"])
    single, ddp = results["single"], results["ddp"]
    assert single["steps"] == 2 * ddp["steps"] == 560  # 10 epochs of 56 (one device) or 28 (two) steps
    for run in (single, ddp):
        assert run["val_loss_last"] < 0.5 * run["val_loss_first"]
        assert run["train_loss_last"] < run["train_loss_first"]
    assert (tmp_path / "02_regression" / "ddp" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_kill_and_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 3: rank 1 SIGKILLed mid-epoch under torchrun, the restart resumes from the step-100 checkpoint, and the
    run ends with the uninterrupted run's weights and validation curve, bit for bit."""
    results = execute("03_kill_and_resume", tmp_path, monkeypatch)
    assert results["global_steps"] == [168, 168] and results["tensors"] >= 2 and results["different"] == []
    [resumed] = results["resumed"]
    assert "at global_step 100, epoch 3, restart 1 of this job" in resumed  # step=100.ckpt or last.ckpt: both hold it
    assert results["curves_equal"] and results["validations"] == 6


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_mingpt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = execute("05_mingpt", tmp_path, monkeypatch)
    val = [loss for _, loss in results["val_loss"]]
    assert len(val) == 3 and val[-1] < val[0] < 4.2  # below ln(65): better than uniform from the first check
    assert results["train_loss_last"] < results["train_loss_first"] - 1.0
    assert results["generated"].startswith("ROMEO:") and len(results["generated"]) == len("ROMEO:") + 300


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_fsdp2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What each rank holds (FSDP2 on 2: half of DDP's bytes), the collectives per block, a sharded checkpoint
    with a shard file per rank, text generated from it."""
    results = execute("06_fsdp2", tmp_path, monkeypatch)
    assert 0.49 < results["ratio"] < 0.51
    n_layer = results["n_layer"]
    assert results["calls"] == {"all_gather_single": 2 * n_layer + 1, "reduce_scatter_single": n_layer + 1}
    files = results["checkpoint_files"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"} <= files.keys(), files
    assert results["generated"].startswith("ROMEO:") and len(results["generated"]) == len("ROMEO:") + 200
