"""The main job's speed in one table: time to a loss against nanoGPT's CPU recipe, Lightning's cost per step,
DDP scaling and MFU, all measured in one run on this machine (``make bench-speed``).

Four measurements, one after the other (this machine is shared: each figure is a ratio of two runs taken
side by side, never an absolute time compared across runs):

1. **Time to val/loss** ``--target`` (1.886): :mod:`bench.nanogpt_reference` (nanoGPT's README CPU recipe
   as a plain single-process loop, stopped once it reaches the target) against ``make train`` itself (the
   Makefile's ``lit-ddp fit`` command, in a fresh run directory), both timed from process launch to the
   first evaluation at or below the target. ``make train``'s times come from the wall times of its
   ``val/loss`` points in TensorBoard's event file. Also its total wall time (launch to exit) and final
   ``val/loss``. ``--rounds`` alternates the two.
2. **Lightning vs plain DDP**: :mod:`bench.framework_overhead` (steady-state step time of ``lit-ddp fit``
   over a plain PyTorch DDP loop, same model, data and batch, 2 processes, the two running in turns of one
   second for ``--overhead_steps`` steps each: rounds of one turn each): the median ratio over rounds with
   its quartiles, and the ratio of all counted steps' mean step times.
3. **DDP scaling**: :mod:`bench.plain_ddp` ``--mode both``: tokens/s of 2 processes x 1 thread over
   1 process x 2 threads on the same global batch, the two running in one-second turns (:mod:`bench.turns`).
4. **MFU**: model FLOPs per token (``GPT.flops_per_token``, the 6N + attention estimate of PaLM's appendix B)
   x tokens/s per process over the fp32 matmul peak of one process's threads (:mod:`bench.matmul_peak`).

Run: ``make bench-speed`` (about 15 minutes), or ``python -m bench.speed --help``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def bench_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def run_reference(target: float, work: Path) -> dict[str, Any]:
    """:mod:`bench.nanogpt_reference` in a subprocess, stopped at ``target``; its JSON record."""
    out = work / "reference.json"
    cmd = [sys.executable, "-m", "bench.nanogpt_reference", "--target", str(target), "--stop_at_target"]
    proc = subprocess.run([*cmd, "--json", str(out)], cwd=REPO, env=bench_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def val_losses(root: Path) -> list[tuple[float, int, float]]:
    """``(wall_time, step, val/loss)`` of every ``val/loss`` point under ``root``'s TensorBoard event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    points = []
    for events in sorted(root.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        if "val/loss" in acc.Tags()["scalars"]:
            points += [(e.wall_time, e.step, e.value) for e in acc.Scalars("val/loss")]
    return sorted(points)


def run_make_train(target: float, work: Path, name: str, extra: list[str]) -> dict[str, Any]:
    """``make train`` in a fresh run directory; seconds from launch to the first val/loss <= ``target``."""
    root = work / name
    args = " ".join(["--trainer.default_root_dir", str(root), *extra])
    cmd = ["make", "-s", "--no-print-directory", "train", f"ARGS={args}"]
    launch = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=bench_env(), capture_output=True, text=True)
    total = time.time() - launch
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    points = val_losses(root)
    if not points:
        raise RuntimeError(f"make train logged no val/loss under {root}")
    reached = next((t - launch for t, _, v in points if v <= target), None)
    return {"seconds_to_target": reached, "total_s": total, "final_val_loss": points[-1][2],
            "best_val_loss": min(v for _, _, v in points), "evals": [(t - launch, s, v) for t, s, v in points]}  # fmt: skip


