"""``python -m lit_ddp.ft.launch``: torchft's lighthouse and R replica groups on one machine, watched until they end
with one model.

    python -m lit_ddp.ft.launch --replica_groups 2 --root runs/regression/torchft -- \\
        fit --config configs/trainer/torchft.yaml --config configs/regression/single_device.yaml

- **The job's secret**: created here (:func:`lit_ddp.launch.secret.create`, never printed) and handed to every
  group in its environment; the groups accept a heal, a peer's request for their state and a quorum only from
  holders of it (:mod:`lit_ddp.ft.transport`, :mod:`lit_ddp.ft.membership`).
- **The lighthouse**: a process of its own (:mod:`lit_ddp.ft.lighthouse`), bound to loopback unless ``--bind`` says
  otherwise; its address, printed once, is kept: where it dies it is started again there, and the groups go on
  through its restart (their managers ask again).
- **The groups**: group ``i`` gets ``$TORCHFT_LIGHTHOUSE``, ``$REPLICA_GROUP_ID=group_<i>``,
  ``$TORCHFT_REPLICA_GROUPS=R``, ``$TORCHFT_MIN_REPLICAS`` (the lighthouse's too: one source) and, at the job's first
  start only, ``$TORCHFT_COLD_START=1``; it trains share ``i`` of each global batch in run directory
  ``<root>/group_<i>``. A ``lit-ddp`` process of its own, or with ``--nproc_per_group W`` a torchrun job of W
  processes (``--standalone``, ``--trainer.devices W``, torchrun's ``--max_restarts 0``: the launcher restarts the
  group, since torchrun reports every failure with status 1 and would start a bad config again too; the launcher
  learns of bad use from ``$LIT_DDP_BAD_USE_FILE``, which a worker exiting for it creates). Its process id is
  printed at every start. With ``--slurm`` (``slurm/train_torchft.sbatch``, in the batch shell) each group is a
  one-task srun step named ``group_<i>`` on its node of the allocation, started again on a spare node
  (``--spare_nodes``) where Slurm has its node down, its output lines prefixed with its name.
- **Liveness**: each group's rank 0 rewrites a record of its committed step (:mod:`lit_ddp.ft.progress`); a group
  that commits none for ``--stall_timeout_s`` while another commits (frozen, deadlocked) is SIGKILLed, its whole
  process tree, and started again, and heals from a live peer. A group that fails is started again too (at most
  ``--max_restarts`` times each; not one that exited for bad use).
- **One model at the end**: once a group has finished, a group still training at a lower step (it could only be
  training alone on a stale state) is ended, and none is started again (nothing live to heal from: a restarted
  group that finds no peer exits without training, :class:`~lit_ddp.ft.strategy.NoLivePeer`). Then the groups'
  final checkpoints are compared (:mod:`lit_ddp.ft.fingerprint`): status 0 only where every group finished with the
  same state; else one line naming the group that differs and status 1, or the first failure's status (2 for bad
  use).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from lit_ddp.errors import BAD_USE_FILE_ENV, UsageError
from lit_ddp.ft import fingerprint, lighthouse, progress
from lit_ddp.ft.strategy import (
    COLD_START_ENV,
    LIGHTHOUSE_ENV,
    MIN_REPLICAS_ENV,
    NO_PEER_EXIT,
    REPLICA_ENV,
    REPLICA_GROUPS_ENV,
    require_torchft,
)
from lit_ddp.launch import secret
from lit_ddp.run_dir import events

PREFIX = "lit_ddp.ft.launch:"
PREEMPTED = (138, 143)  # 128 + SIGUSR1, 128 + SIGTERM: a group that saved at a step boundary and stopped
RUN_ID_ENV = "LIT_DDP_RUN_ID"
POLL_S = 0.1
LIGHTHOUSE_STARTS = 10
EXIT_GRACE_S = 120.0  # a group that finished training has this long (at least) to save and exit


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:] if argv is None else argv
    own, command = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m lit_ddp.ft.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replica_groups", type=int, default=2, help="R: how many replica groups (processes)")
    parser.add_argument(
        "--nproc_per_group", type=int, default=1, help="W: processes per group (W > 1: each group a torchrun job)"
    )
    parser.add_argument(
        "--root",
        default=None,
        help="each group's run directory is ROOT/group_<i> (default runs/torchft; --slurm: the config's "
        "trainer.default_root_dir/[$LIT_DDP_RUN_ID/]group_<i>)",
    )
    parser.add_argument(
        "--bind",
        default="127.0.0.1:0",
        help="the lighthouse's listening address (port 0: a free one, kept for its restarts); loopback "
        "by default: a one-machine run needs nothing else (docs/security.md)",
    )
    parser.add_argument(
        "--min_replicas", type=int, default=1, help="the fewest groups a quorum forms and a step commits with"
    )
    parser.add_argument(
        "--join_timeout_ms",
        type=int,
        default=2000,
        help="how long a quorum waits for a group that heartbeats but "
        "has not asked to join (a restarted one starting up): what a restart can cost the others, once",
    )
    parser.add_argument(
        "--heartbeat_timeout_ms",
        type=int,
        default=5000,
        help="a group silent this long is out of the quorum: about what a dead group costs the others",
    )
    parser.add_argument(
        "--max_restarts", type=int, default=3, help="restarts of each group (W > 1: of its torchrun job)"
    )
    parser.add_argument(
        "--slurm",
        action="store_true",
        help="inside a Slurm allocation (slurm/train_torchft.sbatch): each group a one-task srun step on a node of its "
        "own, the allocation's last --spare_nodes kept for a group whose node is lost",
    )
    parser.add_argument("--spare_nodes", type=int, default=1, help="--slurm: nodes kept for lost ones")
    parser.add_argument("--cpus_per_task", type=int, default=1, help="--slurm: each group's srun --cpus-per-task")
    parser.add_argument(
        "--state_dir",
        default=None,
        help="the groups' progress records and bad-use files (default: a private temporary directory; --slurm: "
        "ROOT/.torchft-<job id>, which every node must share)",
    )
    parser.add_argument(
        "--stall_timeout_s",
        type=float,
        default=90.0,
        help="a group that commits no step for this long while another commits is ended and started again "
        "(default: 3 x the strategy's default timeout of 30 s; keep it above a few steps' time and the timeout)",
    )
    args = parser.parse_args(own)
    if args.replica_groups < 1 or args.nproc_per_group < 1 or not command:
        parser.error(
            "give --replica_groups >= 1, --nproc_per_group >= 1 and, after --, the lit-ddp command (fit --config ...)"
        )
    if not 1 <= args.min_replicas <= args.replica_groups:
        parser.error(f"--min_replicas {args.min_replicas} must be between 1 and --replica_groups {args.replica_groups}")
    return args, command


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process under it (``/proc``; torchrun starts its workers in sessions of their own)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += parents.get(tree[-1], [])
    return tree


def kill_tree(pid: int) -> None:
    for victim in process_tree(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


class Lighthouse:
    """The lighthouse's process (:mod:`lit_ddp.ft.lighthouse`), at an address chosen once (``--bind``'s port, or a
    free one) and started again there when it dies. It starts beside the groups (its imports take as long as
    theirs); a group waits for it to answer before its manager connects (:meth:`TorchFTStrategy._manager`)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        host, port = args.bind.rsplit(":", 1)
        if port == "0":  # a free port, kept for the restarts
            with socket.socket(socket.AF_INET6 if host.startswith("[") else socket.AF_INET) as probe:
                probe.bind((host.strip("[]"), 0))
                port = str(probe.getsockname()[1])
        self.bind = f"{host}:{port}"
        self.address = lighthouse.bound_address(self.bind, self.bind)
        self.start()
        print(f"{PREFIX} lighthouse {self.address} (bind {self.args.bind}) pid {self.proc.pid}", flush=True)

    def record(self) -> None:
        """The lighthouse's start, in the launcher's records (:mod:`lit_ddp.run_dir.events`), for the tools."""
        if self.args.root is not None:
            events.record(self.args.root, events.LIGHTHOUSE_STARTED, pid=self.proc.pid, address=self.address)

    def start(self) -> None:
        cmd = [sys.executable, "-m", "lit_ddp.ft.lighthouse", "--bind", self.bind,
               "--min_replicas", str(self.args.min_replicas), "--join_timeout_ms", str(self.args.join_timeout_ms),
               "--heartbeat_timeout_ms", str(self.args.heartbeat_timeout_ms)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        self.record()

    def watch(self) -> None:
        """Starts it again at its address where it has died (at most :data:`LIGHTHOUSE_STARTS` times in a row
        within a few seconds each: a start that fails at once, the port taken, is tried again)."""
        if self.proc.poll() is None:
            return
        code = self.proc.returncode
        for attempt in range(LIGHTHOUSE_STARTS):
            self.start()
            try:
                self.proc.wait(timeout=1.0 + attempt)  # one that fails, fails at once (its port taken)
            except subprocess.TimeoutExpired:
                print(f"{PREFIX} lighthouse exited with {code}: restarted at {self.address} pid {self.proc.pid}",
                      flush=True)  # fmt: skip
                return
        raise RuntimeError(f"the lighthouse could not be started again at {self.bind}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def slurm_nodes(args: argparse.Namespace) -> list[str]:
    """The allocation's nodes, in order (``scontrol show hostnames``); the first ``--replica_groups`` hold the groups,
    the rest are spares.

    Raises:
        UsageError: outside an allocation, or fewer nodes than groups.
    """
    if not os.environ.get("SLURM_JOB_NODELIST"):
        raise UsageError("--slurm: no Slurm allocation ($SLURM_JOB_NODELIST): submit slurm/train_torchft.sbatch")
    names = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]], capture_output=True,
                           text=True, timeout=60, check=True).stdout.split()  # fmt: skip
    if len(names) < args.replica_groups:
        raise UsageError(f"--slurm: {len(names)} nodes for --replica_groups {args.replica_groups}: give more nodes")
    return names


