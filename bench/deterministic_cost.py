"""What deterministic kernels cost the tutorial model's training step (issue 42): tokens/s with and without
``torch.use_deterministic_algorithms``, timed in alternation in one process.

``configs/checkpoint/exact.yaml`` sets ``trainer.deterministic: true`` so that a resumed run is bit-identical to an
uninterrupted one; Lightning then calls ``torch.use_deterministic_algorithms(True)``, sets
``torch.backends.cudnn.benchmark = False`` and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS's reproducible
workspace). This script sets the same three: the workspace variable before torch starts, for both modes (so that
only the algorithm choice differs), and the other two per mode. The step is the tutorial config's
(``configs/mingpt/tutorial.yaml``): the ``tutorial`` GPT (8 x 8 x 512, context 128, dropout 0.1, biases), 216
windows a step, AdamW from :func:`lit_ddp.recipe.build_optimizer`, bf16 autocast on CUDA (fp32 on the CPU), gradient
clipping at 1.0. The batches are random token ids made on the device (no loader, no checkpoint, no logging:
the kernels alone). Rounds alternate the order of the two modes, each mode warmed up before it is timed.

    python -m bench.deterministic_cost                       # on the GPU, about 20 s
    python -m bench.deterministic_cost --device cpu --tiny   # the plumbing, on a CPU
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before torch initializes cuBLAS: both modes use it

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from lit_ddp.models.gpt import GPT, GPTConfig  # noqa: E402
from lit_ddp.recipe import build_optimizer  # noqa: E402


def set_deterministic(on: bool) -> None:
    """What Lightning's ``Trainer(deterministic=on)`` sets (``_set_torch_flags``), less the workspace variable."""
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(on)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model_type", default="tutorial")
    parser.add_argument("--batch_size", type=int, default=216, help="windows per step (the tutorial's)")
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each timed stretch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="gpt-nano, 8 windows of 32, 5 steps: a smoke test")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.model_type, args.batch_size, args.block_size, args.steps, args.warmup = "gpt-nano", 8, 32, 5, 1
    device = torch.device(args.device)
    torch.manual_seed(1337)
    model = GPT(GPTConfig.from_preset(args.model_type, block_size=args.block_size, vocab_size=65, dropout=0.1))
    model.to(device)
    optimizer = build_optimizer(model, "adamw")  # the tutorial's: lr 3e-4, weight decay 0.1, betas (0.9, 0.95)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def steps(n: int) -> None:
        for _ in range(n):
            x = torch.randint(65, (args.batch_size, args.block_size), device=device)  # (B, T)
            y = torch.randint(65, (args.batch_size, args.block_size), device=device)  # (B, T)
            with autocast:
                _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    seconds = {False: 0.0, True: 0.0}
    for r in range(args.rounds):
        for on in (False, True) if r % 2 == 0 else (True, False):
            set_deterministic(on)
            steps(args.warmup)
            sync()
            t0 = time.perf_counter()
            steps(args.steps)
            sync()
            seconds[on] += time.perf_counter() - t0
    set_deterministic(False)
    tokens = args.rounds * args.steps * args.batch_size * args.block_size
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model_type": args.model_type,
        "tokens_per_step": args.batch_size * args.block_size,
        "steps": args.rounds * args.steps,
        "tokens_per_s": tokens / seconds[False],
        "deterministic_tokens_per_s": tokens / seconds[True],
        "ratio": seconds[False] / seconds[True],  # deterministic tokens/s over the default's
    }
    print(
        f"{result['device']}, {args.model_type}, {result['tokens_per_step']} tokens a step, {result['steps']} steps "
        f"per mode: default {result['tokens_per_s']:,.0f} tokens/s, deterministic "
        f"{result['deterministic_tokens_per_s']:,.0f} tokens/s ({result['ratio']:.3f}x)",
        file=sys.stderr,
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
