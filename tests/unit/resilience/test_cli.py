"""lit_ddp.resilience.cli: ResilientCLI writes checkpoints atomically by default (:class:`AtomicCheckpointIO`)
and keeps a ``CheckpointIO`` that ``trainer.plugins`` names."""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_ddp.cli import cli_main
from lit_ddp.resilience.checkpoint_io import AsyncAtomicCheckpointIO, AtomicCheckpointIO
from tests.helpers import QUIET, REPO


def trainer_of(*args: str):
    cli = cli_main(["fit", *args, *QUIET, "--trainer.max_epochs", "0"])
    return cli.trainer


@pytest.mark.parametrize(
    "config",
    ["configs/regression/single_device.yaml", "configs/mingpt/cpu.yaml"],
)
def test_atomic_checkpoint_io_is_the_default(config: str, tmp_path: Path) -> None:
    one = ["--trainer.devices", "1"]  # in-process: a DDP strategy would relaunch pytest as rank 1
    trainer = trainer_of("--config", str(REPO / config), *one, "--trainer.default_root_dir", str(tmp_path))
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO


def test_another_checkpoint_io_is_kept(tmp_path: Path) -> None:
    trainer = trainer_of(
        "--config", str(REPO / "configs/regression/single_device.yaml"),
        "--trainer.plugins", "lit_ddp.resilience.checkpoint_io.AsyncAtomicCheckpointIO",
        "--trainer.default_root_dir", str(tmp_path),
    )  # fmt: skip
    assert type(trainer.strategy.checkpoint_io) is AsyncAtomicCheckpointIO
