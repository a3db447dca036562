"""What Lightning costs per training step on the main job: ``lit-ddp fit`` against :mod:`bench.plain_ddp` (the
same model, optimizer, schedule and batches from the same YAMLs; 2 gloo processes, validation and sampling off), in
turns (:mod:`bench.harness.turns`): the median ratio over rounds and each side's tokens/s and MFU (docs/speed.md).

    nice -n 10 .venv/bin/python -m bench.framework_overhead --steps 1000
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from bench.harness import turns
from bench.harness.clock import job_figures
from bench.harness.launch import NO_VALIDATION, REPO, fit_command, without_samples
from bench.harness.measure import arguments, peak_flops, write_json
from lit_ddp.models.gpt import GPTConfig

CONFIGS = ("configs/trainer/ddp.yaml", "configs/mingpt/cpu.yaml")  # the main job's, in --config order
SIDES = ("plain", "lightning")  # a round: a lightning turn over the plain turn before it
FLAGS = {"model_type": "--model_type", "n_layer": "--n_layer", "n_head": "--n_head", "n_embd": "--n_embd",
         "learning_rate": "--lr", "optimizer": "--optimizer", "muon_learning_rate": "--muon_lr",
         "warmup_steps": "--lr_warmup_steps", "min_lr_ratio": "--min_lr_ratio"}  # fmt: skip


def plain_flags(configs: tuple[str, ...] = CONFIGS) -> list[str]:
    """:mod:`bench.plain_ddp` flags for the work per step the YAMLs configure: the model's sizes and GPT options,
    the optimizer, learning rates and schedule, the context and batch, the number of processes."""
    model: dict[str, Any] = {}
    data: dict[str, Any] = {}
    trainer: dict[str, Any] = {}
    for path in configs:
        config = yaml.safe_load((REPO / path).read_text()) or {}
        model.update((config.get("model") or {}).get("init_args") or {})
        data.update((config.get("data") or {}).get("init_args") or {})
        trainer.update(config.get("trainer") or {})
    flags = [a for key, flag in FLAGS.items() if model.get(key) is not None for a in (flag, str(model[key]))]
    flags += [
        a for key in ("block_size", "batch_size") if data.get(key) is not None for a in (f"--{key}", str(data[key]))
    ]
    flags += ["--procs", str(trainer["devices"])] if isinstance(trainer.get("devices"), int) else []
    gpt_fields = {f.name for f in fields(GPTConfig)} - {"n_layer", "n_head", "n_embd", "block_size", "vocab_size"}
    return flags + [a for key in sorted(gpt_fields & set(model)) for a in ("--gpt", f"{key}={model[key]}")]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = arguments(__doc__)
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps per side")
    turns.add_arguments(parser, warmup=30, slice_s=1.0)
    parser.add_argument("--peak_flops", type=float, default=None, help="FLOP/s of one process; default: measured")
    parser.add_argument("lightning_args", nargs="*", help="extra lit-ddp arguments (after --)")
    args = parser.parse_args(argv)

    flags = plain_flags()
    print(f"plain loop: python -m bench.plain_ddp {' '.join(flags)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="framework_overhead_") as tmp:
        clocks = {side: Path(tmp) / f"{side}.clock" for side in SIDES}
        plain = [sys.executable, "-m", "bench.plain_ddp", "--mode", "ddp", "--no_mfu", "--steps", str(args.steps),
                 "--warmup", str(args.warmup), "--clock", str(clocks["plain"]), *flags]  # fmt: skip
        fit_args = [*NO_VALIDATION, without_samples(*CONFIGS), "--trainer.max_steps", str(args.steps)]
        lightning = fit_command(*CONFIGS, root=Path(tmp) / "run", clock=clocks["lightning"],
                                args=[*fit_args, *args.lightning_args])  # fmt: skip
        commands = {"plain": plain, "lightning": lightning}
        summary = turns.run_in_turns(commands, clocks, Path(tmp), args.slice_s, args.warmup, args.timeout)
    summary["slice_s"] = args.slice_s
    print(f"Lightning / plain step time, turns of {args.slice_s:g} s: {turns.describe(summary)}")
    peak = args.peak_flops or peak_flops(threads=int(summary["job"]["plain"][2]))
    for side in SIDES:
        s = job_figures(summary["job"][side], summary["mean_step_s"][side], peak)
        summary[side] = s = {**s, "steps_counted": summary["steps_counted"][side]}
        print(f"{side:>9}: {1e3 * s['mean_step_s']:.1f} ms/step ({s['steps_counted']} steps counted), "
              f"{s['tokens_per_s']:,.0f} tokens/s, MFU {100 * s['mfu']:.1f}% (peak {peak / 1e9:.0f} GFLOP/s per process)")  # fmt: skip
    summary["peak_flops_per_proc"] = peak
    write_json(args.json, summary)
    return summary


if __name__ == "__main__":
    main()
