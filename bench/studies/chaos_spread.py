"""How often ``lit-ddp chaos --calibrated K`` fails a run as good as a rerun: the K to choose (answered in
docs/fault_tolerance.md). Trains ``--runs`` uninterrupted fits of the calibrated chaos test's minGPT (gradient noise
standing in for a GPU's fast kernels), then treats each run as "faulted" against every pair of others: any DIFFERENT
is a false alarm. Prints the largest per-step parameter and loss-RMS ratios and how many triples each K would fail.

    python -m bench.studies.chaos_spread --runs 20    # about 3 minutes here (make bench-chaos-spread)
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from bench.harness.launch import fit_command, run
from lit_ddp.chaos.calibrated import loss_curve, rms
from lit_ddp.chaos.sketch import relative_distance, sketches

CONFIGS = ("configs/mingpt/cpu.yaml", "configs/checkpoint/fault_tolerant.yaml", "configs/mingpt/fault_tolerant.yaml")
FIT = ["--model.init_args.n_layer", "1", "--model.init_args.n_head", "2", "--model.init_args.n_embd", "16",
       "--data.init_args.block_size", "16", "--data.init_args.batch_size", "8", "--data.init_args.truncate", "0.02",
       "--trainer.devices", "1", "--trainer.max_steps", "150", "--trainer.log_every_n_steps", "5",
       "--trainer.val_check_interval", "50", "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar", "false",
       "--trainer.callbacks+=lit_ddp.chaos.sketch.ParameterSketch"]  # fmt: skip
NOISE = {"class_path": "tests.callbacks.GradientNoise", "init_args": {"scale": 1e-6}}


def train(root: Path, runs: int) -> list[Path]:
    noise = root / "noise.yaml"
    noise.write_text(yaml.safe_dump({"trainer": {"callbacks+": [NOISE]}}))
    dirs = []
    for i in range(runs):
        start = time.perf_counter()
        run(fit_command(*CONFIGS, args=[*FIT, "--config", str(noise)], root=root / f"run{i}"), timeout=600)
        print(f"run {i}: {time.perf_counter() - start:.1f} s", flush=True)
        dirs.append(root / f"run{i}")
    return dirs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="uninterrupted runs (at least 3)")
    parser.add_argument("--k", type=float, nargs="+", default=[2.5, 3.0, 3.5, 4.0])
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = train(Path(tmp), max(3, args.runs))
        samples, losses = [sketches(r) for r in runs], [loss_curve(r) for r in runs]
    params, loss = [], []
    for f, a, b in itertools.permutations(range(len(runs)), 3):  # f against first a, second b
        if b < a:
            continue
        steps, logged = sorted(samples[a]), sorted(losses[a])
        distance = [relative_distance(samples[a][s], samples[f][s]) / relative_distance(samples[a][s], samples[b][s])
                    for s in steps]  # fmt: skip
        params.append(max(distance))
        spread = rms([losses[b][s] - losses[a][s] for s in logged])
        loss.append(rms([losses[f][s] - losses[a][s] for s in logged]) / spread)
    print(f"{len(runs)} runs, {len(params)} (faulted, first, second) triples, {len(steps)} logged steps each")
    print(f"parameters, the largest per-step ratio of a triple: median {statistics.median_high(params):.2f}, max {max(params):.2f}")  # fmt: skip
    print(f"train loss, RMS ratio: median {statistics.median_high(loss):.2f}, max {max(loss):.2f}")
    for k in args.k:
        failed = sum(p > k or v > k for p, v in zip(params, loss, strict=True))
        print(f"K = {k:g}: {failed} of {len(params)} triples DIFFERENT ({100 * failed / len(params):.2f} %)")


if __name__ == "__main__":
    main()
