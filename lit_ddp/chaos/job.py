"""One run of ``lit-ddp chaos``: its launch command under each launcher, its training processes, and how each fault
kind reaches them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jsonargparse import Namespace

from lit_ddp.launch import secret
from lit_ddp.run_dir import layout
from lit_ddp.strategies import loopback

HANG_TIMEOUT = "0:00:20"  # the collective timeout a hang test runs under: a frozen worker costs this plus 30 s
PHASE_PROBE = "lit_ddp.chaos.phase_probe.PhaseProbe"  # tells the step reached and when validation runs
SKETCH = "lit_ddp.chaos.sketch.ParameterSketch"  # the parameters at each logged step, for --calibrated
RDZV_ID_ENV = "PET_RDZV_ID"  # torchrun's --rdzv_id, read from the environment (torch's argparse_util.env)
PHASE_FILE = ".chaos_phase"  # where it tells it, in the run directory
SBATCH_SCRIPT = Path("slurm/train.sbatch")
ELASTIC_SCRIPT = Path("slurm/train_elastic.sbatch")


@dataclass(frozen=True)
class Fault:
    """One planned fault: its kind, its delay as a fraction of the span between faults, and which of the
    targets (sorted by rank) it hits, as a fraction of their number."""

    kind: str
    delay: float
    target: float


def workers(proc: subprocess.Popen, launcher: str) -> list[int]:
    """The training processes: the process itself (single), torchrun's children, or the replica groups'
    processes (torchft: the children of ``python -m lit_ddp.ft.launch``, and of a group's torchrun)."""
    if launcher == "single":
        return [proc.pid] if proc.poll() is None else []
    if launcher == "torchft":
        return descendants(proc.pid)
    return children(proc.pid)


def descendants(pid: int) -> list[int]:
    """The process ids of ``pid``'s children, theirs, and so on."""
    return [d for child in children(pid) for d in (child, *descendants(child))]


def parent(pid: int) -> int | None:
    """``pid``'s parent process id (``/proc``), None where ``pid`` does not run."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def children(pid: int) -> list[int]:
    """The process ids of ``pid``'s children (``pgrep -P``)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(child) for child in out.split()]


def rank_of(pid: int) -> int:
    """A worker's ``RANK`` (torchrun's environment; 0 for a process started without one)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return 0
    return next((int(e[5:]) for e in environ if e.startswith(b"RANK=")), 0)


def writer_of_temporary_checkpoint(root: Path, pids: list[int], deadline: float) -> int | None:
    """The pid among ``pids`` that holds a checkpoint's temporary file open (``.NAME.XXXX.tmp``, AtomicCheckpointIO's,
    or a shard in such a directory, a sharded checkpoint's, in ``root/checkpoints`` or ``root``), as soon as one
    appears; None if none did before ``deadline``."""
    folders = [Path(layout.checkpoint_dir(str(root))), root]
    while time.monotonic() < deadline:
        for folder in folders:
            with contextlib.suppress(OSError):
                for name in os.listdir(folder):
                    if name.startswith(".") and name.endswith(".tmp") and ".ckpt." in name:
                        path = os.path.abspath(folder / name)  # as /proc/PID/fd links name it
                        for pid in pids:
                            with contextlib.suppress(OSError):
                                for fd in os.listdir(f"/proc/{pid}/fd"):
                                    with contextlib.suppress(OSError):
                                        link = os.readlink(f"/proc/{pid}/fd/{fd}")
                                        if link == path or link.startswith(path + "/"):  # a file or a shard
                                            return pid
        time.sleep(0.0005)
    return None


class Job:
    """One run of the fit command under a launcher: started, polled, faulted, started again, its output kept."""

    def __init__(self, args: Namespace, fit: list[str], root: Path, faulted: bool) -> None:
        self.args, self.root, self.name = args, root, "faulted" if faulted else "reference"
        # torchft: the launcher gives each group its run directory, <root>/group_<i>
        extra = [] if args.launcher == "torchft" else ["--trainer.default_root_dir", str(root)]
        extra += ["--trainer.enable_progress_bar", "false"]
        if (
            faulted
            and "hang" in args.kinds
            and not any(a.startswith("--trainer.strategy.init_args.timeout") for a in fit)
        ):
            extra += ["--trainer.strategy.init_args.timeout", HANG_TIMEOUT]
        # in every run alike (a reference may serve a later --calibrated call)
        extra += [f"--trainer.callbacks+={PHASE_PROBE}", f"--trainer.callbacks+={SKETCH}"]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # where its output goes: a log file, or Slurm's output file per job id (named here for messages)
        self.log = args.root / (f"{self.name}-<job id>.out" if args.launcher == "slurm" else f"{self.name}.log")
        if args.launcher == "single":
            self.cmd = [sys.executable, "-m", "lit_ddp", "fit", *fit, *extra]
        elif args.launcher == "torchrun":
            self.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # a fresh store per restart round (pytorch#135712)
            launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc_per_node),
                        "--max-restarts", str(args.max_restarts), "--monitor-interval", "0.2"]  # fmt: skip
            self.cmd = [*launcher, "-m", "lit_ddp", "fit", *fit, *extra]
        elif args.launcher == "torchft":  # the lighthouse and R groups, each group restarted by the launcher
            launcher = [sys.executable, "-m", "lit_ddp.ft.launch", "--replica_groups", str(args.replica_groups),
                        "--nproc_per_group", str(args.nproc_per_node), "--root", str(root),
                        "--max_restarts", str(args.max_restarts)]  # fmt: skip
            if args.heartbeat_timeout_ms is not None:
                launcher += ["--heartbeat_timeout_ms", str(args.heartbeat_timeout_ms)]
            if getattr(args, "stall_timeout_s", None) is not None:
                launcher += ["--stall_timeout_s", str(args.stall_timeout_s)]
            self.cmd = [*launcher, "--", "fit", *fit, *extra]
        else:
            self.env.setdefault("LIT_DDP_PYTHON", sys.executable)
            tasks = args.nproc_per_node
            if args.elastic:  # one agent per node, which starts the node's workers
                tasks, torchrun = 1, Path(sys.executable).with_name("torchrun")
                self.env.update(NPROC_PER_NODE=str(args.nproc_per_node), MAX_RESTARTS=str(args.max_restarts))
                if torchrun.is_file():
                    self.env.setdefault("LIT_DDP_TORCHRUN", str(torchrun))
            opts = ["--parsable", "--nodes", str(args.nodes), "--ntasks-per-node", str(tasks),
                    "-J", f"chaos-{args.seed}-{self.name}", "-o", str(args.root / f"{self.name}-%j.out")]  # fmt: skip
            self.cmd = ["sbatch", *opts, str(args.sbatch), fit[1], *fit[2:], *extra]
        self.procs: list[subprocess.Popen] = []  # one per torchrun agent (a "node"), or the one process
        self.store: Any = None  # several agents: their rendezvous store, held here as a head node's etcd would be
        self.round = 0  # a new rendezvous id for each start of the whole job
        self.replaced = 0  # agents started again alone, as a replacement node joins the ones still running
        self.job_id = ""
        self.started = 0

    @property
    def proc(self) -> subprocess.Popen | None:
        """The first agent (or the one process); None under Slurm or before the start."""
        return self.procs[0] if self.procs else None

    def _agent_command(self) -> list[str]:
        """The command of one agent: a standalone torchrun, or one of ``--nodes`` agents that meet in this tool's
        store (``is_host=false``: none of them hosts it, so no agent's death takes the rendezvous with it). Their
        rendezvous id is in their environment (:meth:`start`), not on this command line, which every user of the
        machine can read: torch's c10d rendezvous unpickles what the store holds under that id, and the store, on
        loopback, is open to every local user (docs/security.md)."""
        if self.args.launcher != "torchrun":
            return self.cmd
        if self.args.nodes == 1:
            rdzv = ["--standalone"]
        else:
            rdzv = ["--nnodes", str(self.args.nodes), "--rdzv_backend", "c10d", "--rdzv_endpoint",
                    f"127.0.0.1:{self.store.port}", "--rdzv_conf", "is_host=false,join_timeout=120"]  # fmt: skip
        return [*self.cmd[:3], *rdzv, *self.cmd[3:]]

    def _spawn(self) -> subprocess.Popen:
        with open(self.log, "a") as log:
            return subprocess.Popen(
                self._agent_command(), env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def start(self) -> None:
        self.started += 1
        self.args.root.mkdir(parents=True, exist_ok=True)
        if self.args.launcher == "slurm":
            out = subprocess.run(self.cmd, env=self.env, capture_output=True, text=True, timeout=60)
            if out.returncode != 0:
                raise RuntimeError(f"sbatch failed: {out.stderr.strip()}")
            self.job_id = out.stdout.strip().split(";")[0]
            return
        agents = self.args.nodes if self.args.launcher == "torchrun" else 1
        if agents > 1:
            if self.store is None:  # on loopback only (lit_ddp.strategies.loopback)
                self.store = loopback.store(0, None, True, multi_tenant=True, wait_for_workers=False)
            self.round += 1
            # A new id for each start of the whole job, drawn from 128 random bits: nobody else can name its keys.
            self.env[RDZV_ID_ENV] = secret.random_id(f"{self.name}-{self.round}")
        self.procs = [self._spawn() for _ in range(agents)]

    def poll(self) -> int | None:
        """None while running (a requeued Slurm job, pending again, included); else 0 or a failure status. An
        agent SIGKILLed while others run is started again (a replacement node), up to once per fault and node."""
        if self.procs:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                return next((c for c in codes if c != 0), 0)
            for i, code in enumerate(codes):
                # SIGKILLed (a `node` fault), not an agent that gave up: the others would wait for it at their
                # join timeout
                if code == -signal.SIGKILL and self.replaced < self.args.faults + self.args.nodes:
                    self.replaced += 1
                    self.procs[i] = self._spawn()
            return None
        try:
            out = subprocess.run(
                ["scontrol", "show", "job", "-o", self.job_id], capture_output=True, text=True, timeout=30
            )
        except subprocess.TimeoutExpired:
            return None  # a busy controller: ask again
        state = dict(f.split("=", 1) for f in out.stdout.split() if "=" in f).get("JobState", "")
        if state in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "SUSPENDED", ""):
            return None if state or out.returncode == 0 else 1
        return 0 if state == "COMPLETED" else 1

    def targets(self) -> list[tuple[int, int]]:
        """``(rank, pid)`` of the training processes, by rank (none under Slurm: its tasks are reached by scancel)."""
        return sorted(
            (rank_of(pid), pid) for p in self.procs if p.poll() is None for pid in workers(p, self.args.launcher)
        )

    def inject(self, fault: Fault, deadline: float) -> str | None:
        """Injects ``fault``; returns the target's description, or None when there was none (the job ended)."""
        if fault.kind == "validation" and not self._validating(deadline):
            return None
        if self.args.launcher == "slurm":
            try:
                if fault.kind in ("term", "usr1"):  # to every task of the job's steps (scancel's --signal)
                    cmd = ["scancel", f"--signal={fault.kind.upper()}", self.job_id]
                    subprocess.run(cmd, capture_output=True, timeout=30)
                    return f"job {self.job_id}"
                if fault.kind in ("kill", "hang"):  # one process of one node: a worker under train_elastic.sbatch
                    return self._signal_slurm_node(fault.target, "STOP" if fault.kind == "hang" else "KILL", one=True)
                return self._signal_slurm_node(fault.target, "KILL")
            except subprocess.TimeoutExpired:
                return None  # a busy controller: the fault is tried again once the job is back
        targets = self.targets()
        if not targets:
            return None
        rank, pid = targets[min(int(fault.target * len(targets)), len(targets) - 1)]
        if fault.kind == "save":  # the process that writes, the moment its temporary file appears
            found = writer_of_temporary_checkpoint(self.root, [p for _, p in targets], deadline)
            if found is None:
                return None
            rank, pid = rank_of(found), found
        if fault.kind == "node":  # an agent and its workers at once, as when the machine goes
            running = [p for p in self.procs if p.poll() is None]
            if not running:
                return None
            agent = running[min(int(fault.target * len(running)), len(running) - 1)]
            victims = [agent.pid, *workers(agent, self.args.launcher)]
            for victim in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
            where = f" {self.procs.index(agent)}" if len(self.procs) > 1 else ""
            return f"agent{where} + {len(victims) - 1} workers"
        signum = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "hang": signal.SIGSTOP, "save": signal.SIGKILL,
                  "validation": signal.SIGKILL}  # fmt: skip
        os.kill(pid, signum[fault.kind])
        if fault.kind == "term" and self.args.launcher == "torchrun":
            for agent in self.procs:  # every agent: a preemption of the whole job
                with contextlib.suppress(ProcessLookupError):
                    os.kill(agent.pid, signal.SIGTERM)
        return f"rank {rank}"

    def _signal_slurm_node(self, target: float, signal_name: str, one: bool = False) -> str | None:
        """Sends SIG``signal_name`` to this job's processes on one of its nodes (a crash, where ``scancel
        --signal=KILL`` would cancel the job with a SIGTERM first), from a step that overlaps the job's on that
        node: all of them (a lost node; the job's own srun then ends the other nodes' tasks,
        ``--kill-on-bad-exit``, and the job fails), or with ``one`` the newest (a worker, under a torchrun agent).
        The processes are told apart by their environment, as the nodes of a one-machine test cluster share their
        processes."""
        out = subprocess.run(["scontrol", "show", "job", "-o", self.job_id], capture_output=True, text=True, timeout=30)
        nodelist = dict(f.split("=", 1) for f in out.stdout.split() if "=" in f).get("NodeList", "")
        names = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
        nodes = names.stdout.split()
        if not nodes:
            return None  # not running (pending after a requeue): try again once it is back
        node = nodes[min(int(target * len(nodes)), len(nodes) - 1)]
        newest = 'ps=$(printf "%s\\n" $ps | sort -n | tail -n 1); '
        # the job's processes, not its srun (its command line names lit_ddp fit too, and it runs on the first node),
        # nor this script's shells (theirs does too)
        kill = (f"ps=''; for p in $(pgrep -f 'lit_ddp fit'); do c=$(cat /proc/$p/comm); [ \"$c\" != srun ] && "
                f"[ \"$c\" != bash ] && grep -qz '^SLURM_JOB_ID={self.job_id}$' /proc/$p/environ && "
                f"grep -qz '^SLURMD_NODENAME={node}$' /proc/$p/environ && ps=\"$ps $p\"; done; "
                f"{newest if one else ''}"
                f"[ -n \"$ps\" ] && kill -{signal_name} $ps; true")  # fmt: skip
        step = ["srun", "--jobid", self.job_id, "--overlap", "-N1", "-n1", "-w", node, "bash", "-c", kill]
        subprocess.run(step, capture_output=True, timeout=60, env=self.env)
        return f"{'a process of ' if one else ''}node {node}"

    def progress(self, run_dir: Path | None = None) -> tuple[str, int, int] | None:
        """``(phase, global_step, pid)`` of the run's rank zero as it last told them
        (:class:`~lit_ddp.chaos.phase_probe.PhaseProbe`), in ``run_dir`` (default: the job's; torchft: a group's);
        None before it told any (or while it writes)."""
        try:
            phase, step, pid = ((run_dir or self.root) / PHASE_FILE).read_text().split()
            return phase, int(step), int(pid)
        except (OSError, ValueError):
            return None

    def wait_for_step(self, step: int, deadline: float) -> tuple[str, int, int] | None:
        """Waits until the running job has trained ``step`` optimizer steps; returns its :meth:`progress` then, or
        None if it ended (or ``deadline`` passed) before."""
        next_poll = 0.0
        while time.monotonic() < deadline:
            if (now := self.progress()) is not None and now[1] >= step:
                return now
            if time.monotonic() >= next_poll:
                if self.poll() is not None:
                    return None
                next_poll = time.monotonic() + (0.05 if self.proc is not None else 1.0)  # Slurm: ask the controller
            time.sleep(0.0005)
        return None

    def _validating(self, deadline: float) -> bool:
        """Waits until the run's rank zero says a validation runs; False if none did before ``deadline``."""
        while time.monotonic() < deadline:
            if (now := self.progress()) is not None and now[0] == "validation":
                return True
            time.sleep(0.0005)
        return False

    def stop(self) -> None:
        if self.args.launcher == "slurm":
            if self.job_id:
                subprocess.run(["scancel", self.job_id], capture_output=True, timeout=30)
            return
        for agent in self.procs:  # torchrun's workers run in sessions of their own, a frozen one included
            if self.args.launcher == "torchft":  # the launcher and its groups share its session: all at once, so
                with contextlib.suppress(ProcessLookupError):  # that it restarts none of them meanwhile
                    os.killpg(agent.pid, signal.SIGKILL)
            for pid in [*workers(agent, self.args.launcher), agent.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def output(self) -> str:
        if self.args.launcher == "slurm":
            return "".join(p.read_text(errors="replace") for p in sorted(self.args.root.glob(f"{self.name}-*.out")))
        return self.log.read_text(errors="replace") if self.log.exists() else ""
