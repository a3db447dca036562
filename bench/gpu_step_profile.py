"""Where a training step of the GPU main job goes: its parts timed alone, in plain PyTorch (issue 44).

The model of ``configs/mingpt/gpu.yaml`` (6 x 6 x 384, rotary positions, no biases, dropout 0.2, block 256), on
one device, bf16 autocast where the device is CUDA. For each ``--batch_size`` (sequences per step), the median
milliseconds over ``--iters`` steps after ``--warmup`` of:

- ``fwd+bwd``: forward and backward of the loss, the forward through ``torch.compile`` (as ``GPTModule``'s
  ``compile: true``);
- ``clip``: ``torch.nn.utils.clip_grad_norm_`` at 1.0 (Lightning's ``gradient_clip_val``);
- ``muon+adamw``: the job's optimizer step (:func:`lit_ddp.recipe.build_optimizer` ``"muon"``: torch's Muon over
  the blocks' matrices, AdamW over the rest), eager;
- ``adamw``: AdamW over every parameter instead (minGPT's groups), eager;
- ``muon+adamw compiled``: the job's optimizer step through ``torch.compile`` (its first call's seconds apart);
- ``step``: the four above in a row as one plain training step (fwd+bwd, clip, the eager job optimizer),

and tokens/s of that plain step. Seconds to compile are printed apart. With the Lightning step time of the same
job (:mod:`bench.step_timer` in ``lit-ddp fit``, or the TokenThroughputMonitor's tokens/s), the difference is what
Lightning and the loader add.

    python -m bench.gpu_step_profile --batch_size 64 128          # on a GPU
    python -m bench.gpu_step_profile --device cpu --tiny          # the plumbing, on a CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.charlm import get_batch, load_splits
from lit_ddp.models.gpt import GPT, GPTConfig
from lit_ddp.recipe import build_optimizer


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> float:
    """Median wall milliseconds of ``fn()`` over ``iters`` calls after ``warmup``, synchronized each call."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def profile(batch_size: int, args: argparse.Namespace, vocab_size: int, train: torch.Tensor) -> dict[str, Any]:
    device = torch.device(args.device)
    sizes = dict(n_layer=2, n_head=2, n_embd=32) if args.tiny else dict(n_layer=6, n_head=6, n_embd=384)
    block_size = 32 if args.tiny else 256
    config = GPTConfig.from_preset("gpt-mini", **sizes, block_size=block_size, vocab_size=vocab_size, bias=False,
                                   dropout=0.2, rope=True)  # fmt: skip
    torch.manual_seed(0)
    model = GPT(config).to(device)
    forward = torch.compile(model.forward) if args.compile else model.forward
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    x, y = (t.to(device) for t in get_batch(train, block_size, batch_size))
    tokens = x.numel()

    def fwd_bwd() -> None:
        with autocast:
            _, loss = forward(x, y)
        loss.backward()

    def clip() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    job = build_optimizer(model, "muon", learning_rate=1e-3, betas=(0.9, 0.99), muon_learning_rate=2e-2)
    adamw = build_optimizer(model, "adamw", learning_rate=1e-3, betas=(0.9, 0.99))

    t0 = time.perf_counter()
    fwd_bwd()
    sync(device)
    result: dict[str, Any] = {"batch_size": batch_size, "tokens_per_step": tokens,
                              "compile_fwd_bwd_s": time.perf_counter() - t0}  # fmt: skip
    ms = {"fwd+bwd": median_ms(fwd_bwd, device, args.warmup, args.iters)}
    ms["clip"] = median_ms(clip, device, args.warmup, args.iters)
    ms["muon+adamw"] = median_ms(job.step, device, args.warmup, args.iters)
    ms["adamw"] = median_ms(adamw.step, device, args.warmup, args.iters)
    try:
        if not args.compile:
            raise RuntimeError("--no-compile")
        compiled_step = torch.compile(job.step)
        t0 = time.perf_counter()
        compiled_step()
        sync(device)
        result["compile_optimizer_s"] = time.perf_counter() - t0
        ms["muon+adamw compiled"] = median_ms(compiled_step, device, args.warmup, args.iters)
    except Exception as e:  # torch.compile of a library optimizer may refuse; the line says so
        result["compile_optimizer_error"] = f"{type(e).__name__}: {str(e)[:200]}"

    def step() -> None:
        fwd_bwd()
        clip()
        job.step()
        job.zero_grad(set_to_none=True)

    ms["step"] = median_ms(step, device, args.warmup, args.iters)
    result["ms"] = ms
    result["tokens_per_s"] = tokens / (ms["step"] / 1e3)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch_size", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="the forward and (apart) the optimizer step through torch.compile")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="2 x 2 x 32, block 32: the plumbing on a CPU")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    vocab, train, _ = load_splits()
    results = []
    for b in args.batch_size:
        r = profile(b, args, len(vocab), train)
        results.append(r)
        parts = ", ".join(f"{k} {v:.2f}" for k, v in r["ms"].items())
        extra = r.get("compile_optimizer_error") or f"optimizer compile {r.get('compile_optimizer_s', 0):.1f} s"
        print(f"batch {b} ({r['tokens_per_step']} tokens): ms {parts}; {r['tokens_per_s']:,.0f} tokens/s "
              f"(plain step); fwd+bwd compile {r['compile_fwd_bwd_s']:.1f} s; {extra}", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
