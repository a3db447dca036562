"""Two commands timed side by side on a shared machine: both alive at once, running in turns.

This VM's speed drifts by up to 2x over seconds to minutes (other tenants), so two runs taken one after the
other differed by +-20 % in their step-time ratio. Here both commands start, each in its own process group
(every rank of a DDP side), and only one ever runs: the other is stopped (``SIGSTOP`` to its process group,
``SIGCONT`` to resume), and they swap every ``slice_s`` seconds, so both see the same machine. Start-up runs
alone first, one side after the other, until each side's rank zero creates its *started* file at its first
training step. Each side writes a JSON record whose ``step_starts`` are its steps' starts on the system-wide
``CLOCK_MONOTONIC``; a step counts when it began and ended inside one of its side's turns, is not the first
of that turn (caches are cold after a pause) and comes after the first ``warmup`` steps. A *round* is a turn
of the second side and the turn of the first just before it; its ratio is the second's mean step time over
the first's (means, so a periodic cost such as logging every 50 steps counts in full).

Used by :mod:`bench.framework_overhead` (Lightning vs a plain loop) and :mod:`bench.plain_ddp` (DDP scaling).
Our own code: no benchmarking library we know of interleaves whole multi-process programs.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MIN_STEPS_PER_SLICE = 3  # a round whose turns counted fewer steps (start-up, the end) is left out


def started_path(json_path: Path) -> Path:
    """The file a side's rank zero creates when its first training step begins."""
    return json_path.with_suffix(".started")