def node_lost(node: str) -> bool:
    """Whether Slurm's controller has the node down, drained or not responding (``scontrol show node``)."""
    out = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"State=(\S+)", out)
    return found is None or any(s in found.group(1) for s in ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "*"))


def slurm_place(group: int, placed: dict[int, int], nodes: list[str], groups: int) -> int:
    """The node index ``group`` starts on: its own, unless that node is lost; then the first spare (a node past the
    groups') that no group holds and that is not lost."""
    if not node_lost(nodes[placed[group]]):
        return placed[group]
    held = {placed[g] for g in placed if g != group}
    for index in range(groups, len(nodes)):
        if index not in held and not node_lost(nodes[index]):
            print(
                f"{PREFIX} group_{group}: node {nodes[placed[group]]} is lost, starting on {nodes[index]}", flush=True
            )
            return index
    return placed[group]  # no spare: try its node again (the restart fails if it is still lost)


def slurm_kill(step_name: str) -> None:
    """SIGKILL of the job's steps named ``step_name`` (srun --job-name), on whatever node they run."""
    job = os.environ.get("SLURM_JOB_ID", "")
    out = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"], capture_output=True, text=True, timeout=60)
    for line in out.stdout.splitlines():
        step, name = (line.split() + [""])[:2]
        if name == step_name:
            subprocess.run(["scancel", "--signal=KILL", step], capture_output=True, timeout=60)


