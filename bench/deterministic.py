"""What deterministic kernels (``configs/checkpoint/exact.yaml``) cost: tokens/s with and without them, by turns
(``CUBLAS_WORKSPACE_CONFIG`` set for both: only the algorithms differ). ``--fits`` (``make bench-deterministic``):
``lit-ddp fit`` of ``ddp.yaml`` + ``tutorial.yaml`` on ``--devices`` CPU processes at gpt-mini, each fit's median step
from its step clock; else the step alone (the GPU check): the tutorial GPT, random windows made on the device, the
recipe's AdamW, bf16 autocast on CUDA.

    python -m bench.deterministic --fits --rounds 1 --steps 12 --warmup 4     # the plumbing of the fits
    python -m bench.deterministic --device cpu --tiny                         # the step's, on a CPU
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before torch initializes cuBLAS: both modes use it

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.harness.clock import read_clock, step_seconds  # noqa: E402
from bench.harness.launch import QUIET, fit_command, run  # noqa: E402
from bench.harness.measure import alternate, arguments, seconds, write_json  # noqa: E402
from bench.harness.ops import train_step  # noqa: E402
from lit_ddp.models.gpt import GPT, GPTConfig  # noqa: E402
from lit_ddp.recipe import build_optimizer  # noqa: E402

FITS = {"model_type": "gpt-mini", "batch_size": 8, "block_size": 128, "steps": 40, "warmup": 10, "rounds": 2}
STEP = {"model_type": "tutorial", "batch_size": 216, "block_size": 128, "steps": 20, "warmup": 3, "rounds": 3}
TINY = {"model_type": "gpt-nano", "batch_size": 8, "block_size": 32, "steps": 5, "warmup": 1}


def fit(args: argparse.Namespace, deterministic: bool, work: Path) -> float:
    """One fit; the median seconds of its optimizer steps after the warm-up."""
    work = Path(tempfile.mkdtemp(dir=work))
    fit_args = ["--trainer.accelerator", "cpu", "--trainer.devices", str(args.devices), "--trainer.precision", "32-true",
                "--model.init_args.model_type", args.model_type, "--model.init_args.dropout", "0.1",
                "--data.init_args.batch_size", str(args.batch_size), "--data.init_args.num_workers", "0",
                "--trainer.max_steps", str(args.steps), "--trainer.limit_val_batches", "0",
                "--trainer.deterministic", str(deterministic).lower(), *QUIET]  # fmt: skip
    configs = ("configs/trainer/ddp.yaml", "configs/mingpt/tutorial.yaml")
    run(fit_command(*configs, root=work / "run", clock=work / "clock.txt", args=fit_args), timeout=600)
    if not (steps := step_seconds(read_clock(work / "clock.txt"), args.warmup)):
        raise RuntimeError(f"no step timed: ask for more than --warmup {args.warmup} + 1 steps")
    return statistics.median(steps)


def step(args: argparse.Namespace) -> Callable[[bool], float]:
    """The seconds of ``args.steps`` training steps after ``args.warmup``, deterministic or not."""
    device = torch.device(args.device)
    torch.manual_seed(1337)
    model = GPT(GPTConfig.from_preset(args.model_type, block_size=args.block_size, vocab_size=65, dropout=0.1))
    model.to(device)
    optimizer = build_optimizer(model, "adamw")  # the tutorial's: lr 3e-4, weight decay 0.1, betas (0.9, 0.95)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def steps(n: int) -> None:
        for _ in range(n):
            x, y = torch.randint(65, (2, args.batch_size, args.block_size), device=device)  # (B, T) each
            train_step(model, optimizer, x, y, autocast)

    def timed(on: bool) -> float:
        torch.backends.cudnn.benchmark = False  # Trainer(deterministic=on)'s settings, less the workspace
        torch.use_deterministic_algorithms(on)
        steps(args.warmup)
        took = seconds(lambda: steps(args.steps), torch.cuda.synchronize if device.type == "cuda" else None)
        torch.use_deterministic_algorithms(False)
        return took

    return timed


def main(argv: list[str] | None = None) -> dict:
    parser = arguments(__doc__, json_help="also write the result here")
    parser.add_argument("--fits", action="store_true", help="lit-ddp fit on CPU processes, not the step alone")
    parser.add_argument("--devices", type=int, default=2, help="--fits: processes")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="the step's")
    for name in ("model_type", "batch_size", "block_size", "steps", "warmup", "rounds"):
        flags = dict.fromkeys([f"--{name}", f"--{name.replace('_', '-')}"])  # either spelling
        parser.add_argument(*flags, type=str if name == "model_type" else int)
    parser.add_argument("--tiny", action="store_true", help="the step at gpt-nano, 8 windows of 32, 5 steps")
    args = parser.parse_args(argv)
    defaults = {**FITS} if args.fits else {**STEP, **(TINY if args.tiny else {})}
    for name, value in defaults.items():
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    with tempfile.TemporaryDirectory(prefix="deterministic_") as tmp:
        timed = (lambda on: fit(args, on, Path(tmp))) if args.fits else step(args)
        taken = alternate({"default": lambda: timed(False), "deterministic": lambda: timed(True)}, args.rounds)
    tokens = args.batch_size * args.block_size * (args.devices if args.fits else 1)  # per step
    if args.fits:  # tokens / the median step
        per_s = {mode: tokens / statistics.median(s) for mode, s in taken.items()}
        where = f"{args.devices} CPU processes, {args.rounds} fits per mode"
    else:  # tokens of every timed step / their seconds
        per_s = {mode: tokens * args.steps * args.rounds / sum(s) for mode, s in taken.items()}
        where = f"{torch.cuda.get_device_name() if args.device == 'cuda' else args.device}, {args.steps * args.rounds} steps per mode"
    result = {"where": where, "model_type": args.model_type, "tokens_per_step": tokens, "seconds": taken,
              "steps": args.steps * args.rounds, "tokens_per_s": per_s["default"],
              "deterministic_tokens_per_s": per_s["deterministic"],
              "ratio": per_s["deterministic"] / per_s["default"]}  # fmt: skip
    print(f"{where}, {args.model_type}, {tokens} tokens a step: default {per_s['default']:,.0f} tokens/s, "
          f"deterministic {per_s['deterministic']:,.0f} tokens/s ({result['ratio']:.3f}x)")  # fmt: skip
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
