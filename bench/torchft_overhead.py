"""What lit-ddp's torchft machinery costs a quiet step (``python -m bench.torchft_overhead``; docs/torchft.md,
"What the machinery costs a quiet step").

Runs the torchft job (``python -m lit_ddp.ft.launch``, ``--groups`` replica groups of one process, the regression,
``--steps`` steps, no faults) ``--rounds`` times with the machinery on and off, by turns. On a quiet step the
machinery is: the progress record's write (the launcher's liveness watch), the snapshot of the RNG streams (put back
where a step is discarded), and the check that the step's quorum is settled (the membership proof runs only when the
quorum changes; the fingerprints and the heal's signatures only at the end and in a heal). Off: those three made
no-ops in the groups (this script's callback does it; lit-ddp has no switch for it). A callback in each group times
every step (from one batch's start to the next's) and, on, each call of the three, so that their share of a step is
measured in the same steps, beside the on/off comparison of whole steps (which a shared machine's noise swamps).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from bench.harness.launch import REPO, bench_env
from bench.harness.measure import alternate, arguments, markdown_table, write_json

FIT = [
    "fit", "--config", "configs/trainer/torchft.yaml", "--config", "configs/regression/single_device.yaml",
    "--trainer.max_epochs", "-1", "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
]  # fmt: skip
PARTS = ("record", "rng", "settle")


class MachineryClock(Callback):
    """Times each step of this group and, with ``on``, each call of the machinery (:data:`PARTS`); without, makes
    the machinery no-ops. Writes ``<directory>/<group>.json`` at the end: step seconds and the parts' seconds."""

    def __init__(self, directory: str, on: bool = True) -> None:
        self.directory, self.on = Path(directory), on
        self.starts: list[float] = []
        self.parts: dict[str, float] = dict.fromkeys(PARTS, 0.0)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        from lit_ddp.ft import progress
        from lit_ddp.ft.strategy import TorchFTStrategy

        targets = {
            "record": (progress.ProgressWriter, "write"),
            "rng": (TorchFTStrategy, "_rng_streams"),
            "settle": (TorchFTStrategy, "_settle_quorum"),
        }
        for name, (owner, attr) in targets.items():
            original = getattr(owner, attr)
            setattr(owner, attr, self._timed(name, original) if self.on else (lambda *args, **kwargs: None))

    def _timed(self, name: str, fn: Any) -> Any:
        first = [name == "settle"]  # the first step's settle holds the cold start's wait for every group: left out

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if first[0]:
                    first[0] = False
                else:
                    self.parts[name] += time.perf_counter() - t0

        return timed

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        import os

        steps = [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]
        group = os.environ.get("REPLICA_GROUP_ID", "group_0")
        record = {"steps": steps, "parts": self.parts, "batches": len(self.starts)}
        (self.directory / f"{group}.json").write_text(json.dumps(record))


def one_run(groups: int, steps: int, on: bool, work: Path) -> dict[str, Any]:
    """One job; per group its step seconds (the first tenth left out: start-up) and the machinery's seconds."""
    out = Path(tempfile.mkdtemp(dir=work))
    callbacks = out / "clock.yaml"
    callbacks.write_text(
        json.dumps({"trainer": {"callbacks+": [{"class_path": "bench.torchft_overhead.MachineryClock",
                                                "init_args": {"directory": str(out), "on": on}}]}})
    )  # fmt: skip
    cmd = [sys.executable, "-m", "lit_ddp.ft.launch", "--replica_groups", str(groups), "--root", str(out / "runs"),
           "--", *FIT, "--config", str(callbacks), "--trainer.max_steps", str(steps)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=bench_env(OMP_NUM_THREADS="1", RUST_LOG="error"), capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the torchft job failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    found = {}
    for path in sorted(out.glob("group_*.json")):
        record = json.loads(path.read_text())
        steps_kept = record["steps"][len(record["steps"]) // 10 :]
        found[path.stem] = {"steps": steps_kept, "parts": record["parts"], "batches": record["batches"]}
    return found


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="torchft_overhead_") as work:
        runs = alternate(
            {name: (lambda on=on: one_run(args.groups, args.steps, on, Path(work))) for name, on in
             (("on", True), ("off", False))},
            args.rounds,
        )  # fmt: skip
    step_ms = {name: statistics.median(s for run in rs for g in run.values() for s in g["steps"]) * 1e3
               for name, rs in runs.items()}  # fmt: skip
    counted = [(g["parts"], g["batches"]) for run in runs["on"] for g in run.values()]
    per_step_us = {p: sum(parts[p] for parts, _ in counted) / sum(n for _, n in counted) * 1e6 for p in PARTS}
    total_us = sum(per_step_us.values())
    rows = [[f"{step_ms['on']:.2f}", f"{step_ms['off']:.2f}", f"{step_ms['on'] / step_ms['off']:.3f}",
             *(f"{per_step_us[p]:.0f}" for p in PARTS), f"{total_us:.0f}",
             f"{total_us / (step_ms['on'] * 1e3) * 100:.2f} %"]]  # fmt: skip
    columns = ["step ms, on", "step ms, off", "on / off", *(f"{p} us" for p in PARTS), "machinery us", "of a step"]
    print(f"{args.groups} groups x 1 process, the regression, {args.steps} steps, {args.rounds} rounds by turns")
    print(markdown_table(columns, rows))
    write_json(args.json, {"args": vars(args), "step_ms": step_ms, "per_step_us": per_step_us, "runs": runs})


if __name__ == "__main__":
    main()
