"""What ``trainer.deterministic`` costs a real ``lit-ddp fit`` (issue 42): tokens/s of 2-process DDP on this
machine's CPUs with and without it, the runs launched in alternation (A B B A ...), side by side in one call.

Each fit: ``configs/trainer/ddp.yaml`` + ``configs/mingpt/tutorial.yaml`` on ``--devices`` CPU processes, at
``--model-type`` (gpt-mini: 6 x 6 x 192, a few steps a second at batch 8), fp32, no validation, the packaged Tiny
Shakespeare; the step times come from :class:`bench.run_clock.RunClock` (rank zero's wall clock after each optimizer
step), the first ``--warmup`` steps left out. tokens/s = world_size x batch_size x block_size / median step time.

    python -m bench.deterministic_ddp                  # 2 rounds of 40 steps per mode, about 3 minutes here
    python -m bench.deterministic_ddp --rounds 1 --steps 12 --warmup 4    # the plumbing
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.gpu_check import read_run_clock

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 128  # configs/mingpt/tutorial.yaml's (CharDataModule's default)


def fit(work: Path, deterministic: bool, args: argparse.Namespace) -> float:
    """One fit; the median seconds of its optimizer steps after the warm-up."""
    clock = work / "clock.txt"
    cmd = [
        sys.executable, "-m", "lit_ddp", "fit",
        "--config", str(REPO / "configs/trainer/ddp.yaml"), "--config", str(REPO / "configs/mingpt/tutorial.yaml"),
        "--trainer.accelerator", "cpu", "--trainer.devices", str(args.devices), "--trainer.precision", "32-true",
        "--model.init_args.model_type", args.model_type, "--model.init_args.dropout", "0.1",
        "--data.init_args.batch_size", str(args.batch_size), "--data.init_args.num_workers", "0",
        "--trainer.max_steps", str(args.steps), "--trainer.limit_val_batches", "0",
        "--trainer.deterministic", str(deterministic).lower(), "--trainer.default_root_dir", str(work / "run"),
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.callbacks+=bench.run_clock.RunClock", f"--trainer.callbacks.init_args.path={clock}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"fit failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    times = [t for t, _ in read_run_clock(clock)["step"]]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)][args.warmup :]
    if not gaps:
        raise RuntimeError(f"{len(times)} steps timed: ask for more than --warmup {args.warmup} + 1")
    return statistics.median(gaps)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--model-type", default="gpt-mini")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of each fit's median")
    parser.add_argument("--rounds", type=int, default=2, help="fits per mode, launched in alternation")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per fit")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="deterministic_ddp_") as tmp:
        for r in range(args.rounds):
            for on in (False, True) if r % 2 == 0 else (True, False):  # A B, then B A: drift hits both alike
                seconds[on].append(fit(Path(tmp) / f"{r}-{on}", on, args))
    tokens = args.devices * args.batch_size * BLOCK_SIZE
    default, exact = statistics.median(seconds[False]), statistics.median(seconds[True])
    result = {
        "devices": args.devices,
        "model_type": args.model_type,
        "tokens_per_step": tokens,
        "step_seconds": {"default": seconds[False], "deterministic": seconds[True]},
        "tokens_per_s": tokens / default,
        "deterministic_tokens_per_s": tokens / exact,
        "ratio": default / exact,  # deterministic tokens/s over the default's
    }
    print(
        f"{args.devices} CPU processes, {args.model_type}, {tokens} tokens a step, {args.rounds} fits per mode: "
        f"default {result['tokens_per_s']:,.0f} tokens/s, deterministic {result['deterministic_tokens_per_s']:,.0f} "
        f"tokens/s ({result['ratio']:.3f}x)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
