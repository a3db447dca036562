"""What Lightning costs per training step on the main job: ``lit-ddp fit`` against a plain PyTorch DDP loop.

Both sides train the ``configs/mingpt/cpu.yaml`` model on the same batches per step (2 processes, gloo,
32 windows of 64 characters each), validation and sampling off, for ``--steps`` steps:

- plain: :mod:`bench.plain_ddp` (``DDP(model)``, ``DistributedSampler``, the job's optimizer and schedule
  from :mod:`lit_ddp.recipe`, clipping), with the model sizes, GPT options, learning rates and schedule,
  context, batch and process count read from the same YAMLs;
- Lightning: ``python -m lit_ddp fit`` with :class:`bench.step_timer.StepTimer` added to the callbacks (and
  the YAMLs' text-sample callback left out), in a fresh run directory (so nothing resumes), everything else
  as the job runs it (logging every ``log_every_n_steps``, the throughput monitor, checkpoint callbacks,
  the NaN guard, the preemption agreement, the progress bar).

The two run in turns of ``--slice_s`` seconds, both alive at once (:mod:`bench.turns`: this shared machine's
speed drifts more than the effect measured); a round is a Lightning turn and the plain turn just before it.
Printed: the median ratio over rounds with a bootstrap 95 % interval, quartiles and min-max, the pooled
ratio of all counted steps' means (and medians), and tokens/s and MFU of each side (``GPT.flops_per_token``
x tokens/s per process / the fp32 matmul peak of one process's threads, :mod:`bench.matmul_peak`).

    nice -n 10 .venv/bin/python -m bench.framework_overhead --steps 1000
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from bench import turns
from bench.turns import started_path
from lit_ddp.models.gpt import GPTConfig

REPO = Path(__file__).resolve().parents[1]
SIDES = ("plain", "lightning")  # a round: a lightning turn over the plain turn before it


def lightning_command(steps: int, warmup: int, json_path: Path, root: Path, extra: list[str]) -> list[str]:
    """The ``lit-ddp fit`` command line of the main job with validation and sampling off and a StepTimer."""
    configs = [arg for path in job_configs() for arg in ("--config", str(path.relative_to(REPO)))]
    return [
        sys.executable, "-m", "lit_ddp", "fit", *configs,
        "--trainer.max_steps", str(steps),
        "--trainer.val_check_interval", "100000",
        "--trainer.check_val_every_n_epoch", "null",  # else Lightning caps val_check_interval at an epoch
        f"--trainer.callbacks={json.dumps(job_callbacks(job_configs()))}",  # without the text samples
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


def job_callbacks(configs: list[Path]) -> list[dict[str, Any]]:
    """``trainer.callbacks`` of the YAMLs (a later file's list replaces an earlier one's, as in jsonargparse)
    without the text-sample callback: sampling is off, as on the plain side."""
    callbacks: list[dict[str, Any]] = []
    for path in configs:
        trainer = (yaml.safe_load(path.read_text()) or {}).get("trainer") or {}
        callbacks = trainer.get("callbacks", callbacks)
    return [c for c in callbacks if not c["class_path"].endswith(".TextSampleCallback")]


def plain_flags(configs: list[Path]) -> list[str]:
    """:mod:`bench.plain_ddp` flags for the work per step that the YAMLs configure: the model's sizes and
    GPT options, the optimizer, learning rates and schedule, the context and batch, the number of processes."""
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
                      ("muon_learning_rate", "--muon_lr"), ("warmup_steps", "--lr_warmup_steps"),
                      ("min_lr_ratio", "--min_lr_ratio")):  # fmt: skip
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

    flags = plain_flags(job_configs())
    print(f"plain loop: python -m bench.plain_ddp {' '.join(flags)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="framework_overhead_") as tmp:
        work = Path(tmp)
        paths = {side: work / f"{side}.json" for side in SIDES}
        commands = {
            "plain": plain_command(args.steps, args.warmup, paths["plain"], flags),
            "lightning": lightning_command(
                args.steps, args.warmup, paths["lightning"], work / "run", args.lightning_args
            ),
        }
        result = turns.run_in_turns(commands, paths, work, args.slice_s, args.warmup, args.timeout)
    records = {side: record.get("ddp", record) for side, record in result["records"].items()}  # plain_ddp: by mode
    result["records"] = records
    result["rounds"] = turns.pair_rounds(result, {side: records[side]["step_starts"] for side in SIDES}, args.warmup)
    summary = turns.summarize_rounds(result["rounds"], *SIDES)
    summary["slice_s"] = args.slice_s
    print(f"Lightning / plain step time, turns of {args.slice_s:g} s: {turns.describe(summary)}")

    peak = args.peak_flops
    if peak is None:
        from bench.plain_ddp import peak_flops

        peak = peak_flops(records["plain"]["threads_per_proc"])
    for side in SIDES:
        step = summary["mean_step_s"][side]
        record = records[side]
        tokens_per_s = record["tokens_per_step"] / step
        mfu = record["flops_per_token"] * tokens_per_s / record["procs"] / peak
        summary[side] = {
            "mean_step_s": step,
            "steps_counted": summary["steps_counted"][side],
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
        }
        print(
            f"{side:>9}: {1e3 * step:.1f} ms/step ({summary['steps_counted'][side]} steps counted), "
            f"{tokens_per_s:,.0f} tokens/s, MFU {100 * mfu:.1f}% (peak {peak / 1e9:.0f} GFLOP/s per process)"
        )
    summary["peak_flops_per_proc"] = peak
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, **result}, indent=2))
    return summary


if __name__ == "__main__":
    main()
