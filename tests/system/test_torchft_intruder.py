"""Another user of the machine against a torchft job (issue 58, item 5): two replica groups of the regression,
launched by ``python -m lit_ddp.ft.launch`` on loopback; an intruding "group" run as uid 65534 (``nobody``), the
lit-ddp code itself pointed at the lighthouse the launcher printed, with a secret of its own. First one at step 0,
which asks a real group for its live state; then one at a much higher step with another learning rate, which the
lighthouse makes the group everyone heals from. Neither gets or gives a state, and the real groups end with one
model, the configured one. Root only (a process of another uid); loopback only."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.callbacks import StepTrace
from tests.helpers import REPO, callback, compose, start, subprocess_env, write_callbacks_config
from tests.system.test_torchft import steps

pytest.importorskip("torchft")

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

MAX_STEPS = 200
LEARNING_RATE = 1e-3  # RegressionModule's default: the real groups' (and the 1e-3 of their optimizer)
INTRUDER_LR = 0.5

# The intruder: lit-ddp's own fit, with two changes an attacker makes: its manager claims a step (INTRUDER_STEP), and
# what a heal hands it is recorded (INTRUDER_DIR/received). Once imported it waits for INTRUDER_DIR/go (so that its
# imports overlap the job's start), and it reports its first quorum in INTRUDER_DIR/joined.
INTRUDER = r"""
import json, os, sys, time
from pathlib import Path
# Everything it will import, imported first: the interpreter may live where uid 65534 cannot read (root's home).
import concurrent.futures, email.parser, encodings.idna, http.client, http.server, multiprocessing, urllib.request
import lightning.pytorch, torchft, torchmetrics
import lit_ddp.cli, lit_ddp.data.regression, lit_ddp.tasks.regression
from lit_ddp.ft import heal, strategy
os.setgroups([])
os.setgid(65534)
os.setuid(65534)  # from here on, another user of the machine
where = Path(os.environ["INTRUDER_DIR"])
claimed = int(os.environ["INTRUDER_STEP"])
(where / "ready").touch()
while not (where / "go").exists():
    time.sleep(0.05)
started = strategy.TorchFTStrategy.on_train_start
def on_train_start(self):
    started(self)
    if claimed:
        self.manager.load_state_dict({"step": claimed, "batches_committed": 0})
    quorum = self.manager.start_quorum
    def start_quorum(*args, **kwargs):
        quorum(*args, **kwargs)
        (where / "joined").touch()
    self.manager.start_quorum = start_quorum
strategy.TorchFTStrategy.on_train_start = on_train_start
loaded = heal.PeerState.load_state_dict
def load_state_dict(self, state):
    (where / "received").write_text(json.dumps({"step": int(state["loop"]["optimizer_steps"])}))
    loaded(self, state)
