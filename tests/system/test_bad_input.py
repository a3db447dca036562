"""Bad input, tried as a new user would: one clear message naming the bad value and what would be right,
a non-zero exit (2 for usage errors), no process left running, no saved checkpoint touched. Each case is a
whole ``lit-ddp fit`` in a subprocess; the checks themselves are unit-tested beside their modules
(``tests/unit/launch/test_preflight.py``, ``tests/unit/data/test_sources.py``)."""

from __future__ import annotations

import re
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.callbacks import PoisonAtStep
from tests.helpers import QUIET, Runner, callback, compose, lit_ddp

REG = ["regression/single_device"]
REG_DDP = ["trainer/ddp", "regression/ddp"]
GPT = ["trainer/ddp", "mingpt/cpu"]  # as `make train` composes them


@pytest.fixture
def fit(tmp_path: Path, runner: Runner) -> Callable[..., tuple[int, str]]:
    """``fit(*args, root=tmp_path, timeout=90, **env)``: ``lit-ddp fit ARGS`` into ``root/run``, its process
    group killed at the end; returns (exit code, output)."""

    def fit_(*args: str, root: Path = tmp_path, timeout: float = 90, **env: str) -> tuple[int, str]:
        out = runner.fit(*args, "--trainer.default_root_dir", str(root / "run"), *QUIET, timeout=timeout, **env)
        return out.returncode, out.stdout

    return fit_


def error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("lit-ddp: error:")]
    assert len(lines) == 1, f"expected one error line, got:\n{output[-3000:]}"
    return lines[0]


CASES = {
    "malformed yaml": (
        "malformed.yaml",
        "trainer:\n  max_epochs: [1\n",
        [],
        r"malformed\.yaml is not valid YAML \(line \d+",
    ),
    "unknown key": ("typo.yaml", "trainer:\n  max_epoch: 3\n", [], r"does not accept option 'trainer.max_epoch'"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_config_errors(tmp_path: Path, fit, name: str) -> None:
    filename, text, extra, pattern = CASES[name]
    (tmp_path / filename).write_text(text)
    code, out = fit(*compose(*REG), "--config", str(tmp_path / filename), *extra)
    assert code == 2
    assert re.search(pattern, out), out[-2000:]
    assert "Traceback" not in out


@pytest.mark.slow
def test_missing_config_file(tmp_path: Path, fit) -> None:
    code, out = fit("--config", str(tmp_path / "nope.yaml"))
    assert code == 2 and "nope.yaml" in out and "does not exist" in out.lower() and "Traceback" not in out


USAGE = {
    "regression batch_size 0": ((REG, "--data.batch_size", "0"), "data.batch_size=0 must be a positive integer"),
    "gpt batch_size -1": ((GPT, "--data.batch_size", "-1"), "batch_size=-1 must be a positive integer"),
    "truncate 0": ((GPT, "--data.truncate", "0"), "truncate=0.0 must be in (0, 1]"),
    "truncate 1.5": ((GPT, "--data.truncate", "1.5"), "truncate=1.5 must be in (0, 1]"),
    "data missing": ((GPT, "--data.path", "/no/such/text.txt"), "data file /no/such/text.txt does not exist"),
    "block_size vs val split": (  # the embedded Tiny Shakespeare, cut to 1115 characters
        (GPT, "--data.truncate", "0.001", "--data.block_size", "128"),
        "block_size=128 is at least as long as the validation split (112 characters",
    ),
    "devices > cores": ((REG, "--trainer.accelerator", "cpu", "--trainer.devices", "512"), "trainer.devices=512"),
    "16-mixed on cpu": ((REG, "--trainer.accelerator", "cpu", "--trainer.precision", "16-mixed"), "bf16-mixed"),
    "ckpt_path missing": ((REG, "--ckpt_path", "/no/such.ckpt"), "--ckpt_path /no/such.ckpt does not exist"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(USAGE))
def test_usage_errors(fit, name: str) -> None:
    (configs, *args), message = USAGE[name]
    code, out = fit(*compose(*configs), *args)
    assert code == 2, out[-3000:]
    assert message in error_line(out)
    assert "Traceback" not in out


@pytest.mark.slow
def test_empty_data_file(tmp_path: Path, fit) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, out = fit(*compose(*GPT), "--data.path", str(empty), "--trainer.devices", "1",
                    "--trainer.strategy", "auto")  # fmt: skip
    assert code == 2 and "is empty" in error_line(out)


@pytest.mark.slow
def test_truncated_ckpt_path_is_refused_and_left_alone(tmp_path: Path, fit) -> None:
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"PK\x03\x04 not really a checkpoint")
    before = bad.read_bytes()
    code, out = fit(*compose(*REG), "--ckpt_path", str(bad))
    assert code == 2 and "is truncated or not a checkpoint" in error_line(out)
    assert bad.read_bytes() == before


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_busy_master_port_leaves_no_process(tmp_path: Path, fit) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, out = fit(*compose(*REG_DDP), MASTER_PORT=str(port), MASTER_ADDR="127.0.0.1")
    assert code == 2 and f"MASTER_PORT={port} is already in use" in error_line(out)
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "run")], capture_output=True, text=True).stdout
    assert not left.strip(), f"processes left behind: {left}"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path: Path, fit, callbacks_config) -> None:
    poison = callbacks_config("poison", callback(PoisonAtStep, step=60))
    code, out = fit(*compose(*REG), "--config", str(poison), "--checkpoint.every_n_epochs", "1")
    assert code == 1, out[-3000:]
    line = error_line(out)
    assert "train loss became nan at global_step 61" in line, line
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert ckpts == ["epoch=0-step=56.ckpt", "last.ckpt"]
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 56
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values())


