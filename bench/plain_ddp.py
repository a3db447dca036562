"""The main job's training step as a plain PyTorch DDP loop: its step time, tokens/s and MFU, no Lightning.

The same work per step as ``configs/mingpt/cpu.yaml`` (:func:`bench.framework_overhead.plain_flags` passes its
values): its windows, optimizer and schedule (:mod:`lit_ddp.recipe`), clipping at 1.0; no validation, logging or
checkpoints. ``--mode ddp``: ``--procs`` gloo processes, ``cores // procs`` threads each; ``single``: one process,
``cores`` threads, the same global batch; ``both``: the two in turns (:mod:`bench.harness.turns`), the DDP scaling.

    nice -n 10 .venv/bin/python -m bench.plain_ddp --mode both --steps 300
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from bench.harness import turns
from bench.harness.clock import ClockFile, job_figures, read_clock, step_seconds
from bench.harness.launch import free_port, gloo_group
from bench.harness.measure import arguments, peak_flops, write_json
from bench.harness.ops import train_step
from lit_ddp.data.char import CharWindows, build_vocab, encode
from lit_ddp.data.sources import read_embedded_text
from lit_ddp.models.gpt import GPT, GPTConfig
from lit_ddp.recipe import build_optimizer, warmup_cosine_schedule
from lit_ddp.strategies import ddp_buffer_kwargs


def parse_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` for a :class:`GPTConfig` field, the value converted to the field's type."""
    key, sep, value = text.partition("=")
    types = {f.name: f.type for f in fields(GPTConfig)}
    if not sep or key not in types:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE with KEY one of {sorted(types)}")
    if types[key] == "bool":
        return key, value.lower() in ("1", "true", "yes")
    return key, {"int": int, "float": float}.get(str(types[key]), str)(value)


def train_loop(rank: int, world: int, args: argparse.Namespace, threads: int, batch_size: int) -> None:
    """Runs ``args.steps`` steps on this rank; rank zero writes the step clock at ``args.clock``."""
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    text = read_embedded_text()
    vocab = build_vocab(text)
    train = encode(text[: int(0.9 * len(text))], vocab)  # the job's train split
    sizes = {k: v for k in ("n_layer", "n_head", "n_embd") if (v := getattr(args, k)) is not None}
    config = {"dropout": 0.0, "bias": True, **sizes, **dict(args.gpt)}
    model = GPT(GPTConfig.from_preset(args.model_type, **config, block_size=args.block_size, vocab_size=len(vocab)))
    dataset = CharWindows(train, args.block_size)
    if world > 1:
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
        net: torch.nn.Module = DDP(model, **ddp_buffer_kwargs(False))  # as configs/trainer/ddp.yaml
    else:
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(args.seed))
        net = model
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    # The job's recipe (GPTModule.configure_optimizers builds the same), its other settings at their defaults.
    optimizer = build_optimizer(model, args.optimizer, learning_rate=args.lr, muon_learning_rate=args.muon_lr)
    scheduler = warmup_cosine_schedule(optimizer, args.lr_warmup_steps, args.steps, args.min_lr_ratio)
    clock = ClockFile(args.clock)
    if rank == 0:
        clock.start()
        tokens = world * batch_size * args.block_size
        clock.write("job", tokens, world, threads, model.flops_per_token(args.block_size))
    for step, (x, y) in enumerate(loader):
        if step == args.steps:
            break
        train_step(net, optimizer, x, y)
        scheduler.step()
        if rank == 0:
            clock.write("step", step + 1, os.getpid())
    clock.close()


def _ddp_worker(rank: int, world: int, port: int, args: argparse.Namespace, threads: int) -> None:
    with gloo_group(rank, world, port):
        train_loop(rank, world, args, threads, args.batch_size)


