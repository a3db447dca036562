"""The reference the main job is timed against: nanoGPT's Shakespeare-char recipes (:data:`RECIPES`: its README's
"baby GPT" on a CPU; ``config/train_shakespeare_char.py`` on one GPU, val loss 1.4697 in its README, with bf16
autocast, ``torch.compile``, fused AdamW, TF32, pinned batches) as a plain one-process PyTorch loop, no Lightning.
Written from nanoGPT's facts (``prepare.py``, ``get_batch``, ``get_lr``, ``estimate_loss``, ``configure_optimizers``)
with :mod:`lit_ddp.models.gpt`'s model (no biases), not from :mod:`lit_ddp.recipe`; left out: checkpoint writes,
progress prints, the step after the final evaluation. Times are seconds since the process started; iteration time
from the intervals between evaluations after the first.

    nice -n 10 .venv/bin/python -m bench.nanogpt_reference --target 1.886
    python -m bench.nanogpt_reference --recipe gpu --stop_at_target --json /tmp/reference.json
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

import numpy as np
import torch

from bench.harness.launch import process_started_at
from bench.harness.measure import arguments, write_json
from lit_ddp.data.sources import read_embedded_text
from lit_ddp.models.gpt import GPT, GPTConfig

LAUNCH = process_started_at()


def load_splits(train_fraction: float = 0.9) -> tuple[str, torch.Tensor, torch.Tensor]:
    """Tiny Shakespeare as ``shakespeare_char/prepare.py`` makes it: ``(vocab, train ids, val ids)``, ids int64."""
    text = read_embedded_text()
    vocab = "".join(sorted(set(text)))
    table = np.zeros(max(map(ord, vocab)) + 1, dtype=np.int64)
    table[[ord(c) for c in vocab]] = np.arange(len(vocab))
    ids = torch.from_numpy(table[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)])
    n = int(len(ids) * train_fraction)
    return vocab, ids[:n], ids[n:]


def get_batch(data: torch.Tensor, block_size: int, batch_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``(x, y)``, both ``(B, T)``, windows at uniform random starts (``get_batch``), on ``device`` through pinned
    memory without waiting on a GPU."""
    ix = torch.randint(len(data) - block_size, (batch_size,)).tolist()
    x = torch.stack([data[i : i + block_size] for i in ix])  # (B, T)
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])  # (B, T)
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


@torch.no_grad()
def estimate_loss(model: torch.nn.Module, data: torch.Tensor, block_size: int, batch_size: int, iters: int,
                  device: torch.device) -> float:  # fmt: skip
    """Mean loss over ``iters`` random batches of ``data`` in eval mode (``estimate_loss``)."""
    model.eval()
    losses = [model(*get_batch(data, block_size, batch_size, device))[1].item() for _ in range(iters)]
    model.train()
    return sum(losses) / len(losses)


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


