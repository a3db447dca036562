"""What Lightning costs per training step on the main job: ``lit-ddp fit`` against a plain PyTorch DDP loop.

Both sides train the ``configs/mingpt/cpu.yaml`` model on the same batches per step (2 processes, gloo,
32 windows of 64 characters each), validation and sampling off, for ``--steps`` steps; each runs in its
own subprocess, and only its steady-state steps are timed (start-up and the first ``--warmup`` steps are
left out):

- plain: :mod:`bench.plain_ddp` (``DDP(model)``, ``DistributedSampler``, AdamW, clipping), with the
  model sizes, GPT options, learning rate, context, batch and process count read from the same YAMLs;
- Lightning: ``python -m lit_ddp fit`` with :class:`bench.step_timer.StepTimer` added to the callbacks,
  in a fresh run directory (so nothing resumes).

The two alternate for ``--rounds`` rounds (which one goes first alternates too), so load from other
processes on the machine hits both alike. A run's step time is the median of its timed steps (a step
another process stalled is an outlier, not the loop's cost). Printed: per round both step times and their
ratio Lightning / plain (and the ratio of mean step times); then the median ratio with its min-max over rounds, tokens/s and MFU
(``GPT.flops_per_token`` x tokens/s per process / the fp32 matmul peak of one process's threads,
:mod:`bench.matmul_peak`).

    nice -n 10 .venv/bin/python -m bench.framework_overhead --rounds 3 --steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from lit_ddp.models.gpt import GPTConfig

REPO = Path(__file__).resolve().parents[1]


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
        "--steps", str(steps), "--warmup", str(warmup), "--json", str(json_path), *flags,
    ]  # fmt: skip


def run_side(name: str, command: list[str], json_path: Path, log: Path) -> dict[str, Any]:
    """Runs one side in a subprocess; returns its step-time record (raises with the log tail on failure)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as out:
        proc = subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=900)
    if proc.returncode != 0 or not json_path.is_file():
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{name} run failed (exit {proc.returncode}); log {log}:\n{tail}")
    record = json.loads(json_path.read_text())
    return record.get("ddp", record)  # plain_ddp's JSON holds its results by mode


def step_time(record: dict[str, Any]) -> float:
    """A run's steady-state step time: the median of its timed steps (seconds). The median, not the mean: a
    step that another process on this shared machine stalled says nothing about either loop."""
    times = record["step_times"]
    if not times:
        raise RuntimeError("no steady-state steps were timed: raise --steps or lower --warmup")
    return statistics.median(times)


def mean_step(record: dict[str, Any]) -> float:
    return sum(record["step_times"]) / len(record["step_times"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=30, help="first step intervals left out")
    parser.add_argument("--peak_flops", type=float, default=None, help="FLOP/s of one process; default: measured")
    parser.add_argument("--json", type=Path, default=None, help="write all step times and figures here")
    parser.add_argument("lightning_args", nargs="*", help="extra lit-ddp arguments (after --)")
    args = parser.parse_args(argv)

    flags = plain_flags(job_configs())
    print(f"plain loop: python -m bench.plain_ddp {' '.join(flags)}", flush=True)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="framework_overhead_") as tmp:
        work = Path(tmp)
        for r in range(args.rounds):
            order = ["plain", "lightning"] if r % 2 == 0 else ["lightning", "plain"]
            result: dict[str, Any] = {}
            for side in order:
                json_path = work / f"{side}_{r}.json"
                if side == "plain":
                    command = plain_command(args.steps, args.warmup, json_path, flags)
                else:
                    command = lightning_command(
                        args.steps, args.warmup, json_path, work / f"run_{r}", args.lightning_args
                    )
                result[side] = run_side(side, command, json_path, work / f"{side}_{r}.log")
            ratio = step_time(result["lightning"]) / step_time(result["plain"])
            result["ratio"] = ratio
            result["ratio_of_means"] = mean_step(result["lightning"]) / mean_step(result["plain"])
            rounds.append(result)
            print(
                f"round {r + 1}: median step plain {1e3 * step_time(result['plain']):.1f} ms, "
                f"lightning {1e3 * step_time(result['lightning']):.1f} ms, ratio {ratio:.3f} "
                f"(of means {result['ratio_of_means']:.3f})",
                flush=True,
            )

    ratios = [r["ratio"] for r in rounds]
    summary: dict[str, Any] = {
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }
    summary["ratio_of_means_median"] = statistics.median(r["ratio_of_means"] for r in rounds)
    print(
        f"Lightning / plain step time: median {summary['ratio_median']:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}, {len(ratios)} rounds)"
        f"; ratio of mean step times: median {summary['ratio_of_means_median']:.3f}"
    )

    first = rounds[0]["plain"]
    peak = args.peak_flops
    if peak is None:
        from bench.plain_ddp import peak_flops

        peak = peak_flops(first["threads_per_proc"])
    for side in ("plain", "lightning"):
        step = statistics.median(step_time(r[side]) for r in rounds)
        record = rounds[0][side]
        tokens_per_s = record["tokens_per_step"] / step
        mfu = record["flops_per_token"] * tokens_per_s / record["procs"] / peak
        summary[side] = {"median_step_s": step, "tokens_per_s": tokens_per_s, "mfu": mfu}
        print(
            f"{side:>9}: {1e3 * step:.1f} ms/step, {tokens_per_s:,.0f} tokens/s, MFU {100 * mfu:.1f}% (peak {peak / 1e9:.0f} GFLOP/s per process)"
        )
    summary["peak_flops_per_proc"] = peak
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rounds": rounds}, indent=2))
    return summary


if __name__ == "__main__":
    main()
