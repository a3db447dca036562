"""``lit-ddp chaos --calibrated K``: the comparison for runs whose kernels are not deterministic (a GPU's fast ones),
where two uninterrupted runs already differ and bit for bit says nothing. Two uninterrupted runs measure that
spread; the faulted run passes if it stays within ``K`` times it:

- the parameters at every logged step (a fixed sample of their coordinates, :mod:`lit_ddp.chaos.sketch`): the
  faulted run's relative distance to the first run at most K times the second run's, at each step; a resume that
  goes wrong shows at the first logged step after it;
- the training loss (``train/loss_step``, else ``train/loss``): the RMS of ``faulted - first`` over every logged
  step at most K times the RMS of ``second - first``, plus 4 float32 ulps of the loss (two values that round alike);
- the final parameters (``last.ckpt``'s ``state_dict``, all of them), as at each step.

The loss is judged over the whole run, not step by step: a loss at one step is one random draw, and one of two
equally likely differences exceeds three times the other about one time in five (for Gaussian differences,
``1 - 2 atan(3) / pi``); a distance over thousands of coordinates, and an RMS over the run, lie close to their
means. Measured on this CPU (docs/chaos.md, "Which K": 20 uninterrupted runs of the calibrated chaos test's
minGPT with gradient noise, 30 logged steps each, each run judged against every pair of others, 3,420 judgements;
run twice): a run's largest per-step parameter ratio was at most 2.50 and 1.87 (median 1.17), its loss RMS ratio
at most 2.74 and 2.96; none fell outside K = 3, 4 and 3 outside 2.5 (another 3,420 judgements of 20 other runs,
first and second assigned otherwise: 6 outside 3, none outside 3.5).
The report gives both runs' distances at the first logged step after each resume.

Under deterministic kernels the spread is 0 and this is the bit-for-bit test. torchtitan, the nearest, compares loss
curves only in a deterministic debug mode.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from lit_ddp.chaos.compare import scalar_points
from lit_ddp.chaos.sketch import SKETCH_DIR, relative_distance, sketches
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
    ckpt = sharded.read_whole(path)
    return {k: v.double() for k, v in ckpt["state_dict"].items() if v.is_floating_point()}


def state_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``||b - a|| / ||a||`` over every tensor of ``a`` (``inf`` where ``b`` lacks one or shapes differ)."""
    if any(k not in b or b[k].shape != v.shape for k, v in a.items()):
        return math.inf
    diff = sum(float((b[k] - v).square().sum()) for k, v in a.items())
    norm = sum(float(v.square().sum()) for v in a.values())
    return math.sqrt(diff) / math.sqrt(norm) if norm else math.sqrt(diff)


def verdict(
    first: Path, second: Path, faulted: Path, k: float, resumed: list[int], common: bool = False
) -> tuple[str | None, list[str]]:
    """``(what lies outside K x the spread, or None; the report's lines)``; ``resumed``: the steps the faulted run
    resumed from (the report gives both distances at the first logged step after each); ``common``: judged at the
    steps all three runs logged, not at every step of the first (a torchft group that joins late heals to its
    peer's step and logs from there)."""
    a, b, f = loss_curve(first), loss_curve(second), loss_curve(faulted)
    steps = sorted(set(a) & set(b) & set(f) if common else a)
    if missing := [s for s in steps if s not in b or s not in f]:
        return f"tensorboard/train loss: no point at step {missing[0]} in one of the runs", []
    sa, sb, sf = sketches(first), sketches(second), sketches(faulted)
    if common:
        sa = {s: v for s, v in sa.items() if s in sb and s in sf}
    if not sa:
        return f"{first / SKETCH_DIR}: no parameter samples (a run of an older lit-ddp chaos: run it again)", []
    if missing := [s for s in sorted(sa) if s not in sb or s not in sf]:
        return f"parameters: no sample at step {missing[0]} in one of the runs ({SKETCH_DIR}/)", []
    apart = {s: (relative_distance(sa[s], sb[s]), relative_distance(sa[s], sf[s])) for s in sorted(sa)}
    worst = max(apart, key=lambda s: _ratio(*apart[s]))
    spread = rms([b[s] - a[s] for s in steps])
    distance = rms([f[s] - a[s] for s in steps])
    limit = k * spread + ULPS * rms([a[s] for s in steps])
    pa, pb, pf = parameters(first), parameters(second), parameters(faulted)
    param_spread, param_distance = state_distance(pa, pb), state_distance(pa, pf)
    size = len(next(iter(sa.values())))
    lines = [
        f"two uninterrupted runs: train loss {spread:.3g} apart (RMS over {len(steps)} logged steps), parameters "
        f"{apart[max(apart)][0]:.3g} apart at step {max(apart)} (relative, {size} sampled coordinates), "
        f"{param_spread:.3g} at the end (all of them)",
        f"the faulted run: parameters at most {_ratio(*apart[worst]):.3g} x the spread at each of {len(apart)} logged "
        f"steps (step {worst}: {apart[worst][1]:.3g} against {apart[worst][0]:.3g}; limit {k:g} x), train loss "
        f"{distance:.3g} from the first run's (limit {k:g} x {spread:.3g} + rounding = {limit:.3g}), parameters at "
        f"the end {param_distance:.3g} (limit {k * param_spread:.3g})",
    ]
    for r in resumed:
        if (after := next((s for s in steps if s > r), None)) is not None:
            line = (
                f"resumed from step {r}: at step {after} the loss is {abs(f[after] - a[after]):.3g} from the first "
                f"run's (the two uninterrupted runs: {abs(b[after] - a[after]):.3g})"
            )
            if (sampled := next((s for s in apart if s > r), None)) is not None:
                line += f"; at step {sampled} the parameters {apart[sampled][1]:.3g} (theirs {apart[sampled][0]:.3g})"
            lines.append(line)
    if over := next((s for s in apart if apart[s][1] > k * apart[s][0]), None):
        after = next((r for r in reversed(resumed) if r < over), None)
        where = f", the first logged step after the resume from step {after}" if after is not None else ""
        return (
            f"parameters at step {over}{where}: {apart[over][1]:.3g} from the first run's, over {k:g} x the spread "
            f"{apart[over][0]:.3g}",
            lines,
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


def _ratio(spread: float, distance: float) -> float:
    """``distance / spread``; where two uninterrupted runs agree bit for bit, 0 if the faulted run does, else inf."""
    return distance / spread if spread else (0.0 if distance == 0 else math.inf)


def rms(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values)) if values else 0.0
