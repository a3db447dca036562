"""The reference the main job is timed against: nanoGPT's CPU recipe as a plain single-process PyTorch loop.

nanoGPT's README trains a "baby GPT" on a CPU with ``train.py config/train_shakespeare_char.py
--device=cpu --compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4
--n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0``. This loop follows that
recipe from its facts, with the model of :mod:`lit_ddp.models.gpt` (the same architecture code as ours):

- data: char-level Tiny Shakespeare; vocabulary = sorted distinct characters of the whole text; first 90%
  train, last 10% validation (``shakespeare_char/prepare.py``); 12 windows of 64 characters per
  iteration at uniformly random positions (``get_batch``);
- model: 4 layers x 4 heads x 128 wide, context 64, no biases, dropout 0, tied head, GPT-2 init;
- AdamW lr 1e-3, betas (0.9, 0.99), weight decay 0.1 on parameters with 2 or more dimensions only, warmup
  100 iterations then cosine down to 1e-4 at 2000 (``get_lr``), gradient clipping at norm 1.0; fp32;
- evaluation at iteration 0 and every 250: mean loss over 20 random batches of each split;
- seed 1337 before building the model; torch threads = ``os.cpu_count()`` (nanoGPT leaves torch's
  default, one thread per physical core).

This file is the *reference*, so its recipe is nanoGPT's, written out here on purpose rather than taken from
:mod:`lit_ddp.recipe` (the job's, which every other benchmark uses): nanoGPT's AdamW groups (decay by
dimension, not minGPT's by module type) and nanoGPT's ``get_lr`` (:func:`get_lr`).

Left out: nanoGPT's checkpoint writes on a new best val loss (milliseconds for this 0.8M-parameter model)
and the extra training step it runs after the final evaluation. Times are wall-clock seconds since the
process started (from ``/proc``, so interpreter start-up and imports count, as for a timed launch).

    nice -n 10 .venv/bin/python -m bench.nanogpt_reference --target 1.886
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from bench.charlm import estimate_loss, get_batch, load_splits
from lit_ddp.models.gpt import GPT, GPTConfig


def process_start_time() -> float:
    """Unix time at which this process started (Linux ``/proc``); now where ``/proc`` is missing."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        boot = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, StopIteration):
        return time.time()


LAUNCH = process_start_time()


def get_lr(it: int, learning_rate: float, min_lr: float, warmup_iters: int, lr_decay_iters: int) -> float:
    """nanoGPT's ``train.py`` ``get_lr``: linear warmup ``learning_rate * (it + 1) / (warmup_iters + 1)``, then
    a cosine from ``learning_rate`` to ``min_lr`` at ``lr_decay_iters``, ``min_lr`` afterwards."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)  # max: --max_iters <= warmup too
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # from 1 to 0
    return min_lr + coeff * (learning_rate - min_lr)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=float, default=1.886, help="report when val loss first reaches this")
    parser.add_argument("--max_iters", type=int, default=2000, help="iterations (and lr_decay_iters)")
    parser.add_argument("--eval_interval", type=int, default=250)
    parser.add_argument("--eval_iters", type=int, default=20, help="batches per split and evaluation")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--stop_at_target", action="store_true", help="end at the first evaluation <= --target")
    parser.add_argument("--json", type=Path, default=None, help="also write the evaluations here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    block_size, batch_size = 64, 12
    lr, min_lr, warmup, beta2, weight_decay, grad_clip = 1e-3, 1e-4, 100, 0.99, 0.1, 1.0
    torch.manual_seed(args.seed)
    vocab, train, val = load_splits()
    config = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=block_size, vocab_size=len(vocab), bias=False)
    model = GPT(config)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(  # nanoGPT's GPT.configure_optimizers: decay the 2-D tensors only
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, beta2),
    )
    print(f"{model.num_parameters() / 1e6:.2f}M parameters, {args.threads} threads", file=sys.stderr)

    evals: list[dict] = []
    reached: float | None = None
    train_time = 0.0
    x, y = get_batch(train, block_size, batch_size)
    for it in range(args.max_iters + 1):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it, lr, min_lr, warmup, args.max_iters)
        if it % args.eval_interval == 0:
            train_loss = estimate_loss(model, train, block_size, batch_size, args.eval_iters)
            val_loss = estimate_loss(model, val, block_size, batch_size, args.eval_iters)
            seconds = time.time() - LAUNCH
            evals.append({"step": it, "seconds": seconds, "train_loss": train_loss, "val_loss": val_loss})
            print(f"step {it:5d}  {seconds:7.1f} s  train/loss {train_loss:.4f}  val/loss {val_loss:.4f}", flush=True)
            if reached is None and val_loss <= args.target:
                reached = seconds
            if it == args.max_iters or (reached is not None and args.stop_at_target):
                break
        t0 = time.perf_counter()
        _, loss = model(x, y)
        x, y = get_batch(train, block_size, batch_size)  # the next batch, as nanoGPT prefetches it
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train_time += time.perf_counter() - t0

    iters = evals[-1]["step"]
    tokens_per_s = iters * batch_size * block_size / train_time
    print(f"training steps: {tokens_per_s:,.0f} tokens/s ({1e3 * train_time / max(iters, 1):.1f} ms/step)")
    print(f"val/loss <= {args.target}: " + (f"{reached:.1f} s after launch" if reached else "not reached"))
    result = {"evals": evals, "target": args.target, "seconds_to_target": reached, "tokens_per_s": tokens_per_s}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
