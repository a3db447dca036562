"""This CPU's fp32 matmul peak, which MFU is reported against on a CPU: the ``available_flops`` of the
TokenThroughputMonitor in ``configs/mingpt/cpu.yaml``. With P DDP processes, measure with the threads one gets
(Lightning gives each ``cores // P``); a matmul of ``(n, n) @ (n, n)`` counts ``2 n^3`` FLOPs. Prints the best FLOP/s
over a few sizes on stdout, each size's on stderr.

    python -m bench.matmul_peak --threads 1
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.harness.measure import matmul_flops


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048], help="matrix sizes n")
    parser.add_argument("--min_time", type=float, default=0.5, help="seconds of timing per size")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    results = {n: matmul_flops(n, min_time=args.min_time) for n in args.sizes}
    for n, flops in results.items():
        print(f"n={n:5d}  {flops / 1e9:8.1f} GFLOP/s  (fp32, {torch.get_num_threads()} threads)", file=sys.stderr)
    print(f"{max(results.values()):.4g}")
    return max(results.values())


if __name__ == "__main__":
    main()
