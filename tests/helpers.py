"""Test-only callbacks and subprocess helpers, shared by the tests that run the CLI.

The callbacks are passed to a CLI run through a YAML fragment (``trainer.callbacks``), so the training
process itself records what each rank saw; the test reads the files back.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

REPO = Path(__file__).resolve().parents[1]
SHARED_TEXT = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


class RecordRun(Callback):
    """Writes ``<out_dir>/rank<R>.pt`` at the end of fit: world size, cluster environment, the inputs each
    training epoch fed this rank, and the final parameters.

    Args:
        out_dir: where to write; created if missing.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.epochs: dict[int, list[torch.Tensor]] = {}

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self.epochs.setdefault(trainer.current_epoch, []).append(batch[0].detach().cpu().clone())

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        record = {
            "world_size": trainer.world_size,
            "global_rank": trainer.global_rank,
            "cluster_environment": type(getattr(trainer.strategy, "cluster_environment", None)).__name__,
            "epochs": {e: torch.cat(xs) for e, xs in self.epochs.items()},
            "global_step": trainer.global_step,
            "params": {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()},
        }
        torch.save(record, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


class KillAtEpochStart(Callback):
    """SIGKILLs its own process when training epoch ``epoch`` starts, as a crash or an OOM kill would.

    Args:
        epoch: the zero-based epoch at whose start to die.
    """

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            os.kill(os.getpid(), signal.SIGKILL)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env(**extra: str) -> dict[str, str]:
    """The test environment for a child process: the repo importable (for ``tests.helpers``), quiet."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        env.pop(key, None)
    env.update(extra)
    return env


def run(cmd: list[str], timeout: float, cwd: str | Path = REPO, **env: str) -> subprocess.CompletedProcess:
    """Runs ``cmd`` in its own process group; on timeout the whole group is killed and the test fails.

    Returns the completed process with ``stdout`` (stderr merged) as text.
    """
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=subprocess_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"{cmd} did not finish in {timeout} s; output:\n{out[-5000:]}") from None
    finally:
        kill_group(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILLs the process group of ``proc`` (it must have been started with ``start_new_session``)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def lit_ddp(*args: str) -> list[str]:
    """The command line of ``python -m lit_ddp ARGS`` with this interpreter."""
    return [sys.executable, "-m", "lit_ddp", *args]


def write_callbacks_config(path: Path, *callbacks: tuple[str, dict]) -> Path:
    """A YAML fragment setting ``trainer.callbacks`` to the given ``(class_path, init_args)`` pairs."""
    import yaml

    doc = {"trainer": {"callbacks": [{"class_path": c, "init_args": a} for c, a in callbacks]}}
    path.write_text(yaml.safe_dump(doc))
    return path
