"""No host-device synchronization in the GPU main job's training steps except those that log, save or validate,
counted on a CPU by :mod:`bench.host_syncs` (issue 52): what the counter sees, gpu.yaml's steps, and a step that
reads its loss on the host caught."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from bench.host_syncs import HostSyncs, StepSyncs, count_fit, gpu_job_args


def test_the_counter_sees_what_would_wait_for_a_gpu() -> None:
    device, host = torch.ones(4), torch.ones(4)
    with HostSyncs() as counter:
        counter.mark(device)
        derived = (device * 2).sum()  # computed from a device tensor: on the device
        host.sum().item(), bool(host.any()), host.tolist(), host.nonzero()  # noqa: B018  # host tensors: free
        torch.tensor([1, 2], device="cpu")  # a literal "cpu": the host
        assert counter.syncs[None] == 0
        derived.item()
        bool(device.any())
        float(derived)
        device.tolist()
        device.nonzero()
        device[device > 0]  # noqa: B018  # a boolean mask: nonzero inside
        copy = derived.cpu()
        torch.tensor([1, 2], device=torch.device("cpu"))  # host data to the device: a blocking copy
        torch.zeros(2).to(torch.device("cpu"))  # the same
        assert counter.syncs[None] == 9, counter.where[None]
        copy.item()  # the host copy reads for free
        assert counter.syncs[None] == 9


class ReadsLossEveryStep(Callback):
    """``float(loss)`` after every step: what a careless callback does, and the counter must see."""

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        float(outputs["loss"])


def quiet_step_syncs(counted: StepSyncs) -> dict[int, list[str]]:
    return {s.step: s.where for s in counted.quiet_steps()}


def test_gpu_jobs_steps_sync_only_to_log_save_or_validate(tmp_path: Path) -> None:
    """A tiny fit of the DDP fragment and gpu.yaml (its callbacks, bf16 autocast, clipping, the CLI's NaN guard,
    preemption agreements and checkpointing), logging every 5 steps: none of the other steps synchronizes."""
    counted = count_fit(gpu_job_args(max_steps=12, log_every_n_steps=5, val_check_interval=10), str(tmp_path))
    assert len(counted.steps) == 12
    quiet = quiet_step_syncs(counted)
    assert len(quiet) >= 8, sorted(quiet)
    assert all(not where for where in quiet.values()), quiet
    assert all(s.syncs > 0 for s in counted.steps.values() if s.logs), "the counter counts on logging steps"
    assert all(s.ops > 500 for s in counted.steps.values())


def test_a_step_that_reads_its_loss_is_caught(tmp_path: Path) -> None:
    args = gpu_job_args(max_steps=4, log_every_n_steps=50, val_check_interval=4)
    counted = count_fit([*args, "--trainer.callbacks+=tests.unit.test_host_syncs.ReadsLossEveryStep"], str(tmp_path))
    quiet = quiet_step_syncs(counted)
    assert len(quiet) == 3 and all(len(where) == 1 for where in quiet.values()), quiet
    assert "test_host_syncs.py" in quiet[1][0]
