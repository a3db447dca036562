"""Measures this CPU's fp32 matmul throughput, the peak that MFU is reported against on CPU.

Prints the best FLOP/s over a few square sizes on stdout (one number, details on stderr): the value of
``available_flops`` of the ``TokenThroughputMonitor`` in ``configs/mingpt/cpu.yaml``'s ``trainer.callbacks``.
For DDP with P processes on this machine, measure with the threads one process gets (Lightning gives each
``cores // P``):

    python -m bench.matmul_peak --threads 1

A matmul of ``(n, n) @ (n, n)`` counts ``2 n^3`` FLOPs.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def matmul_flops(n: int, dtype: torch.dtype = torch.float32, min_time: float = 0.5) -> float:
    """FLOP/s of ``(n, n) @ (n, n)`` in ``dtype``: the best of repeated timings totalling ``min_time`` seconds."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.matmul(a, b, out=out)  # warm-up
    best = float("inf")
    start = time.perf_counter()
    while time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        torch.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


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
        print(
            f"n={n:5d}  {flops / 1e9:8.1f} GFLOP/s  (fp32, {torch.get_num_threads()} threads)",
            file=sys.stderr,
        )
    peak = max(results.values())
    print(f"{peak:.4g}")
    return peak


if __name__ == "__main__":
    main()
