"""Building and running the commands a benchmark times: a ``lit-ddp fit`` (alone or under torchrun) with the step
clock, the environment that finds this repository, free ports, a process's start time, and the process-tree runner
(a command in a time box; every process left below this one ended)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
NO_VALIDATION = ["--trainer.val_check_interval", "100000", "--trainer.check_val_every_n_epoch", "null"]
KILL_GRACE = 5  # timeout(1)'s -k: SIGKILL this long after the SIGTERM


def bench_env(**extra: str) -> dict[str, str]:
    """This environment with the repository on ``PYTHONPATH`` (``bench`` and ``tests`` importable), plus ``extra``."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def clock_args(path: Path | str, every_rank: bool = False) -> list[str]:
    """Fit arguments adding :class:`bench.harness.callback.StepClock` writing ``path``."""
    args = ["--trainer.callbacks+=bench.harness.callback.StepClock", f"--trainer.callbacks.init_args.path={path}"]
    return args + (["--trainer.callbacks.init_args.every_rank=true"] if every_rank else [])


def yaml_settings(*configs: str) -> dict[str, dict[str, Any]]:
    """The ``model`` and ``data`` init_args and the ``trainer`` settings of the YAMLs, a later file's over an
    earlier's (a list, such as the callbacks, replaced whole, as ``--config`` composes them)."""
    import yaml

    merged: dict[str, dict[str, Any]] = {"model": {}, "data": {}, "trainer": {}}
    for path in configs:
        config = yaml.safe_load((REPO / path).read_text()) or {}
        for key in ("model", "data"):
            merged[key].update((config.get(key) or {}).get("init_args") or {})
        merged["trainer"].update(config.get("trainer") or {})
    return merged


def without_samples(*configs: str) -> str:
    """``--trainer.callbacks=[...]``: the YAMLs' callbacks without the text samples, which a timed run leaves out."""
    callbacks = yaml_settings(*configs)["trainer"].get("callbacks", [])
    kept = [c for c in callbacks if not c["class_path"].endswith(".TextSampleCallback")]
    return f"--trainer.callbacks={json.dumps(kept)}"


def fit_command(
    *configs: str,
    args: Iterable[str] = (),
    root: Path | None = None,
    clock: Path | None = None,
    torchrun: Iterable[str] | None = None,
) -> list[str]:
    """``python -m lit_ddp fit --config C ...`` (under ``python -m torch.distributed.run *torchrun`` where given), run
    directory ``root``, ``args``, then the step clock writing ``clock`` (after any ``--trainer.callbacks=``)."""
    launcher = ["-m", "torch.distributed.run", *torchrun] if torchrun is not None else []
    cmd = [sys.executable, *launcher, "-m", "lit_ddp", "fit", *(a for c in configs for a in ("--config", c))]
    cmd += ["--trainer.default_root_dir", str(root)] if root else []
    return cmd + list(args) + (clock_args(clock) if clock else [])


def run(cmd: list[str]) -> str:
    """Runs ``cmd`` in the repository with :func:`bench_env`; its output.

    Raises:
        RuntimeError: it failed, with its output's tail.
    """
    done = subprocess.run(cmd, cwd=REPO, env=bench_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_group(rank: int = 0, world: int = 1, port: int | None = None) -> Iterator[None]:
    """A gloo process group of ``world`` processes on this host (``port``: a free one) for the block."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or free_port()))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def process_age(pid: int | str = "self") -> float:
    """Seconds since process ``pid`` started (Linux ``/proc``: its start in clock ticks after boot against the
    system's uptime, to a tick, 10 ms)."""
    since_boot = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    return float(Path("/proc/uptime").read_text().split()[0]) - since_boot


def process_started_at(pid: int | str = "self") -> float:
    """When process ``pid`` started, seconds since the epoch (:func:`process_age` before now)."""
    return time.time() - process_age(pid)


def become_subreaper() -> None:
    """Makes the processes orphaned below this one (torchrun and ``lit-ddp chaos`` start sessions of their own) its
    children, so that :func:`end_leftovers` finds them (Linux ``PR_SET_CHILD_SUBREAPER``)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)


def descendants(root: int) -> list[tuple[int, str]]:
    """Every process below ``root`` (from ``/proc``) with its state letter (``Z``: a zombie, waiting to be reaped)."""
    children: dict[int, list[tuple[int, str]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
            children.setdefault(int(ppid), []).append((int(stat.parent.name), state))
        except (OSError, IndexError, ValueError):
            continue
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child[0])
    return found


def end_leftovers(log: Path | None = None) -> list[int]:
    """SIGKILLs every live process below this one, reaps those that are its children (zombies too: orphans come to
    a subreaper), and returns the live ones' pids; their command lines go to ``log``."""
    below = descendants(os.getpid())
    live = [pid for pid, state in below if state != "Z"]
    if live and log:
        with log.open("a") as f:
            for pid in live:
                with contextlib.suppress(OSError):
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                    f.write(f"{pid}: {cmdline.decode(errors='replace')[:300]}\n")
    for pid in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid, _ in below:
        with contextlib.suppress(ChildProcessError):  # only this process's children can be reaped here
            os.waitpid(pid, 0)
    return live


def start_boxed(cmd: list[str], box: float, log: Path, environ: dict[str, str]) -> subprocess.Popen:
    """``timeout -k 5 <box - 5> CMD`` in the repository, a session of its own, its output to ``log``."""
    out = log.open("w")
    out.write("$ " + " ".join(cmd) + "\n")
    out.flush()
    limit = str(max(1, int(box) - KILL_GRACE))
    return subprocess.Popen(["timeout", "-k", str(KILL_GRACE), limit, *cmd], cwd=REPO, env=environ, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def wait_boxed(proc: subprocess.Popen, box: float) -> int:
    """The command's exit status (124 or 137: its box ended it); a backstop kill past the box."""
    try:
        return proc.wait(timeout=box + KILL_GRACE)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def status_of(rc: int) -> str:
    return "ok" if rc == 0 else "timeout" if rc in (124, 137) else f"failed (rc {rc})"
