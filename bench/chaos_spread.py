"""How often ``lit-ddp chaos --calibrated K`` fails a run that is as good as a rerun: the K to choose.

Trains ``--runs`` uninterrupted fits of the calibrated chaos test's minGPT (dropout on, gradient noise from the OS
standing in for a GPU's fast kernels: ``tests.callbacks.GradientNoise``), then treats every run as a "faulted" run
against every pair of others (first, second): that run is no worse than a rerun, so any verdict of DIFFERENT is a
false alarm. Prints, over all such triples, the largest per-step parameter ratio and loss-RMS ratio
(:mod:`lit_ddp.chaos.calibrated`) and how many triples each K would fail.

    python -m bench.chaos_spread --runs 20    # about 3 minutes here (150 steps a run)
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from lit_ddp.chaos.calibrated import loss_curve, rms
from lit_ddp.chaos.sketch import relative_distance, sketches

FIT = [
    *("--config", "configs/mingpt/cpu.yaml", "--config", "configs/checkpoint/fault_tolerant.yaml"),
    *("--config", "configs/mingpt/fault_tolerant.yaml"),
    *("--model.init_args.n_layer", "1", "--model.init_args.n_head", "2", "--model.init_args.n_embd", "16"),
    *("--data.init_args.block_size", "16", "--data.init_args.batch_size", "8", "--data.init_args.truncate", "0.02"),
    *("--trainer.devices", "1", "--trainer.max_steps", "150", "--trainer.log_every_n_steps", "5"),
    *(
        "--trainer.val_check_interval",
        "50",
        "--trainer.limit_val_batches",
        "2",
        "--trainer.enable_progress_bar",
        "false",
    ),
    "--trainer.callbacks+=lit_ddp.chaos.sketch.ParameterSketch",
]
NOISE = {"class_path": "tests.callbacks.GradientNoise", "init_args": {"scale": 1e-6}}


def train(root: Path, runs: int) -> list[Path]:
    noise = root / "noise.yaml"
    noise.write_text(yaml.safe_dump({"trainer": {"callbacks+": [NOISE]}}))
    dirs = []
    for i in range(runs):
        run, start = root / f"run{i}", time.perf_counter()
        cmd = [
            sys.executable,
            "-m",
            "lit_ddp",
            "fit",
            *FIT,
            "--config",
            str(noise),
            "--trainer.default_root_dir",
            str(run),
        ]
        subprocess.run(cmd, check=True, capture_output=True, timeout=600)
        print(f"run {i}: {time.perf_counter() - start:.1f} s", flush=True)
        dirs.append(run)
    return dirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="uninterrupted runs (at least 3)")
    parser.add_argument("--k", type=float, nargs="+", default=[2.5, 3.0, 3.5, 4.0])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = train(Path(tmp), max(3, args.runs))
        samples, losses = [sketches(r) for r in runs], [loss_curve(r) for r in runs]
    params, loss = [], []
    for f, a, b in itertools.permutations(range(len(runs)), 3):  # f against first a, second b
        if b < a:
            continue
        steps, logged = sorted(samples[a]), sorted(losses[a])
        params.append(
            max(
                relative_distance(samples[a][s], samples[f][s]) / relative_distance(samples[a][s], samples[b][s])
                for s in steps
            )
        )
        spread = rms([losses[b][s] - losses[a][s] for s in logged])
        loss.append(rms([losses[f][s] - losses[a][s] for s in logged]) / spread)
    print(f"{len(runs)} runs, {len(params)} (faulted, first, second) triples, {len(steps)} logged steps each")
    print(
        f"parameters, the largest per-step ratio of a triple: median {sorted(params)[len(params) // 2]:.2f}, max {max(params):.2f}"
    )
    print(f"train loss, RMS ratio: median {sorted(loss)[len(loss) // 2]:.2f}, max {max(loss):.2f}")
    for k in args.k:
        failed = sum(p > k or v > k for p, v in zip(params, loss, strict=True))
        print(f"K = {k:g}: {failed} of {len(params)} triples DIFFERENT ({100 * failed / len(params):.2f} %)")


if __name__ == "__main__":
    main()
