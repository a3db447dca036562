"""``lit-ddp chaos --launcher torchft``: faults in one replica group of a torchft job (``python -m lit_ddp.ft.launch``)
while the others train on, what they cost the survivors, and the groups compared with each other.

A fault here is not followed by a resume: the launcher starts the lost group again, which heals from a live peer;
the others are meant to go on without a restart. So the tool watches each group's ``.chaos_phase`` (its pid and
committed step, :class:`~lit_ddp.chaos.phase_probe.PhaseProbe`) and the launcher's lines naming each group's pid at
each start, and reports per fault: the survivors' restarts (new pids of groups the fault did not hit), their
longest pause between two committed steps until the group was back (the training the fault cost them: about the
lighthouse's heartbeat timeout, or less where the restarted group joins sooner), the steps they committed while the
group was down, and the seconds until the healed group committed a step past the fault's (it heals to the
survivors' step at its first quorum). ``group_0`` is never a target: it is the witness whose run directory the
calibrated comparison reads (a hit group misses the steps of its outage); with one process per group every group is
alike.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

from lit_ddp.chaos.compare import first_difference
from lit_ddp.chaos.job import Fault, Job, children, descendants, parent, rank_of
from lit_ddp.run_dir import events, layout, sharded

HANG_AFTER_STALL_S = 10.0  # a hang's SIGCONT comes this long after the launcher's limit, where it still lives
WITNESS = "group_0"  # the group no fault hits (above), as the launcher names it (<root>/group_<i>)


def starts(records: list[dict]) -> list[tuple[str, int, Path]]:
    """``(group, pid, run directory)`` of every start of a group's process the launcher recorded, in order (its
    records, :mod:`lit_ddp.run_dir.events`)."""
    return [
        (str(r["group"]), int(r["pid"]), Path(r["run_dir"]))
        for r in records
        if r.get("event") == events.GROUP_STARTED and {"group", "pid", "run_dir"} <= set(r)
    ]


def group_dirs(records: list[dict]) -> list[Path]:
    """The groups' run directories, in the order of their first start (``group_0`` first)."""
    return list({group: run_dir for group, _, run_dir in starts(records)}.values())


def current_pids(records: list[dict]) -> dict[str, int]:
    """Each group's process id now: the newest start the launcher recorded."""
    return {group: pid for group, pid, _ in starts(records)}


def lighthouse_pid(records: list[dict]) -> int | None:
    """The lighthouse's process id now: the newest the launcher recorded."""
    found = [int(r["pid"]) for r in records if r.get("event") == events.LIGHTHOUSE_STARTED and "pid" in r]
    return found[-1] if found else None


def inject(fault: Fault, pid: int | None, nproc: int = 1, hang_s: float = 0.0) -> int | None:
    """Signals one worker of the group the launcher started as ``pid`` (``kill``, ``heal``: SIGKILL, ``hang``: SIGSTOP,
    then SIGCONT after ``hang_s`` where it still lives; the process itself, or with ``nproc`` > 1 processes per group
    its torchrun's worker of the highest rank) or the whole group (``node``: SIGKILL of ``pid`` and every process
    under it at once); returns the pid signalled (``node``: ``pid``), or None where the group, or a torchrun's
    workers, do not run (yet)."""
    if pid is None or not Path(f"/proc/{pid}").exists():
        return None
    if fault.kind in ("kill", "hang", "heal") and nproc > 1:
        ranks = children(pid)
        if len(ranks) < nproc:
            return None
        pid = max(ranks, key=rank_of)
    victims = [pid, *descendants(pid)] if fault.kind == "node" else [pid]
    for victim in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGSTOP if fault.kind == "hang" else signal.SIGKILL)
    if fault.kind == "hang":
        wake = threading.Timer(hang_s, _cont, args=(pid,))
        wake.daemon = True
        wake.start()
    return pid


