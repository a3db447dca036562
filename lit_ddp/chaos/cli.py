"""``lit-ddp chaos``: does *your* run survive faults exactly? Trains it once uninterrupted and once under faults
injected from outside, then compares the two final checkpoints bit for bit.

    lit-ddp chaos [--launcher single|torchrun|slurm|torchft] [--nproc_per_node N] [--nnodes N] [--faults K]
                  [--replica_groups R] [--heartbeat_timeout_ms MS]
                  [--kinds kill term hang node save validation usr1] [--seed S] [--root DIR] [--reference DIR]
                  [--rtol R | --calibrated K] -- [fit] <the arguments of lit-ddp fit>

- ``single``: ``lit-ddp fit ARGS`` in one process; after each fault the tool runs the same command again, as
  a user or a Slurm requeue would. ``torchrun``: ``torchrun --standalone --nproc_per_node N --max-restarts K``
  (with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), which restarts the workers itself; a fault that ends the
  job (``term``, ``node``) has the tool relaunch it. With ``--nnodes M``, M agents on this machine meet in a
  c10d rendezvous whose store the tool holds (as a head node would); a ``node`` fault SIGKILLs one agent with
  its workers, the others restart their workers and wait, and the tool starts a replacement agent.
  ``slurm``: ``sbatch --nodes N --ntasks-per-node P
  slurm/train.sbatch CONFIG ARGS`` (CONFIG: the first ``--config`` of ARGS) on the cluster ``sbatch`` reaches;
  a job that ends failed is submitted again, as an operator would. ``--sbatch slurm/train_elastic.sbatch``: one
  torchrun agent per node with P workers (``NPROC_PER_NODE``), which restarts them (``MAX_RESTARTS``).
  ``torchft``: ``python -m lit_ddp.ft.launch --replica_groups R --nproc_per_group N --root DIR --max_restarts K --
  fit ARGS``, R replica groups of N processes (default 1; N > 1: a torchrun job each) that train on while one is
  lost, the launcher restarting it
  (:mod:`lit_ddp.chaos.replica_groups`: its faults, its table, its comparison).
- Fault kinds (each chosen kind once before any comes again): ``kill`` (SIGKILL of one worker, a crash),
  ``term`` (SIGTERM of the job, a preemption or ``scancel``: the run saves at a step boundary and exits 143; not
  under torchft, which takes ``kill``, one group's worker (its torchrun's of the highest rank), ``node``, the
  whole group: its process, or its torchrun and workers, ``hang``, ``heal`` and ``lighthouse``),
  ``hang`` (SIGSTOP of one worker: under torchrun the others fail at the collective timeout, which the tool
  sets to 20 s; under torchft the group's, which the launcher ends once its step has stood ``--stall_timeout_s``
  while the others commit, SIGCONT 10 s after that if it still lives), ``lighthouse`` and ``heal`` (torchft only:
  SIGKILL of the lighthouse, which the launcher starts again at its address; SIGKILL of a group, then again of its
  restart in its first step, as it heals), ``node`` (SIGKILL of the torchrun agent and all its workers at once, a lost machine; under
  Slurm of the job's tasks on one node, from an overlapping ``srun`` step),
  ``save`` (SIGKILL of the process writing a checkpoint, the moment its temporary file appears),
  ``validation`` (SIGKILL of one worker, under Slurm of one node's tasks, while a validation runs:
  :class:`~lit_ddp.chaos.phase_probe.PhaseProbe` tells when), ``usr1``
  (``scancel --signal=USR1``, Slurm only: the time limit's warning, save and requeue). The schedule (each
  fault's kind, target rank and delay, a fraction of the checkpoint interval) is drawn from ``--seed`` before the
  run (printed: the same seed replays the same schedule); a fault comes only once the run directory holds a step
  checkpoint, the next one only after the job came back (it resumed, as the run's records of resumes say, and saved
  a step checkpoint since), each at the step ``delay x interval`` past the newest checkpoint (the run's
  ``PhaseProbe``, which the tool adds to both runs, tells the step), at whatever point within the step the
  processes are when the tool sees it.
- The comparison: ``global_step``, the weights, the optimizer and learning-rate scheduler states of the two
  ``last.ckpt``, every tensor bit for bit (``--rtol`` for runs that cannot be exact), then the TensorBoard
  scalars (the last value logged at each step; timing scalars such as tokens/s, MFU, time left out). Printed: one line
  per fault (kind, target, seconds into the run, the step it hit, the newest checkpoint's step before it, the
  step the job resumed from, the steps trained again, the seconds until the job had trained the fault's step
  again), the seconds the faults cost in all, the restore check's verdict (at how many of the resumes it passed;
  a resume it stopped fails the job, and its line is printed), then the verdict and the first differing entry.
- ``--calibrated K``, for runs whose kernels are not deterministic (GPUs without
  ``configs/checkpoint/exact.yaml``): a second uninterrupted run measures how far two runs drift apart, and the
  faulted run must stay within K times that: its parameters at every logged step (a fixed sample of them), its
  training loss over the logged steps and its final parameters (:mod:`lit_ddp.chaos.calibrated`); the report gives
  the spread and both distances at the first logged step after each resume.

- ``--launcher torchft`` (R >= 2 groups; ``--heartbeat_timeout_ms``, the lighthouse's: what a lost group costs the
  others): no resume, no redone steps; each fault hits a group other than ``group_0`` (the witness), or the
  lighthouse, ``delay x S / 2K`` steps after the groups last stepped together (S: the uninterrupted run's steps). The
  table gives per fault the survivors' restarts (goal: none; every group's for a lighthouse fault), their longest
  pause, their steps while the group was down and the seconds until it was back at their step; then the launcher's
  own check (it exits 1 where the groups did not end with one model), the groups' ``last.ckpt`` against each other
  bit for bit, and ``group_0`` against
  two uninterrupted R-group runs, the second with the next seed (``--seed_everything``), by ``--calibrated``
  (default 3; ``--rtol`` refused) at the steps all three logged. Two runs of one seed differ only by the steps
  before the later group joined (often none), far less than the shares a lost group did not train: the yardstick
  is a rerun with another seed.

Exit status: 0 identical (torchft: no survivor restarted, the groups identical, within K x the spread),
1 different or the faulted job failed, 2 bad use (one ``lit-ddp: error:`` line).
torchft's fault injector, the nearest library, checks convergence only, not a resume against a rerun.
"""

