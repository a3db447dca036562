"""Kernel launches of the GPU main job's step, counted on a CPU (issue 52; ``make bench-launches``, about a minute):
the aten ops (an eager op is about one CUDA kernel launch) and milliseconds of one optimizer step and one training
step of ``configs/mingpt/gpu.yaml``'s model (not compiled, train mode, bf16 autocast, 4 x 256 tokens: fewer rows than
gpu.yaml's 64 change no op count), for the recipe's optimizer (``torch.optim.Muon`` and AdamW, as a CPU steps it and
as CUDA does, ``foreach``) and for gpu.yaml's :class:`~lit_ddp.callbacks.batched_step.BatchedOptimizerStep`
(BatchedMuon, AdamW ``fused``). Counted over each optimizer's second step; ms: the median of ``--reps`` steps by
turns. CPU attention kernels differ from CUDA's: the training step's count is near a GPU's, not equal.
"""

from __future__ import annotations

import argparse
import collections
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from bench.harness.measure import alternate, markdown_table, seconds
from lit_ddp.callbacks.batched_step import batch_optimizer_step
from lit_ddp.data.char import build_vocab
from lit_ddp.recipe import build_optimizer
from lit_ddp.tasks.mingpt import GPTModule

GPU_YAML = Path(__file__).resolve().parents[1] / "configs" / "mingpt" / "gpu.yaml"

VOCAB = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # Tiny Shakespeare's 65 characters


def cuda_default(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The recipe's optimizer with AdamW ``foreach``, torch's default on CUDA (a CPU's is a loop over parameters)."""
    for group in optimizer.param_groups:
        if "foreach" in group:
            group["foreach"] = True
    return optimizer


VARIANTS: dict[str, Callable[[torch.optim.Optimizer], torch.optim.Optimizer]] = {
    "recipe, a CPU's AdamW": lambda optimizer: optimizer,
    "recipe, CUDA's AdamW (before)": cuda_default,
    "BatchedOptimizerStep, AdamW fused (after)": lambda optimizer: batch_optimizer_step(optimizer, adamw_fused=True),
}


class AtenOps(TorchDispatchMode):
    """Counts the aten ops dispatched inside it (views and profiler marks too)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


class Job:
    """gpu.yaml's model and one choice of optimizer, from the same seed."""

    def __init__(self, variant: Callable[[torch.optim.Optimizer], torch.optim.Optimizer], batch: torch.Tensor) -> None:
        config = yaml.safe_load(GPU_YAML.read_text())
        args = {**config["model"]["init_args"], "compile": False, "betas": tuple(config["model"]["init_args"]["betas"])}
        torch.manual_seed(0)
        module = GPTModule(**args, block_size=config["data"]["init_args"]["block_size"], vocab=build_vocab(VOCAB))
        assert module.model is not None
        self.model = module.model.train()
        hp = module.hparams
        self.optimizer = variant(build_optimizer(
            self.model, "muon", learning_rate=hp["learning_rate"], weight_decay=hp["weight_decay"],
            betas=hp["betas"], muon_learning_rate=hp["muon_learning_rate"], muon_momentum=hp["muon_momentum"],
            muon_weight_decay=hp["muon_weight_decay"],
        ))  # fmt: skip
        self.batch = batch

    def forward_backward(self) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = self.model(self.batch, self.batch)
        loss.backward()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def count(self) -> tuple[int, int]:
        """Aten ops of (the optimizer step, the training step)."""
        with AtenOps() as ops:
            self.forward_backward()
            before = ops.total
            self.optimizer.step()
            in_step = ops.total - before
            self.optimizer.zero_grad(set_to_none=True)
        return in_step, ops.total

    def time(self) -> tuple[float, float]:
        """Milliseconds of (the optimizer step, the training step)."""
        backward, step = seconds(self.forward_backward), seconds(self.optimizer_step)
        return step * 1e3, (backward + step) * 1e3


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="timed steps of each optimizer, taken by turns")
    parser.add_argument("--batch_size", type=int, default=4, help="sequences of 256 tokens per training step")
    args = parser.parse_args(argv)
    batch = torch.randint(0, len(VOCAB), (args.batch_size, 256), generator=torch.Generator().manual_seed(0))
    jobs = {name: Job(variant, batch) for name, variant in VARIANTS.items()}
    results: dict[str, dict[str, float]] = {}
    for name, job in jobs.items():
        job.forward_backward()
        job.optimizer_step()  # the state, BatchedMuon's stacks
        optimizer_ops, training_ops = job.count()
        results[name] = {"optimizer_ops": optimizer_ops, "training_ops": training_ops}
    times = alternate({name: job.time for name, job in jobs.items()}, args.reps)
    for name, measured in times.items():
        results[name]["optimizer_ms"] = statistics.median(t[0] for t in measured)
        results[name]["training_ms"] = statistics.median(t[1] for t in measured)
    print(f"gpu.yaml's model on this CPU: torch {torch.__version__}, {torch.get_num_threads()} threads, batch "
          f"{args.batch_size} x 256, bf16 autocast, median of {args.reps}")  # fmt: skip
    rows = [("aten ops per optimizer step", "optimizer_ops", "{:.0f}"),
            ("aten ops per training step", "training_ops", "{:.0f}"),
            ("optimizer step ms", "optimizer_ms", "{:.1f}"), ("training step ms", "training_ms", "{:.1f}")]  # fmt: skip
    lines = [[label, *(spec.format(r[key]) for r in results.values())] for label, key, spec in rows]
    print(markdown_table(["", *results], lines, align="---:"))
    return results


if __name__ == "__main__":
    main()
