"""Sampling speed with and without the key-value cache: ``GPT.generate`` (the whole context again for every token)
against :func:`lit_ddp.models.kv_cache.generate` (what ``lit-ddp generate`` and the text samples run), on the
tutorial's model (``configs/mingpt/tutorial.yaml``: preset ``tutorial``, block_size 128, Tiny Shakespeare's 65
characters; random weights, which cost what trained ones cost).

    .venv/bin/python -m bench.sampling                       # CPU, 200 tokens
    python -m bench.sampling --device cuda --precision bf16-mixed

The two are timed alternately, ``--repeats`` rounds after a warm-up, so that a neighbour's load falls on both; the
median of each and their ratio go to stdout, in wall-clock seconds and, on the CPU, in this process's CPU seconds
too (what a shared machine's load changes least: with ``--threads 1``, the work itself). From the default prompt (13 characters), the window reaches block_size
after 115 new tokens and then slides: from there each token recomputes the whole window with or without the cache
(``lit_ddp/models/kv_cache.py`` says why), so the ratio over 200 tokens is less than within the window. On a GPU a
model this small is bound by kernel launches, not arithmetic: one token costs about the same with or without the
cache (an H200, torch 2.11: 0.85 s for 200 tokens either way), where a CPU pays for the arithmetic the cache saves.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from lit_ddp.generate import DEFAULT_PROMPT
from lit_ddp.models import kv_cache
from lit_ddp.models.gpt import GPT, GPTConfig

BLOCK_SIZE = 128  # CharDataModule's default, which tutorial.yaml keeps
VOCAB_SIZE = 65  # Tiny Shakespeare's characters


def timed(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, float, torch.Tensor]:
    """Wall-clock seconds ``fn()`` takes (the device synchronized before and after), this process's CPU seconds in
    them, and what it returned."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, time.process_time() - cpu, out


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--tokens", type=int, default=200, help="new tokens per sample")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds of each, alternately")
    parser.add_argument("--model_type", default="tutorial", help="GPT preset (lit_ddp.models.gpt.PRESETS)")
    parser.add_argument("--block_size", type=int, default=BLOCK_SIZE)
    parser.add_argument("--precision", choices=["32", "bf16-mixed"], default="32", help="Lightning's names")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    with device:
        model = GPT(GPTConfig.from_preset(args.model_type, block_size=args.block_size, vocab_size=VOCAB_SIZE)).eval()
    idx = torch.randint(0, VOCAB_SIZE, (1, len(DEFAULT_PROMPT)), device=device)  # (1, 13)

    def autocast() -> AbstractContextManager[Any]:
        return torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16-mixed" else nullcontext()

    def uncached(n: int) -> torch.Tensor:
        with autocast():
            return model.generate(idx, n, top_k=10, generator=torch.Generator(device).manual_seed(1))

    def cached(n: int) -> torch.Tensor:
        with autocast():
            return kv_cache.generate(model, idx, n, top_k=10, generator=torch.Generator(device).manual_seed(1))

    uncached(8), cached(8)  # warm-up: kernels, allocator
    seconds: dict[str, list[float]] = {"uncached": [], "cached": []}
    cpu_seconds: dict[str, list[float]] = {"uncached": [], "cached": []}
    same = True
    for _ in range(args.repeats):
        outputs = []
        for name, fn in (("uncached", uncached), ("cached", cached)):
            wall, cpu, out = timed(lambda fn=fn: fn(args.tokens), device)  # type: ignore[misc]
            seconds[name].append(wall)
            cpu_seconds[name].append(cpu)
            outputs.append(out)
        same = same and torch.equal(*outputs)
    median = {k: statistics.median(v) for k, v in seconds.items()}
    cpu_median = {k: statistics.median(v) for k, v in cpu_seconds.items()}
    slides = max(0, len(DEFAULT_PROMPT) + args.tokens - args.block_size)
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    print(
        f"{args.model_type} ({model.num_parameters() / 1e6:.1f}M parameters, block_size {args.block_size}) on "
        f"{device}{threads}, precision {args.precision}: {args.tokens} tokens from a {len(DEFAULT_PROMPT)}-token "
        f"prompt (the window slides for the last {slides}); median of {args.repeats}, timed alternately"
    )
    on_cpu = device.type == "cpu"
    for name in ("uncached", "cached"):
        runs = ", ".join(f"{s:.3f}" for s in seconds[name])
        rate = args.tokens / median[name]
        cpu_column = f"  CPU {cpu_median[name]:8.3f} s" if on_cpu else ""
        print(f"  {name:9s} {median[name]:8.3f} s  {rate:8.1f} tokens/s{cpu_column}   (wall: {runs})")
    ratio = median["uncached"] / median["cached"]
    cpu_ratio = f", {cpu_median['uncached'] / cpu_median['cached']:.2f}x in CPU seconds" if on_cpu else ""
    print(
        f"  cache speed-up {ratio:.2f}x{cpu_ratio}; "
        f"same tokens: {'yes' if same else 'no (float rounding on this device)'}"
    )
    return {**median, "ratio": ratio}


if __name__ == "__main__":
    main()