# What the two recipes set (each an option that overrides it); the rest is shared. 2000 iterations each.
RECIPES: dict[str, dict[str, Any]] = {
    "cpu": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "batch_size": 12, "dropout": 0.0,
            "eval_iters": 20, "target": 1.886, "device": "cpu", "dtype": "float32", "compile": False},
    "gpu": {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256, "batch_size": 64, "dropout": 0.2,
            "eval_iters": 200, "target": 1.4697, "device": "cuda", "dtype": "bfloat16", "compile": True},
}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = arguments(__doc__)
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="cpu", help="nanoGPT's CPU or GPU recipe")
    parser.add_argument("--max_iters", type=int, default=2000, help="iterations (and lr_decay_iters)")
    parser.add_argument("--eval_interval", type=int, default=250)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    parser.add_argument("--stop_at_target", action="store_true", help="end at the first evaluation <= --target")
    for name, value in RECIPES["gpu"].items():  # --target: report when val loss first reaches it; float32: no autocast
        kind = {"action": argparse.BooleanOptionalAction} if isinstance(value, bool) else {"type": type(value)}
        parser.add_argument(f"--{name}", default=None, help="overrides the recipe's", **kind)
    args = parser.parse_args(argv)
    recipe = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in RECIPES[args.recipe].items()}
    device, dtype, compiled = torch.device(recipe["device"]), getattr(torch, recipe["dtype"]), recipe["compile"]
    target, eval_iters = recipe["target"], recipe["eval_iters"]
    block_size, batch_size = recipe["block_size"], recipe["batch_size"]

    torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # nanoGPT's train.py
        torch.backends.cudnn.allow_tf32 = True
    lr, min_lr, warmup, beta2, weight_decay, grad_clip = 1e-3, 1e-4, 100, 0.99, 0.1, 1.0
    torch.manual_seed(1337)  # nanoGPT's
    vocab, train, val = load_splits()
    sizes = {k: recipe[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "dropout")}
    raw_model = GPT(GPTConfig(**sizes, vocab_size=len(vocab), bias=False)).to(device)
    params = [p for p in raw_model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
    # nanoGPT's GPT.configure_optimizers: decay the 2-D tensors only; fused on CUDA
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, beta2), fused=device.type == "cuda")
    model = torch.compile(raw_model) if compiled else raw_model

    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def evaluate(data: torch.Tensor) -> float:
        with autocast:
            return estimate_loss(model, data, block_size, batch_size, eval_iters, device=device)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{raw_model.num_parameters() / 1e6:.2f}M parameters, {name}, {dtype}, compile {compiled}, "
          f"{args.threads} threads", file=sys.stderr)  # fmt: skip

    evals: list[dict] = []
    intervals: list[tuple[int, float]] = []  # (training iterations, seconds) between consecutive evaluations
    reached: float | None = None
    x, y = get_batch(train, block_size, batch_size, device)
    started, since = time.perf_counter(), 0
    for it in range(args.max_iters + 1):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it, lr, min_lr, warmup, args.max_iters)
        if it % args.eval_interval == 0:
            sync()
            if it > since:
                intervals.append((it - since, time.perf_counter() - started))
            train_loss, val_loss = evaluate(train), evaluate(val)
            seconds = time.time() - LAUNCH
            evals.append({"step": it, "seconds": seconds, "train_loss": train_loss, "val_loss": val_loss})
            print(f"step {it:5d}  {seconds:7.1f} s  train/loss {train_loss:.4f}  val/loss {val_loss:.4f}", flush=True)
            if reached is None and val_loss <= target:
                reached = seconds
            if it == args.max_iters or (reached is not None and args.stop_at_target):
                break
            started, since = time.perf_counter(), it
        with autocast:
            _, loss = model(x, y)
        x, y = get_batch(train, block_size, batch_size, device)  # the next batch, as nanoGPT prefetches it
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    steady = intervals[1:] or intervals  # the first interval holds the compilation and the warm-up
    iters, train_time = sum(n for n, _ in steady), sum(t for _, t in steady)
    tokens_per_s = iters * batch_size * block_size / train_time if train_time else None
    ms_per_iter = 1e3 * train_time / iters if iters else None
    peak = None
    if device.type == "cuda":  # imported after the timed run
        from bench.harness.measure import peak_flops

        peak = peak_flops(device, "bf16-mixed" if dtype == torch.bfloat16 else "32-true")
    flops_per_token = raw_model.flops_per_token()
    mfu = tokens_per_s * flops_per_token / peak if tokens_per_s and peak else None
    if tokens_per_s is not None:
        first_n, first_s = intervals[0]
        print(f"training steps: {tokens_per_s:,.0f} tokens/s ({ms_per_iter:.1f} ms/step, {iters} steps after the "
              f"first {first_n}, which took {first_s:.1f} s)" + (f", MFU {mfu:.3f}" if mfu else ""))  # fmt: skip
    print(f"val/loss <= {target}: " + (f"{reached:.1f} s after launch" if reached else "not reached"))
    result = {**recipe, "recipe": args.recipe, "device": name, "evals": evals, "seconds_to_target": reached,
              "tokens_per_s": tokens_per_s, "ms_per_iter": ms_per_iter, "flops_per_token": flops_per_token,
              "peak_flops": peak, "mfu": mfu, "first_interval": list(intervals[0]) if intervals else None}  # fmt: skip
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
