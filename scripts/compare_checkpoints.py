"""Compares the model weights of two checkpoints: see for yourself that a killed and resumed run ends where an
uninterrupted one does.

    python scripts/compare_checkpoints.py runs/mingpt/reference/checkpoints/last.ckpt \
        runs/mingpt/fault_tolerant/checkpoints/last.ckpt

Prints each checkpoint's global_step, the number of weight tensors and the largest absolute difference between
them; exits 0 when the weights are bit-identical, 1 when they differ, 2 when the files cannot be compared
(another task's checkpoint, a missing file). Checkpoints are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def compare(a: Path, b: Path) -> tuple[int, int, int, float]:
    """``(global_step of a, of b, number of weight tensors, max |a - b| over all of them)``.

    Raises:
        ValueError: a file is not a checkpoint readable with ``weights_only=True``, or the two hold different
            weights (names or shapes: another task or model size).
    """
    states = []
    for path in (a, b):
        try:
            states.append(torch.load(path, map_location="cpu", weights_only=True))
        except (OSError, RuntimeError, EOFError) as e:
            raise ValueError(f"{path}: not a readable checkpoint ({e})") from e
    (sa, wa), (sb, wb) = ((s.get("global_step", -1), s["state_dict"]) for s in states)
    shapes = ({k: tuple(v.shape) for k, v in w.items()} for w in (wa, wb))
    if next(shapes) != next(shapes):
        raise ValueError(f"{a} and {b} hold different weights (names or shapes): checkpoints of one model please")
    diff = max((float((wa[k].double() - wb[k].double()).abs().max()) for k in wa if wa[k].numel()), default=0.0)
    return sa, sb, len(wa), diff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="a checkpoint (e.g. the uninterrupted run's last.ckpt)")
    parser.add_argument("b", type=Path, help="another checkpoint of the same model")
    args = parser.parse_args(argv)
    try:
        step_a, step_b, tensors, diff = compare(args.a, args.b)
    except ValueError as e:
        print(f"compare_checkpoints: error: {e}", file=sys.stderr)
        return 2
    print(f"global_step: {step_a} and {step_b}; {tensors} weight tensors; max |a - b| = {diff:g}")
    print("bit-identical" if diff == 0.0 and step_a == step_b else "different")
    return 0 if diff == 0.0 and step_a == step_b else 1


if __name__ == "__main__":
    sys.exit(main())