from __future__ import annotations

import random
import shutil
import sys
import time
from pathlib import Path

import yaml
from jsonargparse import ArgumentParser, Namespace

from lit_ddp.chaos.calibrated import verdict
from lit_ddp.chaos.compare import compare
from lit_ddp.chaos.job import ELASTIC_SCRIPT, SBATCH_SCRIPT, Fault, Job
from lit_ddp.chaos.replica_groups import WITNESS, group_dirs, groups_difference, print_group_faults, run_faulted_groups
from lit_ddp.errors import UsageError
from lit_ddp.run_dir import events, layout, sharded

KINDS = ("kill", "term", "hang", "node", "save", "validation", "usr1", "lighthouse", "heal")
# What each launcher can inject: a Slurm job's processes run on other machines, reached through scancel only.
LAUNCHER_KINDS = {
    "single": ("kill", "term", "save", "validation"),
    "torchrun": ("kill", "term", "hang", "node", "save", "validation"),
    "slurm": ("kill", "node", "term", "validation", "usr1"),
    # a replica group's worker, or the whole group, frozen, killed again while it heals; or the lighthouse
    "torchft": ("kill", "node", "hang", "heal", "lighthouse"),
}
# slurm/train_elastic.sbatch: a torchrun agent per node restarts its workers; it has no SIGUSR1 handler (a USR1 would
# end the agent), and a frozen worker is torchrun's to end.
ELASTIC_KINDS = ("kill", "hang", "node", "term", "validation")


def plan(seed: int, faults: int, kinds: list[str]) -> list[Fault]:
    """The fault schedule of ``seed``: the same seed, the same kinds, delays and targets. The kinds come in an
    order drawn from the seed, each once before any comes again: K faults of K kinds inject every one."""
    rng = random.Random(seed)
    order = rng.sample(list(dict.fromkeys(kinds)), len(set(kinds)))
    return [Fault(order[i % len(order)], rng.random(), rng.random()) for i in range(faults)]


