"""Plain helpers and constants of the tests, defined once: paths, tiny-run arguments, config composition, the
subprocess runner, and reading back what the recorder callbacks (:mod:`tests.callbacks`) wrote.

Fixtures built on these live in ``tests/conftest.py``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lit_ddp"
CONFIGS = REPO / "configs"
NOTEBOOK_DIR = REPO / "notebooks"
# Files the tests read: the recorded reference losses (tests/system/test_reference_losses.py rewrites them).
TEST_DATA = Path(__file__).resolve().parent / "data"
# The markers of the tests under tests/system (each has at least one; a test under tests/unit has none).
SYSTEM_MARKERS = ("slow", "multiprocess", "slurm")
# The environment variable that replays a random test: its seed (the ``seed`` fixture, tests/conftest.py).
SEED_ENV = "LIT_DDP_TEST_SEED"
# True where tests/conftest.py set OMP_NUM_THREADS=1 (under pytest-xdist; the user had not set it).
ONE_THREAD_PER_PROCESS = False
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
# A tiny GPT and a small slice of text: seconds per run on 2 cores.
TINY_GPT_ARGS = [
    "--model.init_args.n_layer", "1",
    "--model.init_args.n_head", "2",
    "--model.init_args.n_embd", "16",
    "--data.init_args.block_size", "16",
    "--data.init_args.batch_size", "8",
    "--data.init_args.truncate", "0.02",
    *QUIET,
]  # fmt: skip
# A short text of a few characters, for the data modules' tests (tests/unit/data).
SHORT_TEXT = "A Citizen:\nBefore we proceed any further, hear me speak.\n" * 20
# Lines a newcomer should not meet on a command that does not concern them (issues 21, 25 and 43): other libraries'
# hints, advertisements and deprecations, and on GPUs Lightning's TF32 tip, its model summary's warning under mixed
# precision and torch's warning of a DDP built on another stream than the one that trains.
NOISE = ("DistributedSampler", "LeafSpec", "Tip:", "set_vital", "litlogger", "srun` command is available",
         "smaller than the logging interval", "`weights_only` was not set", "exists and is not empty",
         "set_float32_matmul_precision", "not supported by the model summary", "AccumulateGrad node's stream")  # fmt: skip


def noise_lines(output: str) -> list[str]:
    """The lines of ``output`` that hold a :data:`NOISE` phrase."""
    return [line for line in output.splitlines() if any(n in line for n in NOISE)]


# Environment variables of a launcher that a child process must not inherit from the test's own environment.
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")


# docs/tutorial.md's table of what each step prints (tests/system/test_tutorial_page.py checks it).
TUTORIAL_PAGE = REPO / "docs" / "tutorial.md"
README = REPO / "README.md"


def readme_outputs() -> Any:
    """``scripts/readme_outputs.py`` as a module: it runs the README's commands and writes their output blocks."""
    sys.path.insert(0, str(REPO / "scripts"))
    import readme_outputs as module

    return module


def main_job() -> Any:
    """``scripts/main_job.py`` as a module: which configs ``make train`` composes on this machine."""
    sys.path.insert(0, str(REPO / "scripts"))
    import main_job as module

    return module


def readme_steps() -> dict[str, str]:
    """The README's tutorial steps: each command of a bash block under a numbered heading (``## 3. Fault-tolerant
    ...``), by the heading's text (``3. Fault-tolerant distributed training with torchrun``); a step's command that
    prints no output block: the heading and the command's program in parentheses (``4. Multinode training
    (sbatch)``)."""
    tool = readme_outputs()
    text = README.read_text()
    shown = {block.command for block in tool.blocks(text)}
    steps: dict[str, str] = {}
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        title = section.splitlines()[0].strip()
        if not re.match(r"\d\. ", title):
            continue
        for fence in re.finditer(r"^```bash\n(.*?)^```\n", section, re.M | re.S):
            for command in tool.commands(fence[1]):
                program = next(w for w in shlex.split(command) if not re.match(r"^\w+=", w))  # past NAME=VALUE
                steps[title if command in shown else f"{title} ({Path(program).name})"] = command
    return steps


