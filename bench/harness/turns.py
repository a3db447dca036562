"""Commands timed side by side on a shared machine: all alive at once, running in turns (two, or several).

This VM's speed drifts by up to 2x within minutes, so two runs taken one after the other differ by +-20 %. Here each
command runs in its own process group and only one runs at a time: the other is stopped (``SIGSTOP`` / ``SIGCONT``),
and they swap every ``slice_s`` seconds. Start-up runs alone first, until each side's step clock shows a step. A step
counts when it began and ended inside one of its side's turns, is not the turn's first (cold caches) and comes after
the first ``warmup``. A *round* is a turn of the second side and the first side's turn before it; its ratio is the
second's mean step time over the first's. (pyperf and pytest-benchmark time calls in one process: neither
interleaves multi-process programs.)
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness.clock import read_clock
from bench.harness.launch import REPO, bench_env

MIN_STEPS_PER_SLICE = 3  # a round whose turns counted fewer steps (start-up, the end) is left out


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Sends ``sig`` to ``proc``'s process group (the side's every rank); a group that is gone is ignored."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def run_until_started(proc: subprocess.Popen, clock: Path, timeout: float) -> None:
    """Lets ``proc`` run (alone) until its clock shows a step (RuntimeError: it exited first; TimeoutError)."""
    deadline = time.monotonic() + timeout
    signal_group(proc, signal.SIGCONT)
    while not read_clock(clock)["step"]:
        if proc.poll() is not None:
            raise RuntimeError(f"exited ({proc.returncode}) before its first training step")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no training step within {timeout:.0f} s")
        time.sleep(0.05)


def interleave(
    procs: dict[str, subprocess.Popen],
    slice_s: float,
    timeout: float,
    rounds: int | None = None,
    before_kill: Callable[[dict[str, subprocess.Popen]], None] | None = None,
) -> list[tuple[str, float, float]]:
    """Lets the sides run one at a time, ``slice_s`` seconds each, until one exits, then the others to their end
    (TimeoutError past ``timeout`` s); with ``rounds``, until each has had that many turns, then ``before_kill(procs)``
    (every side stopped, still alive) and every side SIGKILLed. The turns ``(side, start, stop)``
    (``time.time()``) while all were alive."""
    order, deadline, slices = list(procs), time.monotonic() + timeout, []
    for proc in procs.values():
        signal_group(proc, signal.SIGSTOP)
    turn = 0
    while all(p.poll() is None for p in procs.values()):
        if rounds is not None and turn >= rounds * len(order):
            if before_kill is not None:
                before_kill(procs)
            for proc in procs.values():
                signal_group(proc, signal.SIGKILL)
            break
        name = order[turn % len(order)]
        signal_group(procs[name], signal.SIGCONT)
        start = time.time()
        try:
            procs[name].wait(timeout=slice_s)
            break  # it finished inside its turn: the other side has nothing left to pair with
        except subprocess.TimeoutExpired:
            pass
        slices.append((name, start, time.time()))
        signal_group(procs[name], signal.SIGSTOP)
        turn += 1
        if time.monotonic() > deadline:
            raise TimeoutError(f"the sides ran longer than {timeout:.0f} s")
    if rounds is not None:  # a side that ended before its rounds failed: the others would run on to no end
        for proc in procs.values():
            signal_group(proc, signal.SIGKILL)
    for proc in procs.values():
        signal_group(proc, signal.SIGCONT)
    for proc in procs.values():
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    return slices


def steps_in_slices(
    spans: list[tuple[float, ...]], slices: list[tuple[float, float]], warmup: int
) -> list[list[float]]:
    """For each turn ``(start, stop)``, the seconds of the steps (``spans``, after the first ``warmup``) that began and
    ended inside it, the turn's first such step left out."""
    spans = spans[warmup:]
    return [[b - a for a, b in spans if t0 <= a and b <= t1][1:] for t0, t1 in slices]