def chaos_parser() -> ArgumentParser:
    """The arguments of ``lit-ddp chaos``, a subcommand of the ``lit-ddp`` parser (:class:`lit_ddp.cli.LitDDPCLI`):
    the tool's options, then ``--`` and the arguments of ``lit-ddp fit``."""
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launcher", choices=tuple(LAUNCHER_KINDS), default="single")
    parser.add_argument(
        "--nproc_per_node", type=int | None, default=None,
        help="torchrun: processes (default 2); slurm: tasks per node (2); torchft: processes per group (1)",
    )  # fmt: skip
    parser.add_argument("--nodes", "--nnodes", type=int, default=1, help="slurm: nodes; torchrun: agents here")
    parser.add_argument("--replica_groups", type=int, default=2, help="torchft: replica groups (>= 2)")
    parser.add_argument(
        "--heartbeat_timeout_ms", type=int | None, default=None,
        help="torchft: the lighthouse's (default the launcher's, 5000): a group silent this long is out of the quorum",
    )  # fmt: skip
    parser.add_argument(
        "--stall_timeout_s", type=float | None, default=None,
        help="torchft: the launcher's (a group whose step stands this long while another commits is ended; "
        "default the launcher's, 90); a hang lasts this plus 10 s",
    )  # fmt: skip
    parser.add_argument(
        "--max-restarts", type=int | None, default=None, help="torchrun's; torchft: each group's (default: --faults)"
    )
    parser.add_argument(
        "--sbatch", type=Path, default=SBATCH_SCRIPT, help=f"slurm: the script (default {SBATCH_SCRIPT})"
    )
    parser.add_argument("--faults", type=int, default=2, help="faults to inject (>= 1)")
    parser.add_argument(
        "--kinds", nargs="+", choices=KINDS, default=None, help="default: kill term (slurm: usr1 node; torchft: kill)"
    )
    parser.add_argument("--seed", type=int | None, default=None, help="replays a fault schedule (printed)")
    parser.add_argument("--root", type=Path | None, default=None, help="run directories (default runs/chaos/<seed>)")
    parser.add_argument("--reference", type=Path | None, default=None, help="a finished uninterrupted run to reuse")
    parser.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (0: bit for bit)")
    parser.add_argument(
        "--calibrated", type=float | None, default=None, metavar="K",
        help="runs with nondeterministic kernels: a second uninterrupted run measures the spread, the faulted run "
        "must stay within K x it at every logged step (3 is the usual choice: a rerun falls outside it about 1 time in 500; "
        "torchft's default)",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=1800, help="seconds each job may take")
    parser.add_argument("fit", nargs="*", default=[], help="after `--`: the arguments of lit-ddp fit")
    return parser


def torchft_heal(args: Namespace) -> bool:
    """Whether a torchft run takes ``heal`` faults (each restarts its group twice)."""
    return args.launcher == "torchft" and "heal" in (args.kinds or [])


