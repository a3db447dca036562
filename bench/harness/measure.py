"""Timing in a shared machine's noise, peak FLOP/s, a script's parser and JSON, and the table a benchmark prints.

:func:`alternate` runs variants by turns, each round starting one variant later (A B, then B A), so that a neighbour's
load falls on all alike. :func:`peak_flops` is the figure MFU is reported against: a GPU's from the throughput
callback's table (one source with the training job's MFU), a CPU's measured here.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def alternate(variants: dict[str, Callable[[], T]], rounds: int) -> dict[str, list[T]]:
    """Each variant's results over ``rounds``, called by turns, round ``r`` starting at variant ``r mod n``."""
    names = list(variants)
    results: dict[str, list[T]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            results[name].append(variants[name]())
    return results


def seconds(fn: Callable[[], Any], sync: Callable[[], Any] | None = None) -> float:
    """Wall seconds of ``fn()``, ``sync()`` (a device's) before and after."""
    sync = sync or (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def timing(fn: Callable[..., T], calls: list[tuple[float, float]]) -> Callable[..., T]:
    """``fn`` appending ``(start, seconds)`` of each call to ``calls`` (the start from ``time.time()``)."""

    def timed(*args: Any, **kwargs: Any) -> T:
        start, t0 = time.time(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            calls.append((start, time.perf_counter() - t0))

    return timed


def peak_flops(device: Any = "cpu", precision: str = "32-true", threads: int | None = None) -> float | None:
    """Peak FLOP/s of one process on ``device``: on CUDA the throughput callback's figure for ``precision``
    (:func:`lit_ddp.callbacks.throughput.available_flops`; None where no table knows the GPU); on the CPU the best
    fp32 ``(n, n) @ (n, n)`` (``2 n^3`` FLOPs) over a few ``n`` with ``threads`` torch threads (default: as set)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        from lit_ddp.callbacks.throughput import available_flops

        dtype = torch.bfloat16 if precision.startswith("bf16") else "tfloat32"
        return available_flops(device, precision, dtype)
    before, best = torch.get_num_threads(), 0.0
    torch.set_num_threads(threads or before)
    for n in (256, 512, 1024):
        a, b, out = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
        torch.matmul(a, b, out=out)  # warm-up
        start = time.perf_counter()
        while time.perf_counter() - start < 0.2:
            best = max(best, 2 * n**3 / seconds(functools.partial(torch.matmul, a, b, out=out)))
    torch.set_num_threads(before)
    return best


def arguments(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser, its module docstring ``doc`` as ``--help`` shows it, with ``--json``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return parser


def write_json(path: Path | None, results: Any) -> None:
    """Writes ``results`` as JSON into ``path`` (``--json``), where given."""
    if path:
        path.write_text(json.dumps(results, indent=2, default=str))


def fmt(value: float | None, spec: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "---") -> str:
    """A markdown table (a ``|`` or a line break inside a cell becomes ``/`` or a space)."""
    lines = [columns, [align] * len(columns), *rows]
    return "\n".join(
        "| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in line) + " |" for line in lines
    )