def run(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One measurement: ``mode`` is ``ddp`` or ``single``."""
    cores = os.cpu_count() or 1
    if mode == "ddp":
        threads = max(1, cores // args.procs)
        mp.spawn(_ddp_worker, args=(args.procs, free_port(), args, threads), nprocs=args.procs)
    else:
        threads = cores
        train_loop(0, 1, args, threads, args.procs * args.batch_size)
    events = read_clock(args.clock)
    times = step_seconds(events, args.warmup)
    peak = args.peak_flops or (peak_flops(threads=threads) if args.mfu else None)
    result = job_figures(events["job"][0][1:], statistics.mean(times), peak)
    return {**result, "median_step_s": statistics.median(times), "steps_counted": len(times)}


def both_in_turns(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """``ddp`` and ``single`` as two subprocesses in turns; the DDP scaling is the median over rounds of a single
    turn's mean step time over the ddp turn's before it (the same global batch: tokens/s of ddp over single)."""
    base = [a for i, a in enumerate(argv) if not a.startswith("--json") and (i == 0 or argv[i - 1] != "--json")]
    with tempfile.TemporaryDirectory(prefix="plain_ddp_both_") as tmp:
        clocks = {mode: Path(tmp) / f"{mode}.clock" for mode in ("ddp", "single")}
        commands = {mode: [sys.executable, "-m", "bench.plain_ddp", *base, "--mode", mode, "--no_mfu", "--clock",
                           str(clocks[mode])] for mode in clocks}  # fmt: skip
        summary = turns.run_in_turns(commands, clocks, Path(tmp), args.slice_s, args.warmup, timeout=1800.0)
    results: dict[str, Any] = {}
    for mode, job in summary["job"].items():
        peak = args.peak_flops or (peak_flops(threads=int(job[2])) if args.mfu else None)
        results[mode] = job_figures(job, summary["mean_step_s"][mode], peak)
        results[mode].update(median_step_s=results[mode]["mean_step_s"], steps_counted=summary["steps_counted"][mode])
        report(mode, results[mode])
    results["ddp_over_single"] = summary["ratio_median"]
    results["scaling"] = summary
    print(f"DDP scaling, tokens/s of ddp / single in turns of {args.slice_s:g} s: {turns.describe(summary)}")
    return results


def report(name: str, r: dict[str, Any]) -> None:
    mfu = f", MFU {100 * r['mfu']:.1f}%" if "mfu" in r else ""
    print(f"{name:>6}: {r['procs']} process(es) x {r['threads_per_proc']} thread(s): {1e3 * r['mean_step_s']:.1f} "
          f"ms/step mean, {1e3 * r['median_step_s']:.1f} median ({r['steps_counted']} steps), "
          f"{r['tokens_per_s']:,.0f} tokens/s{mfu}")  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = arguments(__doc__)
    parser.add_argument("--mode", choices=["ddp", "single", "both"], default="ddp")
    parser.add_argument("--procs", type=int, default=2, help="DDP processes (the job's trainer.devices)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per measurement")
    parser.add_argument("--warmup", type=int, default=30, help="first steps left out of the timing")
    parser.add_argument("--model_type", default="gpt-nano")
    for name in ("n_layer", "n_head", "n_embd"):
        parser.add_argument(f"--{name}", type=int, default=None, help="overrides the preset")
    parser.add_argument("--gpt", type=parse_option, action="append", default=[], metavar="KEY=VALUE",
                        help="another GPTConfig field (bias=false, rope=true, dropout=0.1...); repeatable")  # fmt: skip
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=32, help="windows per process and step (ddp)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate")
    parser.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    parser.add_argument("--muon_lr", type=float, default=0.02, help="Muon's peak learning rate")
    parser.add_argument("--lr_warmup_steps", type=int, default=100, help="learning-rate warmup (optimizer steps)")
    parser.add_argument("--min_lr_ratio", type=float, default=0.1, help="the cosine's floor, relative to the peak")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--peak_flops", type=float, default=None, help="FLOP/s of one process; default: measured")
    parser.add_argument("--no_mfu", dest="mfu", action="store_false", help="skip the matmul peak measurement")
    parser.add_argument("--clock", type=Path, default=None, help="the step clock's file (default: a temporary one)")
    parser.add_argument("--slice_s", type=float, default=1.0, help="--mode both: seconds per turn")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup + 1:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup} + 1")
    if args.steps <= args.lr_warmup_steps:
        parser.error(f"--steps {args.steps} must exceed --lr_warmup_steps {args.lr_warmup_steps}")
    if args.mode == "both":
        results = both_in_turns(args, sys.argv[1:] if argv is None else argv)  # the last --mode, --clock count
    else:
        with tempfile.TemporaryDirectory(prefix="plain_ddp_") as tmp:
            args.clock = args.clock or Path(tmp) / "clock.txt"
            results = {args.mode: run(args.mode, args)}
        report(args.mode, results[args.mode])
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