@pytest.mark.slow
def test_generate_errors(tmp_path: Path, fit, runner: Runner) -> None:
    not_gpt = tmp_path / "reg"
    code, out = fit(*compose(*REG), "--trainer.max_epochs", "1", root=not_gpt)
    assert code == 0, out[-2000:]
    ckpt = not_gpt / "run" / "checkpoints" / "last.ckpt"
    out = runner.run(lit_ddp("generate", "--ckpt_path", str(ckpt)), timeout=60)
    assert out.returncode != 0 and "not a minGPT checkpoint" in out.stdout, out.stdout[-2000:]
    out = runner.run(lit_ddp("generate", "--ckpt_path", str(ckpt), "--max_new_tokens", "-1"), timeout=60)
    assert out.returncode == 2 and "--max_new_tokens=-1" in out.stdout, out.stdout[-2000:]


def sigterm_pending(pid: int) -> bool:
    """Whether ``pid`` has a SIGTERM waiting (``/proc/PID/status``), e.g. sent while it was stopped."""
    import signal

    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # gone: nothing left to wait for
    pending = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask >> (signal.SIGTERM - 1) & 1 for mask in pending)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_an_error_every_rank_meets_is_printed_when_rank_zero_is_slow(tmp_path: Path, runner: Runner, seed: int) -> None:
    """torchrun, 2 workers, a bad value every rank rejects (batch_size 0), rank zero frozen (SIGSTOP) at a random
    moment of its start: rank 1 fails first and prints the cause, once; torchrun stops the group (issue 22). A
    rank exiting first in silence used to have torchrun stop rank zero before it printed: no message at all."""
    import contextlib
    import os
    import random
    import signal
    import time

    from tests.helpers import torchrun
    from tests.system.test_reliability import Watched, workers

    rng = random.Random(seed)
    cmd = torchrun("--standalone", "--nproc_per_node", "2", "-m", "lit_ddp", "fit",
                   *compose("trainer/ddp", "regression/torchrun"), "--data.init_args.batch_size", "0",
                   "--trainer.default_root_dir", str(tmp_path / "run"), *QUIET)  # fmt: skip
    watched = Watched(runner.start(cmd))
    deadline = time.monotonic() + 60
    while len(pids := workers(watched.proc)) < 2:
        assert time.monotonic() < deadline and watched.proc.poll() is None, "torchrun started no 2 workers"
        time.sleep(0.02)
    environ = {pid: Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") for pid in pids}
    [rank0] = [pid for pid, env in environ.items() if b"RANK=0" in env]
    time.sleep(rng.uniform(0.0, 1.0))  # lightning imports take seconds: rank zero is frozen before its error
    os.kill(rank0, signal.SIGSTOP)
    try:
        printed = watched.wait_for("lit-ddp: error:", 1, 60)
        while (
            printed and time.monotonic() < deadline + 60 and not sigterm_pending(rank0)
        ):  # torchrun stopping the group
            time.sleep(0.02)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank0, signal.SIGCONT)  # the pending SIGTERM ends it before it runs on
    assert watched.finish(60) != 0
    errors = [line for line in watched.lines if line.startswith("lit-ddp: error:")]
    assert printed and len(errors) == 1 and "batch_size=0" in errors[0], watched.output[-3000:]
