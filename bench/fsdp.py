"""What FSDP2 saves and costs against DDP (``make bench-fsdp``, about 12 minutes here): bytes per rank, then step time.

1. **Memory**: the bytes of parameters, gradients and AdamW state a step leaves held per rank (a DTensor: its local
   shard), for the tutorial's GPT (8 x 8 x 512, block 128) under DDP and FSDP2 on 1 and 2 gloo processes, with the
   product's pieces (:func:`lit_ddp.recipe.build_optimizer`, :func:`lit_ddp.models.parallelize.shard`, a unit per
   block); not counted: activations, DDP's gradient buckets, the block FSDP2 holds gathered while it computes.
2. **Step time**: ``lit-ddp fit`` with ``configs/trainer/fsdp.yaml`` over ``ddp.yaml`` (the main job with AdamW,
   validation and sampling off, 2 processes) in turns (:mod:`bench.harness.turns`), for gpt-nano and the tutorial's
   size (batch 4 per process, a step near a second).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from bench.harness import turns
from bench.harness.launch import NO_VALIDATION, QUIET, fit_command, free_port, gloo_group, without_samples
from bench.harness.measure import arguments, markdown_table, write_json
from lit_ddp.models.gpt import GPT, Block, GPTConfig
from lit_ddp.models.parallelize import shard
from lit_ddp.recipe import build_optimizer

SIDES = ("ddp", "fsdp")  # a round: an FSDP2 turn over the DDP turn before it
VOCAB_SIZE = 65  # the embedded Tiny Shakespeare's characters


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of ``tensor``: a DTensor's local shard, else the whole tensor."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """``{"params", "grads", "optimizer"}``: bytes this rank holds of each after a step."""
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(local_bytes(t) for t in state),
    }


class CollectiveCounter:
    """Counts the collectives FSDP2 issues, by wrapping the two functions it calls (``dist.all_gather_single``,
    ``dist.reduce_scatter_single``) while the block runs: calls and bytes of each call's output, per kind."""

    NAMES = ("all_gather_single", "reduce_scatter_single")

    def __init__(self) -> None:
        self.calls = {name: 0 for name in self.NAMES}
        self.bytes = {name: 0 for name in self.NAMES}

    def __enter__(self) -> CollectiveCounter:
        self.saved = {name: getattr(dist, name) for name in self.NAMES}
        for name, real in self.saved.items():
            setattr(dist, name, self._counting(name, real))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, real in self.saved.items():
            setattr(dist, name, real)

    def _counting(self, name: str, real: Any) -> Any:
        def call(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            self.bytes[name] += output.numel() * output.element_size()
            return real(output, *args, **kwargs)

        return call


def _memory_worker(rank: int, world_size: int, strategy: str, port: int, out: Any) -> None:
    with gloo_group(rank, world_size, port):
        torch.manual_seed(0)
        model: nn.Module = GPT(GPTConfig.from_preset("tutorial", vocab_size=VOCAB_SIZE, block_size=128))
        if strategy == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh

            shard(model, init_device_mesh("cpu", (world_size,)), units=(Block,))
            trained = model
        else:
            trained = nn.parallel.DistributedDataParallel(model)
        optimizer = build_optimizer(model, "adamw")
        idx = torch.randint(0, VOCAB_SIZE, (2, 128), generator=torch.Generator().manual_seed(rank))  # (B, T)
        with CollectiveCounter() as counter:
            _, loss = trained(idx, idx)
            loss.backward()
        optimizer.step()
        out.put((rank, {"held": held_bytes(model, optimizer), "calls": counter.calls, "bytes": counter.bytes}))


def measure(strategy: str, world_size: int) -> dict[str, Any]:
    """Rank zero's figures for one strategy and size: ``held`` bytes (every rank holds as much, to the shards'
    padding), and the ``calls`` and output ``bytes`` of FSDP2's all-gathers and reduce-scatters in one step."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(
        _memory_worker, args=(world_size, strategy, free_port(), out), nprocs=world_size,
        start_method="spawn",
    )  # fmt: skip
    found = dict(out.get() for _ in range(world_size))
    return found[0]


def step_time_ratio(size: str, steps: int, warmup: int, slice_s: float, timeout: float) -> dict[str, Any]:
    """FSDP2 / DDP step time of the main job with AdamW at ``size`` (``gpt-nano`` or ``tutorial``), 2 processes,
    validation and sampling off, in turns."""
    extra = [] if size == "gpt-nano" else ["--model.init_args.model_type", "tutorial", "--data.batch_size", "4"]
    with tempfile.TemporaryDirectory(prefix="bench_fsdp_") as tmp:
        clocks = {side: Path(tmp) / f"{side}.clock" for side in SIDES}
        commands = {}
        for side in SIDES:
            configs = (f"configs/trainer/{side}.yaml", "configs/mingpt/cpu.yaml")
            args = ["--model.init_args.optimizer", "adamw", "--trainer.max_steps", str(steps), *NO_VALIDATION,
                    without_samples(*configs), *QUIET, *extra]  # fmt: skip
            commands[side] = fit_command(*configs, root=Path(tmp) / side, clock=clocks[side], args=args)
        summary = turns.run_in_turns(commands, clocks, Path(tmp), slice_s, warmup, timeout)
    summary["slice_s"] = slice_s
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = arguments(__doc__)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per side, gpt-nano")
    parser.add_argument("--tutorial_steps", type=int, default=120, help="optimizer steps per side, tutorial size")
    turns.add_arguments(parser, warmup=10, slice_s=2.0)
    parser.add_argument("--tutorial_slice_s", type=float, default=12.0, help="--slice_s at the tutorial's size")
    parser.add_argument("--parts", nargs="+", default=["memory", "gpt-nano", "tutorial"], help="what to measure")
    args = parser.parse_args(argv)

    figures: dict[str, Any] = {"memory": {}, "step_time": {}}
    if "memory" in args.parts:
        print_memory(figures)
    sizes = {"gpt-nano": (args.steps, args.slice_s), "tutorial": (args.tutorial_steps, args.tutorial_slice_s)}
    for size, (steps, slice_s) in sizes.items():
        if size in args.parts:
            summary = step_time_ratio(size, steps, args.warmup, slice_s, args.timeout)
            figures["step_time"][size] = summary
            print(f"{size}: FSDP2 / DDP step time, 2 processes, turns of {slice_s:g} s: {turns.describe(summary)}")
    write_json(args.json, figures)
    return figures


def print_memory(figures: dict[str, Any]) -> None:
    print("bytes per rank after a step, the tutorial's GPT (8 x 8 x 512, block_size 128), fp32 + AdamW:")
    rows = []
    for strategy in SIDES:
        for world_size in (1, 2):
            held = measure(strategy, world_size)["held"]
            counted = figures["memory"][f"{strategy}-{world_size}"] = {**held, "total": sum(held.values())}
            rows.append([strategy, world_size, *(f"{v:,d}" for v in counted.values())])
    print(markdown_table(["strategy", "procs", "params", "grads", "optimizer", "total"], rows))
    ratio = figures["memory"]["fsdp-2"]["total"] / figures["memory"]["ddp-2"]["total"]
    print(f"FSDP2 on 2 / DDP on 2: {ratio:.3f} of the bytes per rank", flush=True)


if __name__ == "__main__":
    main()
