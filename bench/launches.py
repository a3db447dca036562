"""Kernel launches of the GPU main job's step, counted on a CPU (``make bench-launches``; docs/speed.md, "Optimizer
step: aten ops"): aten ops and ms of one optimizer step and one training step of gpu.yaml's model (eager, bf16
autocast, 4 x 256 tokens) for the recipe's optimizer (a CPU's AdamW, CUDA's ``foreach``) and for gpu.yaml's
:class:`~lit_ddp.callbacks.batched_step.BatchedOptimizerStep`. Counted over each optimizer's second step; ms: the
median of ``--reps`` steps by turns.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from bench.harness.measure import alternate, arguments, markdown_table, seconds, write_json
from bench.harness.ops import VOCAB, AtenOps, recipe_model
from lit_ddp.callbacks.batched_step import batch_optimizer_step


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


class Job:
    """gpu.yaml's model and one choice of optimizer, from the same seed."""

    def __init__(self, variant: Callable[[torch.optim.Optimizer], torch.optim.Optimizer], batch: torch.Tensor) -> None:
        module, optimizer = recipe_model(device=batch.device.type)
        self.model, self.optimizer, self.batch = module.model, variant(optimizer), batch
        self.sync = torch.cuda.synchronize if batch.is_cuda else None

    def forward_backward(self) -> None:
        with torch.autocast(self.batch.device.type, dtype=torch.bfloat16):
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
            in_step = ops.total - before  # zero_grad's profiler marks left out
            self.optimizer.zero_grad(set_to_none=True)
        return in_step, ops.total

    def time(self) -> tuple[float, float]:
        """Milliseconds of (the optimizer step, the training step)."""
        backward, step = seconds(self.forward_backward, self.sync), seconds(self.optimizer_step, self.sync)
        return step * 1e3, (backward + step) * 1e3


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = arguments(__doc__)
    parser.add_argument("--reps", type=int, default=5, help="timed steps of each optimizer, taken by turns")
    parser.add_argument("--batch_size", type=int, default=4, help="sequences of 256 tokens per training step")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the same counts and the GPU's ms")
    args = parser.parse_args(argv)
    batch = torch.randint(0, len(VOCAB), (args.batch_size, 256), generator=torch.Generator().manual_seed(0))
    batch = batch.to(args.device)
    jobs = {name: Job(variant, batch) for name, variant in VARIANTS.items()}
    results: dict[str, dict[str, float]] = {}
    for name, job in jobs.items():
        job.forward_backward()
        job.optimizer_step()  # the state, BatchedMuon's stacks
        optimizer_ops, training_ops = job.count()
        results[name] = {"optimizer_ops": optimizer_ops, "training_ops": training_ops}
    for name, measured in alternate({name: job.time for name, job in jobs.items()}, args.reps).items():
        results[name]["optimizer_ms"] = statistics.median(t[0] for t in measured)
        results[name]["training_ms"] = statistics.median(t[1] for t in measured)
    where = torch.cuda.get_device_name() if batch.is_cuda else f"this CPU, {torch.get_num_threads()} threads"
    print(f"gpu.yaml's model on {where}: torch {torch.__version__}, batch "
          f"{args.batch_size} x 256, bf16 autocast, median of {args.reps}")  # fmt: skip
    rows = [("aten ops per optimizer step", "optimizer_ops", "{:.0f}"),
            ("aten ops per training step", "training_ops", "{:.0f}"),
            ("optimizer step ms", "optimizer_ms", "{:.1f}"), ("training step ms", "training_ms", "{:.1f}")]  # fmt: skip
    lines = [[label, *(spec.format(r[key]) for r in results.values())] for label, key, spec in rows]
    print(markdown_table(["", *results], lines, align="---:"))
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
