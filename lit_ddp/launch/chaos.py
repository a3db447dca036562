"""``lit-ddp chaos``: does *your* run survive faults exactly? Trains it once uninterrupted and once under faults
injected from outside, then compares the two final checkpoints bit for bit.

    lit-ddp chaos [--launcher single|torchrun] [--nproc_per_node N] [--faults K] [--kinds kill term hang]
                  [--seed S] [--root DIR] [--reference DIR] -- <the arguments of lit-ddp fit>

- ``single``: ``lit-ddp fit ARGS`` in one process; after each fault the tool runs the same command again, as
  a user or a Slurm requeue would. ``torchrun``: ``torchrun --standalone --nproc_per_node N --max-restarts K``
  (with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), which restarts the workers itself; a ``term`` fault ends the
  job (torchrun passes SIGTERM on) and the tool relaunches it.
- Fault kinds: ``kill`` (SIGKILL of one worker, a crash), ``term`` (SIGTERM, a preemption: the run saves at a
  step boundary and exits 143), ``hang`` (SIGSTOP of one worker, torchrun only: the others fail at the
  collective timeout, which the tool sets to 20 s). Each fault comes at a wall-clock moment drawn from
  ``--seed`` (printed: the same seed replays the same schedule), only once the run directory holds a
  checkpoint, and the next one only after the job came back (a new process reached a new checkpoint).
- The comparison: ``global_step``, the weights, the optimizer and learning-rate scheduler states of the two
  ``last.ckpt``, every tensor bit for bit. Printed: one line per fault (kind, target, seconds into the run,
  the newest checkpoint's step before it), then the verdict and the first differing entry.

Exit status: 0 identical, 1 different or the faulted job failed, 2 bad use (one ``lit-ddp: error:`` line).
Not yet here (issue 23): the Slurm launcher, several torchrun agents, faults timed to a checkpoint write or a
validation, TensorBoard scalars. No library does this (torchft's injector checks convergence only), hence our
code.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lit_ddp.launch.errors import UsageError

KINDS = ("kill", "term", "hang")
HANG_TIMEOUT = "0:00:20"  # the collective timeout a hang test runs under: a frozen worker costs this plus 30 s
CKPT_STEP = re.compile(r"step=(\d+)")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Splits ``argv`` at ``--`` into the tool's options and the fit arguments.

    Raises:
        UsageError: no ``--`` or nothing after it, ``--faults`` below 1, ``hang`` with ``--launcher single``.
    """
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise UsageError(
            "lit-ddp chaos needs the run's fit arguments after `--`, e.g. `lit-ddp chaos --faults 2 -- --config "
            "configs/regression/single_device.yaml --config configs/checkpoint/fault_tolerant.yaml`"
        )
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="lit-ddp chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--launcher", choices=("single", "torchrun"), default="single")
    parser.add_argument("--nproc_per_node", type=int, default=2, help="torchrun: processes")
    parser.add_argument("--faults", type=int, default=2, help="faults to inject (>= 1)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=["kill", "term"])
    parser.add_argument("--seed", type=int, default=None, help="replays a fault schedule (printed)")
    parser.add_argument("--root", type=Path, default=None, help="run directories (default runs/chaos/<seed>)")
    parser.add_argument("--reference", type=Path, default=None, help="a finished uninterrupted run to reuse")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds each job may take")
    args = parser.parse_args(argv[:split])
    if args.faults < 1:
        raise UsageError(f"--faults {args.faults}: give at least 1 (faults to inject into the run)")
    if "hang" in args.kinds and args.launcher == "single":
        raise UsageError("--kinds hang needs --launcher torchrun: one process has no peer to wait for it")
    if args.seed is None:
        args.seed = random.randrange(2**31)
    if args.root is None:
        args.root = Path("runs") / "chaos" / str(args.seed)
    if (args.root / "faulted").exists():
        raise UsageError(f"{args.root / 'faulted'} exists (an earlier chaos run): remove it, or give another --root")
    return args, argv[split + 1 :]


def command(args: argparse.Namespace, fit: list[str], root: Path, faulted: bool) -> tuple[list[str], dict]:
    """The launch command of one run and its environment."""
    extra = ["--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar", "false"]
    if faulted and "hang" in args.kinds:
        extra += ["--trainer.strategy.init_args.timeout", HANG_TIMEOUT]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.launcher == "single":
        return [sys.executable, "-m", "lit_ddp", "fit", *fit, *extra], env
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # a fresh store per restart round (pytorch#135712)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                str(args.nproc_per_node), "--max-restarts", str(args.faults), "--monitor-interval", "0.2"]  # fmt: skip
    return [*launcher, "-m", "lit_ddp", "fit", *fit, *extra], env


def checkpoint_steps(root: Path) -> list[int]:
    """The steps of the run directory's step-named checkpoints (``...step=N...ckpt``)."""
    steps = []
    for path in (root / "checkpoints").glob("*.ckpt"):
        if (match := CKPT_STEP.search(path.name)) is not None:
            steps.append(int(match.group(1)))
    return sorted(steps)


def workers(proc: subprocess.Popen, launcher: str) -> list[int]:
    """The training processes: the process itself (single) or torchrun's children."""
    if launcher == "single":
        return [proc.pid] if proc.poll() is None else []
    out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def run_faulted(args: argparse.Namespace, fit: list[str], root: Path, rng: random.Random, span: float) -> list[dict]:
    """Runs the job under ``args.faults`` faults; returns one record per fault.

    Raises:
        RuntimeError: the job failed, or did not come back within ``args.timeout`` seconds.
    """
    cmd, env = command(args, fit, root, faulted=True)
    start = time.monotonic()
    deadline = start + args.timeout
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    faults: list[dict] = []
    relaunches = args.faults  # a `kill` under single, a `term`: the tool starts the job again, as a requeue does

    def relaunch(status: int) -> subprocess.Popen:
        nonlocal relaunches
        relaunches -= 1
        if relaunches < 0:
            raise RuntimeError(f"the faulted job failed with status {status}")
        return subprocess.Popen(cmd, env=env, start_new_session=True)

    try:
        for number in range(args.faults):
            seen = checkpoint_steps(root)
            while not seen or (faults and seen[-1] <= faults[-1]["step"]):  # a checkpoint since the last fault
                if proc.poll() is not None:
                    if proc.returncode == 0:
                        raise RuntimeError(f"the run finished before fault {number + 1}: give it more steps")
                    proc = relaunch(proc.returncode)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no new checkpoint within --timeout {args.timeout:.0f} s")
                time.sleep(0.1)
                seen = checkpoint_steps(root)
            time.sleep(rng.uniform(0.0, span / (args.faults + 1)))  # all K within the training, on average
            kind, targets = rng.choice(args.kinds), workers(proc, args.launcher)
            if not targets:
                continue  # it ended meanwhile: the loop above relaunches or reports
            target = targets[rng.randrange(len(targets))]
            os.kill(target, {"kill": signal.SIGKILL, "term": signal.SIGTERM, "hang": signal.SIGSTOP}[kind])
            if kind == "term" and args.launcher == "torchrun":
                os.kill(proc.pid, signal.SIGTERM)  # the agent: a preemption of the whole job
            faults.append({"kind": kind, "target": target, "t": time.monotonic() - start, "step": seen[-1]})
        while proc.wait(timeout=max(1.0, deadline - time.monotonic())) != 0:
            proc = relaunch(proc.returncode)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the faulted job did not finish within --timeout {args.timeout:.0f} s") from None
    finally:  # on a failure: torchrun's workers run in sessions of their own, a frozen one included
        for pid in [*workers(proc, args.launcher), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return faults


def first_difference(a: Any, b: Any, where: str = "") -> str | None:
    """The path of the first entry where two checkpoint trees differ (tensors bit for bit), or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
        return None if same and torch.equal(a, b) else where
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                return f"{where}/{key}"
            if (found := first_difference(a[key], b[key], f"{where}/{key}")) is not None:
                return found
        return None
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if (found := first_difference(x, y, f"{where}[{i}]")) is not None:
                return found
        return None
    return None if a == b else where


def compare(reference: Path, faulted: Path) -> str | None:
    """The first differing entry of the two runs' ``last.ckpt``: global_step, weights, optimizer, schedulers."""
    a, b = (
        torch.load(r / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
        for r in (reference, faulted)
    )
    for key in ("global_step", "state_dict", "optimizer_states", "lr_schedulers"):
        if (found := first_difference(a.get(key), b.get(key), key)) is not None:
            return found
    return None


def run_reference(cmd: list[str], env: dict, root: Path, timeout: float) -> float | None:
    """Runs the uninterrupted job; returns the seconds from its first step checkpoint to its end (the part of
    a run that faults may hit), or None when it failed."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    start, first = time.monotonic(), None
    try:
        while proc.poll() is None:
            if first is None and checkpoint_steps(root):
                first = time.monotonic()
            if time.monotonic() - start > timeout:
                return None
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return None if proc.returncode != 0 else time.monotonic() - (first or start)


def chaos_main(argv: list[str]) -> int:
    """``lit-ddp chaos``: see the module docstring. Returns the exit status."""
    try:
        args, fit = parse(argv)
    except UsageError as e:
        print(f"lit-ddp: error: {e}", file=sys.stderr)
        return UsageError.exit_code
    print(f"lit-ddp chaos: seed {args.seed} (--seed {args.seed} replays it); run directories under {args.root}")
    rng = random.Random(args.seed)
    reference = args.reference or args.root / "reference"
    # seconds of training between the first checkpoint and the end (a guess when the reference is given)
    span: float | None = 30.0
    if args.reference is None:
        span = run_reference(*command(args, fit, reference, faulted=False), reference, args.timeout)
        if span is None:
            print("lit-ddp chaos: the uninterrupted run failed", file=sys.stderr)
            return 1
    if not (reference / "checkpoints" / "last.ckpt").is_file():
        print(f"lit-ddp: error: {reference} holds no checkpoints/last.ckpt", file=sys.stderr)
        return UsageError.exit_code
    try:
        faults = run_faulted(args, fit, args.root / "faulted", rng, span or 30.0)
    except RuntimeError as e:
        print(f"lit-ddp chaos: {e}", file=sys.stderr)
        return 1
    print(f"{'fault':>5s}  {'kind':5s} {'target pid':>10s} {'at s':>7s} {'newest checkpoint before':>25s}")
    for i, f in enumerate(faults, 1):
        print(f"{i:5d}  {f['kind']:5s} {f['target']:10d} {f['t']:7.1f} {'step ' + str(f['step']):>25s}")
    difference = compare(reference, args.root / "faulted")
    if difference is None:
        print(f"identical: the faulted run ends bit for bit where the uninterrupted one does ({len(faults)} faults)")
        return 0
    print(f"DIFFERENT: first at {difference}")
    return 1
