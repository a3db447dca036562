"""What FSDP2 saves against DDP (``make bench-fsdp``; docs/fsdp.md, notebooks/06_fsdp2.ipynb): the bytes of
parameters, gradients and AdamW state a step leaves held per rank (a DTensor: its local shard), for the tutorial's GPT
(8 x 8 x 512, block 128) under DDP and FSDP2 on 1 and 2 gloo processes, with the product's pieces
(:func:`lit_ddp.recipe.build_optimizer`, :func:`lit_ddp.models.parallelize.shard`, a unit per block), and FSDP2's
collectives in that step. Not counted: activations, DDP's gradient buckets, the block FSDP2 holds gathered while it
computes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from bench.harness.launch import free_port, gloo_group
from bench.harness.measure import arguments, markdown_table, write_json
from lit_ddp.models.gpt import GPT, Block, GPTConfig
from lit_ddp.models.parallelize import shard
from lit_ddp.recipe import build_optimizer

VOCAB_SIZE = 65  # the embedded Tiny Shakespeare's characters


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of ``tensor``: a DTensor's local shard, else the whole tensor."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """``{"params", "grads", "optimizer"}``: bytes this rank holds of each after a step."""
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    held = {"params": params, "grads": [p.grad for p in params if p.grad is not None], "optimizer": state}
    return {name: sum(map(local_bytes, tensors)) for name, tensors in held.items()}


class CollectiveCounter:
    """Counts the collectives FSDP2 issues, by wrapping the two functions it calls (``dist.all_gather_single``,
    ``dist.reduce_scatter_single``) while the block runs: calls and bytes of each call's output, per kind."""

    NAMES = ("all_gather_single", "reduce_scatter_single")

    def __init__(self) -> None:
        self.calls, self.bytes = dict.fromkeys(self.NAMES, 0), dict.fromkeys(self.NAMES, 0)

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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = arguments(__doc__).parse_args(argv)
    print("bytes per rank after a step, the tutorial's GPT (8 x 8 x 512, block_size 128), fp32 + AdamW:")
    figures, rows = {}, []
    for strategy in ("ddp", "fsdp"):
        for world_size in (1, 2):
            figures[f"{strategy}-{world_size}"] = found = measure(strategy, world_size)
            held = found["held"] = {**found["held"], "total": sum(found["held"].values())}
            rows.append([strategy, world_size, *(f"{v:,d}" for v in held.values())])
    print(markdown_table(["strategy", "procs", "params", "grads", "optimizer", "total"], rows))
    ratio = figures["fsdp-2"]["held"]["total"] / figures["ddp-2"]["held"]["total"]
    print(f"FSDP2 on 2 / DDP on 2: {ratio:.3f} of the bytes per rank", flush=True)
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