def prefix_lines(proc: subprocess.Popen, prefix: str) -> None:
    """Copies ``proc``'s output to this process's, each line after ``prefix`` (a thread of its own)."""

    def copy() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(prefix + line)
            sys.stdout.flush()

    threading.Thread(target=copy, daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args, command = parse_args(argv)
    require_torchft()
    secret.create()  # the job's, in os.environ for the groups; never printed
    if args.root is not None:  # the groups' run directories and the launcher's records go there
        Path(args.root).mkdir(parents=True, exist_ok=True)
    nodes = slurm_nodes(args) if args.slurm else None
    beacon = Lighthouse(args)
    private = tempfile.TemporaryDirectory(prefix="lit_ddp_ft_")  # bad-use files and progress records, this user's
    if args.state_dir is None and args.slurm:  # every node writes its group's record there: the job's storage
        args.state_dir = str(Path(args.root or "runs", f".torchft-{os.environ.get('SLURM_JOB_ID', 'job')}"))
    state = Path(args.state_dir or private.name)
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    run_dirs = {g: Path(args.root or "runs/torchft", f"group_{g}") for g in range(args.replica_groups)}
    placed = {g: g for g in range(args.replica_groups)}  # --slurm: group -> its node's index

    def bad_use_file(group: int) -> Path:
        return Path(state, f"group_{group}.bad_use")

    def record_file(group: int) -> Path:
        return Path(state, f"group_{group}.progress")

    def record_start(group: int, pid: int) -> None:
        """A group's start, in the launcher's records (:mod:`lit_ddp.run_dir.events`), for the tools."""
        if args.root is not None:
            events.record(
                args.root, events.GROUP_STARTED, group=f"group_{group}", pid=pid, run_dir=str(run_dirs[group])
            )

    def start(group: int, cold: bool) -> subprocess.Popen:
        env = dict(os.environ)
        env.update({
            LIGHTHOUSE_ENV: beacon.address,
            REPLICA_ENV: f"group_{group}",
            REPLICA_GROUPS_ENV: str(args.replica_groups),
            MIN_REPLICAS_ENV: str(args.min_replicas),
            BAD_USE_FILE_ENV: str(bad_use_file(group)),
            progress.PROGRESS_ENV: str(record_file(group)),
        })  # fmt: skip
        env.pop(COLD_START_ENV, None)
        if cold:
            env[COLD_START_ENV] = "1"
        cmd = [sys.executable, "-m", "lit_ddp", *command]
        if args.root is None and args.slurm:  # the config's root/[$LIT_DDP_RUN_ID/]group_<i>, as a Slurm job's run
            env[RUN_ID_ENV] = "/".join(filter(None, [os.environ.get(RUN_ID_ENV), f"group_{group}"]))
        else:
            cmd += ["--trainer.default_root_dir", str(run_dirs[group])]
        if args.nproc_per_group > 1:
            torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc_per_group)]
            cmd[1:3] = [*torchrun, "--max_restarts", "0", "-m", "lit_ddp"]
            cmd += ["--trainer.devices", str(args.nproc_per_group)]
        bad_use_file(group).unlink(missing_ok=True)
        record_file(group).unlink(missing_ok=True)
        if nodes is None:
            proc = subprocess.Popen(cmd, env=env)
            print(f"{PREFIX} group_{group} pid {proc.pid} run directory {run_dirs[group]}", flush=True)
            record_start(group, proc.pid)
            return proc
        placed[group] = slurm_place(group, placed, nodes, args.replica_groups)
        node = nodes[placed[group]]
        srun = ["srun", "--nodes", "1", "--ntasks", "1", "--nodelist", node, "--cpus-per-task",
                str(args.cpus_per_task), "--job-name", f"group_{group}", "--kill-on-bad-exit=1"]  # fmt: skip
        step = subprocess.Popen([*srun, *cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        prefix_lines(step, f"group_{group}: ")
        print(f"{PREFIX} group_{group} pid {step.pid} node {node} run directory {run_dirs[group]}", flush=True)
        record_start(group, step.pid)
        return step

    procs = {g: start(g, cold=True) for g in range(args.replica_groups)}
    restarts = dict.fromkeys(procs, 0)
    seen: dict[int, tuple[int, float]] = {}  # a training group -> (its committed step, when it last changed)
    committed: dict[int, float] = {}  # a group -> when it last committed a step
    final: tuple[int, float] | None = None  # (the step the first group to finish ended at, when)
    preempted = 0  # the status of the first group that saved and stopped for a signal
    done: dict[int, float] = {}  # a running group whose record says it finished training -> when
    status = 0

    def stop(signum: int, _frame: object) -> None:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signum)

    def forward(signum: int, _frame: object) -> None:  # Slurm's preemption notice to the batch shell, passed on
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGUSR1, forward)
    try:
        while procs:
            beacon.watch()
            now = time.monotonic()
            for group in procs:
                record = progress.read(record_file(group))
                if record is not None and seen.get(group, (None, 0.0))[0] != record["step"]:
                    if group in seen:  # a step committed (a process's first record is where it starts)
                        committed[group] = now
                    seen[group] = (record["step"], now)
                if record is not None and record["finished"] and group not in done:
                    done[group] = now  # its training ended: the first one's step is the final one
                    final = final or (record["step"], now)
            for group, proc in list(procs.items()):
                code = proc.poll()
                if code is None:
                    why: str | None
                    if group in done:  # finished training: only its exit is awaited (a save, the teardown)
                        if now - done[group] < max(args.stall_timeout_s, EXIT_GRACE_S):
                            continue
                        why = (
                            f"finished training but did not exit within {max(args.stall_timeout_s, EXIT_GRACE_S):.0f} s"
                        )
                    else:
                        why = ended_why(group, seen, committed, final, now, args.stall_timeout_s)
                        if why is None and nodes is None and stalled(group, seen, now, args.stall_timeout_s):
                            why = stopped_why(proc.pid, seen[group][0], now - seen[group][1])
                    if why is None:
                        continue
                    print(f"{PREFIX} group_{group} {why}: SIGKILLed", flush=True)
                    if nodes is not None:
                        slurm_kill(f"group_{group}")
                    kill_tree(proc.pid)
                    proc.wait()
                    code = 0 if group in done else proc.returncode
                del procs[group]
                step = seen.pop(group, (-1, now))[0]
                committed.pop(group, None)
                done.pop(group, None)
                record = progress.read(record_file(group))
                if record is not None and record.get("run_dir"):
                    run_dirs[group] = Path(record["run_dir"])  # where the group itself says it saves
                if code == 0 and not (record is not None and record.get("finished")):
                    # srun says 0 for a step it lost to a node failure: only the group's own record says it finished
                    print(f"{PREFIX} group_{group} exited with 0 before finishing its training (at step {step})",
                          flush=True)  # fmt: skip
                    code = 1
                if code in PREEMPTED:  # it saved at a step boundary and stopped: the job is requeued
                    print(f"{PREFIX} group_{group} stopped by a preemption signal ({code}): not restarted", flush=True)
                    preempted = preempted or code
                    continue
                if code == 0:
                    print(f"{PREFIX} group_{group} finished at step {step}", flush=True)
                    final = final or (step, now)
                elif code == UsageError.exit_code or bad_use_file(group).exists():  # every start would fail alike
                    print(f"{PREFIX} group_{group} exited with {code} (bad use): not restarted", flush=True)
                    status = status or UsageError.exit_code
                elif final is not None:
                    reason = "found no live group to heal from" if code == NO_PEER_EXIT else f"exited with {code}"
                    print(f"{PREFIX} group_{group} {reason}; a group has finished: not restarted", flush=True)
                elif restarts[group] < args.max_restarts:
                    restarts[group] += 1
                    print(f"{PREFIX} group_{group} exited with {code}: restart {restarts[group]}", flush=True)
                    procs[group] = start(group, cold=False)
                else:
                    print(f"{PREFIX} group_{group} exited with {code}, no restarts left", flush=True)
                    status = status or code
            time.sleep(POLL_S)
    finally:
        beacon.stop()
        private.cleanup()
    if preempted and status == 0:
        print(f"{PREFIX} preempted: every group saved and stopped; the job may be requeued", flush=True)
        return preempted
    if status == 0:
        differs = fingerprint.first_difference({f"group_{g}": d for g, d in run_dirs.items()})
        if differs is not None:
            print(f"{PREFIX} the groups did not end with one model: {differs}", flush=True)
            return 1
        print(f"{PREFIX} every group finished with the same state", flush=True)
    return status


