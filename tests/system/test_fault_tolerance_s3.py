"""A run directory in S3 (``s3://bucket/run``) through fsspec/s3fs, against moto's S3 server on 127.0.0.1:
checkpoints and logs are written there, listed, validated, and a run killed at a random moment resumes from them
exactly. (Not through ``lit-ddp chaos``, whose ``--root`` is a local directory: the tool watches its files.)"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from lit_ddp.resilience.resume import choose_checkpoint
from lit_ddp.run_dir.atomic import write_atomic
from lit_ddp.run_dir.checkpoints import checkpoint_candidates, checkpoint_step, is_valid_checkpoint
from tests.helpers import QUIET, Runner, compose, kill_group, lit_ddp, load_records, start
from tests.system.test_reliability import Watched

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """moto's S3 server on a free local port with a bucket ``ftbucket``; the environment that points boto at it."""
    port = find_free_network_port()
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = start(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=False)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "moto server did not start"
                time.sleep(0.1)
        endpoint = f"http://127.0.0.1:{port}"
        env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,  # boto3 / aiobotocore (s3fs)
            "S3_ENDPOINT": endpoint,  # tensorboard's own S3 writer
        }
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir("ftbucket")
        yield env
    finally:
        kill_group(proc)
        proc.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_s3_run_directory_resumes(s3_env: dict[str, str], tmp_path: Path, runner: Runner, recorder, seed: int) -> None:
    """The regression in one process, its run directory ``s3://ftbucket/run``, a checkpoint every 40 steps: once
    the first is in the bucket, a SIGKILL from outside after a delay drawn from the seed (mid-step or mid-save,
    wherever it lands). The bucket's checkpoints list and validate through fsspec, a torn newer object is skipped,
    and the same command resumes from the newest and ends bit-identical to an uninterrupted local run, its
    TensorBoard log continued."""
    args = [
        *compose("trainer/ddp", "checkpoint/fault_tolerant", "regression/fault_tolerant"),
        "--trainer.devices", "1", "--trainer.strategy", "auto",
        "--trainer.max_steps", "500", "--trainer.max_epochs", "-1", "--data.num_samples", "288",
        "--checkpoint.every_n_train_steps", "40", *QUIET,
    ]  # fmt: skip
    ref, ref_rec = recorder("ref")
    out = runner.fit(*args, "--config", str(ref), "--trainer.default_root_dir", str(tmp_path / "local"), timeout=120)
    assert out.returncode == 0, out.stdout[-3000:]

    cb, rec = recorder("ft")
    args += ["--config", str(cb), "--trainer.default_root_dir", "s3://ftbucket/run"]
    struck = Watched(runner.start(lit_ddp("fit", *args), **s3_env))
    deadline = time.monotonic() + 120
    while not checkpoint_candidates("s3://ftbucket/run"):
        assert struck.proc.poll() is None and time.monotonic() < deadline, struck.output[-3000:]
        time.sleep(0.05)
    time.sleep(random.Random(seed).uniform(0.0, 2.0))
    assert struck.proc.poll() is None, "the run ended before its kill: make it longer"
    os.kill(struck.proc.pid, signal.SIGKILL)
    assert struck.finish(60) == -signal.SIGKILL

    # Listed and validated through fsspec; a truncated newer object is skipped (written atomically itself: one PUT).
    candidates = checkpoint_candidates("s3://ftbucket/run")
    assert all(c.startswith("s3://ftbucket/run/checkpoints/") and is_valid_checkpoint(c) for c in candidates)
    newest = choose_checkpoint("s3://ftbucket/run")
    step = checkpoint_step(newest)
    print(f"killed with the checkpoint of step {step} the newest of 500")
    write_atomic("s3://ftbucket/run/checkpoints/epoch=999-step=99999.ckpt", b"PK\x03\x04 truncated")
    assert choose_checkpoint("s3://ftbucket/run") == newest
    import s3fs

    s3fs.S3FileSystem().rm("ftbucket/run/checkpoints/epoch=999-step=99999.ckpt")

    out = runner.fit(*args, timeout=120, **s3_env)
    assert out.returncode == 0, out.stdout[-3000:]
    assert f"Resuming from {newest}" in out.stdout, out.stdout[-3000:]
    [final], [reference] = load_records(rec), load_records(ref_rec)
    assert final["start_step"] == step > 0 and final["optimizer_steps"] == 500 - step
    for name, tensor in reference["params"].items():
        assert torch.equal(final["params"][name], tensor), name
    files = {p.rsplit("/", 1)[-1] for p in s3fs.S3FileSystem().find("ftbucket/run")}
    assert {"config.yaml", "last.ckpt"} <= files
    assert sum(f.startswith("events.out.tfevents") for f in files) == 2  # one log, continued