def check(args: Namespace) -> tuple[Namespace, list[str]]:
    """The parsed ``lit-ddp chaos`` arguments with their defaults filled in, and the fit arguments.

    Raises:
        UsageError: no fit arguments, ``--faults`` below 1, a kind the launcher cannot inject, ``--launcher slurm``
            without ``sbatch`` or without a ``--config`` first, a negative ``--rtol``, a ``--calibrated`` factor
            that is not positive or comes with ``--rtol``, a ``--root`` that holds an earlier faulted run.
    """
    fit = list(args.fit)
    fit = fit[1:] if fit[:1] == ["--"] else fit  # Python versions differ in whether argparse keeps the `--`
    fit = fit[1:] if fit[:1] == ["fit"] else fit  # `-- fit --config ...`, as python -m lit_ddp.ft.launch takes it
    if not fit:
        raise UsageError(
            "lit-ddp chaos needs the run's fit arguments after `--`, e.g. `lit-ddp chaos --faults 2 -- --config "
            "configs/regression/single_device.yaml --config configs/checkpoint/fault_tolerant.yaml`"
        )
    if args.faults < 1:
        raise UsageError(f"--faults {args.faults}: give at least 1 (faults to inject into the run)")
    if args.nodes < 1 or (args.nodes > 1 and args.launcher in ("single", "torchft")):
        raise UsageError(
            f"--nodes {args.nodes}: give 1 for --launcher single and torchft, at least 1 for torchrun and slurm"
        )
    if args.nproc_per_node is None:
        args.nproc_per_node = 1 if args.launcher == "torchft" else 2
    if args.nproc_per_node < 1:
        raise UsageError(f"--nproc_per_node {args.nproc_per_node}: give at least 1")
    if args.launcher == "torchft":
        if args.replica_groups < 2:
            raise UsageError(
                f"--replica_groups {args.replica_groups}: give at least 2 (a fault needs a group that survives it)"
            )
        if args.rtol:  # its trajectory differs by the shares the lost group did not train
            raise UsageError("--launcher torchft compares by --calibrated K (default 3), not --rtol")
        if args.calibrated is None:
            args.calibrated = 3.0
    if args.max_restarts is None:
        args.max_restarts = args.faults * (2 if torchft_heal(args) else 1)
    args.elastic = args.launcher == "slurm" and args.sbatch.name == ELASTIC_SCRIPT.name
    possible = ELASTIC_KINDS if args.elastic else LAUNCHER_KINDS[args.launcher]
    if args.kinds is None:
        args.kinds = {"slurm": ["usr1", "node"], "torchft": ["kill"]}.get(args.launcher, ["kill", "term"])
    torchft = args.launcher == "torchft"
    if wrong := [k for k in args.kinds if k not in possible]:
        raise UsageError(
            f"--kinds {' '.join(wrong)}: --launcher {args.launcher}{' with ' + str(args.sbatch) if args.elastic else ''} "
            f"injects {', '.join(possible)}"
            + (" (one process has no peer to wait for a frozen one)" if "hang" in wrong and not torchft else "")
            + (
                " (a group's worker killed or frozen, the whole group, a group killed again as it heals, the lighthouse)"
                if torchft
                else ""
            )
        )
    if args.launcher == "slurm":
        if shutil.which("sbatch") is None:
            raise UsageError("--launcher slurm needs Slurm's sbatch on PATH (none here): run it where you submit jobs")
        if not args.sbatch.is_file():
            raise UsageError(f"--sbatch {args.sbatch}: no such script (run lit-ddp chaos from the repository root)")
        if fit[0] != "--config" or len(fit) < 2:
            raise UsageError("--launcher slurm: the fit arguments start with the step config, `-- --config CONFIG ...`")
    if args.rtol < 0:
        raise UsageError(f"--rtol {args.rtol}: give 0 (bit for bit) or a positive relative tolerance")
    if args.calibrated is not None and (args.calibrated <= 0 or args.rtol):
        raise UsageError(
            f"--calibrated {args.calibrated}: give a factor > 0 (3: three times the spread of two uninterrupted runs), "
            "without --rtol"
        )
    if args.seed is None:
        args.seed = random.randrange(2**31)
    if args.root is None:
        args.root = Path("runs") / "chaos" / str(args.seed)
    if (args.root / "faulted").exists():
        raise UsageError(f"{args.root / 'faulted'} exists (an earlier chaos run): remove it, or give another --root")
    return args, fit


def checkpoint_steps(root: Path) -> list[int]:
    """The steps of the run directory's step-named checkpoints (``...step=N...ckpt``)."""
    steps = []
    for path in Path(layout.checkpoint_dir(str(root))).glob("*"):
        if layout.is_checkpoint_name(path.name) and (match := layout.STEP_IN_NAME.search(path.name)) is not None:
            steps.append(int(match.group(1)))
    return sorted(steps)


def resumed_steps(root: Path) -> list[int]:
    """The global step of each resume of the run in ``root``, in order (its records: :mod:`lit_ddp.run_dir.events`)."""
    return [int(e["global_step"]) for e in events.read(root, events.RESUMED) if isinstance(e.get("global_step"), int)]


def run_reference(job: Job, timeout: float) -> tuple[float, float] | None:
    """Runs the uninterrupted job; returns its seconds in all and from its first step checkpoint to its end (the
    part of a run that faults may hit), or None when it failed."""
    job.start()
    start, first = time.monotonic(), None
    try:
        while (status := job.poll()) is None:
            if first is None and checkpoint_steps(job.root):
                first = time.monotonic()
            if time.monotonic() - start > timeout:
                return None
            time.sleep(0.1)
    finally:
        job.stop()
    end = time.monotonic()
    return None if status != 0 else (end - start, end - (first or end))


