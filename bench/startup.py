"""Where the seconds from launch to the GPU main job's first optimizer step go, part by part (:data:`PARTS`), for
each ``compile`` choice (docs/speed.md, "Start-up, part by part"): ``lit-ddp fit`` of the DDP fragment and gpu.yaml on
one process, batch 4 x 256 on a CPU, each choice in a process of its own with a cold Inductor cache. Then the pace (a
step of each choice, the choices by turns in one process), the estimate of launch to val/loss 1.4697 (the first step
plus ``--steps_to_target`` steps at that pace), and validation's cost: an eager batch, gpu.yaml's 7 batches in steps,
its text sample, and the validation interval that costs least to see 1.4697 crossed.

    python -m bench.startup                          # none, blocks, model: a few minutes on this CPU
    python -m bench.startup --accelerator gpu --batch_size 64      # on a GPU (not run on one yet)
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.launch import QUIET, REPO, bench_env, fit_command, process_started_at
from bench.harness.measure import arguments, fmt, markdown_table, timing, write_json

CHOICES: dict[str, bool | str] = {"none": False, "blocks": "blocks", "model": True}  # --compile: GPTModule's
GPU_JOB = ("configs/trainer/ddp.yaml", "configs/mingpt/gpu.yaml")
STEPS_TO_TARGET = 800  # the H200's main job: 1.4752 at step 750, 1.4475 at 1,000 (linear between: ~800)
VALIDATION_BATCHES = 7  # gpu.yaml's validation split: 390 windows of 256, 7 batches of 64
PARTS = ("imports", "config and CLI", "process group", "data", "model build", "strategy set-up", "sanity check",
         "other", "first step")  # fmt: skip
TIMED = {  # part: (module, class, method) whose calls it sums
    "process group": ("lit_ddp.strategies", "DDPStrategy", "setup_environment"),
    "strategy set-up": ("lit_ddp.strategies", "DDPStrategy", "setup"),
    "data": ("lit_ddp.data.char", "CharDataModule", "prepare_data"),
    "data ": ("lit_ddp.data.device_char", "DeviceCharDataModule", "setup"),  # its own, which calls CharDataModule's
    "model build": ("lit_ddp.tasks.mingpt", "GPTModule", "configure_model"),
}


def fit_args(compile: str, accelerator: str, batch_size: int, steps: int, root: str) -> list[str]:
    """gpu.yaml's fit with one validation of :data:`VALIDATION_BATCHES` batches after the third step."""
    args = ["--trainer.accelerator", accelerator, "--trainer.devices", "1", "--trainer.max_steps", str(steps),
            "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", str(VALIDATION_BATCHES), *QUIET[:2],
            "--data.init_args.batch_size", str(batch_size), "--model.init_args.compile", str(CHOICES[compile]).lower()]  # fmt: skip
    return fit_command(*(str(REPO / c) for c in GPU_JOB), root=Path(root), args=args)[3:]


# ---------------------------------------------------------------------------------------------------------------
# The child: one fit, its parts timed


