"""Fixtures shared by the tests: the packaged Tiny Shakespeare as a local file, a runner of subprocesses that
leaves no process behind, and the recorder callbacks' YAML fragments."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lit_ddp.data.sources import DATA_ENV, read_embedded_text
from tests import helpers

# Lightning's tips and the bare "GPU available" banner only clutter test output.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
# The tests read the packaged text or files of their own, never a text the user points $LIT_DDP_DATA at
# (subprocesses inherit this environment).
os.environ.pop(DATA_ENV, None)


@pytest.fixture(scope="session")
def tiny_shakespeare(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local file holding the Tiny Shakespeare embedded in the package (written once per session), for the
    tests that need a path; tests that need none leave ``data.init_args.path`` unset."""
    path = tmp_path_factory.mktemp("data") / "tinyshakespeare.txt"
    path.write_text(read_embedded_text(), encoding="utf-8")
    return path


@pytest.fixture
def runner() -> Iterator[helpers.Runner]:
    """A :class:`tests.helpers.Runner`: subprocesses with a timeout, every process group killed at the end of
    the test."""
    r = helpers.Runner()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def recorder(tmp_path: Path) -> Callable[..., tuple[Path, Path]]:
    """``recorder(name, *extra)``: a YAML fragment adding :class:`tests.callbacks.RecordRun` (into
    ``tmp_path/name/rec``) and the ``extra`` ``(class_path, init_args)`` callbacks to a CLI run; returns
    (fragment, record directory). Read the records with :func:`tests.helpers.load_records`."""

    def make(name: str, *extra: tuple[str, dict[str, Any]]) -> tuple[Path, Path]:
        return helpers.recorder_config(tmp_path, name, *extra)

    return make


@pytest.fixture
def callbacks_config(tmp_path: Path) -> Callable[..., Path]:
    """``callbacks_config(name, *callbacks)``: a YAML fragment ``tmp_path/<name>.yaml`` setting
    ``trainer.callbacks`` to the given ``(class_path, init_args)`` pairs (:func:`tests.helpers.callback`)."""

    def make(name: str, *callbacks: tuple[str, dict[str, Any]]) -> Path:
        return helpers.write_callbacks_config(tmp_path / f"{name}.yaml", *callbacks)

    return make
