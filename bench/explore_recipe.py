"""Which GPT recipe learns most per second on this CPU: a plain PyTorch loop over the model options.

Two measurements, kept apart because this machine is shared (other processes slow a run down, but do not
change what it learns per step):

- training (default): ``--steps`` optimizer steps on Tiny Shakespeare (first 90% train, last 10% val) with
  ``--procs`` gloo processes of ``--threads`` threads each, ``--batch_size`` random windows per step over
  all processes (nanoGPT's ``get_batch``, each rank its own generator); warmup over ``--warmup`` steps,
  then a cosine down to ``--min_lr_ratio`` x the peak at the last step (the job's schedule,
  :func:`lit_ddp.recipe.warmup_cosine_schedule`); gradient clipping at norm 1.0. Printed every
  ``--eval_every`` steps and at the end: the loss on the whole validation split (all disjoint windows, as
  the job's ``val/loss``) and the wall seconds so far. One process with the global batch learns the same
  as DDP, so exploring with ``--procs 1 --threads 1`` leaves a core to others. A long run can be cut into
  pieces (``--pause_after`` seconds, then the same command again, with ``--state`` holding model,
  optimizer, schedule and RNG states between them), so that no single run holds a shared machine for
  long; the wall seconds add up over the pieces;
- ``--cost``: the wall time of one training step (forward, backward, clipping, optimizer) of the given
  recipe and of the baseline (gpt-nano, AdamW), alternated in one process with one thread at the
  per-process batch, so that load from other processes hits both alike; the ratio to the baseline turns
  the job's measured step time into an estimate for the recipe.

Optimizers, the job's (:func:`lit_ddp.recipe.build_optimizer`): ``adamw`` (minGPT's decay groups, ``--lr``) or
``muon`` (``torch.optim.Muon`` for the blocks' matrices at ``--muon_lr``, AdamW for the rest at ``--lr``).
On a CPU without bf16 units, ``torch.optim.Muon``'s bf16 Newton-Schulz is slow; ``--cost`` shows it.

    nice -n 10 .venv/bin/python -m bench.explore_recipe --procs 1 --steps 2000 --rope --optimizer muon
    nice -n 10 .venv/bin/python -m bench.explore_recipe --cost --n_layer 4 --n_embd 128 --n_head 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.charlm import full_loss, get_batch, load_splits
from bench.plain_ddp import free_port
from lit_ddp.models.gpt import GPT, GPTConfig
from lit_ddp.recipe import build_optimizer, warmup_cosine_schedule


def build(args: argparse.Namespace, vocab_size: int) -> GPT:
    sizes = {k: v for k in ("n_layer", "n_head", "n_embd") if (v := getattr(args, k)) is not None}
    config = GPTConfig.from_preset(
        args.model_type,
        **sizes,
        block_size=args.block_size,
        vocab_size=vocab_size,
        bias=args.bias,
        rope=args.rope,
    )
    return GPT(config)


def optimizer(args: argparse.Namespace, model: GPT) -> torch.optim.Optimizer:
    """The job's optimizer (:func:`lit_ddp.recipe.build_optimizer`) with this run's settings."""
    return build_optimizer(
        model,
        args.optimizer,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        betas=(0.9, args.beta2),
        muon_learning_rate=args.muon_lr,
        muon_weight_decay=args.muon_wd,
    )


def train_step(
    net: torch.nn.Module, model: GPT, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    _, loss = net(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    vocab, train, val = load_splits()
    model = build(args, len(vocab))
    net = DDP(model) if world > 1 else model
    opt = optimizer(args, model)
    scheduler = warmup_cosine_schedule(opt, args.warmup, args.steps, args.min_lr_ratio)
    gen = torch.Generator().manual_seed(args.seed + rank)  # each rank its own windows
    curve: list[dict[str, float]] = []
    first, wall_before = 0, 0.0
    if args.state and args.state.is_file():  # a run paused by --pause_after: go on where it stopped
        state = torch.load(args.state, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        gen.set_state(state["generator"])
        torch.set_rng_state(state["rng"])
        first, wall_before, curve = state["step"], state["wall_s"], state["curve"]
        print(f"resumed at step {first}", flush=True)

    wall0 = time.perf_counter() - wall_before
    for step in range(first, args.steps + 1):
        if args.pause_after and step > first and time.perf_counter() - wall0 - wall_before > args.pause_after:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": scheduler.state_dict()}
            state["step"] = step
            state.update(generator=gen.get_state(), rng=torch.get_rng_state(), curve=curve)
            torch.save({**state, "wall_s": time.perf_counter() - wall0}, args.state)
            print(f"PAUSED at step {step}: run again with the same arguments to go on", flush=True)
            return
        if rank == 0 and (step % args.eval_every == 0 or step == args.steps):
            loss = full_loss(model, val, args.block_size)
            curve.append({"step": step, "wall_s": time.perf_counter() - wall0, "val_loss": loss})
            print(f"step {step:5d}  {curve[-1]['wall_s']:6.1f} s  val/loss {loss:.4f}", flush=True)
        if step == args.steps:
            break
        train_step(net, model, opt, *get_batch(train, args.block_size, args.batch_size // world, gen))
        scheduler.step()
    wall = time.perf_counter() - wall0
    if rank == 0:
        result = {
            "args": vars(args),
            "steps": args.steps,
            "wall_s": wall,
            "params": model.num_parameters(),
            "tokens": args.steps * args.batch_size * args.block_size,
            "val_loss": curve[-1]["val_loss"],
            "curve": curve,
        }
        Path(out).write_text(json.dumps(result, default=str))
    if world > 1:
        del net  # the DDP wrapper first: see lit_ddp.ddp_by_hand.grad_worker for the exit hang otherwise
        dist.destroy_process_group()


def step_cost(args: argparse.Namespace, rounds: int = 7, steps: int = 10) -> dict[str, float]:
    """Seconds per training step of the recipe and of the baseline (gpt-nano, AdamW, no options), one
    thread, per-process batch; alternated, the median over ``rounds`` of ``steps`` steps each."""
    torch.set_num_threads(1)
    vocab, train, _ = load_splits()
    base_args = argparse.Namespace(**{**vars(args), **BASELINE})
    runs = {}
    for name, a in (("recipe", args), ("baseline", base_args)):
        torch.manual_seed(a.seed)
        model = build(a, len(vocab))
        runs[name] = (model, optimizer(a, model), get_batch(train, a.block_size, a.batch_size // a.procs))
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        for name in list(runs)[:: 1 if r % 2 else -1]:  # which goes first alternates
            model, opt, (x, y) = runs[name]
            train_step(model, model, opt, x, y)  # warm
            t0 = time.perf_counter()
            for _ in range(steps):
                train_step(model, model, opt, x, y)
            times[name].append((time.perf_counter() - t0) / steps)
    cost = {name: statistics.median(t) for name, t in times.items()}
    cost["ratio"] = cost["recipe"] / cost["baseline"]
    return cost


BASELINE = {
    "model_type": "gpt-nano", "n_layer": None, "n_head": None, "n_embd": None, "block_size": 64, "batch_size": 64,
    "bias": True, "rope": False,
    "optimizer": "adamw", "procs": 2,
}  # fmt: skip
"""The job's recipe in ``configs/mingpt/cpu.yaml`` before this exploration (2 processes x 32 windows)."""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    p.add_argument("--cost", action="store_true", help="measure the step time against the baseline instead")
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--model_type", default="gpt-nano")
    p.add_argument("--n_layer", type=int, default=None)
    p.add_argument("--n_head", type=int, default=None)
    p.add_argument("--n_embd", type=int, default=None)
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=64, help="windows per step, over all processes")
    p.add_argument("--bias", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--rope", action="store_true")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"])
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate")
    p.add_argument("--muon_lr", type=float, default=0.02)
    p.add_argument("--muon_wd", type=float, default=0.0)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100, help="warmup steps")
    p.add_argument("--min_lr_ratio", type=float, default=0.1)
    p.add_argument("--eval_every", type=int, default=250, help="steps between validations")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--json", type=Path, default=None, help="append the result as one JSON line here")
    p.add_argument("--tag", default="", help="a name for the table")
    p.add_argument("--state", type=Path, default=None, help="pause/resume file (one process only)")
    p.add_argument("--pause_after", type=float, default=None, help="wall seconds before pausing into --state")
    args = p.parse_args(argv)

    if (args.state or args.pause_after) and (args.procs != 1 or not args.state):
        p.error("--state/--pause_after need --procs 1 and a --state file")
    if args.batch_size % args.procs:
        p.error(f"--batch_size {args.batch_size} must be divisible by --procs {args.procs}")
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if args.cost:
        cost = step_cost(args)
        print(
            f"COST {args.tag or '-'}: {1e3 * cost['recipe']:.1f} ms/step vs baseline {1e3 * cost['baseline']:.1f} "
            f"ms/step (1 thread, {args.batch_size // args.procs} windows): ratio {cost['ratio']:.2f}"
        )
        return cost
    out = Path("/tmp") / f"explore_{os.getpid()}.json"
    if args.procs > 1:
        mp.spawn(worker, args=(args.procs, free_port(), args, str(out)), nprocs=args.procs)
    else:
        worker(0, 1, 0, args, str(out))
    if not out.is_file():
        return {}  # paused
    result = json.loads(out.read_text())
    out.unlink()
    if args.state:
        args.state.unlink(missing_ok=True)
    print(
        f"RESULT {args.tag or '-'}: val/loss {result['val_loss']:.4f}  steps {result['steps']}  "
        f"wall {result['wall_s']:.1f} s  params {result['params']:,}  "
        f"tokens {result['tokens']:,}"
    )
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result, default=str) + "\n")
    sys.stdout.flush()
    return result


if __name__ == "__main__":
    main()