def child(out: Path, args: list[str]) -> None:
    """Runs ``lit-ddp fit ARGS`` in this process with the parts timed, and writes them to ``out`` as JSON."""
    launched = process_started_at()
    import importlib

    from lightning.pytorch import Callback

    import lit_ddp.cli

    imported = time.time()
    calls: dict[str, list[tuple[float, float]]] = {part.strip(): [] for part in TIMED}  # (start, seconds)
    marks: dict[str, float] = {}
    for part, (module, cls, method) in TIMED.items():
        owner = getattr(importlib.import_module(module), cls)
        setattr(owner, method, timing(getattr(owner, method), calls[part.strip()]))

    class Marks(Callback):
        steps: list[tuple[int, float, float]] = []  # (global step, start, end)
        validation: dict[str, Any] = {"batches": [], "start": 0.0, "end": 0.0, "loop_end": 0.0}

        def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
            if not trainer.sanity_checking:
                Marks.validation["start"] = time.time()

        def on_validation_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            if not trainer.sanity_checking:
                Marks.validation["batches"].append(time.time())

        def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            if not trainer.sanity_checking:
                Marks.validation["loop_end"] = time.time()

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:  # after the text sample's (listed first)
            if not trainer.sanity_checking:
                Marks.validation["end"] = time.time()

        def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
            marks["sanity start"] = time.time()

        def on_sanity_check_end(self, trainer: Any, pl_module: Any) -> None:
            calls["sanity check"] = [(marks["sanity start"], time.time() - marks["sanity start"])]

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, i: int) -> None:
            Marks.steps.append((trainer.global_step + 1, time.time(), 0.0))

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            step, start, _ = Marks.steps[-1]
            Marks.steps[-1] = (step, start, time.time())

    original = lit_ddp.cli.LitDDPCLI.instantiate_trainer

    def instantiate_trainer(self: Any, **kwargs: Any) -> Any:
        trainer: Any = original(self, **kwargs)
        trainer.callbacks.append(Marks())
        return trainer

    lit_ddp.cli.LitDDPCLI.instantiate_trainer = instantiate_trainer  # type: ignore[method-assign]
    lit_ddp.cli.cli_main(args)
    steps, val = Marks.steps, Marks.validation
    first_start, first_end = steps[0][1], steps[0][2]
    # Start to start, from step 2 on, leaving out the one validation falls in.
    later = [b[1] - a[1] for a, b in zip(steps[1:], steps[2:], strict=False) if not a[1] < val["start"] < b[1]]
    step_s = statistics.median(later) if later else steps[-1][2] - steps[-1][1]
    batches = val["batches"]
    batch_s = statistics.median(b - a for a, b in zip(batches, [*batches[1:], val["loop_end"]], strict=True))
    parts = {"imports": imported - launched, "config and CLI": calls["process group"][0][0] - imported}
    parts |= {k: sum(s for _, s in calls.get(k, [])) for k in PARTS[2:7]}
    parts["first step"] = first_end - first_start
    parts["other"] = first_start - launched - sum(v for k, v in parts.items() if k != "first step")
    result = {
        "parts": parts,
        "launch_to_first_step_s": first_end - launched,
        "compile_s": max(parts["first step"] - step_s, 0.0),
        "step_s": step_s,
        "steps": [s[0] for s in steps],
        "validation_batch_s": batch_s,  # its forward (eager, whatever the compile choice)
        "validation_s": val["end"] - val["start"],  # the batches, the loop, the text sample
        "validation_sample_s": val["end"] - val["loop_end"],  # after the loop: mostly the text sample
    }
    out.write_text(json.dumps(result, indent=1))


# ---------------------------------------------------------------------------------------------------------------
# The pace: the choices' training steps by turns in one process, so that a shared CPU's load falls on all alike


def pace(choices: list[str], batch_size: int, rounds: int, device: str = "cpu") -> dict[str, float]:
    """Median seconds of a training step of gpu.yaml's model (forward, backward, clipping, the optimizer step as
    gpu.yaml's BatchedOptimizerStep makes it; bf16 autocast) for each compile choice, stepped by turns after a first
    step each (its compiling)."""
    import torch

    from bench.harness.measure import alternate, seconds
    from bench.harness.ops import VOCAB, recipe_model, train_step
    from lit_ddp.callbacks.batched_step import batch_optimizer_step

    sync = torch.cuda.synchronize if device == "cuda" else None

    def job(choice: str) -> Any:
        module, built = recipe_model(compile=CHOICES[choice], device=device)
        optimizer = batch_optimizer_step(built)
        x = torch.randint(0, len(VOCAB), (batch_size, module.hparams["block_size"]), device=device)

        step = functools.partial(train_step, module, optimizer, x, x, torch.autocast(device, dtype=torch.bfloat16))
        step()  # compiles
        return step

    steps = {choice: job(choice) for choice in choices}
    timed = alternate({c: functools.partial(seconds, f, sync) for c, f in steps.items()}, rounds)
    return {c: statistics.median(t) for c, t in timed.items()}


# ---------------------------------------------------------------------------------------------------------------
# The parent: one child per compile choice, the table


