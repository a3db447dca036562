"""One process, no DDP (issue 52): :class:`lit_ddp.strategies.DDPStrategy` on one device trains without a process
group or DDP's wrapper, and on several it is DDP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.nn.parallel import DistributedDataParallel

from lit_ddp.cli import cli_main
from lit_ddp.strategies import DDPStrategy
from tests.helpers import CONFIGS, REPO
from tests.unit.test_configs import DDP, GPU_JOB_ON_CPU


class RecordsTheSetUp(Callback):
    """What each hook that runs the model finds: a process group, the module wrapped in DDP."""

    seen: list[tuple[str, bool, bool]] = []  # class-wide: the CLI builds the instance

    def _record(self, trainer: Trainer, hook: str) -> None:
        model = trainer.strategy.model
        RecordsTheSetUp.seen.append((hook, dist.is_initialized(), isinstance(model, DistributedDataParallel)))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._record(trainer, "train")

    def on_validation_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._record(trainer, "validate" if trainer.state.fn == "validate" else "fit's validation")


def test_gpu_jobs_dry_run_on_one_device_has_no_process_group_or_wrapper(tmp_path: Path) -> None:
    configs = ["--config", str(REPO / DDP), "--config", str(CONFIGS / "mingpt" / "gpu.yaml")]
    common = [*configs, *GPU_JOB_ON_CPU, "--trainer.default_root_dir", str(tmp_path)]
    added = "--trainer.callbacks+=tests.unit.test_one_process.RecordsTheSetUp"
    RecordsTheSetUp.seen = []
    cli = cli_main(["fit", *common, "--trainer.precision", "32-true", added])
    assert cli is not None and cli.trainer.global_step == 5
    assert isinstance(cli.trainer.strategy, DDPStrategy) and cli.trainer.strategy.one_process
    cli = cli_main(["validate", *common, "--trainer.precision", "32-true", added])  # the run's last checkpoint
    hooks = {hook for hook, _, _ in RecordsTheSetUp.seen}
    assert hooks == {"train", "fit's validation", "validate"}
    assert all(not group and not wrapped for _, group, wrapped in RecordsTheSetUp.seen), RecordsTheSetUp.seen


def test_one_process_is_one_device_on_one_node() -> None:
    strategy = DDPStrategy()
    strategy.parallel_devices = [torch.device("cpu")]
    assert strategy.one_process
    strategy.parallel_devices = [torch.device("cpu")] * 2
    assert not strategy.one_process
    strategy.parallel_devices, strategy.num_nodes = [torch.device("cpu")], 2
    assert not strategy.one_process
