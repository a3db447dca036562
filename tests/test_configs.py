"""Every shipped YAML parses: complete configs alone, fragments composed onto a complete one."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lit_ddp.cli import cli_main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ALL = sorted(CONFIGS.rglob("*.yaml"))
BASE = CONFIGS / "regression" / "single_device.yaml"


def is_complete(path: Path) -> bool:
    doc = yaml.safe_load(path.read_text()) or {}
    return "model" in doc and "data" in doc


@pytest.mark.parametrize("path", [p for p in ALL if is_complete(p)], ids=lambda p: str(p.relative_to(CONFIGS)))
def test_complete_config_parses(path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--config", str(path), "--print_config"])
    assert exc.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"].startswith("lit_ddp.")
    assert printed["trainer"]["default_root_dir"].startswith("runs/")


@pytest.mark.parametrize("path", [p for p in ALL if not is_complete(p)], ids=lambda p: str(p.relative_to(CONFIGS)))
def test_fragment_composes(path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--config", str(BASE), "--config", str(path), "--print_config"])
    assert exc.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    fragment = yaml.safe_load(path.read_text())
    for section, values in fragment.items():
        for key, value in values.items():
            if not isinstance(value, dict):
                assert printed[section][key] == value, f"{path}: {section}.{key}"


def test_all_configs_found() -> None:
    assert any(is_complete(p) for p in ALL)
    assert (CONFIGS / "trainer" / "cpu_ddp.yaml") in ALL
