"""What Lightning costs per training step on the main job: ``lit-ddp fit`` against a plain PyTorch DDP loop.

Both sides train the ``configs/mingpt/cpu.yaml`` model on the same batches per step (2 processes, gloo,
32 windows of 64 characters each), validation and sampling off, for ``--steps`` steps:

- plain: :mod:`bench.plain_ddp` (``DDP(model)``, ``DistributedSampler``, Muon/AdamW, clipping), with the
  model sizes, GPT options, learning rate, context, batch and process count read from the same YAMLs;
- Lightning: ``python -m lit_ddp fit`` with :class:`bench.step_timer.StepTimer` added to the callbacks,
  in a fresh run directory (so nothing resumes), everything else as the job runs it (logging every
  ``log_every_n_steps``, checkpoint callbacks, the NaN guard, the preemption agreement, the progress bar).

**Time-sliced interleaving.** This machine is shared: its speed drifts by up to 2x over seconds to minutes,
and runs taken one after the other differed by +-20 % in their step-time ratio, more than the effect
measured. So both sides run at once, each in its own process group, and only one is ever running: the
other is stopped (``SIGSTOP`` to its whole process group, ``SIGCONT`` to resume), and they swap every
``--slice_s`` seconds. A step counts when it started and ended inside one of its side's running slices
(steps start on the system-wide ``CLOCK_MONOTONIC``), is not the first in its slice (caches are cold
after a pause) and comes after the first ``--warmup`` steps (start-up). A *round* is one Lightning slice
and the plain slice just before it, a few seconds apart, so both see the same machine: its ratio is the
Lightning slice's mean step time over the plain slice's (means, not medians, so a periodic cost such as
logging every 50 steps counts in full). Printed: the median ratio over rounds with quartiles and min-max,
a bootstrap 95 % interval of that median, the pooled ratio of all counted steps' means (and medians), and
tokens/s and MFU of each side
(``GPT.flops_per_token`` x tokens/s per process / the fp32 matmul peak of one process's threads,
:mod:`bench.matmul_peak`).

    nice -n 10 .venv/bin/python -m bench.framework_overhead --steps 1000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from lit_ddp.models.gpt import GPTConfig

REPO = Path(__file__).resolve().parents[1]
SIDES = ("plain", "lightning")
MIN_STEPS_PER_SLICE = 3  # a round whose slices counted fewer steps (start-up, the end) is left out


def lightning_command(steps: int, warmup: int, json_path: Path, root: Path, extra: list[str]) -> list[str]:
    """The ``lit-ddp fit`` command line of the main job with validation and sampling off and a StepTimer."""
    configs = [arg for path in job_configs() for arg in ("--config", str(path.relative_to(REPO)))]
    return [
        sys.executable, "-m", "lit_ddp", "fit", *configs,
        "--trainer.max_steps", str(steps),
        "--trainer.val_check_interval", "100000",
        "--trainer.check_val_every_n_epoch", "null",  # else Lightning caps val_check_interval at an epoch
        "--model.init_args.sample_tokens", "0",
        "--trainer.callbacks+=bench.step_timer.StepTimer",
        f"--trainer.callbacks.init_args.path={json_path}",
        f"--trainer.callbacks.init_args.warmup_steps={warmup}",
        f"--trainer.callbacks.init_args.started_path={started_path(json_path)}",
        "--trainer.default_root_dir", str(root),
        *extra,
    ]  # fmt: skip


def job_configs() -> list[Path]:
    """The YAMLs of the main job, in ``--config`` order."""
    configs = [REPO / "configs/mingpt/cpu.yaml"]
    if (REPO / "configs/trainer/ddp.yaml").is_file():
        configs.insert(0, REPO / "configs/trainer/ddp.yaml")
    return configs


def plain_flags(configs: list[Path]) -> list[str]:
    """:mod:`bench.plain_ddp` flags for the work per step that the YAMLs configure: the model's sizes and
    GPT options, the learning rate, the context and batch, the number of processes."""
    model: dict[str, Any] = {}
    data: dict[str, Any] = {}
    trainer: dict[str, Any] = {}
    for path in configs:
        config = yaml.safe_load(path.read_text()) or {}
        model.update((config.get("model") or {}).get("init_args") or {})
        data.update((config.get("data") or {}).get("init_args") or {})
        trainer.update(config.get("trainer") or {})
    flags: list[str] = []
    for key, flag in (("model_type", "--model_type"), ("n_layer", "--n_layer"), ("n_head", "--n_head"),
                      ("n_embd", "--n_embd"), ("learning_rate", "--lr"), ("optimizer", "--optimizer"),
                      ("muon_learning_rate", "--muon_lr")):  # fmt: skip
        if model.get(key) is not None:
            flags += [flag, str(model[key])]
    for key, flag in (("block_size", "--block_size"), ("batch_size", "--batch_size")):
        if data.get(key) is not None:
            flags += [flag, str(data[key])]
    if isinstance(trainer.get("devices"), int):
        flags += ["--procs", str(trainer["devices"])]
    gpt_fields = {f.name for f in fields(GPTConfig)} - {"n_layer", "n_head", "n_embd", "block_size", "vocab_size"}
    for key in sorted(gpt_fields & set(model)):
        flags += ["--gpt", f"{key}={model[key]}"]
    return flags


def plain_command(steps: int, warmup: int, json_path: Path, flags: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "bench.plain_ddp", "--mode", "ddp", "--no_mfu",
        "--steps", str(steps), "--warmup", str(warmup), "--json", str(json_path),
        "--started_file", str(started_path(json_path)), *flags,
    ]  # fmt: skip


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
    """Lets the sides run one at a time, ``slice_s`` seconds each, in turn, until one exits; then lets the
    others run to their end. Returns the running slices ``(side, start, stop)`` (``CLOCK_MONOTONIC`` s)
    during which both sides were alive.

    Raises:
        TimeoutError: the sides did not all exit within ``timeout`` seconds (they are killed).
    """
    clock = time.CLOCK_MONOTONIC
    deadline = time.monotonic() + timeout
    slices: list[tuple[str, float, float]] = []
    for proc in procs.values():
        signal_group(proc, signal.SIGSTOP)
    try:
        turn = 0
        while all(p.poll() is None for p in procs.values()):
            name = SIDES[turn % len(SIDES)]
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


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Runs both sides interleaved (see the module docstring); returns their records, slices and rounds."""
    flags = plain_flags(job_configs())
    paths = {side: work / f"{side}.json" for side in SIDES}
    commands = {
        "plain": plain_command(args.steps, args.warmup, paths["plain"], flags),
        "lightning": lightning_command(args.steps, args.warmup, paths["lightning"], work / "run", args.lightning_args),
    }
    print(f"plain loop: python -m bench.plain_ddp {' '.join(flags)}", flush=True)
    logs = {side: open(work / f"{side}.log", "w") for side in SIDES}  # noqa: SIM115 - closed below
    procs: dict[str, subprocess.Popen] = {}
    try:
        # Start-up (imports, process group, data) runs alone, one side after the other, so that the
        # interleaving begins with both at their first step and both have --steps steps left.
        for side in SIDES:
            procs[side] = subprocess.Popen(
                commands[side], cwd=REPO, env=bench_env(), stdout=logs[side], stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: SIGSTOP reaches every rank of that side
            )  # fmt: skip
            try:
                run_until_started(procs[side], started_path(paths[side]), args.timeout)
            except (RuntimeError, TimeoutError) as err:
                tail = (work / f"{side}.log").read_text()[-3000:]
                raise RuntimeError(f"{side}: {err}:\n{tail}") from err
            signal_group(procs[side], signal.SIGSTOP)
        slices = interleave(procs, args.slice_s, timeout=args.timeout)
    except BaseException:
        for proc in procs.values():
            signal_group(proc, signal.SIGKILL)
            signal_group(proc, signal.SIGCONT)
        raise
    finally:
        for log in logs.values():
            log.close()
    records = {}
    for side in SIDES:
        if procs[side].returncode != 0 or not paths[side].is_file():
            tail = (work / f"{side}.log").read_text()[-3000:]
            raise RuntimeError(f"{side} run failed (exit {procs[side].returncode}):\n{tail}")
        record = json.loads(paths[side].read_text())
        records[side] = record.get("ddp", record)  # plain_ddp's JSON holds its results by mode
    counted = {
        side: steps_in_slices(
            records[side]["step_starts"], [(a, b) for name, a, b in slices if name == side], args.warmup
        )
        for side in SIDES
    }
    # Slices alternate plain, lightning, plain, ...: round k is lightning slice k and plain slice k before it.
    rounds = []
    for plain, lightning in zip(counted["plain"], counted["lightning"], strict=False):
        if len(plain) >= MIN_STEPS_PER_SLICE and len(lightning) >= MIN_STEPS_PER_SLICE:
            rounds.append(
                {"plain": plain, "lightning": lightning, "ratio": statistics.mean(lightning) / statistics.mean(plain)}
            )
    return {"records": records, "slices": slices, "rounds": rounds}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps per side")
    parser.add_argument("--warmup", type=int, default=30, help="first steps of each side left out")
    parser.add_argument("--slice_s", type=float, default=1.0, help="seconds each side runs before they swap")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds before both sides are killed")
    parser.add_argument("--peak_flops", type=float, default=None, help="FLOP/s of one process; default: measured")
    parser.add_argument("--json", type=Path, default=None, help="write all step times and figures here")
    parser.add_argument("lightning_args", nargs="*", help="extra lit-ddp arguments (after --)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="framework_overhead_") as tmp:
        result = measure(args, Path(tmp))
    rounds = result["rounds"]
    if not rounds:
        raise RuntimeError("no round counted steps on both sides: raise --steps or --slice_s")
    ratios = [r["ratio"] for r in rounds]
    pooled = {side: [t for r in rounds for t in r[side]] for side in SIDES}
    q1, q3 = quartiles(ratios)
    low, high = bootstrap_median_interval(ratios)
    summary: dict[str, Any] = {
        "rounds": len(rounds),
        "slice_s": args.slice_s,
        "ratio_median": statistics.median(ratios),
        "ratio_q1": q1,
        "ratio_q3": q3,
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_median_ci95": [low, high],
        "pooled_ratio_of_means": statistics.mean(pooled["lightning"]) / statistics.mean(pooled["plain"]),
        "pooled_ratio_of_medians": statistics.median(pooled["lightning"]) / statistics.median(pooled["plain"]),
    }
    print(
        f"Lightning / plain step time over {len(rounds)} rounds of {args.slice_s:g} s slices: median "
        f"{summary['ratio_median']:.3f} (95% interval of the median {low:.3f}-{high:.3f}; quartiles {q1:.3f}-{q3:.3f}, "
        f"min {min(ratios):.3f}, max {max(ratios):.3f}); "
        f"all counted steps: ratio of means {summary['pooled_ratio_of_means']:.3f}, "
        f"of medians {summary['pooled_ratio_of_medians']:.3f}"
    )

    records = result["records"]
    peak = args.peak_flops
    if peak is None:
        from bench.plain_ddp import peak_flops

        peak = peak_flops(records["plain"]["threads_per_proc"])
    for side in SIDES:
        step = statistics.mean(pooled[side])
        record = records[side]
        tokens_per_s = record["tokens_per_step"] / step
        mfu = record["flops_per_token"] * tokens_per_s / record["procs"] / peak
        summary[side] = {
            "mean_step_s": step,
            "steps_counted": len(pooled[side]),
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
        }
        print(
            f"{side:>9}: {1e3 * step:.1f} ms/step ({len(pooled[side])} steps counted), {tokens_per_s:,.0f} tokens/s, "
            f"MFU {100 * mfu:.1f}% (peak {peak / 1e9:.0f} GFLOP/s per process)"
        )
    summary["peak_flops_per_proc"] = peak
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, **result}, indent=2))
    return summary


if __name__ == "__main__":
    main()