def checkpoint_interval(run: Path) -> int:
    """Optimizer steps between the step checkpoints of a finished run: the median gap between those it kept (a
    save moved past a validation makes one gap a step longer and the next a step shorter), or the step of its
    only one."""
    steps = checkpoint_steps(run)
    gaps = sorted(b - a for a, b in zip(steps, steps[1:], strict=False) if b > a)
    return gaps[len(gaps) // 2] if gaps else max(steps[0], 1)


def run_faulted(job: Job, schedule: list[Fault], every: int, span: float, timeout: float) -> tuple[list[dict], float]:
    """Runs the job under the ``schedule``; returns one record per fault and the job's seconds in all.

    Each fault comes once the job has trained ``delay x every`` steps past its newest step checkpoint (``every``:
    the steps between checkpoints; a job already past that step gets the same offset in a later interval), at the
    wall-clock moment the tool sees it there, wherever the processes are within the step. A record holds the step
    the fault hit and, once the restarted job has trained that step again, the seconds that took.

    Raises:
        RuntimeError: the job failed more often than the faults explain, or did not come back within
            ``timeout`` seconds.
    """
    start = time.monotonic()
    deadline = start + timeout
    job.start()
    faults: list[dict] = []
    relaunches = len(schedule)  # a fault that ends the job: the tool starts it again, as a requeue does

    def relaunch(status: int) -> None:
        nonlocal relaunches
        relaunches -= 1
        if relaunches < 0:
            raise RuntimeError(f"the faulted job failed with status {status}; its output: {job.log}")
        job.start()

    def regained() -> None:
        """Notes when a process other than the one a fault hit has trained the fault's step again."""
        if (now := job.progress()) is not None:
            for f in faults:
                if f["lost"] is None and now[2] != f["pid"] and now[1] >= f["at"]:
                    f["lost"] = time.monotonic() - start - f["t"]

    def back() -> bool:
        """Whether the job came back from every fault so far: it resumed once per fault (its records of resumes)
        and saved a step checkpoint after the last resume."""
        regained()
        seen = checkpoint_steps(job.root)
        if not seen or job.poll() is not None:
            return False
        if not faults:
            return True
        resumed = resumed_steps(job.root)
        return len(resumed) >= len(faults) and seen[-1] > resumed[len(faults) - 1]

    try:
        for number, fault in enumerate(schedule, 1):
            while True:
                while not back():
                    if (status := job.poll()) is not None:
                        if status == 0:
                            raise RuntimeError(f"the run finished before fault {number}: give it more steps")
                        relaunch(status)
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"no new checkpoint within --timeout {timeout:.0f} s")
                    time.sleep(0.1)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"fault {number} found no moment within --timeout {timeout:.0f} s")
                at = checkpoint_steps(job.root)[-1] + max(1, round(fault.delay * every))
                if (now := job.progress()) is not None and now[1] >= at:
                    at += ((now[1] - at) // every + 1) * every
                if (seen := job.wait_for_step(at, min(deadline, time.monotonic() + span))) is None:
                    continue  # it ended, or is slow to get there: again once it is back
                before = checkpoint_steps(job.root)
                target = job.inject(fault, min(deadline, time.monotonic() + span))
                if target is not None:  # injected: it counts once, whatever the job says after it
                    hit = job.progress() or seen
                    break
                # else it ended meanwhile (or a `save` saw no write in time): again once it is back
            t = time.monotonic() - start
            faults.append({"kind": fault.kind, "target": target, "t": t, "step": before[-1], "at": hit[1],
                           "pid": hit[2], "lost": None})  # fmt: skip
        while (status := job.poll()) != 0:
            regained()
            if status is not None:
                relaunch(status)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the faulted job did not finish within --timeout {timeout:.0f} s")
            time.sleep(0.1)
    finally:  # on a failure, and the frozen worker of a hang that torchrun gave up on
        job.stop()
    return faults, time.monotonic() - start


def print_faults(faults: list[dict], resumed: list[int]) -> None:
    """The table: per fault its kind, target, seconds into the job, the step it hit, the newest checkpoint's step
    before it, the step the job resumed from, the steps trained again and the seconds until the job had trained
    the fault's step again ("-": it did not, e.g. a preemption that saved past it)."""
    print(f"{'fault':>5s}  {'kind':10s} {'target':>22s} {'at s':>7s} {'at step':>8s} {'checkpoint':>10s} "
          f"{'resumed from':>12s} {'redone':>6s} {'lost s':>7s}")  # fmt: skip
    for i, f in enumerate(faults):
        back = resumed[i] if i < len(resumed) else None
        redone = "-" if back is None else str(max(0, f["at"] - back))
        lost = "-" if f["lost"] is None else f"{f['lost']:.1f}"
        print(
            f"{i + 1:5d}  {f['kind']:10s} {f['target']:>22s} {f['t']:7.1f} {f['at']:8d} {f['step']:10d} "
            f"{'-' if back is None else str(back):>12s} {redone:>6s} {lost:>7s}"
        )


def chaos_main(config: Namespace) -> int:
    """``lit-ddp chaos`` with its parsed arguments (:func:`chaos_parser`): see the module docstring. Returns the exit
    status.

    Raises:
        UsageError: see :func:`check`.
    """
    args, fit = check(config)
    schedule = plan(args.seed, args.faults, args.kinds)
    print(f"lit-ddp chaos: seed {args.seed} (--seed {args.seed} replays it); run directories under {args.root}")
    print("schedule: " + ", ".join(f"{f.kind} (delay {f.delay:.2f}, target {f.target:.2f})" for f in schedule))
    reference = args.reference or args.root / "reference"
    took: tuple[float, float] | None = None
    if args.reference is None:
        ref_job = Job(args, fit, reference, faulted=False)
        took = run_reference(ref_job, args.timeout)
        if took is None:
            print(f"lit-ddp chaos: the uninterrupted run failed; its output: {ref_job.log}", file=sys.stderr)
            return 1
    if args.launcher == "torchft":
        return torchft_main(args, fit, schedule, reference, took)
    if not Path(layout.last_checkpoint(str(reference))).exists():  # a file, or a sharded directory
        print(f"lit-ddp: error: {reference} holds no {layout.CHECKPOINTS}/{layout.LAST}", file=sys.stderr)
        return UsageError.exit_code
    if not checkpoint_steps(reference):
        print(
            f"lit-ddp: error: the run writes no step checkpoint ({layout.checkpoint_dir(str(reference))}/*step=N*.ckpt) "
            "before its end, so no fault could come: add --config configs/checkpoint/fault_tolerant.yaml or "
            "--checkpoint.every_n_train_steps N",
            file=sys.stderr,
        )
        return UsageError.exit_code
    if args.calibrated is not None:  # the spread of two uninterrupted runs
        second = Job(args, fit, args.root / "reference2", faulted=False)
        if run_reference(second, args.timeout) is None:
            print(f"lit-ddp chaos: the second uninterrupted run failed; its output: {second.log}", file=sys.stderr)
            return 1
    job = Job(args, fit, args.root / "faulted", faulted=True)
    span = took[1] if took else 30.0  # a guess when the reference is given
    every = checkpoint_interval(reference)
    offsets = ", ".join(f"{f.kind} +{max(1, round(f.delay * every))}" for f in schedule)
    print(f"checkpoints every {every} steps; steps past the newest one: {offsets}")
    try:
        faults, seconds = run_faulted(job, schedule, every, span, args.timeout)
    except RuntimeError as e:
        print(f"lit-ddp chaos: {e}", file=sys.stderr)
        for record in events.read(job.root, events.RESTORE_CHECK):
            if not record.get("passed"):
                print(f"restore check: {record.get('message')}", file=sys.stderr)
        return 1
    resumed = resumed_steps(job.root)
    print_faults(faults, resumed)
    checked = [str(c.get("entries")) for c in events.read(job.root, events.RESTORE_CHECK) if c.get("passed")]
    entries = f" ({', '.join(checked)} entries on rank 0)" if checked else ""
    print(f"restore check: passed at {len(checked)} of {len(resumed)} resumes{entries}")
    if took:
        print(f"the faults cost {seconds - took[0]:.1f} s ({seconds:.1f} s against {took[0]:.1f} s uninterrupted)")
    if args.calibrated is not None:
        return calibrated_report(args, reference, resumed)
    difference = compare(reference, args.root / "faulted", args.rtol)
    if difference is None:
        how = f"within rtol {args.rtol:g}" if args.rtol else "bit for bit"
        print(f"identical: the faulted run ends {how} where the uninterrupted one does ({len(faults)} faults)")
        return 0
    print(f"DIFFERENT: first at {difference}")
    if not args.rtol and not deterministic(reference):
        print(
            "the runs chose their kernels (trainer.deterministic is not true): on GPUs two uninterrupted runs differ "
            "as well; add --config configs/checkpoint/exact.yaml for a bit-for-bit comparison"
        )
    return 1


def torchft_main(
    args: Namespace, fit: list[str], schedule: list[Fault], reference: Path, took: tuple[float, float] | None
) -> int:
    """``lit-ddp chaos --launcher torchft``, once the uninterrupted run is there: the second one, the faulted one
    (:func:`lit_ddp.chaos.replica_groups.run_faulted_groups`), its table, the groups against each other bit for bit,
    and the witness group against the uninterrupted runs' by the calibrated comparison. Returns the exit status: 1
    where a survivor restarted, the groups differ or the comparison fails."""
    witness = Path(WITNESS)
    if not Path(layout.last_checkpoint(str(reference / witness))).exists():
        print(f"lit-ddp: error: {reference / witness} holds no {layout.CHECKPOINTS}/{layout.LAST}", file=sys.stderr)
        return UsageError.exit_code
    # the yardstick: a rerun with another seed. Two runs of the same seed differ only by the steps before the later
    # group joined (often none), far less than the shares a lost group does not train.
    seed = config_of(reference / witness).get("seed_everything")
    other = (seed if type(seed) is int else 0) + 1
    seeds = f"{seed} and {other}"
    second = Job(args, [*fit, "--seed_everything", str(other)], args.root / "reference2", faulted=False)
    if run_reference(second, args.timeout) is None:
        print(f"lit-ddp chaos: the second uninterrupted run failed; its output: {second.log}", file=sys.stderr)
        return 1
    steps = int(sharded.read_whole(Path(layout.last_checkpoint(str(reference / witness))))["global_step"])
    every = max(1, steps // (2 * args.faults))
    offsets = ", ".join(f"{f.kind} +{max(1, round(f.delay * every))}" for f in schedule)
    print(f"the uninterrupted run trained {steps} steps; steps past the groups' last common start: {offsets}")
    job = Job(args, fit, args.root / "faulted", faulted=True)
    try:
        faults, seconds = run_faulted_groups(job, schedule, every, args.timeout)
    except RuntimeError as e:
        print(f"lit-ddp chaos: {e}", file=sys.stderr)
        return 1
    print_group_faults(faults)
    if took:
        print(f"the faults cost {seconds - took[0]:.1f} s ({seconds:.1f} s against {took[0]:.1f} s uninterrupted)")
    failures = []
    for number, f in enumerate(faults, 1):
        if f["back"] is None:
            failures.append(
                f"fault {number}: {f['group']} was not back before the others finished (it then trained alone from "
                "its own checkpoint): give the run more steps"
            )
    if restarted := sum(f["restarts"] for f in faults):
        failures.append(f"the survivors restarted {restarted} times (their pids changed)")
    dirs = group_dirs(events.read(job.root))
    if (difference := groups_difference(dirs)) is None:
        print(f"groups: {', '.join(d.name for d in dirs)} end identical, bit for bit (global_step, weights, optimizer)")
    else:
        failures.append(f"the groups' last checkpoints differ, first at {difference}")
    failure, lines = verdict(
        reference / witness,
        args.root / "reference2" / witness,
        args.root / "faulted" / witness,
        args.calibrated,
        [],
        common=True,
    )
    print("\n".join(lines))
    if failure is None:
        print(f"{witness}: within {args.calibrated:g} x the spread of two uninterrupted runs (seeds {seeds})")
    else:
        failures.append(f"{witness}: {failure}")
    for line in failures:
        print(f"DIFFERENT: {line}")
    return 1 if failures else 0


def calibrated_report(args: Namespace, reference: Path, resumed: list[int]) -> int:
    """The ``--calibrated`` verdict and its lines (:func:`lit_ddp.chaos.calibrated.verdict`); the exit status."""
    failure, lines = verdict(reference, args.root / "reference2", args.root / "faulted", args.calibrated, resumed)
    print("\n".join(lines))
    if failure is None:
        print(f"within {args.calibrated:g} x the spread of two uninterrupted runs: the resume is as good as a rerun")
        return 0
    print(f"DIFFERENT: first at {failure}")
    return 1


def config_of(run: Path) -> dict:
    """The run's ``config.yaml`` (LightningCLI writes it into the run directory); empty where it is missing or
    unreadable."""
    try:
        return yaml.safe_load((run / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def deterministic(run: Path) -> bool:
    """Whether the run at ``run`` trained with ``trainer.deterministic: true`` (its ``config.yaml``); False where
    that file is missing or unreadable."""
    return (config_of(run).get("trainer") or {}).get("deterministic") is True