def run_until_started(proc: subprocess.Popen, marker: Path, timeout: float) -> None:
    """Lets ``proc`` run (alone) until it creates ``marker``.

    Raises:
        RuntimeError: it exited first. TimeoutError: no marker within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    signal_group(proc, signal.SIGCONT)
    while not marker.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"exited ({proc.returncode}) before its first training step")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no training step within {timeout:.0f} s")
        time.sleep(0.05)


def bench_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Sends ``sig`` to ``proc``'s process group (the side's every rank); a group that is gone is ignored."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def interleave(procs: dict[str, subprocess.Popen], slice_s: float, timeout: float) -> list[tuple[str, float, float]]:
    """Lets the sides run one at a time, ``slice_s`` seconds each, in ``procs``' order, until one exits; then
    lets the others run to their end. Returns the running slices ``(side, start, stop)`` (``CLOCK_MONOTONIC`` s)
    during which both sides were alive.

    Raises:
        TimeoutError: the sides did not all exit within ``timeout`` seconds (they are killed).
    """
    clock = time.CLOCK_MONOTONIC
    order = list(procs)
    deadline = time.monotonic() + timeout
    slices: list[tuple[str, float, float]] = []
    for proc in procs.values():
        signal_group(proc, signal.SIGSTOP)
    try:
        turn = 0
        while all(p.poll() is None for p in procs.values()):
            name = order[turn % len(order)]
            proc = procs[name]
            signal_group(proc, signal.SIGCONT)
            start = time.clock_gettime(clock)
            try:
                proc.wait(timeout=slice_s)
                break  # it finished inside its slice: the other side has nothing left to pair with
            except subprocess.TimeoutExpired:
                pass
            stop = time.clock_gettime(clock)
            signal_group(proc, signal.SIGSTOP)
            slices.append((name, start, stop))
            turn += 1
            if time.monotonic() > deadline:
                raise TimeoutError(f"the two sides ran longer than {timeout:.0f} s")
        for proc in procs.values():
            signal_group(proc, signal.SIGCONT)
        for proc in procs.values():
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except BaseException:
        for proc in procs.values():
            signal_group(proc, signal.SIGKILL)
            signal_group(proc, signal.SIGCONT)
        raise
    return slices


def steps_in_slices(starts: list[float | None], slices: list[tuple[float, float]], warmup: int) -> list[list[float]]:
    """For each running slice ``(start, stop)``, the durations (s) of the steps that began and ended inside
    it, the slice's first such step left out; steps before ``warmup`` are left out, and so is a step whose
    start or end is ``None`` (a validation came between)."""
    spans = [
        (a, b)
        for i, (a, b) in enumerate(zip(starts[:-1], starts[1:], strict=True))
        if i >= warmup and a is not None and b is not None
    ]
    counted: list[list[float]] = []
    for t0, t1 in slices:
        inside = [b - a for a, b in spans if t0 <= a and b <= t1]
        counted.append(inside[1:])
    return counted


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def bootstrap_median_interval(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 2.5 % and 97.5 % points of the median over ``resamples`` bootstrap resamples of ``values`` (Efron's
    percentile bootstrap): how far the median of this many rounds moves by chance."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def run_in_turns(
    commands: dict[str, list[str]], json_paths: dict[str, Path], work: Path, slice_s: float, warmup: int, timeout: float
) -> dict[str, Any]:
    """Runs the two ``commands`` in turns (see the module docstring); each must write its JSON record to
    its ``json_paths`` entry and create ``started_path`` of it at its first step.

    Returns:
        ``{"records": {name: record}, "slices": [(name, start, stop)], "rounds": [{first: [s], second: [s],
        "ratio": mean(second) / mean(first)}]}``, step times in seconds.

    Raises:
        RuntimeError: a side failed (with its log's tail). TimeoutError: the whole took over ``timeout`` s.
    """
    first, second = commands
    logs = {side: open(work / f"{side}.log", "w") for side in commands}  # noqa: SIM115 - closed below
    procs: dict[str, subprocess.Popen] = {}
    try:
        for side in commands:  # start-up alone: the turns begin with both sides at their first step
            procs[side] = subprocess.Popen(
                commands[side], cwd=REPO, env=bench_env(), stdout=logs[side], stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: SIGSTOP reaches every rank of that side
            )  # fmt: skip
            try:
                run_until_started(procs[side], started_path(json_paths[side]), timeout)
            except (RuntimeError, TimeoutError) as err:
                tail = (work / f"{side}.log").read_text()[-3000:]
                raise RuntimeError(f"{side}: {err}:\n{tail}") from err
            signal_group(procs[side], signal.SIGSTOP)
        slices = interleave(procs, slice_s, timeout=timeout)
    except BaseException:
        for proc in procs.values():
            signal_group(proc, signal.SIGKILL)
            signal_group(proc, signal.SIGCONT)
        raise
    finally:
        for log in logs.values():
            log.close()
    records = {}
    for side in commands:
        if procs[side].returncode != 0 or not json_paths[side].is_file():
            tail = (work / f"{side}.log").read_text()[-3000:]
            raise RuntimeError(f"{side} run failed (exit {procs[side].returncode}):\n{tail}")
        records[side] = json.loads(json_paths[side].read_text())
    return {"records": records, "slices": slices, "rounds": []}


def pair_rounds(result: dict[str, Any], step_starts: dict[str, list], warmup: int) -> list[dict[str, Any]]:
    """The rounds of a :func:`run_in_turns` result, given each side's ``step_starts`` (see the docstring)."""
    first, second = step_starts
    counted = {
        side: steps_in_slices(starts, [(a, b) for name, a, b in result["slices"] if name == side], warmup)
        for side, starts in step_starts.items()
    }
    rounds = []
    for a, b in zip(counted[first], counted[second], strict=False):  # turns alternate first, second, first...
        if len(a) >= MIN_STEPS_PER_SLICE and len(b) >= MIN_STEPS_PER_SLICE:
            rounds.append({first: a, second: b, "ratio": statistics.mean(b) / statistics.mean(a)})
    return rounds


def summarize_rounds(rounds: list[dict[str, Any]], first: str, second: str) -> dict[str, Any]:
    """Median ratio with its bootstrap 95 % interval, quartiles, min-max, and the pooled ratios of all
    counted steps' means and medians.

    Raises:
        RuntimeError: no round (the runs were too short for ``slice_s``).
    """
    if not rounds:
        raise RuntimeError("no round counted steps on both sides: raise the steps or the turn length")
    ratios = [r["ratio"] for r in rounds]
    pooled = {side: [t for r in rounds for t in r[side]] for side in (first, second)}
    q1, q3 = quartiles(ratios)
    return {
        "rounds": len(rounds),
        "ratio_median": statistics.median(ratios),
        "ratio_median_ci95": list(bootstrap_median_interval(ratios)),
        "ratio_q1": q1,
        "ratio_q3": q3,
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "pooled_ratio_of_means": statistics.mean(pooled[second]) / statistics.mean(pooled[first]),
        "pooled_ratio_of_medians": statistics.median(pooled[second]) / statistics.median(pooled[first]),
        "mean_step_s": {side: statistics.mean(pooled[side]) for side in pooled},
        "steps_counted": {side: len(pooled[side]) for side in pooled},
    }


def describe(summary: dict[str, Any]) -> str:
    """One line: the median ratio, its interval, quartiles, min-max and the pooled ratios."""
    low, high = summary["ratio_median_ci95"]
    return (
        f"median {summary['ratio_median']:.3f} over {summary['rounds']} rounds (95% interval of the median "
        f"{low:.3f}-{high:.3f}; quartiles {summary['ratio_q1']:.3f}-{summary['ratio_q3']:.3f}, min "
        f"{summary['ratio_min']:.3f}, max {summary['ratio_max']:.3f}); all counted steps: ratio of means "
        f"{summary['pooled_ratio_of_means']:.3f}, of medians {summary['pooled_ratio_of_medians']:.3f}"
    )
