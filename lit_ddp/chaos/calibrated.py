"""``lit-ddp chaos --calibrated K``: the comparison for runs whose kernels are not deterministic (a GPU's fast ones),
where two uninterrupted runs already differ and bit for bit says nothing. Two uninterrupted runs measure that
spread; the faulted run passes if it stays within ``K`` times it:

- the training loss (``train/loss_step``, else ``train/loss``) over every step the runs logged: the RMS of
  ``faulted - first`` at most K times the RMS of ``second - first``, plus 4 float32 ulps of the loss (two values
  that round alike);
- the final parameters (``last.ckpt``'s ``state_dict``): ``||faulted - first|| <= K x ||second - first||``
  (relative to ``||first||``).

Over the whole run, not step by step: at one step the two distances are two draws of one random difference, and
one exceeds three times the other about one time in five (for Gaussian differences, ``1 - 2 atan(3) / pi``); their
RMS over the run's logged steps, and the norms over all parameters, do not. The report gives the distance at the
first logged step after each resume beside the two uninterrupted runs' there.

Under deterministic kernels the spread is 0 and this is the bit-for-bit test. Our own code: no library does it
(torchtitan compares loss curves only in a deterministic debug mode).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from lit_ddp.chaos.compare import scalar_points
from lit_ddp.run_dir import layout, sharded

LOSS_TAGS = ("train/loss_step", "train/loss")
ULPS = 4 * 2.0**-23  # float32 rounding of a logged value, relative


def loss_curve(run: Path) -> dict[int, float]:
    """The training loss at each step the run logged (its last value there): ``{step: loss}``.

    Raises:
        ValueError: the run logged no training loss.
    """
    points = scalar_points(run)
    tag = next((t for t in LOSS_TAGS if t in points), None)
    if tag is None:
        raise ValueError(f"{run} logged none of {', '.join(LOSS_TAGS)}: nothing to calibrate on")
    return points[tag]


def parameters(run: Path) -> dict[str, torch.Tensor]:
    """The floating-point tensors of the run's ``last.ckpt`` ``state_dict`` (a sharded one consolidated), in fp64."""
    path = Path(layout.last_checkpoint(str(run)))
    ckpt = sharded.full_checkpoint(path) if sharded.is_sharded(path) else torch.load(path, map_location="cpu")
    return {k: v.double() for k, v in ckpt["state_dict"].items() if v.is_floating_point()}


def relative_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``||b - a|| / ||a||`` over every tensor of ``a`` (``inf`` where ``b`` lacks one or shapes differ)."""
    if any(k not in b or b[k].shape != v.shape for k, v in a.items()):
        return math.inf
    diff = sum(float((b[k] - v).square().sum()) for k, v in a.items())
    norm = sum(float(v.square().sum()) for v in a.values())
    return math.sqrt(diff) / math.sqrt(norm) if norm else math.sqrt(diff)


def verdict(first: Path, second: Path, faulted: Path, k: float, resumed: list[int]) -> tuple[str | None, list[str]]:
    """``(what lies outside K x the spread, or None; the report's lines)``; ``resumed``: the steps the faulted run
    resumed from (the report gives the loss distance at the first logged step after each)."""
    a, b, f = loss_curve(first), loss_curve(second), loss_curve(faulted)
    steps = sorted(a)
    if missing := [s for s in steps if s not in b or s not in f]:
        return f"tensorboard/train loss: no point at step {missing[0]} in one of the runs", []
    spread = rms([b[s] - a[s] for s in steps])
    distance = rms([f[s] - a[s] for s in steps])
    limit = k * spread + ULPS * rms([a[s] for s in steps])
    pa, pb, pf = parameters(first), parameters(second), parameters(faulted)
    param_spread, param_distance = relative_distance(pa, pb), relative_distance(pa, pf)
    lines = [
        f"two uninterrupted runs: train loss {spread:.3g} apart (RMS over {len(steps)} logged steps), parameters "
        f"{param_spread:.3g} apart (relative)",
        f"the faulted run: train loss {distance:.3g} from the first run's (limit {k:g} x {spread:.3g} + rounding = "
        f"{limit:.3g}), parameters {param_distance:.3g} (limit {k * param_spread:.3g})",
    ]
    for r in resumed:
        if (after := next((s for s in steps if s > r), None)) is not None:
            lines.append(
                f"resumed from step {r}: at step {after} the loss is {abs(f[after] - a[after]):.3g} from the first "
                f"run's (the two uninterrupted runs: {abs(b[after] - a[after]):.3g})"
            )
    if distance > limit:
        return f"tensorboard/train loss: {distance:.3g} from the first run, over {k:g} x the spread {spread:.3g}", lines
    if param_distance > k * param_spread:
        return (
            f"{layout.LAST}'s parameters: {param_distance:.3g} from the first run, over {k:g} x the spread "
            f"{param_spread:.3g}",
            lines,
        )
    return None, lines


def rms(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values)) if values else 0.0