def bootstrap_median_interval(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 2.5 % and 97.5 % points of the median over ``resamples`` bootstrap resamples of ``values`` (Efron's
    percentile bootstrap): how far the median of this many rounds moves by chance."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def run_sides(
    commands: dict[str, list[str]],
    work: Path,
    slice_s: float,
    timeout: float,
    rounds: int | None = None,
    before_kill: Callable[[dict[str, subprocess.Popen]], None] | None = None,
) -> tuple[dict[str, Any], list[tuple[str, float, float]]]:
    """Starts each of ``commands`` alone until its step clock (``<work>/<side>.clock``) shows a step, then runs them
    in turns (:func:`interleave`: to their end, or ``rounds`` turns each, ``before_kill`` and a kill). Returns each
    side's clock events and the turns. RuntimeError: a side failed (its log's tail); TimeoutError."""
    work.mkdir(parents=True, exist_ok=True)
    logs = {side: work / f"{side}.log" for side in commands}
    clocks = {side: work / f"{side}.clock" for side in commands}
    procs: dict[str, subprocess.Popen] = {}
    try:
        for side, cmd in commands.items():  # start-up alone: the turns begin with every side past its first step
            with logs[side].open("w") as log:  # its own session: SIGSTOP reaches every rank of that side
                procs[side] = subprocess.Popen(cmd, cwd=REPO, env=bench_env(), stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True)  # fmt: skip
            try:
                run_until_started(procs[side], clocks[side], timeout)
            except (RuntimeError, TimeoutError) as err:
                raise RuntimeError(f"{side}: {err}:\n{logs[side].read_text()[-3000:]}") from err
            signal_group(procs[side], signal.SIGSTOP)
        slices = interleave(procs, slice_s, timeout=timeout, rounds=rounds, before_kill=before_kill)
    except BaseException:
        for proc in procs.values():
            signal_group(proc, signal.SIGKILL)
            signal_group(proc, signal.SIGCONT)
        raise
    for side, proc in procs.items():  # with rounds, each side was killed (-9) when they were done
        if proc.returncode != (0 if rounds is None else -signal.SIGKILL):
            raise RuntimeError(f"{side} run failed (exit {proc.returncode}):\n{logs[side].read_text()[-3000:]}")
    return {side: read_clock(clocks[side]) for side in commands}, slices


def run_in_turns(
    commands: dict[str, list[str]], work: Path, slice_s: float, warmup: int, timeout: float
) -> dict[str, Any]:
    """Runs the two ``commands`` in turns, each writing its step clock at ``<work>/<side>.clock``: :func:`summarize`'s
    figures, and ``job``: each side's clock ``job`` line. RuntimeError: a side failed (its log's tail); TimeoutError."""
    events, slices = run_sides(commands, work, slice_s, timeout)
    first, second = commands
    counted = {
        side: steps_in_slices(events[side]["span"], [(a, b) for name, a, b in slices if name == side], warmup)
        for side in commands
    }
    rounds = [
        {first: a, second: b, "ratio": statistics.mean(b) / statistics.mean(a)}
        for a, b in zip(counted[first], counted[second], strict=False)  # turns alternate first, second, first...
        if len(a) >= MIN_STEPS_PER_SLICE and len(b) >= MIN_STEPS_PER_SLICE
    ]
    return {**summarize(rounds, first, second), "job": {side: events[side]["job"][0][1:] for side in commands}}


def summarize(rounds: list[dict[str, Any]], first: str, second: str) -> dict[str, Any]:
    """Median ratio with its bootstrap 95 % interval, quartiles, min-max, the pooled ratios of all counted steps'
    means and medians, each side's mean step seconds and steps counted (RuntimeError: no round)."""
    if not rounds:
        raise RuntimeError("no round counted steps on both sides: raise the steps or the turn length")
    ratios = [r["ratio"] for r in rounds]
    pooled = {side: [t for r in rounds for t in r[side]] for side in (first, second)}
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
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
