"""What checkpointing every 50 steps costs on the minGPT CPU config: synchronous vs asynchronous writes.

Three variants of the same training run side by side in one process, interleaved over rounds (so that
load from other processes on the machine hits them alike): no step checkpoints, ``AtomicCheckpointIO``
(synchronous) and ``AsyncAtomicCheckpointIO`` (asynchronous), each saving ``epoch=..-step=N.ckpt`` and
``last.ckpt`` every ``--every`` steps. Two figures per variant, as fractions of its training time:

- **blocked**: time the training loop spent inside the checkpoint callback (for async: the state dump, the
  tensor clones and the hand-off to the writer thread), the direct cost;
- **vs none**: its whole training time against the no-checkpoint variant's, which also catches what the
  writer thread takes from training (CPU, memory bandwidth), but is as noisy as the machine.

One process (``devices=1``; under DDP only rank zero writes while the others wait at the same barrier),
validation off. Run: ``python -m bench.checkpoint_overhead`` (``make bench``).

``--sharded``: the same three variants under ``configs/trainer/fsdp.yaml`` (FSDP2, with AdamW as measured),
whose checkpoints are directories of DCP shards: ``sync`` writes them in the training loop, ``async``
through DCP's ``async_save`` (``FSDP2Strategy(async_save=True)``), committed at the next save and at the end.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from lit_ddp.cli import LitDDPCLI
from lit_ddp.data.sources import DATA_ENV

REPO = Path(__file__).resolve().parents[1]
# The configs as `make train` composes them (the Makefile's CONFIGS); the run below makes it one process.
CONFIGS = ["configs/trainer/ddp.yaml", "configs/mingpt/cpu.yaml"]
VARIANTS = {
    "none": None,
    "sync": "lit_ddp.resilience.checkpoint_io.AtomicCheckpointIO",
    "async": "lit_ddp.resilience.checkpoint_io.AsyncAtomicCheckpointIO",
}
SHARDED_CONFIGS = ["configs/trainer/fsdp.yaml", "configs/mingpt/cpu.yaml"]
SHARDED = {"none": None, "sync": "false", "async": "true"}  # FSDP2Strategy's async_save


class _Clock(Callback):
    """Wall time of fit's training part (train start to train end, writer threads drained by teardown)."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.end = time.perf_counter()


def _timed(fn: Any, sink: list[float]) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t0)

    return wrapper


def run_variant(
    name: str, steps: int, every: int, root: Path, data: str | None, sharded: bool = False, tutorial: bool = False
) -> dict[str, float]:
    """One training run of ``steps`` optimizer steps on the text at ``data`` (None: ``$LIT_DDP_DATA``,
    else the embedded Tiny Shakespeare); returns its times (seconds) and save count."""
    configs = SHARDED_CONFIGS if sharded else CONFIGS
    args = [
        *(arg for config in configs for arg in ("--config", str(REPO / config))),
        "--trainer.devices", "1", *(["--model.init_args.optimizer", "adamw"] if sharded else ["--trainer.strategy", "auto"]),
        "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0",  # so the text samples are off too
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--trainer.default_root_dir", str(root / name),
        "--checkpoint.monitor", "step", "--checkpoint.mode", "max", "--checkpoint.save_top_k", "3",
        "--checkpoint.every_n_epochs", "0",
    ]  # fmt: skip
    if data:
        args += ["--data.init_args.path", data]
    if tutorial:
        args += ["--model.init_args.model_type", "tutorial", "--data.init_args.batch_size", "4"]
    if VARIANTS[name] is None:
        args += ["--checkpoint.every_n_train_steps", "0", "--checkpoint.save_last", "false"]
    elif sharded:
        args += [
            "--checkpoint.every_n_train_steps",
            str(every),
            "--trainer.strategy.init_args.async_save",
            SHARDED[name],
        ]
    else:
        args += ["--checkpoint.every_n_train_steps", str(every), "--trainer.plugins", VARIANTS[name]]
    cli = LitDDPCLI(args=args, run=False)
    clock = _Clock()
    cli.trainer.callbacks.append(clock)
    blocked: list[float] = []
    ckpt = cli.trainer.checkpoint_callback
    ckpt.on_train_batch_end = _timed(ckpt.on_train_batch_end, blocked)  # type: ignore[method-assign]
    saves = [0]
    save = cli.trainer.save_checkpoint

    def counting_save(*a: Any, **k: Any) -> None:
        saves[0] += 1
        save(*a, **k)

    cli.trainer.save_checkpoint = counting_save  # type: ignore[method-assign]
    t0 = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    total = time.perf_counter() - t0  # includes teardown, i.e. waiting for async writes to finish
    # Every call of the checkpoint hook costs a little even when it does not save; the overhead is the hook
    # time above that of the no-checkpoint variant (measured the same way).
    return {"train": clock.end - clock.start, "fit": total, "blocked": sum(blocked), "saves": saves[0]}


