"""Pipeline parallelism's speed and memory against its bubble (``make bench-pipeline``; docs/tutorial.md, "Pipeline
parallelism"): at one global batch, the steps/s and the peak memory of each rank for one stage (``pp=1``: one process
training the whole GPT) and for 2 stages with 1, 2, 4 and 8 microbatches under each schedule, beside the bubble
theory predicts for GPipe and 1F1B ((p - 1) / (m + p - 1), p stages, m microbatches) and the one measured: the share
of the 2 ranks' time a step would save were it the ideal half of one stage's.

Every figure is measured side by side: each schedule's four microbatch counts and a one-stage run of their own are
alive at once, run in turns (:func:`bench.harness.turns.run_sides`), and the steps/s of each is taken over the same
rounds. A run's peak memory is each rank's resident high-water mark (``VmHWM``), read while it is alive.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.harness import turns
from bench.harness.launch import NO_VALIDATION, QUIET, descendants, fit_command, without_samples
from bench.harness.measure import arguments, fmt, markdown_table, write_json

CONFIGS = ("configs/trainer/pp.yaml", "configs/mingpt/cpu.yaml")
MODEL = ["--model.optimizer", "adamw", "--model.n_layer", "8", "--model.n_head", "4", "--model.warmup_steps", "0"]
"""An 8-block GPT (4 blocks a stage), AdamW; its width and window (``--n_embd``, ``--block_size``) are the options'. At
the defaults, 64 and 64 with 32 windows a step, its activations (about 14 MB a block) show in a rank's memory beside
the process's own."""
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")
MICROBATCHES = (1, 2, 4, 8)


def command(pp: int, schedule: str, m: int, size: Any, work: Path, side: str) -> list[str]:
    """``lit-ddp fit`` of :data:`MODEL` on ``pp`` stages (one per process) for as long as the turns last, into
    ``work/side``, its step clock at ``work/side.clock`` (where the turns read it), no validation, no text samples;
    ``size``: the options ``n_embd``, ``block_size`` and ``batch``."""
    args = [*MODEL, "--model.n_embd", str(size.n_embd), "--data.block_size", str(size.block_size),
            "--data.batch_size", str(size.batch), "--trainer.max_steps", "1000000", *NO_VALIDATION, *QUIET,
            without_samples(*CONFIGS), "--trainer.devices", str(pp),
            "--trainer.strategy.init_args.pipeline_parallel_size", str(pp),
            "--trainer.strategy.init_args.schedule", schedule, "--trainer.strategy.init_args.n_microbatches", str(m),
            "--checkpoint.every_n_train_steps", "0", "--checkpoint.save_last", "false"]  # fmt: skip
    return fit_command(*CONFIGS, args=args, root=work / side, clock=work / f"{side}.clock")


def peak_memory(procs: dict[str, Any]) -> dict[str, list[float]]:
    """Each side's processes' resident high-water marks (MiB): the side's own process (rank 0) first, then the
    ranks Lightning started (rank 1)."""
    peaks = {}
    for side, proc in procs.items():
        pids = [proc.pid] + [pid for pid, state in descendants(proc.pid) if state != "Z"]
        marks = []
        for pid in pids:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"lit_ddp" in cmdline:
                marks.append(next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM")))
        peaks[side] = [kb / 1024 for kb in marks]
    return peaks


def group(schedule: str, args: Any, work: Path) -> dict[str, dict[str, Any]]:
    """One stage and 2 stages under ``schedule`` with each microbatch count it runs, in turns: per side its median
    step seconds over the counted steps, steps/s, and each rank's peak memory."""
    from lit_ddp.models.parallelize import check_schedule, stages_per_rank_for

    work = work / schedule
    sides = {"pp=1": command(1, "GPipe", 1, args, work, "pp=1")}
    refused = {}
    for m in MICROBATCHES:
        try:
            check_schedule(schedule, 2, m, stages_per_rank_for(schedule, None))
        except ValueError as e:
            refused[f"m={m}"] = str(e).split(":")[1].strip()
            continue
        sides[f"m={m}"] = command(2, schedule, m, args, work, f"m={m}")
    memory: dict[str, list[float]] = {}
    events, slices = turns.run_sides(sides, work, args.slice_s, args.timeout, rounds=args.rounds,
                                     before_kill=lambda procs: memory.update(peak_memory(procs)))  # fmt: skip
    out: dict[str, dict[str, Any]] = {}
    for side in sides:
        counted = turns.steps_in_slices(events[side]["span"], [(a, b) for n, a, b in slices if n == side], args.warmup)
        steps = [t for turn in counted for t in turn]
        if not steps:
            raise RuntimeError(f"{schedule} {side}: no step counted; raise --slice_s or --rounds")
        median = statistics.median(steps)
        out[side] = {"step_s": median, "steps_per_s": 1 / median, "steps_counted": len(steps),
                     "peak_mib": memory.get(side, [])}  # fmt: skip
    for side, why in refused.items():
        out[side] = {"refused": why}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = arguments(__doc__)
    parser.add_argument("--batch", type=int, default=32, help="windows per step (the one global batch)")
    parser.add_argument("--n_embd", type=int, default=64, help="the GPT's width")
    parser.add_argument("--block_size", type=int, default=64, help="characters per window")
    parser.add_argument("--rounds", type=int, default=6, help="turns each side runs")
    parser.add_argument("--slice_s", type=float, default=4.0, help="seconds each side runs before the next")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each side left out")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before a group is killed")
    parser.add_argument("--schedules", nargs="*", default=list(SCHEDULES), choices=SCHEDULES)
    args = parser.parse_args(argv)
    # One intra-op thread per process, as torchrun gives its workers: one stage computes on one core, two on two
    # (the bubble's arithmetic), and no side's threads spin on the cores of the next one's turn.
    os.environ["OMP_NUM_THREADS"] = "1"
    results: dict[str, Any] = {"machine": f"{os.cpu_count()} cores, torch {__import__('torch').__version__}"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        for schedule in args.schedules:
            found = results[schedule] = group(schedule, args, Path(tmp))
            one = found["pp=1"]
            rows.append([schedule, "pp=1", "-", fmt(one["steps_per_s"], ".2f"), "1.00",
                         " / ".join(fmt(x, ".0f") for x in one["peak_mib"]), "-", "-"])  # fmt: skip
            for m in MICROBATCHES:
                side = found[f"m={m}"]
                theory = fmt(1 / (m + 1), ".2f") if schedule in ("GPipe", "1F1B") else "-"
                if "refused" in side:
                    rows.append([schedule, "pp=2", str(m), "refused: " + side["refused"], "", "", theory, ""])
                    continue
                speedup = one["step_s"] / side["step_s"]
                measured = 1 - speedup / 2  # the ranks' time left idle, were each step's work the ideal half
                rows.append([schedule, "pp=2", str(m), fmt(side["steps_per_s"], ".2f"), fmt(speedup, ".2f"),
                             " / ".join(fmt(x, ".0f") for x in side["peak_mib"]), theory, fmt(measured, ".2f")])  # fmt: skip
            print(f"{schedule}: done", flush=True)
    columns = ["schedule", "stages", "microbatches", "steps/s", "x one stage", "peak MiB (rank 0 / 1)",
               "bubble (p-1)/(m+p-1)", "idle share measured"]  # fmt: skip
    print(markdown_table(columns, rows))
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
