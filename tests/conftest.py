"""Fixtures shared by the tests: the packaged Tiny Shakespeare as a local file, a runner of subprocesses that
leaves no process behind, the recorder callbacks' YAML fragments, and the seed of a random test (printed, and
replayed from ``$LIT_DDP_TEST_SEED``); every test gets ``os.environ`` back as it found it.

Hooks: a test's place says what it is (``tests/unit``: no ``slow`` / ``multiprocess`` / ``slurm`` marker;
``tests/system``: at least one), checked at collection; under pytest-xdist the Slurm tests form one group, and
one that runs outside it fails; the terminal summary repeats the seed of each failed random test. Under
pytest-xdist each process gets one intra-op thread (below)."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from lit_ddp.data.sources import DATA_ENV, read_embedded_text
from tests import helpers

# Lightning's tips and the bare "GPU available" banner only clutter test output.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
# The tests read the packaged text or files of their own, never a text the user points $LIT_DDP_DATA at
# (subprocesses inherit this environment).
os.environ.pop(DATA_ENV, None)
# Under pytest-xdist (``make test``), two tests run at once on this 2-core machine: processes that each spread
# over every core (torch's default) made a one-process fit 5x slower beside another, measured. One intra-op
# thread per process, as torchrun gives its workers. The jobs tests submit through
# :func:`tests.system.helpers_slurm.slurm_env` still take their threads from --cpus-per-task (chaos's jobs inherit
# the one thread); the serial tests run alone with torch's default.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    helpers.ONE_THREAD_PER_PROCESS = True


@pytest.fixture(autouse=True)
def restored_environment() -> Iterator[None]:
    """Each test leaves ``os.environ`` as it found it: Lightning's DDP launcher sets ``LOCAL_RANK``, ``NODE_RANK``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` in the process that fits, and a later in-process fit then took itself for a
    process Lightning had started (no run-directory lock: ``tests/unit/test_cli.py::test_fit_holds_the_run_directory``
    failed after a TorchFTStrategy fit in the same worker)."""
    with mock.patch.dict(os.environ):
        yield


@pytest.fixture(scope="session")
def tiny_shakespeare(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local file holding the Tiny Shakespeare embedded in the package (written once per session), for the
    tests that need a path; tests that need none leave ``data.init_args.path`` unset."""
    path = tmp_path_factory.mktemp("data") / "tinyshakespeare.txt"
    path.write_text(read_embedded_text(), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def regression_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of a 3-epoch one-process regression fit, in process (once per test module), logging
    every 5 steps: what the TensorBoard tests read."""
    from lit_ddp.cli import cli_main

    root = tmp_path_factory.mktemp("regression")
    cli_main(
        ["fit", *helpers.compose("regression/single_device"), *helpers.QUIET]
        + ["--trainer.default_root_dir", str(root), "--trainer.max_epochs", "3", "--trainer.log_every_n_steps", "5"]
    )
    return root


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


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """The seed of a test that draws random delays, moments or values: ``$LIT_DDP_TEST_SEED`` when set (to replay
    a run), else a fresh one. Printed (pytest shows it with a failure's captured output), kept in the test's
    ``user_properties`` (JUnit XML) and repeated in the terminal summary when the test fails. Draw from
    ``random.Random(seed)`` (or ``torch.manual_seed(seed)``), never from the global ``random`` module."""
    given = os.environ.get(helpers.SEED_ENV)
    value = int(given) if given else random.SystemRandom().randrange(2**32)
    print(f"seed={value} (replay: {replay_command(value, request.node.nodeid)})")
    request.node.user_properties.append(("seed", value))
    return value


def replay_command(seed: int, nodeid: str) -> str:
    if nodeid.rfind("@") > nodeid.rfind("]"):  # xdist's group suffix (``...::test@slurm``): not a selectable id
        nodeid = nodeid[: nodeid.rfind("@")]
    return f"{helpers.SEED_ENV}={seed} pytest '{nodeid}'"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """After the failures: ``seed=N (replay: ...)`` for each failed test that took the ``seed`` fixture."""
    lines = []
    for report in terminalreporter.stats.get("failed", []) + terminalreporter.stats.get("error", []):
        for name, value in getattr(report, "user_properties", ()):
            if name == "seed":
                lines.append(f"{report.nodeid}: seed={value} (replay: {replay_command(value, report.nodeid)})")
    if lines:
        terminalreporter.write_sep("=", "seeds of failed random tests")
        for line in dict.fromkeys(lines):  # a test failing in setup and teardown is reported twice
            terminalreporter.write_line(line)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Unit tests (``tests/unit``) carry none of :data:`tests.helpers.SYSTEM_MARKERS`; system tests
    (``tests/system``) at least one; no test lives elsewhere. Checked before ``-m`` deselects anything. Under
    pytest-xdist (``make test``), the Slurm tests form one group (``--dist loadgroup``: one worker runs them)."""
    here = Path(__file__).resolve().parent
    wrong = []
    for item in items:
        try:
            part = item.path.resolve().relative_to(here).parts[0]
        except ValueError:
            continue  # not one of these tests
        marks = {m.name for m in item.iter_markers()} & set(helpers.SYSTEM_MARKERS)
        if part == "unit" and marks:
            wrong.append(f"{item.nodeid}: a unit test marked {sorted(marks)}: move it to tests/system/")
        elif part == "system" and not marks:
            wrong.append(f"{item.nodeid}: a system test without a marker of {list(helpers.SYSTEM_MARKERS)}")
        elif part not in ("unit", "system"):
            wrong.append(f"{item.nodeid}: put it in tests/unit/ (unmarked) or tests/system/ (marked)")
    if wrong:
        raise pytest.UsageError("tests in the wrong place:\n  " + "\n  ".join(wrong))
    if config.pluginmanager.hasplugin("xdist"):  # the Slurm tests share one cluster: in order, on one worker
        for item in items:
            if item.get_closest_marker("slurm"):
                item.add_marker(pytest.mark.xdist_group("slurm"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """On an xdist worker with ``--dist loadgroup``: fails a Slurm test that xdist left out of its group. Side by
    side, one test's jobs take the nodes another test's jobs wait for, and real preemption (test_slurm_preemption)
    never comes. pytest 9.2 makes xdist 3.8 drop every group silently (pytest-dev/pytest-xdist#1386, open):
    pyproject pins ``pytest<9.2`` until that is fixed, and this check says when the pin can go."""
    grouped = item.config.getoption("loadgroup", default=False)
    if grouped and item.get_closest_marker("slurm") and not item.nodeid.endswith("@slurm"):
        pytest.fail(
            f"pytest {pytest.__version__} with --dist loadgroup: xdist dropped this Slurm test's group, so it"
            " would run beside another on the one cluster (pytest-dev/pytest-xdist#1386). Install pytest<9.2,"
            " as pyproject's dev extras say, or run the Slurm tests without -n.",
            pytrace=False,
        )


@pytest.fixture
def tiny_text(tmp_path: Path) -> Path:
    """The first 6000 characters of the packaged Tiny Shakespeare, as a text file for ``--data.path``."""
    path = tmp_path / "tiny.txt"
    path.write_text(read_embedded_text()[:6000])
    return path


@pytest.fixture
def no_big_gpt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails a test that builds a GPT of more than 8 blocks or width 1024 anywhere but on the meta device: what a
    crafted checkpoint's hyperparameters would make ``generate`` or ``fit --ckpt_path`` allocate (petabytes)."""
    from lit_ddp.models.gpt import GPT, GPTConfig

    real = GPT.__init__

    def guarded(self: GPT, config: GPTConfig) -> None:
        if torch.empty(0).device.type != "meta" and (config.n_layer > 8 or config.n_embd > 1024):
            raise AssertionError(f"a {config} built with memory")
        real(self, config)

    monkeypatch.setattr(GPT, "__init__", guarded)