def measure(compile: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "startup.json"
        fit = fit_args(compile, args.accelerator, args.batch_size, args.steps, str(Path(tmp) / "run"))
        # A cold compile; torch's log of each recompilation (its first validation must cause none: issue 52)
        env = bench_env(TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "inductor"), TORCH_LOGS="recompiles")
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [sys.executable, "-m", "bench.startup", "--child", str(out), "--", *fit]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        result = json.loads(out.read_text())
        result["recompiles"] = [line for line in done.stderr.splitlines() if "Recompiling" in line]
        return result


def estimate(result: dict[str, Any], step_s: float, steps_to_target: int) -> None:
    """Adds to a child's ``result`` the estimates at ``step_s`` seconds a step: seconds from launch to 1.4697, the
    validation's cost in steps, and the validation interval that costs least to see the crossing."""
    result["paced_step_s"] = step_s
    result["to_target_s"] = result["launch_to_first_step_s"] + (steps_to_target - 1) * step_s
    # A validation every I steps sees the crossing I / 2 steps late on average and costs V steps each, S / I of them
    # before it: I / 2 + V S / I, least at I = sqrt(2 V S) (text samples apart: gpu.yaml draws one every 5).
    result["validation_steps"] = VALIDATION_BATCHES * result["validation_batch_s"] / step_s
    result["best_interval"] = math.sqrt(2 * result["validation_steps"] * steps_to_target)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(Path(argv[1]), argv[3:])
        return {}
    parser = arguments(__doc__, raw=True)
    parser.add_argument("--compile", nargs="+", choices=list(CHOICES), default=list(CHOICES))
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--batch_size", type=int, default=4, help="sequences of 256 tokens per step")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps of each fit (later steps: the pace)")
    parser.add_argument("--steps_to_target", type=int, default=STEPS_TO_TARGET)
    parser.add_argument("--rounds", type=int, default=5, help="training steps of each choice by turns, for the pace")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for each fit")
    args = parser.parse_args(argv)
    results = {c: measure(c, args) for c in args.compile}
    device = "cuda" if args.accelerator == "gpu" else "cpu"
    for choice, step_s in pace(args.compile, args.batch_size, args.rounds, device).items():
        estimate(results[choice], step_s, args.steps_to_target)
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    print(f"gpu.yaml's model from launch to its first optimizer step, seconds: {args.accelerator}, {threads} thread(s), "
          f"batch {args.batch_size} x 256, bf16 autocast, a cold Inductor cache")  # fmt: skip
    rows = [[p, *(fmt(r["parts"][p]) for r in results.values())] for p in PARTS]
    rows += [["launch to the first step", *(fmt(r["launch_to_first_step_s"]) for r in results.values())],
             ["of which compiling (first step - a later one)", *(fmt(r["compile_s"]) for r in results.values())],
             ["a later step (in the fit)", *(fmt(r["step_s"], ".2f") for r in results.values())],
             ["a step, the choices by turns (median)", *(fmt(r["paced_step_s"], ".2f") for r in results.values())],
             [f"estimate to 1.4697: first step + {args.steps_to_target - 1} steps",
              *(fmt(r["to_target_s"], ".0f") for r in results.values())],
             ["a validation batch (eager forward)", *(fmt(r["validation_batch_s"], ".2f") for r in results.values())],
             [f"a validation ({VALIDATION_BATCHES} batches), in steps",
              *(fmt(r["validation_steps"], ".1f") for r in results.values())],
             ["its text sample (200 tokens)", *(fmt(r["validation_sample_s"], ".1f") for r in results.values())],
             ["validation interval costing least to see 1.4697, steps",
              *(fmt(r["best_interval"], ".0f") for r in results.values())],
             ["recompilations (TORCH_LOGS=recompiles; its first validation included)",
              *(str(len(r["recompiles"])) for r in results.values())]]  # fmt: skip
    print(markdown_table(["compile:", *results], rows))
    for choice, r in results.items():
        for line in r["recompiles"]:
            print(f"{choice}: {line.strip()}")
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