def stalled(group: int, seen: dict[int, tuple[int, float]], now: float, stall_s: float) -> bool:
    return group in seen and now - seen[group][1] > stall_s


def stopped_why(pid: int, step: int, stood: float) -> str | None:
    """Why a group whose step has stood ``stood`` seconds must be ended although no other group commits either: a
    process of its tree is stopped (SIGSTOP, state ``T`` in ``/proc``). One stopped worker of a group of several
    keeps the others waiting in their quorum: its rank 0 still heartbeats, so the lighthouse keeps waiting for the
    group (torchft 0.2.0), and nobody commits. One machine only (``/proc`` of the group's processes)."""
    for victim in process_tree(pid):
        try:
            state = Path(f"/proc/{victim}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state in ("T", "t"):
            return f"has a stopped process (pid {victim}) and committed no step for {stood:.0f} s (since step {step})"
    return None


def ended_why(
    group: int,
    seen: dict[int, tuple[int, float]],
    committed: dict[int, float],
    final: tuple[int, float] | None,
    now: float,
    stall_s: float,
) -> str | None:
    """Why a running group must be ended now, or None. ``seen``: each training group's step (its process's first
    record, then each committed step) and when it last changed; ``committed``: when each group last committed a step
    (a process's first record is not one); ``final``: the step a group finished at, and when (None: none has).

    - No group finished: it committed no step for ``stall_s`` while another committed (frozen, deadlocked).
    - A group finished: it has not trained yet (nothing live is left to heal it), or it committed a step below the
      final one after that group's end (it trains alone on a stale state), or it has not finished ``stall_s`` later.
    """
    if final is not None:
        final_step, ended_at = final
        if group not in seen or (group not in committed and seen[group][0] < final_step):
            return f"has not trained since its start, and a group finished at step {final_step}: nothing to heal from"
        step, since = seen[group]
        if step < final_step and committed.get(group, 0.0) > ended_at:
            return (
                f"committed step {step} after a group finished at step {final_step}: it trains alone on a stale state"
            )
        if now - max(since, ended_at) > stall_s:
            return f"did not finish within {stall_s:.0f} s of a group's end at step {final_step} (it is at step {step})"
        return None
    if group not in seen:
        return None  # not training yet: its own timeouts bound its start
    step, since = seen[group]
    if now - since > stall_s and any(t > since for g, t in committed.items() if g != group):
        return f"committed no step for {now - since:.0f} s (since step {step}) while another group did"
    return None


if __name__ == "__main__":
    raise SystemExit(main())
