"""What deterministic kernels (``configs/checkpoint/exact.yaml``) cost a training step: tokens/s with and without
them, by turns (``CUBLAS_WORKSPACE_CONFIG`` set for both: only the algorithms differ). The tutorial GPT, random
windows made on the device, the recipe's AdamW, bf16 autocast on CUDA; the GPU check's determinism part
(docs/fault_tolerance.md, "Exact or fast").

    python -m bench.deterministic --device cpu --tiny     # the plumbing, on a CPU
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before torch initializes cuBLAS: both modes use it

from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402

from bench.harness.measure import alternate, arguments, seconds, write_json  # noqa: E402
from bench.harness.ops import train_step  # noqa: E402
from lit_ddp.models.gpt import GPT, GPTConfig  # noqa: E402
from lit_ddp.recipe import build_optimizer  # noqa: E402

STEP = {"model_type": "tutorial", "batch_size": 216, "block_size": 128, "steps": 20, "warmup": 3}
TINY = {"model_type": "gpt-nano", "batch_size": 8, "block_size": 32, "steps": 5, "warmup": 1}


def timed_steps(device: torch.device, model_type: str, batch_size: int, block_size: int, steps: int,
                warmup: int) -> Callable[[bool], float]:  # fmt: skip
    """The seconds of ``steps`` training steps after ``warmup``, deterministic or not."""
    torch.manual_seed(1337)
    model = GPT(GPTConfig.from_preset(model_type, block_size=block_size, vocab_size=65, dropout=0.1)).to(device)
    optimizer = build_optimizer(model, "adamw")  # the tutorial's: lr 3e-4, weight decay 0.1, betas (0.9, 0.95)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def run(n: int) -> None:
        for _ in range(n):
            x, y = torch.randint(65, (2, batch_size, block_size), device=device)  # (B, T) each
            train_step(model, optimizer, x, y, autocast)

    def timed(on: bool) -> float:
        torch.backends.cudnn.benchmark = False  # Trainer(deterministic=on)'s settings, less the workspace
        torch.use_deterministic_algorithms(on)
        run(warmup)
        took = seconds(lambda: run(steps), torch.cuda.synchronize if device.type == "cuda" else None)
        torch.use_deterministic_algorithms(False)
        return took

    return timed


def main(argv: list[str] | None = None) -> dict:
    parser = arguments(__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=3, help="turns of each mode")
    parser.add_argument("--tiny", action="store_true", help="gpt-nano, 8 windows of 32, 5 steps")
    args = parser.parse_args(argv)
    size = {**STEP, **(TINY if args.tiny else {})}
    timed = timed_steps(torch.device(args.device), **size)
    taken = alternate({"default": lambda: timed(False), "deterministic": lambda: timed(True)}, args.rounds)
    tokens = size["batch_size"] * size["block_size"]  # per step
    per_s = {mode: tokens * size["steps"] * args.rounds / sum(s) for mode, s in taken.items()}
    where = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    result = {"where": where, "model_type": size["model_type"], "tokens_per_step": tokens, "seconds": taken,
              "steps": size["steps"] * args.rounds, "tokens_per_s": per_s["default"],
              "deterministic_tokens_per_s": per_s["deterministic"],
              "ratio": per_s["deterministic"] / per_s["default"]}  # fmt: skip
    print(f"{where}, {size['model_type']}, {tokens} tokens a step: default {per_s['default']:,.0f} tokens/s, "
          f"deterministic {per_s['deterministic']:,.0f} tokens/s ({result['ratio']:.3f}x)")  # fmt: skip
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