def _cont(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def run_faulted_groups(job: Job, schedule: list[Fault], every: int, timeout: float) -> tuple[list[dict], float]:
    """Runs the torchft job under the ``schedule``; returns one record per fault and the job's seconds in all.

    Each fault comes once every group commits steps with its current process (at the start, or the previous fault's
    group healed), ``delay x every`` steps later; it hits one of the groups but the witness (``target`` picks it).
    A record holds the group and pid hit, the seconds into the job, the survivors' step then, and, as the job goes
    on, the survivors' longest pause between two committed steps until the hit group was back (``stall``: the
    training the fault cost them), the seconds until the hit group committed a step past the fault's (``back``),
    the survivors' steps before it (``during``: those they trained without it) and their restarts meanwhile
    (``restarts``).

    Raises:
        RuntimeError: the job failed (a group out of the launcher's restarts), finished before a fault, or did not
            finish within ``timeout`` seconds.
    """
    start = time.monotonic()
    deadline = start + timeout
    hang_s = (job.args.stall_timeout_s or 90.0) + HANG_AFTER_STALL_S  # the launcher's limit (its default), then 10 s
    job.start()
    faults: list[dict] = []
    read_at, seen = 0.0, []

    def output() -> list[dict]:
        """The launcher's records, read again at most every 0.2 s (the tool shares the job's CPUs)."""
        nonlocal read_at, seen
        if time.monotonic() - read_at > 0.2:
            read_at, seen = time.monotonic(), events.read(job.root)
        return seen

    def step_of(group_dir: Path, pid: int | None = None) -> int | None:
        """The group's committed step, as its rank zero last told it; None where that process is not ``pid``, the
        group's process the launcher started (or, a torchrun group, one of its workers)."""
        now = job.progress(group_dir)
        if now is None or (pid is not None and now[2] != pid and parent(now[2]) != pid):
            return None
        return now[1]

    def watch() -> None:
        """Notes, for each fault whose group is not back yet, the survivors' pauses and steps and the group's return."""
        text = output()
        pids, dirs = current_pids(text), {g: d for g, _, d in starts(text)}
        for f in faults:
            if f["back"] is not None:
                continue
            survivors = [s for s in (step_of(dirs[g], pids[g]) for g in pids if g != f["group"]) if s is not None]
            now = time.monotonic() - start
            if survivors and max(survivors) > f["last"][0]:  # the survivors stepped: the pause since their last step
                f["stall"] = max(f["stall"], now - f["last"][1])
                f["last"] = (max(survivors), now)
            if f["group"] == "lighthouse":  # back: every group past the fault's step (none of them was hit)
                if len(survivors) == job.args.replica_groups and min(survivors) > f["step"]:
                    f["back"], f["during"] = now - f["t"], 0
                    f["restarts"] = len(starts(text)) - f["starts"]
                continue
            # back with the others: its new process at a step past the fault's, and at least the survivors' (less
            # one: the files are read one after the other), while they still run (not one that trained alone
            # from its own checkpoint after they finished)
            healed = job.progress(dirs[f["group"]])
            if (f["kind"] == "heal" and f["again"] is None and healed is not None and healed[0] == "start"
                    and healed[2] not in f["stale"]):  # fmt: skip
                # its restart's first step, in which it heals: SIGKILLed again (the whole group)
                again = pids[f["group"]]
                f["again"], f["stale"] = again, {*f["stale"], again, *children(again), healed[2]}
                inject(Fault("node", 0.0, 0.0), again)
                continue
            running = [g for g in pids if g != f["group"] and Path(f"/proc/{pids[g]}").exists()]
            if (healed is not None and healed[0] != "start" and healed[2] not in f["stale"] and healed[1] > f["step"]
                    and running and healed[1] >= max(survivors, default=0) - 1
                    and (f["kind"] != "heal" or f["again"] is not None)):  # fmt: skip
                # it healed to the survivors' step and committed the next with them: theirs alone came before
                f["back"], f["during"] = now - f["t"], max(0, healed[1] - 1 - f["step"])
                f["restarts"] = sum(1 for g, _, _ in starts(text)[f["starts"] :] if g != f["group"])

    def together(since: int) -> int | None:
        """The groups' highest committed step where every group has committed one past ``since`` with its current
        process, else None."""
        text = output()
        pids, dirs = current_pids(text), {g: d for g, _, d in starts(text)}
        steps = [step_of(dirs[g], pids[g]) for g in pids]
        if len(steps) < job.args.replica_groups or any(s is None or s <= since for s in steps):
            return None
        return max(s for s in steps if s is not None)

    def alive() -> None:
        if (status := job.poll()) is not None:
            if status == 0:
                raise RuntimeError(f"the run finished before fault {len(faults) + 1}: give it more steps")
            raise RuntimeError(f"the faulted job failed with status {status}; its output: {job.log}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"fault {len(faults) + 1} found no moment within --timeout {timeout:.0f} s")

    try:
        since = 0
        for fault in schedule:
            while (now := together(since)) is None:
                alive()
                watch()
                time.sleep(0.02)
            group = f"group_{1 + min(int(fault.target * (job.args.replica_groups - 1)), job.args.replica_groups - 2)}"
            group = "lighthouse" if fault.kind == "lighthouse" else group
            at = now + max(1, round(fault.delay * every))
            while True:
                alive()
                watch()
                dirs = {g: d for g, _, d in starts(output())}
                steps = [s for d in dirs.values() if (s := step_of(d)) is not None]
                if steps and max(steps) >= at:
                    if group == "lighthouse":
                        victim, stale = lighthouse_pid(output()), set()
                        pid = inject(Fault("node", 0.0, 0.0), victim)  # SIGKILL, its process alone
                    else:
                        victim = current_pids(output()).get(group)
                        stale = {victim, *children(victim)} if victim is not None else set()  # its processes before
                        pid = inject(fault, victim, job.args.nproc_per_node, hang_s)
                    if pid is not None:
                        break
                time.sleep(0.01)
            hit = max(s for g, d in dirs.items() if g != group and (s := step_of(d)) is not None)
            t = time.monotonic() - start
            faults.append({"kind": fault.kind, "group": group, "pid": pid, "stale": stale, "t": t, "step": hit,
                           "last": (hit, t), "again": None,
                           "starts": len(starts(output())), "stall": 0.0, "back": None, "during": None,
                           "restarts": None})  # fmt: skip
            while faults[-1]["back"] is None:  # the next fault only once this one's group is back
                if job.poll() is not None or time.monotonic() > deadline:
                    break
                watch()
                time.sleep(0.02)
            since = hit + (faults[-1]["during"] or 0)
        while (status := job.poll()) is None:
            watch()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the faulted job did not finish within --timeout {timeout:.0f} s")
            time.sleep(0.02)
        watch()
        if status != 0:
            raise RuntimeError(f"the faulted job failed with status {status}; its output: {job.log}")
    finally:
        job.stop()
    for f in faults:  # a group never back: the survivors' restarts and steps until the end
        if f["restarts"] is None:
            f["restarts"] = sum(1 for g, _, _ in starts(events.read(job.root))[f["starts"] :] if g != f["group"])
            f["during"] = f["last"][0] - f["step"]
    return faults, time.monotonic() - start


def print_group_faults(faults: list[dict]) -> None:
    """The table: per fault its kind, the group and pid hit, seconds into the job, the survivors' step then, their
    restarts, their longest pause (seconds lost), the steps they committed while the group was down and the seconds
    until the group was back at a step with them ("-": not before the job's end)."""
    print(f"{'fault':>5s}  {'kind':6s} {'target':>18s} {'at s':>7s} {'at step':>8s} {'survivor restarts':>17s} "
          f"{'lost s':>7s} {'steps while down':>16s} {'back s':>7s}")  # fmt: skip

    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    for i, f in enumerate(faults):
        print(
            f"{i + 1:5d}  {f['kind']:6s} {f['group'] + ' pid ' + str(f['pid']):>18s} {f['t']:7.1f} {f['step']:8d} "
            f"{f['restarts']:17d} {f['stall']:7.1f} {num(f['during'], 'd'):>16s} {num(f['back'], '.1f'):>7s}"
        )


def groups_difference(dirs: list[Path]) -> str | None:
    """The first entry where a group's ``last.ckpt`` (global_step, weights, optimizer states) differs from the first
    group's, bit for bit, named with the group's run directory; None where all agree."""
    first, *others = (sharded.read_whole(Path(layout.last_checkpoint(str(d)))) for d in dirs)
    for run_dir, other in zip(dirs[1:], others, strict=True):
        for key in ("global_step", "state_dict", "optimizer_states"):
            if (found := first_difference(first.get(key), other.get(key), key)) is not None:
                return f"{run_dir.name}: {found}"
    return None