def more_compositions() -> dict[str, str]:
    """docs/tutorial.md's "More compositions": the first column (a composition's name) -> its command."""
    section = TUTORIAL_PAGE.read_text().split("## More compositions", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| (.+?) \| `([^`]+)` \|$", section, re.M))


def step_commands() -> dict[str, str]:
    """Every documented training command by name: the README's steps, then docs/tutorial.md's other compositions."""
    return readme_steps() | more_compositions()


def documented_commands() -> list[str]:
    """Every shell command the README and docs/tutorial.md show: the README's bash blocks (continuations joined)
    and inline code spans of both pages."""
    commands = readme_outputs().commands
    found = []
    for page in (README, TUTORIAL_PAGE):
        text = page.read_text()
        for fence in re.finditer(r"^```bash\n(.*?)^```\n", text, re.M | re.S):
            found += commands(fence[1])
        text = re.sub(r"^```.*?^```\n", "", text, flags=re.M | re.S)
        found += [span for span in re.findall(r"`([^`\n]+)`", text) if _splits(span)]
    return found


def _splits(text: str) -> bool:
    """Whether ``text`` splits into words as a shell's (a code span that wraps a line pairs its backticks wrong)."""
    try:
        return bool(shlex.split(text))
    except ValueError:
        return False


def page_figures() -> tuple[float, dict[str, dict[str, float]]]:
    """The page's tolerance (relative) and, per step name measured here, its figures: ``first_step``,
    ``first_loss``, ``last_step``, ``last_loss``."""
    text = TUTORIAL_PAGE.read_text()
    tolerance = float(re.search(r"within (\d+(?:\.\d+)?) ?% \(relative\)", text).group(1)) / 100
    section = text.split("## What each step prints", 1)[1].split("\n## ", 1)[0]
    figures: dict[str, dict[str, float]] = {}
    for row in re.findall(r"^\| (.+)\|$", section, re.M):
        cells = [c.strip() for c in row.split("|")]
        first = re.fullmatch(r"step (\d+): ([\d.]+)", cells[1])
        if first is None:
            continue  # the header, or a row not measured here
        last = re.fullmatch(r"step (\d+): ([\d.]+)", cells[2])
        assert last is not None, f"docs/tutorial.md: {cells[0]!r} gives a first validation but no end"
        figures[cells[0]] = {"first_step": int(first[1]), "first_loss": float(first[2])}
        figures[cells[0]] |= {"last_step": int(last[1]), "last_loss": float(last[2])}
    return tolerance, figures


def config(name: str) -> str:
    """The path of ``configs/<name>.yaml`` (``name`` as ``"trainer/ddp"``)."""
    path = CONFIGS / f"{name}.yaml"
    assert path.is_file(), f"no config {path}"
    return str(path)


def compose(*names: str) -> list[str]:
    """``--config`` arguments composing ``configs/<name>.yaml`` in order (later ones override earlier ones), as
    the README composes them: ``compose("trainer/ddp", "regression/ddp")``."""
    return [arg for name in names for arg in ("--config", config(name))]


# What slurm/train.sbatch composes before the step config it is given, and the step config: srun by hand.
SRUN_CONFIGS = compose("trainer/ddp", "trainer/slurm", "regression/slurm")
SLURM_PLUGIN = [{"class_path": "lightning.pytorch.plugins.environments.SLURMEnvironment"}]
# A fake environment for the launch checks: task 0 of `srun -J train -N1 --ntasks-per-node=2`.
SRUN_2 = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "train",
    "SLURM_STEP_ID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_NNODES": "1",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_PROCID": "0",
}


def without(env: Mapping[str, str], *keys: str) -> dict[str, str]:
    """``env`` less ``keys``."""
    return {k: v for k, v in env.items() if k not in keys}


def lit_ddp(*args: str) -> list[str]:
    """The command line of ``python -m lit_ddp ARGS`` with this interpreter."""
    return [sys.executable, "-m", "lit_ddp", *args]


def torchrun(*args: str, shared_store: bool = False) -> list[str]:
    """The command line of ``torchrun ARGS`` (``python -m torch.distributed.run``) with this interpreter, with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` as the README runs it (``shared_store``: torch's default instead)."""
    opt_out = [] if shared_store else ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"]
    return [*opt_out, sys.executable, "-m", "torch.distributed.run", *args]


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: the repo importable (for ``tests.callbacks``), unbuffered output,
    no launcher variables inherited, plus ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    for key in LAUNCH_ENV:
        env.pop(key, None)
    env.update(extra)
    return env


def start(
    cmd: list[str], cwd: str | Path = REPO, env: Mapping[str, str] | None = None, **popen: Any
) -> subprocess.Popen:
    """Starts ``cmd`` in a new session (its own process group, so that :func:`kill_group` reaches every
    process it starts), stdout and stderr merged as text.

    Args:
        cmd: the command line.
        cwd: its working directory.
        env: its whole environment; None: :func:`subprocess_env`.
        popen: overrides of the other ``subprocess.Popen`` arguments (e.g. ``stdout=subprocess.DEVNULL`` for a
            server whose output nobody reads).
    """
    kwargs: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    kwargs.update(popen)
    return subprocess.Popen(
        cmd, cwd=cwd, env=dict(subprocess_env() if env is None else env), start_new_session=True, **kwargs
    )


OTHER_UID = 65534
"""The uid another user of the machine runs as in the tests of docs/security.md's threats (``nobody``)."""
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="becoming another user (uid 65534) needs root: these tests run as root here and in CI"
)


