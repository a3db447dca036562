"""Time to recover from a fault under torchrun: from the fault to the first optimizer step after it.

    python -m bench.recovery [--faults kill hang node] [--timeout 30]      (make bench-recovery)
    python -m bench.recovery --faults kill --nproc_per_node 1 --configs configs/trainer/ddp.yaml \
        configs/mingpt/gpu.yaml --json restart.json                          (the GPU main job: make bench-gpu)

Runs the README's fault-tolerant regression step (``torchrun --standalone --nproc_per_node 2 --max-restarts 1``,
``configs/checkpoint/fault_tolerant.yaml``: a checkpoint every 50 steps) and, 3-6 s (drawn at random) after
training began, injects one fault from outside into a random worker:

- ``kill``: SIGKILL (a crash, an out-of-memory kill). The other worker's collective fails at once, torchrun
  sees the dead worker and restarts the group.
- ``node``: two agents (``--nnodes 1:2 --nproc_per_node 1``, c10d rendezvous on this host), the second one
  SIGKILLed with its worker (a machine lost). The first agent's worker fails at once (its peer's connection
  closes); the agent restarts it, and the rendezvous goes on with one node once the lost agent's heartbeat is
  3 ``keep_alive_interval`` old (``--keep-alive``; torch's default 5 s) and ``last_call_timeout`` has passed
  (``--last-call``; torch's default 30 s: how long a new round waits for more nodes). The first agent hosts the rendezvous store: its loss ends the job
  (c10d's store is not replicated).
- ``hang``: SIGSTOP (a stuck collective, a frozen host). The other worker waits in its collective for the
  DDP strategy's timeout (``--timeout`` seconds; ``configs/trainer/ddp.yaml`` says 5 minutes), then fails;
  torchrun stops the group (SIGTERM, and SIGKILL after its 30 s shutdown grace, since a stopped process cannot
  act on SIGTERM) and restarts it.

``--configs`` (with ``--nproc_per_node``, and fit arguments after ``--``) times another job the same way, e.g. the
GPU main job on one GPU (:mod:`bench.gpu_check`). Every worker appends the wall time of each optimizer step to a
file (:class:`StepClock`). Printed per fault,
in seconds: fault to the first step of the restarted group, split into fault to the restarted workers' start
(detection, timeout, shutdown) and their start to their first step (imports, process group, resume); and the
steps repeated (done before the fault, after the checkpoint the group resumed from). Written for this
question alone: no library measures it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.pytorch import Callback, LightningModule, Trainer

from lit_ddp.chaos.job import workers

REPO = Path(__file__).resolve().parents[1]
CONFIGS = [
    "configs/trainer/ddp.yaml",
    "configs/checkpoint/fault_tolerant.yaml",
    "configs/regression/fault_tolerant.yaml",
]


def process_started_at() -> float:
    """This process's creation time, wall-clock seconds since the epoch (from ``/proc``, Linux; +-1 s: the boot time
    is in whole seconds)."""
    ticks = os.sysconf("SC_CLK_TCK")
    since_boot = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
    boot = next(
        float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
    )
    return boot + since_boot


class StepClock(Callback):
    """Appends ``"start <time> <pid>"`` (the process's creation) at fit start and ``"<time> <global_step> <pid>"``
    after every optimizer step to ``<directory>/rank<RANK>.txt`` (wall-clock seconds since the epoch)."""

    def __init__(self, directory: str) -> None:
        self.path = Path(directory) / f"rank{os.environ.get('RANK', '0')}.txt"

    def _write(self, line: str) -> None:
        with self.path.open("a") as f:
            f.write(line + "\n")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._write(f"start {process_started_at()} {os.getpid()}")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._write(f"{time.time()} {trainer.global_step} {os.getpid()}")


def read_clock(directory: Path) -> tuple[list[tuple[float, int]], list[tuple[float, int, int]]]:
    """(process starts as (time, pid), steps as (time, global_step, pid)) of every rank so far."""
    starts, steps = [], []
    for path in directory.glob("rank*.txt"):
        for line in path.read_text().splitlines():
            fields = line.split()
            if fields[0] == "start" and len(fields) == 3:
                starts.append((float(fields[1]), int(fields[2])))
            elif len(fields) == 3:
                steps.append((float(fields[0]), int(fields[1]), int(fields[2])))
    return starts, steps


def measure(
    fault: str,
    timeout_s: int,
    rng: random.Random,
    work: Path,
    last_call: int = 30,
    keep_alive: int = 5,
    configs: list[str] | None = None,
    nproc_per_node: int = 2,
    fit_args: list[str] | None = None,
    log: Path | None = None,
) -> dict[str, float]:
    """One ``fault`` into the job of ``configs`` (default: :data:`CONFIGS`) under torchrun, ``nproc_per_node``
    workers (``node``: two agents of one worker each), ``fit_args`` appended, the job's output appended to ``log``
    (None: discarded); the seconds of the module docstring."""
    clock = work / "clock"
    clock.mkdir(parents=True)
    extra = work / "clock.yaml"
    callback = {"class_path": "bench.recovery.StepClock", "init_args": {"directory": str(clock)}}
    extra.write_text(yaml.safe_dump({"trainer": {"callbacks+": [callback]}}))
    if fault == "node":  # two agents of one process each, the README's multinode row made elastic
        port = find_free_network_port()
        launch = ["--nnodes", "1:2", "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_id", f"bench{port}",
                  "--rdzv_endpoint", f"127.0.0.1:{port}",
                  "--rdzv_conf", f"last_call_timeout={last_call},keep_alive_interval={keep_alive}"]  # fmt: skip
    else:
        launch = ["--standalone", "--nproc_per_node", str(nproc_per_node)]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch,
           "--max-restarts", "1", "-m", "lit_ddp", "fit", *(a for c in configs or CONFIGS for a in ("--config", c)),
           "--config", str(extra), "--trainer.default_root_dir", str(work / "run"), "--trainer.max_epochs", "-1",
           "--trainer.max_steps", "10000000", "--trainer.strategy.init_args.timeout", f"0:00:{timeout_s:02d}",
           "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
           *(fit_args or [])]  # fmt: skip
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # as the README's command
    agents = []
    output = log.open("a") if log else subprocess.DEVNULL
    for _ in range(2 if fault == "node" else 1):
        agents.append(
            subprocess.Popen(cmd, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        )
        time.sleep(2)  # the first agent hosts the rendezvous store: it is not the node that is lost
    agent = agents[0]
    try:
        while not read_clock(clock)[1]:
            if any(a.poll() is not None for a in agents):
                raise RuntimeError(f"the job ended before training ({agent.returncode}): {' '.join(cmd)}")
            time.sleep(0.05)
        time.sleep(rng.uniform(3.0, 6.0))
        faulted_at = time.time()
        if fault == "node":  # the second agent and its worker at once, as when the machine goes
            lost = workers(agents[1], "torchrun")
            os.killpg(agents[1].pid, signal.SIGKILL)
            for pid in lost:
                os.kill(pid, signal.SIGKILL)
        else:
            os.kill(rng.choice(workers(agent, "torchrun")), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        before = {pid for _, pid in read_clock(clock)[0]}
        deadline = time.monotonic() + timeout_s + 180
        while True:
            starts, steps = read_clock(clock)
            after = [s for s in steps if s[2] not in before]
            if after:
                break
            if time.monotonic() > deadline or agent.poll() is not None:
                raise RuntimeError(f"no step after the {fault} (job status {agent.poll()})")
            time.sleep(0.05)
        restarted = min(t for t, pid in starts if pid not in before)
        first = min(after)
        done = max(step for t, step, pid in steps if pid in before and t <= faulted_at)
        return {
            "recovery": first[0] - faulted_at,
            "to_restart": restarted - faulted_at,
            "start_to_step": first[0] - restarted,
            "repeated": done - (first[1] - 1),
        }
    finally:
        for a in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(a.pid, signal.SIGKILL)
        subprocess.run(["pkill", "-9", "-f", str(work / "run")], check=False)  # workers: sessions of their own
        for a in agents:
            a.wait()
        if log:
            output.close()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)  # fit arguments after `--`
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", nargs="+", choices=["kill", "hang", "node"], default=["kill", "hang", "node"])
    parser.add_argument("--timeout", type=int, default=30, help="the DDP collective timeout, seconds (< 60)")
    parser.add_argument("--last-call", type=int, default=30, help="node: the rendezvous' last_call_timeout, seconds")
    parser.add_argument("--keep-alive", type=int, default=5, help="node: the rendezvous' keep_alive_interval, s")
    parser.add_argument("--seed", type=int, default=None, help="replays the fault moments (printed)")
    parser.add_argument("--configs", nargs="+", default=CONFIGS, help="the job's configs (default: the regression's)")
    parser.add_argument("--nproc_per_node", type=int, default=2, help="torchrun workers (kill, hang)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--log", type=Path, default=None, help="the jobs' output, appended (default: discarded)")
    args = parser.parse_args(argv[:split])
    fit_args = argv[split + 1 :]
    # A time box's SIGTERM (timeout(1)) ends the measurement through its `finally`: the job's process groups go too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(
        f"seed {seed}; {' '.join(args.configs)} under torchrun, {args.nproc_per_node} processes, collective timeout "
        f"{args.timeout} s; node: last_call_timeout {args.last_call} s, keep_alive_interval {args.keep_alive} s",
        flush=True,
    )
    rng = random.Random(seed)
    print(f"{'fault':6s} {'recovery s':>11s} {'fault->restart s':>17s} {'start->step s':>14s} {'steps repeated':>15s}")
    results = {}
    for fault in args.faults:
        with tempfile.TemporaryDirectory() as tmp:
            r = measure(fault, args.timeout, rng, Path(tmp), args.last_call, args.keep_alive, args.configs,
                        args.nproc_per_node, fit_args, args.log)  # fmt: skip
        results[fault] = r
        row = f"{r['recovery']:11.1f} {r['to_restart']:17.1f} {r['start_to_step']:14.1f} {r['repeated']:15.0f}"
        print(f"{fault:6s} {row}", flush=True)
        if args.json:
            args.json.write_text(json.dumps({"seed": seed, "configs": args.configs, "results": results}, indent=2))


if __name__ == "__main__":
    main()
