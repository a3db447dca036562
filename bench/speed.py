"""The main job's speed in one table (``make bench-speed``, about 15 minutes; docs/speed.md, "The speed table"), each
figure a ratio of two runs side by side: time from launch to val/loss ``--target`` of :mod:`bench.nanogpt_reference`
against ``make train``; in turns (:mod:`bench.harness.turns`), the step time of ``lit-ddp fit`` against
:mod:`bench.plain_ddp` (2 gloo processes, validation and sampling off), and DDP scaling (:mod:`bench.plain_ddp`'s two
modes); MFU against the fp32 matmul peak.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import turns
from bench.harness.clock import job_figures, read_clock
from bench.harness.launch import NO_VALIDATION, clock_args, fit_command, run, without_samples
from bench.harness.measure import arguments, fmt, markdown_table, peak_flops, write_json
from bench.plain_ddp import CONFIGS


def run_reference(target: float, work: Path) -> dict[str, Any]:
    """:mod:`bench.nanogpt_reference` in a subprocess, stopped at ``target``; its JSON record."""
    out = work / "reference.json"
    run([sys.executable, "-m", "bench.nanogpt_reference", "--target", str(target), "--stop_at_target", "--json",
         str(out)])  # fmt: skip
    return json.loads(out.read_text())


def run_make_train(target: float, work: Path, extra: list[str]) -> dict[str, Any]:
    """``make train`` in a fresh run directory; seconds from launch to the first val/loss <= ``target``."""
    clock = work / "train.clock"
    args = " ".join(["--trainer.default_root_dir", str(work / "train"), *extra, *clock_args(clock)])
    launch = time.time()
    run(["make", "-s", "--no-print-directory", "train", f"ARGS={args}"])
    total = time.time() - launch
    points = read_clock(clock)["val"]  # (time, step, val/loss)
    if not points:
        raise RuntimeError(f"make train logged no val/loss into {clock}")
    reached = next((t - launch for t, _, v in points if v <= target), None)
    return {"seconds_to_target": reached, "total_s": total, "final_val_loss": points[-1][2],
            "best_val_loss": min(v for _, _, v in points), "evals": [(t - launch, s, v) for t, s, v in points]}  # fmt: skip


def in_turns(commands: dict[str, list[str]], work: Path, args: Any, timeout: float = 1800.0) -> dict[str, Any]:
    """The two commands, each writing its step clock at ``<work>/<side>.clock``, in turns: the summary of
    :func:`bench.harness.turns.run_in_turns`, and per side its tokens/s and MFU."""
    summary = turns.run_in_turns(commands, work, args.slice_s, args.warmup, timeout)
    for side, job in summary["job"].items():
        figures = job_figures(job, summary["mean_step_s"][side], peak_flops(threads=int(job[2])))
        summary[side] = {**figures, "steps_counted": summary["steps_counted"][side]}
    low, high = summary["ratio_median_ci95"]
    print(f"{' / '.join(reversed(commands))} step time, turns of {args.slice_s:g} s: median {summary['ratio_median']:.3f} "
          f"({low:.3f}-{high:.3f}) over {summary['rounds']} rounds", flush=True)  # fmt: skip
    return summary


def plain(mode: str, steps: int, clock: Path) -> list[str]:
    return [sys.executable, "-m", "bench.plain_ddp", "--mode", mode, "--steps", str(steps), "--clock", str(clock)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = arguments(__doc__)
    parser.add_argument("--target", type=float, default=1.886, help="val/loss both runs are timed to")
    parser.add_argument("--overhead_steps", type=int, default=2000, help="steps per side, lit-ddp fit / plain DDP")
    parser.add_argument("--steps", type=int, default=600, help="steps per side of the DDP scaling measurement")
    parser.add_argument("--warmup", type=int, default=30, help="first steps of each side left out of the turns")
    parser.add_argument("--slice_s", type=float, default=1.0, help="seconds each side runs before they swap")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds before both sides are killed")
    parser.add_argument("--skip", nargs="*", default=[], choices=["time", "overhead", "scaling"])
    parser.add_argument("train_args", nargs="*", help="extra make train arguments (after --)")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"machine": f"{os.cpu_count()} cores, torch {__import__('torch').__version__}"}
    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="bench_speed_") as tmp:
        if "time" not in args.skip:
            reference = run_reference(args.target, Path(tmp))
            train = run_make_train(args.target, Path(tmp), args.train_args)
            ref, ours = reference["seconds_to_target"], train["seconds_to_target"]
            ratio = ours / ref if ours and ref else None
            results["time_to_target"] = {"reference": reference, "make train": train, "ratio": ratio}
            rows.append((f"nanoGPT CPU recipe: s to val/loss {args.target}", fmt(ref, ".1f", "not reached"), "plain loop, 1 process"))  # fmt: skip
            rows.append((f"make train: s to val/loss {args.target}", fmt(ours, ".1f", "not reached"), "from launch"))
            rows.append(("make train: wall s, launch to exit", f"{train['total_s']:.1f}", "target <= 120"))
            rows.append(("make train: final val/loss", f"{train['final_val_loss']:.3f}", "target <= 1.70"))
            rows.append(("time to loss, make train / reference", fmt(ratio, ".2f"), "target <= 0.60"))
        if "overhead" not in args.skip:
            work, steps = Path(tmp) / "overhead", ["--trainer.max_steps", str(args.overhead_steps)]
            fit = [*NO_VALIDATION, without_samples(*CONFIGS), *steps]
            lightning = fit_command(*CONFIGS, root=work / "run", clock=work / "lightning.clock", args=fit)
            commands = {"plain": plain("ddp", args.overhead_steps, work / "plain.clock"), "lightning": lightning}
            over = results["framework_overhead"] = in_turns(commands, work, args, args.timeout)
            low, high = over["ratio_median_ci95"]
            rows.append(("step time, lit-ddp fit / plain DDP", f"{over['ratio_median']:.3f} ({low:.3f}-{high:.3f})", f"median of {over['rounds']} rounds (95% interval); target <= 1.02"))  # fmt: skip
            rows.append(("  quartiles of the rounds' ratios", f"{over['ratio_q1']:.3f}-{over['ratio_q3']:.3f}", ""))
            rows.append(("  all counted steps: ratio of mean step times", f"{over['pooled_ratio_of_means']:.3f}", f"{over['plain']['steps_counted']} + {over['lightning']['steps_counted']} steps"))  # fmt: skip
            for side in ("plain", "lightning"):
                s = over[side]
                rows.append((f"{side} DDP: tokens/s (2 x 1 thread)", f"{s['tokens_per_s']:,.0f}", f"MFU {100 * s['mfu']:.1f}%"))  # fmt: skip
        if "scaling" not in args.skip:
            work = Path(tmp) / "scaling"
            modes = {m: plain(m, args.steps, work / f"{m}.clock") for m in ("ddp", "single")}
            sc = results["scaling"] = in_turns(modes, work, args)
            rows.append(("DDP scaling: tokens/s 2 x 1 thread / 1 x 2 threads", f"{sc['ratio_median']:.3f} ({sc['ratio_median_ci95'][0]:.3f}-{sc['ratio_median_ci95'][1]:.3f})", f"median of {sc['rounds']} rounds (95% interval); same global batch"))  # fmt: skip
            for mode in ("ddp", "single"):
                r = sc[mode]
                rows.append((f"  {mode}: tokens/s, MFU", f"{r['tokens_per_s']:,.0f}", f"MFU {100 * r.get('mfu', 0):.1f}%"))  # fmt: skip
        peak1, peak2 = peak_flops(threads=1), peak_flops(threads=2)
        results["peak_flops"] = {"1": peak1, "2": peak2}
        rows.append(("fp32 matmul peak, 1 / 2 threads (GFLOP/s)", f"{peak1 / 1e9:.0f} / {peak2 / 1e9:.0f}", "measure.peak_flops"))  # fmt: skip
    print(f"\n{results['machine']}\n" + markdown_table(["figure", "value", "note"], rows))
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