def as_other_user(code: str, *args: str) -> subprocess.Popen:
    """``python -c code args`` as another user of this machine (uid and gid :data:`OTHER_UID`, no supplementary
    groups), from ``/``, with this environment's packages and the repository importable: what a process of someone
    else on a shared login or compute node can do. Its stdout and stderr are merged, as text. Needs root
    (:data:`needs_root`); skips where no interpreter of this Python version is open to other users."""

    def become() -> None:
        os.setgroups([])
        os.setgid(OTHER_UID)
        os.setuid(OTHER_UID)

    python, paths = _interpreter_for_others()
    env = {"PATH": os.environ.get("PATH", ""), "HOME": "/tmp", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *paths])
    return subprocess.Popen(
        [python, "-c", code, *args],
        cwd="/",
        env=env,
        preexec_fn=become,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _interpreter_for_others() -> tuple[str, list[str]]:
    """A Python interpreter of this version that other users may run, and the package directories it must be given:
    this one where every directory above it is open to them, else the system's (``/usr/bin/python3``) with this
    environment's site-packages (a pyenv build under a private home directory is not)."""
    real = Path(os.path.realpath(sys.executable))
    if all(os.stat(d).st_mode & 0o001 for d in real.parents):
        return sys.executable, []
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"):
        if os.access(candidate, os.X_OK) and all(os.stat(d).st_mode & 0o001 for d in Path(candidate).parents):
            return candidate, [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    pytest.skip(f"no Python {version} interpreter that another user may run")


def descendants(pid: int) -> list[int]:
    """The pids of every live descendant of ``pid`` (from ``/proc``; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILLs the process group of ``proc`` (started by :func:`start`) and, while ``proc`` still runs, every
    descendant of it in another session too (torchrun starts each worker in a new session); never raises."""
    stray = descendants(proc.pid) if proc.poll() is None else []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in stray:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def wait(proc: subprocess.Popen, timeout: float, term_grace: float = 0.0) -> subprocess.CompletedProcess:
    """Waits for ``proc`` (from :func:`start`) and returns its output; its process group is killed in any case,
    so nothing it started is left behind.

    Args:
        proc: the process.
        timeout: seconds to wait; then the test fails with the output's tail.
        term_grace: on timeout, first SIGTERM ``proc`` alone and wait this long (``srun`` forwards it and ends
            its job step); 0 kills the group at once.

    Raises:
        AssertionError: ``proc`` did not finish within ``timeout`` seconds.
    """
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if term_grace > 0:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=term_grace)
        kill_group(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"{proc.args} did not finish in {timeout} s; output:\n{(out or '')[-5000:]}") from None
    finally:
        kill_group(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def run(cmd: list[str], timeout: float, cwd: str | Path = REPO, **env: str) -> subprocess.CompletedProcess:
    """Runs ``cmd`` (environment :func:`subprocess_env` plus ``env``) to its end, or fails the test after
    ``timeout`` seconds; its whole process group is killed either way. ``stdout`` holds stdout and stderr."""
    return wait(start(cmd, cwd, subprocess_env(**env)), timeout)


class Runner:
    """Starts subprocesses in their own process groups and kills every group it started when the test ends,
    so that no process is left behind whatever happens (see :func:`start`); the ``runner`` fixture
    (``tests/conftest.py``) gives each test one."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], cwd: str | Path = REPO, **env: str) -> subprocess.Popen:
        """Starts ``cmd`` (environment :func:`subprocess_env` plus ``env``), stdout and stderr
        merged into ``proc.stdout``."""
        return self.track(start(cmd, cwd, subprocess_env(**env)))

    def track(self, proc: subprocess.Popen) -> subprocess.Popen:
        """Kills ``proc``'s process group at the end of the test too."""
        self.procs.append(proc)
        return proc

    def run(self, cmd: list[str], timeout: float, cwd: str | Path = REPO, **env: str) -> subprocess.CompletedProcess:
        """Runs ``cmd`` to its end, or fails the test after ``timeout`` seconds (:func:`wait`)."""
        return wait(self.start(cmd, cwd, **env), timeout)

    def fit(self, *args: str, timeout: float, cwd: str | Path = REPO, **env: str) -> subprocess.CompletedProcess:
        """Runs ``python -m lit_ddp fit ARGS`` to its end (see :meth:`run`)."""
        return self.run(lit_ddp("fit", *args), timeout, cwd, **env)

    def close(self) -> None:
        """Kills every process group started here and reaps the processes."""
        for proc in self.procs:
            kill_group(proc)
            if proc.stdout is not None:
                proc.stdout.close()
            proc.wait(timeout=30)


def usage_error(capsys: pytest.CaptureFixture, *args: str) -> str:
    """The one ``lit-ddp: error:`` line of an in-process CLI call (``lit_ddp.cli.cli_main(args)``) that must stop
    with status 2 before anything starts, without a traceback."""
    from lit_ddp.cli import cli_main

    with pytest.raises(SystemExit) as exc:
        cli_main(list(args))
    err = capsys.readouterr().err
    assert exc.value.code == 2, err[-2000:]
    assert "Traceback" not in err
    [line] = [line for line in err.splitlines() if line.startswith("lit-ddp: error:")]
    return line


def callback(cls: type, **init_args: Any) -> tuple[str, dict[str, Any]]:
    """The ``(class_path, init_args)`` of a callback class (of :mod:`tests.callbacks`) for
    :func:`write_callbacks_config`."""
    return f"{cls.__module__}.{cls.__qualname__}", init_args


def write_callbacks_config(path: Path, *callbacks: tuple[str, dict[str, Any]]) -> Path:
    """A YAML fragment appending the given ``(class_path, init_args)`` pairs to ``trainer.callbacks`` (``callbacks+``:
    the step config's own callbacks, e.g. minGPT's text samples and throughput, stay)."""
    import yaml

    doc = {"trainer": {"callbacks+": [{"class_path": c, "init_args": a} for c, a in callbacks]}}
    path.write_text(yaml.safe_dump(doc))
    return path


def recorder_config(directory: Path, name: str, *extra: tuple[str, dict[str, Any]]) -> tuple[Path, Path]:
    """A YAML fragment ``<directory>/<name>.yaml`` with :class:`tests.callbacks.RecordRun` writing into
    ``<directory>/<name>/rec``, plus the ``extra`` callbacks; returns (fragment, record directory)."""
    from tests.callbacks import RecordRun

    rec = directory / name / "rec"
    return write_callbacks_config(directory / f"{name}.yaml", callback(RecordRun, out_dir=str(rec)), *extra), rec


def load_records(out_dir: str | Path) -> list[dict]:
    """The :class:`tests.callbacks.RecordRun` files of a run, by rank."""
    files = sorted(Path(out_dir).glob("rank*.pt"), key=lambda p: int(p.stem[len("rank") :]))
    return [torch.load(f, weights_only=False) for f in files]


def tensorboard_steps(run_dir: str | Path) -> dict[str, list[int]]:
    """Every scalar tag of a run directory and the steps it was logged at, as TensorBoard shows them
    (orphaned points of a killed run purged), in file order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def flip_payload_bit(path: str | Path) -> str:
    """Flips the lowest mantissa bit of the first element of a tensor in the checkpoint ``path`` (the lowest bit of
    the first byte of its data: little-endian float32), in place: a single file's first ``state_dict`` tensor, or a
    sharded checkpoint's first ``state_dict`` entry in its last shard file. The file still parses and
    ``torch.load`` returns the changed value without a word. Returns what a refusal must name: the tensor's
    ``state_dict`` key (a single file) or its fully qualified name in the shards (``state_dict.model...``). Reads the
    files with zipfile and torch only (no lit-ddp reader), so that it runs against any version of the package."""
    import io
    import zipfile

    from torch.distributed.checkpoint import FileSystemReader

    def data_start(archive: Any, info: zipfile.ZipInfo) -> int:
        """Where a zip record's bytes begin: past its local header (PKZIP APPNOTE 4.3.7: 30 bytes, then its name
        and extra field)."""
        archive.seek(info.header_offset)
        header = archive.read(30)
        return (
            info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
        )

    path = Path(path)
    if path.is_dir():
        entries = FileSystemReader(str(path)).read_metadata().storage_data  # a test's own file: a plain pickle is fine
        last_shard = max(info.relative_path for info in entries.values())
        index, info = next(
            (i, s) for i, s in entries.items() if s.relative_path == last_shard and i.fqn.startswith("state_dict.")
        )
        target = path / last_shard
        entry = io.BytesIO(target.read_bytes()[info.offset : info.offset + info.length])
        record = next(r for r in zipfile.ZipFile(entry).infolist() if "/data/" in r.filename and r.file_size)
        at, name = info.offset + data_start(entry, record), index.fqn
    else:
        name, tensor = next(iter(torch.load(path, weights_only=True)["state_dict"].items()))
        payload = bytes(tensor.untyped_storage())
        with open(path, "rb") as f:
            archive = zipfile.ZipFile(f)
            record = next(r for r in archive.infolist() if "/data/" in r.filename and archive.read(r) == payload)
            at, target = data_start(f, record), path
    with open(target, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 1]))
    return name