def fmt(value: float | None, spec: str) -> str:
    return "not reached" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=float, default=1.886, help="val/loss both runs are timed to")
    parser.add_argument("--rounds", type=int, default=1, help="reference / make train pairs, alternating")
    parser.add_argument("--overhead_steps", type=int, default=2000, help="steps per side of bench.framework_overhead")
    parser.add_argument("--steps", type=int, default=600, help="steps per side of the DDP scaling measurement")
    parser.add_argument("--skip", nargs="*", default=[], choices=["time", "overhead", "scaling"])
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument("train_args", nargs="*", help="extra make train arguments (after --)")
    args = parser.parse_args(argv)

    from bench import framework_overhead, plain_ddp
    from bench.plain_ddp import peak_flops

    results: dict[str, Any] = {"machine": f"{os.cpu_count()} cores, torch {__import__('torch').__version__}"}
    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="bench_speed_") as tmp:
        work = Path(tmp)
        if "time" not in args.skip:
            pairs = []
            for r in range(args.rounds):
                order = ["reference", "make train"] if r % 2 == 0 else ["make train", "reference"]
                pair = {}
                for side in order:
                    print(f"round {r + 1}: {side} ...", flush=True)
                    if side == "reference":
                        pair[side] = run_reference(args.target, work)
                    else:
                        pair[side] = run_make_train(args.target, work, f"train_{r}", args.train_args)
                ref, ours = pair["reference"]["seconds_to_target"], pair["make train"]["seconds_to_target"]
                pair["ratio"] = ours / ref if ours and ref else None
                print(f"round {r + 1}: reference {fmt(ref, '.1f')} s, make train {fmt(ours, '.1f')} s to "
                      f"val/loss {args.target}; ratio {fmt(pair['ratio'], '.2f')}", flush=True)  # fmt: skip
                pairs.append(pair)
            results["time_to_target"] = pairs
            ratios = [p["ratio"] for p in pairs if p["ratio"] is not None]
            for p in pairs:
                ours = p["make train"]
                rows.append(
                    (
                        "nanoGPT CPU recipe: s to val/loss " + str(args.target),
                        fmt(p["reference"]["seconds_to_target"], ".1f"),
                        "plain loop, 1 process",
                    )
                )
                rows.append(
                    (
                        "make train: s to val/loss " + str(args.target),
                        fmt(ours["seconds_to_target"], ".1f"),
                        "from launch",
                    )
                )
                rows.append(("make train: wall s, launch to exit", f"{ours['total_s']:.1f}", "target <= 120"))
                rows.append(("make train: final val/loss", f"{ours['final_val_loss']:.3f}", "target <= 1.70"))  # fmt: skip
            if ratios:
                spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
                rows.append(("time to loss, make train / reference", f"{statistics.median(ratios):.2f}{spread}", "target <= 0.60"))  # fmt: skip
        if "overhead" not in args.skip:
            over = framework_overhead.main(["--steps", str(args.overhead_steps)])
            results["framework_overhead"] = over
            low, high = over["ratio_median_ci95"]
            rows.append(("step time, lit-ddp fit / plain DDP", f"{over['ratio_median']:.3f} ({low:.3f}-{high:.3f})", f"median of {over['rounds']} rounds (95% interval); target <= 1.02"))  # fmt: skip
            rows.append(("  quartiles of the rounds' ratios", f"{over['ratio_q1']:.3f}-{over['ratio_q3']:.3f}", ""))  # fmt: skip
            rows.append(("  all counted steps: ratio of mean step times", f"{over['pooled_ratio_of_means']:.3f}", f"{over['plain']['steps_counted']} + {over['lightning']['steps_counted']} steps"))  # fmt: skip
            for side in ("plain", "lightning"):
                s = over[side]
                rows.append((f"{side} DDP: tokens/s (2 x 1 thread)", f"{s['tokens_per_s']:,.0f}", f"MFU {100 * s['mfu']:.1f}%"))  # fmt: skip
        if "scaling" not in args.skip:
            flags = framework_overhead.plain_flags(framework_overhead.job_configs())
            both = plain_ddp.main(["--mode", "both", "--steps", str(args.steps), *flags])
            results["scaling"] = both
            sc = both["scaling"]
            rows.append(("DDP scaling: tokens/s 2 x 1 thread / 1 x 2 threads", f"{sc['ratio_median']:.3f} ({sc['ratio_median_ci95'][0]:.3f}-{sc['ratio_median_ci95'][1]:.3f})", f"median of {sc['rounds']} rounds (95% interval); same global batch"))  # fmt: skip
            for mode in ("ddp", "single"):
                r = both[mode]
                rows.append(
                    (f"  {mode}: tokens/s, MFU", f"{r['tokens_per_s']:,.0f}", f"MFU {100 * r.get('mfu', 0):.1f}%")
                )
        peak1, peak2 = peak_flops(1), peak_flops(2)
        results["peak_flops"] = {"1": peak1, "2": peak2}
        rows.append(("fp32 matmul peak, 1 / 2 threads (GFLOP/s)", f"{peak1 / 1e9:.0f} / {peak2 / 1e9:.0f}", "bench.matmul_peak"))  # fmt: skip

    width = max(len(r[0]) for r in rows)
    print(f"\n{'figure':<{width}}  {'value':>18}  note   ({results['machine']})")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>18}  {note}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return results


if __name__ == "__main__":
    main()
