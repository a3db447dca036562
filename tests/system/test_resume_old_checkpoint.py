"""A checkpoint written before the callbacks were rebuilt on public APIs (commit 696c9f9: PeriodicCheckpoint swapped
ModelCheckpoint's private triggers, TokenThroughputMonitor subclassed Lightning's ThroughputMonitor) resumes with
today's code: every callback finds its state under the key it was filed under, and the run goes on counting.

The fixture, tests/data/mingpt_last_696c9f9.ckpt (77 kB), is the ``last.ckpt`` of this command at that commit::

    lit-ddp fit --config configs/mingpt/cpu.yaml --config configs/checkpoint/fault_tolerant.yaml \\
        --trainer.devices 1 --trainer.strategy auto <TINY_GPT_ARGS> --trainer.max_steps 6 \\
        --trainer.val_check_interval 4 --trainer.log_every_n_steps 2 --checkpoint.every_n_train_steps 3 \\
        --checkpoint.save_top_k 2 --trainer.default_root_dir /tmp/lit-ddp-fixture-696c9f9

The test puts it back where it was written: ModelCheckpoint reloads its file list (top-k, ``last.ckpt``) only in
the same directory.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lit_ddp.cli import cli_main
from lit_ddp.tensorboard import read_scalars
from tests.helpers import REPO, TINY_GPT_ARGS, compose

FIXTURE = REPO / "tests" / "data" / "mingpt_last_696c9f9.ckpt"
RUN = Path("/tmp/lit-ddp-fixture-696c9f9")  # where it was written
ARGS = [
    *compose("mingpt/cpu", "checkpoint/fault_tolerant"), *TINY_GPT_ARGS,
    "--trainer.devices", "1", "--trainer.strategy", "auto", "--trainer.val_check_interval", "4",
    "--trainer.log_every_n_steps", "2", "--checkpoint.every_n_train_steps", "3", "--checkpoint.save_top_k", "2",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.xdist_group("fixture-696c9f9")  # one test uses RUN
def test_a_checkpoint_of_the_earlier_callbacks_resumes() -> None:
    old = torch.load(FIXTURE, weights_only=False)
    assert old["global_step"] == 6
    shutil.rmtree(RUN, ignore_errors=True)
    (RUN / "checkpoints").mkdir(parents=True)
    shutil.copy(FIXTURE, RUN / "checkpoints" / "last.ckpt")
    try:
        resume_and_check(old, RUN)
    finally:
        shutil.rmtree(RUN, ignore_errors=True)


def resume_and_check(old: dict, run: Path) -> None:
    cli_main(["fit", *ARGS, "--trainer.max_steps", "8", "--trainer.default_root_dir", str(run)])

    new = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert new["global_step"] == 8
    assert new["callbacks"].keys() == old["callbacks"].keys()  # each state filed, and found, under the same key
    assert new["callbacks"]["TokenThroughputMonitor"] == {"batches": 8, "samples": 64, "lengths": 1024}
    points = read_scalars(run, "train/batches")  # this run's event files only: none from the fixture's run
    assert points[0][0] >= 6 and points[-1][1] == 8.0, points  # resumed at step 6, counted on from its 6
    assert not (run / "checkpoints" / "last-v1.ckpt").exists()  # PeriodicCheckpoint knew its last.ckpt