def _size(path: Path) -> int:
    """Bytes of a checkpoint: a file, or a sharded checkpoint's directory."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    parser.add_argument("--every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of the three variants")
    parser.add_argument(
        "--data", default=None, help=f"text path or URL (default: ${DATA_ENV}, else the embedded Tiny Shakespeare)"
    )
    parser.add_argument("--sharded", action="store_true", help="FSDP2's sharded checkpoints: DCP, sync vs async_save")
    parser.add_argument(
        "--tutorial",
        action="store_true",
        help="the tutorial's GPT (8 x 8 x 512, 4 windows a step) in place of gpt-nano",
    )
    ns = parser.parse_args(argv)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    with tempfile.TemporaryDirectory(prefix="ckpt_bench_") as tmp:
        # imports, allocator, first-step costs: the same model and strategy as the measured runs
        run_variant("none", 10, ns.every, Path(tmp) / "warmup", ns.data, ns.sharded, ns.tutorial)
        names = list(VARIANTS)
        for r in range(ns.rounds):
            for name in names[r % 3 :] + names[: r % 3]:  # each round in another order
                res = run_variant(name, ns.steps, ns.every, Path(tmp) / f"r{r}", ns.data, ns.sharded, ns.tutorial)
                results[name].append(res)
                print(f"round {r} {name:>5}: {res}", file=sys.stderr)
        ckpt_size = max((_size(p) for p in Path(tmp).rglob("last.ckpt")), default=0)  # bytes
    base_train = statistics.median(x["train"] for x in results["none"])
    base_blocked = statistics.median(x["blocked"] for x in results["none"])
    kind = "FSDP2, sharded checkpoints (sync: in the loop; async: async_save)" if ns.sharded else "DDP"
    kind += ", the tutorial's GPT" if ns.tutorial else ""
    print(f"minGPT CPU config, {kind}, 1 process, {ns.steps} steps, checkpoint every {ns.every} steps "
          f"(+ last.ckpt, {ckpt_size / 1e6:.2f} MB each), median of {ns.rounds} rounds, order rotated")  # fmt: skip
    nones = [x["train"] for x in results["none"]]
    print(f"machine noise: the no-checkpoint runs took {min(nones):.1f}-{max(nones):.1f} s; a 'vs none' smaller "
          "than that spread means nothing, 'blocked' is the direct, robust measure")  # fmt: skip
    print(f"{'variant':>8} {'train s':>8} {'saves':>6} {'blocked s':>10} {'blocked %':>10} {'vs none %':>10}")
    for name, runs in results.items():
        train = statistics.median(x["train"] for x in runs)
        blocked = statistics.median(x["blocked"] for x in runs) - base_blocked
        saves = int(statistics.median(x["saves"] for x in runs))
        print(
            f"{name:>8} {train:8.2f} {saves:6d} {blocked:10.3f} {100 * blocked / train:10.2f} "
            f"{100 * (train - base_train) / base_train:10.2f}"
        )


if __name__ == "__main__":
    main()