heal.PeerState.load_state_dict = load_state_dict
from lit_ddp.__main__ import main
main()
"""


def fit_args(trace: Path, tmp: Path, *extra: str, hold: Path | None = None) -> list[str]:
    """The fit of a group, traced; ``hold``: its step 10 waits until that file exists."""
    trace_args: dict[str, object] = {
        "directory": str(trace),
        "sleep": {"group_0": 0.03, "group_1": 0.03},
        "indices": True,
    }
    if hold is not None:
        trace_args.update(hold_at=10, hold_until=str(hold))
    callbacks = write_callbacks_config(tmp / "trace.yaml", callback(StepTrace, **trace_args))
    return [
        "fit", *compose("trainer/torchft", "regression/single_device"), "--config", str(callbacks),
        "--trainer.max_steps", str(MAX_STEPS), "--trainer.max_epochs", "-1", "--trainer.limit_val_batches", "0",
        "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false", *extra,
    ]  # fmt: skip


def intruder(tmp: Path, name: str, lighthouse: str, claimed: int, *extra: str) -> subprocess.Popen:
    """The intruding group's process, which turns itself into uid 65534 once imported, in a directory of its own
    under ``tmp`` (which it can enter)."""
    where = tmp / name
    for path in (where, where / "trace"):
        path.mkdir()
        os.chmod(path, 0o777)
    env = subprocess_env(
        OMP_NUM_THREADS="1", RUST_LOG="error", HOME=str(where), TORCHFT_LIGHTHOUSE=lighthouse,
        REPLICA_GROUP_ID="group_1", TORCHFT_REPLICA_GROUPS="2", INTRUDER_DIR=str(where), INTRUDER_STEP=str(claimed),
        LIT_DDP_JOB_SECRET=os.urandom(32).hex(),  # its own: it cannot read the job's
    )  # fmt: skip
    cmd = [sys.executable, "-c", INTRUDER, *fit_args(where / "trace", where, "--trainer.default_root_dir",
           str(where / "run"), *extra)]  # fmt: skip
    with open(where / "out.txt", "w") as out:
        return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="starts a process as another uid (65534): needs root")
@pytest.mark.timeout(300)
def test_an_intruding_group_neither_gets_the_state_nor_becomes_the_heal_source(tmp_path: Path) -> None:
    """The low intruder (step 0) asks a real group for its state: it receives none; the high one (step 10**4,
    learning rate 0.5) is the heal source the lighthouse names: no real group loads its state. While either is in
    the quorum no step commits (one line names the quorum); once it is gone the groups go on, and end at max_steps
    with the configured learning rate and identical weights and optimizer states; the launcher exits 0."""
    outside = Path(tempfile.mkdtemp(prefix="lit_ddp_intruder_"))  # pytest's tmp_path is root's alone
    os.chmod(outside, 0o755)
    trace = tmp_path / "trace"
    cmd = [sys.executable, "-m", "lit_ddp.ft.launch", "--replica_groups", "2", "--root", str(tmp_path / "runs"),
           "--heartbeat_timeout_ms", "1000", "--", *fit_args(trace, tmp_path, hold=tmp_path / "intruders_ready")]  # fmt: skip
    job = start(cmd, env=subprocess_env(OMP_NUM_THREADS="1", RUST_LOG="error"))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(job.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    intruders: list[subprocess.Popen] = []

    def until(what: str, done: object, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not done():  # type: ignore[operator]
            assert job.poll() is None and time.monotonic() < deadline, f"{what}:\n{''.join(lines)[-4000:]}"
            time.sleep(0.1)

    try:
        until("the lighthouse's address", lambda: any("lighthouse http" in line for line in lines), 60)
        lighthouse = re.search(r"lighthouse (http://\S+)", "".join(lines)).group(1)  # type: ignore[union-attr]
        low = intruder(outside, "low", lighthouse, 0)
        high = intruder(outside, "high", lighthouse, 10**4, "--model.init_args.learning_rate", str(INTRUDER_LR))
        intruders += [low, high]
        for name in ("low", "high"):
            until(f"the {name} intruder's imports", lambda n=name: (outside / n / "ready").exists(), 120)
        (tmp_path / "intruders_ready").touch()  # the groups, held at step 10, go on
        until("the groups training", lambda: min(len(steps(trace, g)) for g in ("group_0", "group_1")) >= 12, 60)
        for name, proc in (("low", low), ("high", high)):
            (outside / name / "go").touch()
            until(f"the {name} intruder in a quorum", lambda n=name: (outside / n / "joined").exists(), 90)
            time.sleep(2)  # its quorums, its heals, the groups' answers
            proc.kill()
            proc.wait(timeout=30)
        until("the job's end", lambda: job.poll() is not None, 120)
    finally:
        for proc in intruders:
            if proc.poll() is None:
                proc.kill()
        if job.poll() is None:
            job.kill()
        job.wait(timeout=30)
        reader.join(timeout=10)
    out = "".join(lines)
    print(out[-6000:])
    received = (outside / "low" / "received").exists()
    for name in ("low", "high"):
        print(f"--- the {name} intruder's output (its end):\n" + (outside / name / "out.txt").read_text()[-1500:])
    shutil.rmtree(outside, ignore_errors=True)
    assert not received, "the intruder received a real group's live state"
    final = {
        g: torch.load(tmp_path / "runs" / g / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        for g in ("group_0", "group_1")
    }
    for g, ckpt in final.items():
        lrs = [group["lr"] for group in ckpt["optimizer_states"][0]["param_groups"]]
        assert lrs == [LEARNING_RATE], f"{g} ends with the intruder's learning rate {lrs}: it healed from it"
        assert ckpt["global_step"] == MAX_STEPS and ckpt["torchft"]["step"] == MAX_STEPS, (g, ckpt["torchft"])
    for key in ("state_dict", "optimizer_states"):
        a, b = (torch.utils._pytree.tree_flatten(final[g][key])[0] for g in ("group_0", "group_1"))
        assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b, strict=True))
    assert "holds a process without this job's secret" in out, out[-4000:]
    assert job.returncode == 0, out[-4000:]
