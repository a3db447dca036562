"""The main job's training step as a plain PyTorch loop, no Lightning: the model and optimizer its YAMLs give
``GPTModule`` (:func:`bench.harness.ops.recipe_model`), the recipe's schedule, the job's windows and batch, clipping at
1.0; no validation, logging or checkpoints. It writes the step clock. ``--mode ddp``: ``trainer.devices`` gloo
processes, ``cores // devices`` threads each; ``single``: one process, every core, the same global batch.
:mod:`bench.speed` runs it in turns against ``lit-ddp fit`` and against itself.

    python -m bench.plain_ddp --mode single --steps 300 --clock /tmp/single.clock
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from bench.harness.clock import ClockFile, job_figures, read_clock
from bench.harness.launch import free_port, gloo_group, yaml_settings
from bench.harness.measure import arguments, write_json
from bench.harness.ops import recipe_model, train_step
from lit_ddp.data.char import CharWindows, build_vocab, encode
from lit_ddp.data.sources import read_embedded_text
from lit_ddp.recipe import warmup_cosine_schedule
from lit_ddp.strategies import ddp_buffer_kwargs

CONFIGS = ("configs/trainer/ddp.yaml", "configs/mingpt/cpu.yaml")  # make train's
SEED = 1337


def train_loop(rank: int, world: int, args: argparse.Namespace, threads: int, batch_size: int) -> None:
    """Runs ``args.steps`` steps on this rank; rank zero writes the step clock at ``args.clock``."""
    torch.set_num_threads(threads)
    module, optimizer = recipe_model(*args.configs)
    model, hp = module.model, module.hparams
    torch.manual_seed(SEED)
    text = read_embedded_text()
    dataset = CharWindows(encode(text[: int(0.9 * len(text))], build_vocab(text)), hp["block_size"])  # train split
    if world > 1:
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
        net: torch.nn.Module = DDP(model, **ddp_buffer_kwargs(False))  # as configs/trainer/ddp.yaml
    else:
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(SEED))
        net = model
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    scheduler = warmup_cosine_schedule(optimizer, hp["warmup_steps"], args.steps, hp["min_lr_ratio"])
    clock = ClockFile(args.clock)
    if rank == 0:
        clock.start()
        clock.write("job", world * batch_size * hp["block_size"], world, threads, model.flops_per_token())
    for step, (x, y) in enumerate(loader):
        if step == args.steps:
            break
        train_step(net, optimizer, x, y)
        scheduler.step()
        if rank == 0:
            clock.write("step", step + 1, os.getpid())
    clock.close()


def _ddp_worker(rank: int, world: int, port: int, args: argparse.Namespace, threads: int, batch_size: int) -> None:
    with gloo_group(rank, world, port):
        train_loop(rank, world, args, threads, batch_size)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = arguments(__doc__)
    parser.add_argument("--mode", choices=["ddp", "single"], default="ddp")
    parser.add_argument("--configs", nargs="+", default=CONFIGS, help="the job's YAMLs, in --config order")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--clock", type=Path, required=True, help="the step clock's file")
    args = parser.parse_args(argv)
    settings = yaml_settings(*args.configs)
    procs, batch_size = int(settings["trainer"].get("devices", 2)), settings["data"]["batch_size"]
    cores = os.cpu_count() or 1
    if args.mode == "ddp":
        threads = max(1, cores // procs)
        mp.spawn(_ddp_worker, args=(procs, free_port(), args, threads, batch_size), nprocs=procs)
    else:
        train_loop(0, 1, args, cores, procs * batch_size)
    events = read_clock(args.clock)
    times = [b - a for a, b in events["span"][min(30, args.steps // 3) :]]  # after the warm-up
    result = job_figures(events["job"][0][1:], statistics.mean(times))
    print(f"{args.mode}: {1e3 * result['mean_step_s']:.1f} ms/step, {result['tokens_per_s']:,.0f} tokens/s")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
