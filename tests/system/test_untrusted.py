"""Untrusted files and networks, through the whole command: a checkpoint planted in a run directory runs none of its
code when ``lit-ddp fit`` resumes or ``lit-ddp generate`` reads it (one line and status 2 instead), and a
two-process DDP fit on one machine listens on loopback only."""

from __future__ import annotations

import ipaddress
import pickle
import time
from pathlib import Path

import psutil
import pytest
import torch

from lit_ddp.run_dir import sharded
from tests.helpers import QUIET, Runner, compose, descendants, lit_ddp, wait
from tests.unit.run_dir.test_untrusted import Payload

REG = ["regression/single_device"]
REG_DDP = ["trainer/ddp", "regression/ddp"]


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("lit-ddp: error:")]


@pytest.mark.slow
@pytest.mark.parametrize("planted", ["pickle as last.ckpt", "sharded directory"])
def test_a_planted_checkpoint_is_not_resumed(tmp_path: Path, runner: Runner, planted: str) -> None:
    run, marker = tmp_path / "run", tmp_path / "MARKER"
    checkpoints = run / "checkpoints"
    checkpoints.mkdir(parents=True)
    if planted == "sharded directory":
        directory = checkpoints / "epoch=0-step=9.ckpt"
        directory.mkdir()
        (directory / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
        torch.save({"global_step": 9}, directory / sharded.META)
        expected = "is not a checkpoint's metadata and was not loaded"
    else:
        torch.save({"global_step": 9, "state_dict": {}, "payload": Payload(marker)}, checkpoints / "last.ckpt")
        expected = "holds objects other than tensors and plain data, which lit-ddp does not load"
    out = runner.fit(*compose(*REG), "--trainer.default_root_dir", str(run), *QUIET, timeout=120)
    assert out.returncode == 2, out.stdout[-3000:]
    [line] = error_lines(out.stdout)
    assert expected in line
    assert "Traceback" not in out.stdout
    assert not marker.exists(), "code from the planted checkpoint ran"


@pytest.mark.slow
def test_generate_refuses_a_planted_sharded_checkpoint(tmp_path: Path, runner: Runner) -> None:
    directory, marker = tmp_path / "last.ckpt", tmp_path / "MARKER"
    directory.mkdir()
    (directory / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    torch.save({"global_step": 9}, directory / sharded.META)
    out = runner.run(lit_ddp("generate", "--ckpt_path", str(directory)), timeout=120)
    assert out.returncode == 2, out.stdout[-3000:]
    [line] = error_lines(out.stdout)
    assert "is not a checkpoint's metadata and was not loaded" in line
    assert not marker.exists(), "code from the planted checkpoint ran"


def listening(pids: list[int]) -> set[tuple[str, int]]:
    """The (address, port) pairs the processes listen on (TCP)."""
    found = set()
    for pid in pids:
        try:
            for conn in psutil.Process(pid).net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found.add((conn.laddr.ip, conn.laddr.port))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_one_machine_ddp_fit_listens_on_loopback_only(tmp_path: Path, runner: Runner) -> None:
    """Every TCP socket the fit's processes listen on while they train (sampled every 0.2 s) is a loopback one: the
    process group's store and gloo's pairs alike."""
    proc = runner.start(
        lit_ddp(
            "fit", *compose(*REG_DDP), "--trainer.default_root_dir", str(tmp_path / "run"), *QUIET,
            "--trainer.max_epochs", "30",
        )
    )  # fmt: skip
    seen: set[tuple[str, int]] = set()
    processes = 0
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        pids = [proc.pid, *descendants(proc.pid)]
        processes = max(processes, len(pids))
        seen |= listening(pids)
        time.sleep(0.2)
    out = wait(proc, timeout=60)
    assert out.returncode == 0, out.stdout[-3000:]
    assert processes >= 2 and seen, f"no listening socket seen ({processes} processes)"
    assert all(ipaddress.ip_address(ip).is_loopback for ip, _ in seen), seen
