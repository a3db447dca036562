"""Per-step fault tolerance with torchft (lit_ddp.ft) on CPU: two replica groups of one process each, launched by
``python -m lit_ddp.ft.launch`` with the lighthouse on loopback; one group SIGKILLed mid-training. Each group's
trace records the samples every step trained (tests.callbacks.StepTrace)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lit_ddp.cli import DEFAULT_SEED
from lit_ddp.data.regression import RegressionDataModule
from lit_ddp.data.samplers import GlobalOrderSampler
from tests.callbacks import StepTrace
from tests.helpers import callback, compose, descendants, start, subprocess_env, wait, write_callbacks_config

pytest.importorskip("torchft")

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def launch(tmp_path: Path, trace: Path, max_steps: int, sleep: dict[str, float], *extra: str) -> subprocess.Popen:
    callbacks = write_callbacks_config(
        tmp_path / "trace.yaml", callback(StepTrace, directory=str(trace), sleep=sleep, indices=True)
    )
    cmd = [
        sys.executable, "-m", "lit_ddp.ft.launch", "--replica_groups", "2", "--root", str(tmp_path / "runs"),
        *extra, "--",
        "fit", *compose("trainer/torchft", "regression/single_device"), "--config", str(callbacks),
        "--trainer.max_steps", str(max_steps), "--trainer.max_epochs", "-1", "--trainer.limit_val_batches", "0",
        "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip
    return start(cmd, env=subprocess_env(OMP_NUM_THREADS="1", RUST_LOG="warn"))


def steps(trace: Path, group: str) -> list[tuple[float, int, int]]:
    """(time, pid, global step) of each training batch the group ran."""
    path = trace / f"{group}.txt"
    if not path.exists():
        return []
    rows = [line.split()[:3] for line in path.read_text().splitlines() if line.count(" ") == 3]
    return [(float(t), int(pid), int(step)) for t, pid, step in rows]


def trained(trace: Path, group: str) -> list[tuple[int, int, list[int]]]:
    """(step, epoch, train set indices) of each training batch the group ran, that step committed or not."""
    lines = (trace / f"{group}.txt").read_text().splitlines()
    rows = [line.split()[3].split(":") for line in lines if line.count(" ") == 3]
    return [(int(step), int(epoch), [int(i) for i in indices.split(",")]) for step, epoch, indices in rows]


def committed(trace: Path, group: str) -> dict[int, tuple[int, list[int]]]:
    """Step -> (epoch, indices) of the group's committed steps: a step whose global step went one past it."""
    after = [step for _, _, step in steps(trace, group)]
    return {
        step: (epoch, idx) for (step, epoch, idx), done in zip(trained(trace, group), after, strict=True) if done > step
    }


@functools.cache
def regression_sizes() -> tuple[int, int]:
    """(train samples, batch size) of configs/regression/single_device.yaml's data."""
    data = RegressionDataModule()
    data.setup()
    assert data.train_set is not None
    return len(data.train_set), data.hparams["batch_size"]


