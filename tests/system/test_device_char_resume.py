"""gpu.yaml's data module (:class:`~lit_ddp.data.device_char.DeviceCharDataModule`, batches gathered on the device)
trains bit for bit as :class:`~lit_ddp.data.char.CharDataModule`, and a checkpoint of the plain module resumes under
it: the README's fault-tolerant minGPT composition, one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_ddp.chaos.compare import compare, first_difference
from lit_ddp.run_dir import sharded
from lit_ddp.run_dir.checkpoints import checkpoint_step
from tests.helpers import Runner, lit_ddp
from tests.system.test_fault_tolerance import mingpt_args, one_process

DEVICE_DATA = ["--data.class_path", "lit_ddp.data.device_char.DeviceCharDataModule"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_device_batches_train_and_resume_as_the_plain_modules(tmp_path: Path, runner: Runner, tiny_text: Path) -> None:
    fit = one_process(mingpt_args(10, 5, tiny_text))
    runs = {"plain": [], "device": DEVICE_DATA}
    for name, extra in runs.items():
        out = runner.run(lit_ddp("fit", *fit, *extra, "--trainer.default_root_dir", str(tmp_path / name)), timeout=120)
        assert out.returncode == 0, out.stdout[-3000:]
    assert compare(tmp_path / "plain", tmp_path / "device") is None  # weights, optimizer, schedule, every scalar

    # The first step checkpoint: step 6 (the trigger at 5 falls before a validation, and saves after the next step).
    saved = {checkpoint_step(str(p)): p for p in (tmp_path / "plain" / "checkpoints").glob("*.ckpt")}
    first = saved[min(saved)]
    assert 0 < min(saved) < 10
    resumed = tmp_path / "resumed"
    again = lit_ddp("fit", *fit, *DEVICE_DATA, "--trainer.default_root_dir", str(resumed), "--ckpt_path", str(first))
    out = runner.run(again, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:]
    a, b = (sharded.read_whole(run / "checkpoints" / "last.ckpt") for run in (tmp_path / "plain", resumed))
    for key in ("global_step", "state_dict", "optimizer_states", "lr_schedulers"):
        assert first_difference(a.get(key), b.get(key), key, 0.0) is None, key
