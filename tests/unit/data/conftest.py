"""The fixtures of the data modules' tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import SHORT_TEXT


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    """``tmp_path/input.txt`` holding :data:`tests.helpers.SHORT_TEXT`."""
    path = tmp_path / "input.txt"
    path.write_text(SHORT_TEXT, encoding="utf-8")
    return path
