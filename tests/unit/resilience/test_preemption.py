"""PreemptionCheckpoint's agreement cadence: about one all-reduce per ``agreement_interval_s`` of training
(not one per step), a recorded signal is acted on, with a checkpoint, within two intervals and a step, and
Lightning's per-step SIGTERM broadcast is off exactly when the callback owns SIGTERM."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from lit_ddp import compat
from lit_ddp.data.regression import RegressionDataModule
from lit_ddp.resilience import signals
from lit_ddp.resilience.deferred import DeferredFlag
from lit_ddp.resilience.preemption import Preempted, PreemptionCheckpoint
from lit_ddp.tasks.regression import RegressionModule

STEP_S = 0.01  # each step sleeps this long, so its time is known to within the machine's noise
INTERVAL_S = 0.1  # about ten steps between agreements


class SlowSteps(Callback):
    """Sleeps ``STEP_S`` in every step; sends this process ``SIGUSR1`` after global step ``signal_at``."""

    def __init__(self, signal_at: int | None = None) -> None:
        self.signal_at = signal_at
        self.signal_step: int | None = None

    def on_train_batch_end(self, trainer: Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        time.sleep(STEP_S)
        if trainer.global_step == self.signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)  # a real signal; the handler only records it
            self.signal_step = trainer.global_step


def fit(tmp_path: Path, max_steps: int, slow: SlowSteps) -> Trainer:
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=[slow, PreemptionCheckpoint(agreement_interval_s=INTERVAL_S)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(RegressionModule(), RegressionDataModule(num_samples=4096, batch_size=8))
    return trainer


@pytest.fixture(autouse=True)
def _restore_sigusr1():
    before = signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, before)
    signals.clear()


def test_agreements_follow_the_interval_not_the_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[int] = []
    start = DeferredFlag.start

    def counting_start(self: DeferredFlag, values, device: torch.device, world_size: int) -> None:
        started.append(1)
        start(self, values, device, world_size)

    monkeypatch.setattr(DeferredFlag, "start", counting_start)
    steps = 100
    trainer = fit(tmp_path, steps, SlowSteps())
    assert trainer.global_step == steps
    # ~STEP_S per step and INTERVAL_S between agreements: about steps * STEP_S / INTERVAL_S = 10 of them; a
    # machine slowed even 3x by other load stays far below one per step.
    assert 3 <= len(started) <= steps // 3, len(started)


def test_signal_is_acted_on_within_two_intervals(tmp_path: Path) -> None:
    slow = SlowSteps(signal_at=30)
    with pytest.raises(Preempted) as raised:
        fit(tmp_path, 200, slow)
    path = Path(raised.value.path)
    assert path.name.startswith("hpc_ckpt_") and path.is_file()
    saved_step = torch.load(path, map_location="cpu", weights_only=False)["global_step"]
    most_steps_between = int(INTERVAL_S / STEP_S)  # a step takes at least STEP_S
    assert (
        slow.signal_step is not None and slow.signal_step < saved_step <= slow.signal_step + 2 * most_steps_between + 1
    )
    assert raised.value.signum == signal.SIGUSR1 and not raised.value.requeued


def test_lightnings_per_step_sigterm_broadcast_goes_when_we_own_sigterm() -> None:
    """Lightning 2.6 broadcasts a SIGTERM flag before every step (blocking); once PreemptionCheckpoint's handler
    owns SIGTERM that flag can never be set, so the broadcast is turned off, and only then."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        for handle_sigterm in (True, False):
            trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
            PreemptionCheckpoint(handle_sigterm=handle_sigterm).on_train_start(trainer, None)
            turned_off = trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor is compat.signals._no_sigterm_broadcast
            assert turned_off is handle_sigterm
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path: run where a GPU is")
def test_a_deferred_flag_on_cuda_waits_for_its_own_step_only() -> None:
    """The agreed values come back through a host copy and an event recorded when the flag was sent: reading
    them does not wait for GPU work queued afterwards (``.tolist()`` on the device tensor would)."""
    flag = DeferredFlag("max")
    flag.start([3, -7], torch.device("cuda"), world_size=1)
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU work queued after the flag (cycles)
    started = time.monotonic()
    assert flag.results() == [3, -7]
    assert time.monotonic() - started < 0.5, "the read waited for work queued after the flag"
    torch.cuda.synchronize()
