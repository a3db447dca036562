"""The main job's training step as a plain PyTorch DDP loop: its step time, tokens/s and MFU, no Lightning.

The same work per step as ``configs/mingpt/cpu.yaml`` (its defaults are that file's values when this was
written; :mod:`bench.framework_overhead` passes the file's current ones): the GPT of
:mod:`lit_ddp.models.gpt` (``gpt-nano``, context 64, biases, dropout 0; ``--gpt KEY=VALUE`` for the other
:class:`~lit_ddp.models.gpt.GPTConfig` fields), windows of 64 characters starting at every position of the first 90% of
Tiny Shakespeare, shuffled by a ``DistributedSampler``, 32 windows per process and step, the job's optimizer
and schedule from :mod:`lit_ddp.recipe` (the code ``GPTModule`` trains with: AdamW at ``--lr`` with minGPT's
decay groups, or ``--optimizer muon``: ``torch.optim.Muon`` at ``--muon_lr`` on the blocks' matrices and AdamW
on the rest; warmup over ``--lr_warmup_steps``, then a cosine to ``--min_lr_ratio`` x the peak at the last
step), gradient clipping at norm 1.0. No validation, logging or checkpoints: only training steps are timed.

Modes:

- ``ddp``: ``--procs`` processes (default 2), ``torch.multiprocessing.spawn``, gloo,
  ``DDP`` without the per-step buffer broadcast (as ``configs/trainer/ddp.yaml``:
  :func:`lit_ddp.strategies.ddp_buffer_kwargs`), each
  process with ``cores // procs`` threads (what Lightning gives each);
- ``single``: one process with ``cores`` threads and the same global batch (``procs x batch_size``);
- ``both``: ``ddp`` and ``single`` as two subprocesses running in turns of ``--slice_s`` seconds
  (:mod:`bench.turns`), and the DDP scaling: the median over rounds of tokens/s of ``ddp`` over ``single``.

A step's time is the wall time between the starts of consecutive steps on rank zero (data loading,
forward, backward with the gradient all-reduce, clipping and the optimizer step); the first ``--warmup``
steps are left out. MFU = ``GPT.flops_per_token`` x tokens/s per process / the fp32 matmul peak of the
threads one process has (:mod:`bench.matmul_peak`, measured here unless ``--peak_flops`` is given).

    nice -n 10 .venv/bin/python -m bench.plain_ddp --mode both --steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler

from bench.charlm import load_splits
from bench.matmul_peak import matmul_flops
from lit_ddp.models.gpt import GPT, GPTConfig
from lit_ddp.recipe import build_optimizer, warmup_cosine_schedule
from lit_ddp.strategies import ddp_buffer_kwargs


class Windows(Dataset):
    """Item ``i``: ``(data[i : i + T], data[i + 1 : i + T + 1])``, every start position (the job's train set)."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return len(self.data) - self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i : i + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def parse_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` for a :class:`GPTConfig` field, the value converted to the field's type."""
    key, sep, value = text.partition("=")
    types = {f.name: f.type for f in fields(GPTConfig)}
    if not sep or key not in types:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE with KEY one of {sorted(types)}")
    kind = types[key]
    if kind == "bool":
        return key, value.lower() in ("1", "true", "yes")
    return key, {"int": int, "float": float}.get(kind, str)(value)


def gpt_config(args: argparse.Namespace, vocab_size: int) -> GPTConfig:
    sizes = {k: v for k in ("n_layer", "n_head", "n_embd") if (v := getattr(args, k)) is not None}
    overrides = dict(args.gpt)
    return GPTConfig.from_preset(
        args.model_type,
        **{"dropout": 0.0, "bias": True, **sizes, **overrides},
        block_size=args.block_size,
        vocab_size=vocab_size,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_flops(threads: int) -> float:
    """fp32 matmul FLOP/s with ``threads`` torch threads (a quick :mod:`bench.matmul_peak`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return max(matmul_flops(n, min_time=0.2) for n in (256, 512, 1024))
    finally:
        torch.set_num_threads(before)


def train_loop(rank: int, world: int, args: argparse.Namespace, threads: int, batch_size: int) -> dict[str, Any]:
    """Runs ``args.steps`` steps on this rank; returns rank zero's step times (seconds) and sizes."""
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    vocab, train, _ = load_splits()
    model = GPT(gpt_config(args, len(vocab)))
    dataset = Windows(train, args.block_size)
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

    times: list[float] = []
    starts: list[float] = []
    last = None
    for step, (x, y) in enumerate(loader):
        if step == args.steps:
            break
        now = time.clock_gettime(time.CLOCK_MONOTONIC)  # after the batch fetch, as on_train_batch_start
        starts.append(now)
        if step == 0 and rank == 0 and args.started_file:
            Path(args.started_file).touch()  # start-up is over (bench.framework_overhead waits for this)
        if last is not None:
            times.append(now - last)
        last = now
        _, loss = net(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    return {
        "step_times": times[args.warmup :],
        "step_starts": starts,  # every step's start, CLOCK_MONOTONIC (system-wide) seconds
        "tokens_per_step": world * batch_size * args.block_size,
        "procs": world,
        "threads_per_proc": threads,
        "flops_per_token": model.flops_per_token(args.block_size),
        "final_train_loss": loss.item(),
    }


def _ddp_worker(rank: int, world: int, port: int, args: argparse.Namespace, threads: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = train_loop(rank, world, args, threads, args.batch_size)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def summarize(result: dict[str, Any], peak: float | None) -> dict[str, Any]:
    """Adds mean / median step time (s), tokens/s (all processes) and MFU to a loop's result."""
    times = result["step_times"]
    mean = sum(times) / len(times)
    result["mean_step_s"] = mean
    result["median_step_s"] = statistics.median(times)
    result["tokens_per_s"] = result["tokens_per_step"] / mean
    if peak:
        per_proc = result["tokens_per_s"] / result["procs"]
        result["peak_flops_per_proc"] = peak
        result["mfu"] = result["flops_per_token"] * per_proc / peak
    return result


def run(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One measurement: ``mode`` is ``ddp`` or ``single``."""
    cores = os.cpu_count() or 1
    if mode == "ddp":
        threads = max(1, cores // args.procs)
        out = Path(args.tmp) / f"plain_ddp_{os.getpid()}.json"
        mp.spawn(_ddp_worker, args=(args.procs, free_port(), args, threads, str(out)), nprocs=args.procs)
        result = json.loads(out.read_text())
        out.unlink()
    else:
        threads = cores
        result = train_loop(0, 1, args, threads, args.procs * args.batch_size)
        result["procs"] = 1
    peak = args.peak_flops or (peak_flops(threads) if args.mfu else None)
    return summarize(result, peak)


def without_options(argv: list[str], *names: str) -> list[str]:
    """``argv`` without the options ``names`` and their values (``--name value`` or ``--name=value``)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not any(arg.startswith(f"{name}=") for name in names):
            out.append(arg)
    return out


def both_in_turns(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """``ddp`` and ``single`` as two subprocesses running in turns of ``--slice_s`` seconds
    (:mod:`bench.turns`); the DDP scaling is the median over rounds of a single turn's mean step time over
    the ddp turn's before it (the same global batch: tokens/s of ddp over single)."""
    from bench import turns

    base = without_options(argv, "--mode", "--json", "--started_file")
    with tempfile.TemporaryDirectory(prefix="plain_ddp_both_") as tmp:
        work = Path(tmp)
        paths = {mode: work / f"{mode}.json" for mode in ("ddp", "single")}
        commands = {
            mode: [sys.executable, "-m", "bench.plain_ddp", *base, "--mode", mode, "--json", str(paths[mode]),
                   "--started_file", str(turns.started_path(paths[mode]))]
            for mode in paths
        }  # fmt: skip
        result = turns.run_in_turns(commands, paths, work, args.slice_s, args.warmup, timeout=1800.0)
    results = {mode: record[mode] for mode, record in result["records"].items()}
    rounds = turns.pair_rounds(result, {mode: results[mode]["step_starts"] for mode in results}, args.warmup)
    summary = turns.summarize_rounds(rounds, "ddp", "single")
    for mode in results:  # tokens/s and MFU from the steps counted in the turns
        r = results[mode]
        r["mean_step_s"] = summary["mean_step_s"][mode]
        r["tokens_per_s"] = r["tokens_per_step"] / r["mean_step_s"]
        if "peak_flops_per_proc" in r:
            r["mfu"] = r["flops_per_token"] * r["tokens_per_s"] / r["procs"] / r["peak_flops_per_proc"]
        report(mode, r)
    results["ddp_over_single"] = summary["ratio_median"]
    results["scaling"] = summary
    print(f"DDP scaling, tokens/s of ddp / single in turns of {args.slice_s:g} s: {turns.describe(summary)}")
    return results


def report(name: str, r: dict[str, Any]) -> None:
    mfu = f", MFU {100 * r['mfu']:.1f}%" if "mfu" in r else ""
    print(
        f"{name:>6}: {r['procs']} process(es) x {r['threads_per_proc']} thread(s): "
        f"{1e3 * r['mean_step_s']:.1f} ms/step mean, {1e3 * r['median_step_s']:.1f} median "
        f"({len(r['step_times'])} steps), {r['tokens_per_s']:,.0f} tokens/s{mfu}"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["ddp", "single", "both"], default="ddp")
    parser.add_argument("--procs", type=int, default=2, help="DDP processes (the job's trainer.devices)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per measurement")
    parser.add_argument("--warmup", type=int, default=30, help="first steps left out of the timing")
    parser.add_argument("--model_type", default="gpt-nano")
    parser.add_argument("--n_layer", type=int, default=None, help="overrides the preset")
    parser.add_argument("--n_head", type=int, default=None, help="overrides the preset")
    parser.add_argument("--n_embd", type=int, default=None, help="overrides the preset")
    parser.add_argument(
        "--gpt", type=parse_option, action="append", default=[], metavar="KEY=VALUE",
        help="another GPTConfig field (bias=false, rope=true, dropout=0.1...); repeatable",
    )  # fmt: skip
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
    parser.add_argument("--json", type=Path, default=None, help="write the results (step times included) here")
    parser.add_argument("--tmp", default="/tmp")
    parser.add_argument("--started_file", default=None, help="rank zero creates this file when step 0 begins")
    parser.add_argument("--slice_s", type=float, default=1.0, help="--mode both: seconds per turn")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup + 1:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup} + 1")
    if args.steps <= args.lr_warmup_steps:
        parser.error(f"--steps {args.steps} must exceed --lr_warmup_steps {args.lr_warmup_steps}")

    if args.mode == "both":
        results = both_in_turns(args, argv if argv is not None else sys.argv[1:])
    else:
        results = {args.mode: run(args.mode, args)}
        report(args.mode, results[args.mode])
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    sys.stdout.flush()
    return results


if __name__ == "__main__":
    main()
