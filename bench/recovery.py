"""Time to recover from a fault under torchrun: from the fault to the first optimizer step after it (``make
bench-recovery``; docs/fault_tolerance.md, "What a restart costs"; the GPU check's restart part).

Runs the README's fault-tolerant regression step (``torchrun --standalone --nproc_per_node 2 --max-restarts 1``;
``--configs``, ``--nproc_per_node`` and fit arguments after ``--``: another job) and, 3-6 s into training, injects one
fault into a random worker: ``kill`` (SIGKILL), ``node`` (two agents of one worker each on c10d, the second SIGKILLed
with its worker: a lost machine), ``hang`` (SIGSTOP: the other worker waits out the collective ``--timeout``). Printed
per fault, from every worker's step clock: seconds to the restarted group's first step, split at the restarted
workers' start, and the steps repeated.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import launch
from bench.harness.clock import read_clock
from bench.harness.measure import arguments, markdown_table, write_json
from lit_ddp.chaos.job import workers

CONFIGS = [
    "configs/trainer/ddp.yaml",
    "configs/checkpoint/fault_tolerant.yaml",
    "configs/regression/fault_tolerant.yaml",
]
COLUMNS = ["fault", "recovery s", "fault->restart s", "start->step s", "steps repeated"]


def clock_of(clock: Path) -> tuple[list[tuple[float, int]], list[tuple[float, int, int]]]:
    """(process starts as (time, pid), steps as (time, global_step, pid)) of every rank so far."""
    events = read_clock(clock)
    return [(e[2], int(e[1])) for e in events["start"]], [(e[0], int(e[1]), int(e[2])) for e in events["step"]]


def measure(
    fault: str, args: argparse.Namespace, rng: random.Random, work: Path, fit_args: list[str]
) -> dict[str, float]:
    """One ``fault`` into the job of ``args.configs`` under torchrun, ``args.nproc_per_node`` workers (``node``: two
    agents of one worker each), ``fit_args`` appended, the job's output appended to ``args.log`` (None: discarded);
    the seconds of the module docstring."""
    timeout_s, log, clock = args.timeout, args.log, work / "clock"
    if fault == "node":  # two agents of one process each, the README's multinode row made elastic
        port = launch.free_port()
        conf = f"last_call_timeout={args.last_call},keep_alive_interval={args.keep_alive}"
        torchrun = ["--nnodes", "1:2", "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_id", f"bench{port}",
                    "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_conf", conf]  # fmt: skip
    else:
        torchrun = ["--standalone", "--nproc_per_node", str(args.nproc_per_node)]
    fit = ["--trainer.max_epochs", "-1", "--trainer.max_steps", "10000000",
           "--trainer.strategy.init_args.timeout", f"0:00:{timeout_s:02d}", *launch.QUIET, *fit_args,
           *launch.clock_args(clock, every_rank=True)]  # fmt: skip
    cmd = launch.fit_command(*args.configs, root=work / "run", torchrun=[*torchrun, "--max-restarts", "1"], args=fit)
    env = launch.bench_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # as the README's command
    launch.become_subreaper()
    agents = []
    output = log.open("a") if log else subprocess.DEVNULL
    for _ in range(2 if fault == "node" else 1):
        agents.append(subprocess.Popen(cmd, cwd=launch.REPO, env=env, stdout=output, stderr=subprocess.STDOUT,
                                       start_new_session=True))  # fmt: skip
        time.sleep(2)  # the first agent hosts the rendezvous store: it is not the node that is lost
    agent = agents[0]
    try:
        while not clock_of(clock)[1]:
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
        before = {pid for _, pid in clock_of(clock)[0]}
        deadline = time.monotonic() + timeout_s + 180
        while True:
            starts, steps = clock_of(clock)
            after = [s for s in steps if s[2] not in before]
            if after:
                break
            if time.monotonic() > deadline or agent.poll() is not None:
                raise RuntimeError(f"no step after the {fault} (job status {agent.poll()})")
            time.sleep(0.05)
        restarted = min(t for t, pid in starts if pid not in before)
        first = min(after)
        done = max(step for t, step, pid in steps if pid in before and t <= faulted_at)
        return {"recovery": first[0] - faulted_at, "to_restart": restarted - faulted_at,
                "start_to_step": first[0] - restarted, "repeated": done - (first[1] - 1)}  # fmt: skip
    finally:
        for a in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(a.pid, signal.SIGKILL)
        for a in agents:
            a.wait()
        launch.end_leftovers()  # the workers: sessions of their own, orphaned to this subreaper
        if log:
            output.close()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)  # fit arguments after `--`
    parser = arguments(__doc__)
    parser.add_argument("--faults", nargs="+", choices=["kill", "hang", "node"], default=["kill", "hang", "node"])
    parser.add_argument("--timeout", type=int, default=30, help="the DDP collective timeout, seconds (< 60)")
    parser.add_argument("--last-call", type=int, default=30, help="node: the rendezvous' last_call_timeout, seconds")
    parser.add_argument("--keep-alive", type=int, default=5, help="node: the rendezvous' keep_alive_interval, s")
    parser.add_argument("--seed", type=int, default=None, help="replays the fault moments (printed)")
    parser.add_argument("--configs", nargs="+", default=CONFIGS, help="the job's configs (default: the regression's)")
    parser.add_argument("--nproc_per_node", type=int, default=2, help="torchrun workers (kill, hang)")
    parser.add_argument("--log", type=Path, default=None, help="the jobs' output, appended (default: discarded)")
    args = parser.parse_args(argv[:split])
    fit_args = argv[split + 1 :]
    # A time box's SIGTERM (timeout(1)) ends the measurement through its `finally`: the job's process groups go too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"seed {seed}; {' '.join(args.configs)} under torchrun, {args.nproc_per_node} processes, collective timeout "
          f"{args.timeout} s; node: last_call_timeout {args.last_call} s, keep_alive_interval {args.keep_alive} s",
          flush=True)  # fmt: skip
    rng = random.Random(seed)
    print(markdown_table(COLUMNS, []), flush=True)
    results = {}
    for fault in args.faults:
        with tempfile.TemporaryDirectory() as tmp:
            r = measure(fault, args, rng, Path(tmp), fit_args)
        results[fault] = r
        row = [fault, *(f"{r[k]:.1f}" for k in ("recovery", "to_restart", "start_to_step")), f"{r['repeated']:.0f}"]
        print(markdown_table(COLUMNS, [row]).splitlines()[-1], flush=True)
        write_json(args.json, {"seed": seed, "configs": args.configs, "results": results})


if __name__ == "__main__":
    main()
