"""The package layout the README's "Development" map describes: module sizes, who may import whom, the
embedded default text, and atomic checkpoint writes as the CLI's default."""

from __future__ import annotations

import ast
import hashlib
import sys
from pathlib import Path

import pytest

from lit_ddp.checkpointing import AsyncAtomicCheckpointIO, AtomicCheckpointIO
from lit_ddp.cli import cli_main
from lit_ddp.data.sources import TINY_SHAKESPEARE_BYTES, TINY_SHAKESPEARE_SHA256, read_embedded_text

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lit_ddp"
MODULES = sorted(PACKAGE.rglob("*.py"))
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def imported_modules(path: Path) -> set[str]:
    """Top-level names of the modules ``path`` imports (absolute imports; the package uses no others)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_module_is_at_most_400_lines(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= 400


@pytest.mark.parametrize("path", sorted((PACKAGE / "models").rglob("*.py")), ids=lambda p: p.name)
def test_models_import_only_torch(path: Path) -> None:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for name in imported_modules(path):
        top = name.split(".")[0]
        assert top in stdlib or top == "torch" or name.startswith("lit_ddp.models"), f"{path.name} imports {name}"


@pytest.mark.parametrize("path", sorted((PACKAGE / "data").rglob("*.py")), ids=lambda p: p.name)
def test_data_never_imports_tasks_or_training_machinery(path: Path) -> None:
    for name in imported_modules(path):
        assert not name.startswith(("lit_ddp.tasks", "lit_ddp.callbacks", "lit_ddp.cli")), f"{path.name}: {name}"


def test_callbacks_never_import_tasks() -> None:
    for path in (PACKAGE / "callbacks").rglob("*.py"):
        assert not any(n.startswith("lit_ddp.tasks") for n in imported_modules(path)), path.name


def test_embedded_text_is_tiny_shakespeare() -> None:
    data = read_embedded_text().encode("utf-8")
    assert len(data) == TINY_SHAKESPEARE_BYTES
    assert hashlib.sha256(data).hexdigest() == TINY_SHAKESPEARE_SHA256


def test_embedded_text_is_package_data() -> None:
    """Shipped with the package (pyproject's package-data), so a wheel carries it too."""
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"lit_ddp.data" = ["tinyshakespeare.txt.gz"]' in pyproject
    assert (PACKAGE / "data" / "tinyshakespeare.txt.gz").stat().st_size < 500_000


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
        "--trainer.plugins", "lit_ddp.checkpointing.AsyncAtomicCheckpointIO",
        "--trainer.default_root_dir", str(tmp_path),
    )  # fmt: skip
    assert type(trainer.strategy.checkpoint_io) is AsyncAtomicCheckpointIO