def expected_share(step: int, group: int, groups: int = 2) -> tuple[int, list[int]]:
    """(epoch, indices): group ``group``'s share of the global batch of step ``step`` in an uninterrupted run of
    the regression (its data, the CLI's seed)."""
    n, batch_size = regression_sizes()
    global_batch = batch_size * groups
    epoch, batch = divmod(step, n // global_batch)
    order = GlobalOrderSampler(range(n), num_replicas=groups, rank=group, seed=DEFAULT_SEED).order(epoch)
    return epoch, order[batch * global_batch : (batch + 1) * global_batch][group::groups].tolist()


def final_parameters(run_dir: Path) -> tuple[int, dict[str, torch.Tensor]]:
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return ckpt["global_step"], ckpt["state_dict"]


def outage(
    victim: str,
    survivor: list[tuple[float, int, int]],
    hit: list[tuple[float, int, int]],
    hit_pid: int,
    killed_at: float,
) -> tuple[list[tuple[float, int, int]], int]:
    """Prints and checks what a kill at ``killed_at`` of the process ``hit_pid`` cost: the survivor's steps during the
    outage (some, past the step at the kill) and its longest pause, and when and at which step the hit group stepped
    again (past that step: it healed to the survivor's). Returns the hit group's rows after the kill and that step."""
    back = [row for row in hit if row[1] != hit_pid]
    assert back, "group_1 never stepped again"
    back_at, _, back_step = back[0]
    during = [step for t, _, step in survivor if killed_at < t < back_at]
    before = max(step for t, _, step in survivor if t <= killed_at)
    gaps = [b[0] - a[0] for a, b in zip(survivor, survivor[1:], strict=False) if a[0] >= killed_at - 1]
    print(
        f"\n{victim} killed at survivor step {before}; the survivor made {len(during)} steps "
        f"({before} -> {max(during, default=before)}) during the outage, its longest pause {max(gaps):.2f} s; "
        f"group_1 stepped again {back_at - killed_at:.2f} s after the kill, at step {back_step}"
    )
    assert len(during) > 0 and max(during) > before, "the survivor did not step during the outage"
    assert back_step > before, "the restarted group did not heal to the survivor's step"
    return back, back_step


def same_final_parameters(root: Path, max_steps: int) -> None:
    """Both groups' last checkpoints under ``root/runs`` at ``max_steps``, their parameters equal bit for bit."""
    (step_0, params_0), (step_1, params_1) = (final_parameters(root / "runs" / g) for g in ("group_0", "group_1"))
    assert step_0 == step_1 == max_steps
    assert params_0.keys() == params_1.keys()
    assert all(torch.equal(params_0[k], params_1[k]) for k in params_0), "the groups' final parameters differ"


@pytest.mark.timeout(250)
def test_a_killed_group_stops_no_one_and_heals_from_its_peer(tmp_path: Path) -> None:
    """group_1 is SIGKILLed mid-training (group_0 then waits in the all-reduce for it, group_1 being slower): group_0
    keeps its process and steps on during the outage; the launcher restarts group_1, which heals from group_0 and
    ends with parameters identical to group_0's, bit for bit. Every committed step of each group trained its share
    of the same global batch as an uninterrupted run (group_0 samples 0, 2, ... of it, group_1 1, 3, ...): the groups
    up read disjoint shares, none read a sample twice in an epoch, group_1's share is skipped while it is down, a
    discarded step's batch (where there is one) is read again, and the healed group_1 trains its share of the
    survivors' batch from its first step back."""
    trace = tmp_path / "trace"
    # A 1 s heartbeat timeout: the survivor gives group_1 up (and trains alone) well before its restart is back,
    # seconds of imports; at torchft's 5 s default a quick restart rejoins first and the survivor only waits.
    # 250 steps: group_0 alone for about 11 s after the kill, more than group_1's restart takes at a load of 6 (a
    # restart that comes back after the others finished is ended, and the launcher exits 1).
    proc = launch(tmp_path, trace, 250, {"group_0": 0.05, "group_1": 0.1}, "--max_restarts", "1",
                  "--heartbeat_timeout_ms", "1000")  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not (len(steps(trace, "group_1")) >= 20 and len(steps(trace, "group_0")) >= 20):
            assert proc.poll() is None and time.monotonic() < deadline, "the groups did not both train"
            time.sleep(0.2)
        survivor_pid, victim_pid = steps(trace, "group_0")[-1][1], steps(trace, "group_1")[-1][1]
        os.kill(victim_pid, signal.SIGKILL)
        killed_at = time.time()
        done = wait(proc, timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert done.returncode == 0, done.stdout[-3000:]

    survivor, victim = steps(trace, "group_0"), steps(trace, "group_1")
    assert {pid for _, pid, _ in survivor} == {survivor_pid}, "the survivor's process was restarted"
    back, back_step = outage("torchft: group_1", survivor, victim, victim_pid, killed_at)
    same_final_parameters(tmp_path, 250)

    shares = {g: committed(trace, f"group_{g}") for g in (0, 1)}
    print(f"sampler seed {DEFAULT_SEED} (the CLI's)")
    for g, share in shares.items():
        wrong = [s for s, got in share.items() if got != expected_share(s, g)]
        assert not wrong, f"group_{g} trained other samples than its share at steps {wrong[:5]}"
    both = sorted(shares[0].keys() & shares[1].keys())
    assert all(set(shares[0][s][1]).isdisjoint(shares[1][s][1]) for s in both)
    first_back = [step for step, _, _ in trained(trace, "group_1")][len(victim) - len(back)]
    assert first_back == back_step - 1 and first_back in shares[0], "group_1 came back at another step"
    per_epoch: dict[int, list[int]] = {}
    for share in shares.values():
        for epoch, indices in share.values():
            per_epoch.setdefault(epoch, []).extend(indices)
    assert all(len(set(v)) == len(v) for v in per_epoch.values()), "a sample was trained twice in an epoch"
    discarded = {g: len(trained(trace, f"group_{g}")) - len(shares[g]) for g in (0, 1)}
    print(
        f"torchft data: steps trained by both groups {len(both)}, by group_0 alone {len(shares[0]) - len(both)}, "
        f"by group_1 alone {len(shares[1]) - len(both)} (the other joining or down); "
        f"group_1's first step back {first_back} trained its share of group_0's batch of that step; "
        f"discarded steps read again: group_0 {discarded[0]}, group_1 {discarded[1]}; samples trained per epoch "
        f"{[len(per_epoch[e]) for e in sorted(per_epoch)]}, none twice"
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc", [1, 2], ids=["groups of 1 process", "groups of 2 processes"])
def test_a_group_refusing_its_config_is_not_restarted(tmp_path: Path, nproc: int) -> None:
    """A bad option makes every group exit for bad use (under torchrun, whose status is 1, too); the launcher
    restarts none of them (each start would fail alike) and ends with 2."""
    cmd = [
        sys.executable, "-m", "lit_ddp.ft.launch", "--replica_groups", "2", "--root", str(tmp_path / "runs"),
        "--nproc_per_group", str(nproc), "--",
        "fit", *compose("trainer/torchft", "regression/single_device"), "--trainer.max_steps", "many",
    ]  # fmt: skip
    done = wait(start(cmd, env=subprocess_env(OMP_NUM_THREADS="1", RUST_LOG="warn")), timeout=100)
    assert done.returncode == 2, done.stdout[-3000:]
    assert done.stdout.count("(bad use): not restarted") == 2, done.stdout[-3000:]
    # one message per process (each of torchrun's processes prints the config parser's)
    assert done.stdout.count("Got value: many") == 2 * nproc, done.stdout[-3000:]
    assert "restart 1" not in done.stdout


MAX_STEPS_2X2 = 300  # about 30 s of group_0's steps alone after the kill


@pytest.mark.timeout(240)
@pytest.mark.parametrize("lost", ["worker", "group"])
def test_groups_of_two_processes_a_lost_worker_or_group_stops_no_other_group(tmp_path: Path, lost: str) -> None:
    """Two replica groups of two processes each (one torchrun job per group, ``--nproc_per_group 2``). ``worker``:
    rank 1 of group_1 is SIGKILLed mid-training, and torchrun restarts group_1's two processes; ``group``: group_1's
    torchrun and both its processes are SIGKILLed at once (a lost node), and the launcher starts the group again.
    group_0's processes keep their process ids and step on during the outage; the restarted group heals rank by rank
    from group_0 and ends with parameters identical to group_0's, bit for bit. Each committed step of each process trained its share of the same global
    batch as an uninterrupted run of 4 readers (group ``i``'s rank ``r`` is reader ``2i + r``)."""
    trace = tmp_path / "trace"
    # Slow enough steps that group_0 alone is still training when group_1's restart is back (torchrun and two
    # processes importing: 5 to 20 s here, by the load), else group_1 would come back to a finished job.
    proc = launch(tmp_path, trace, MAX_STEPS_2X2, {"group_0": 0.1, "group_1": 0.12}, "--nproc_per_group", "2",
                  "--max_restarts", "1", "--heartbeat_timeout_ms", "1000")  # fmt: skip
    ranks = {(g, r): f"group_{g}" if r == 0 else f"group_{g}.rank{r}" for g in (0, 1) for r in (0, 1)}
    try:
        deadline = time.monotonic() + 120
        while not all(len(steps(trace, name)) >= 15 for name in ranks.values()):
            assert proc.poll() is None and time.monotonic() < deadline, "the groups did not all train"
            time.sleep(0.2)
        survivor_pids = {steps(trace, ranks[0, r])[-1][1] for r in (0, 1)}
        victim_pid = steps(trace, ranks[1, 1])[-1][1]
        agent = int(Path(f"/proc/{victim_pid}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its torchrun
        for pid in [agent, *descendants(agent)] if lost == "group" else [victim_pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        done = wait(proc, timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert done.returncode == 0, done.stdout[-3000:]

    assert {pid for r in (0, 1) for _, pid, _ in steps(trace, ranks[0, r])} == survivor_pids, (
        "a survivor's process was restarted"
    )
    victim = f"group_1's {'rank 1' if lost == 'worker' else 'torchrun and processes'}"
    outage(f"torchft, 2 groups x 2 processes: {victim}", steps(trace, ranks[0, 0]), steps(trace, ranks[1, 1]),
           victim_pid, killed_at)  # fmt: skip
    same_final_parameters(tmp_path, MAX_STEPS_2X2)

    print(f"sampler seed {DEFAULT_SEED} (the CLI's)")
    for (g, r), name in ranks.items():
        share = committed(trace, name)
        wrong = [s for s, got in share.items() if got != expected_share(s, 2 * g + r, groups=4)]
        assert not wrong, f"group_{g} rank {r} trained other samples than its share at steps {wrong[:5]}"
