"""What checkpointing every 50 steps costs on the minGPT CPU config, sync vs async (``make bench``): no checkpoints,
``AtomicCheckpointIO`` and ``AsyncAtomicCheckpointIO`` in one process by turns. Per variant: **blocked**, the loop's
time in the checkpoint callback; **vs none**, its training time against no checkpoints (noisier). ``--sharded``: the
same under ``configs/trainer/fsdp.yaml``, DCP shards written in the loop or through ``async_save``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

from bench.harness.callback import StepClock
from bench.harness.clock import read_clock
from bench.harness.launch import QUIET, REPO, fit_command
from bench.harness.measure import alternate, arguments, markdown_table, timing, write_json
from lit_ddp.cli import LitDDPCLI

# The configs as `make train` composes them, made one process below (--sharded: under FSDP2)
CONFIGS = {False: ("configs/trainer/ddp.yaml", "configs/mingpt/cpu.yaml"),
           True: ("configs/trainer/fsdp.yaml", "configs/mingpt/cpu.yaml")}  # fmt: skip
VARIANTS = {  # the checkpoint IO plugin, or under --sharded FSDP2Strategy's async_save
    "none": (None, None),
    "sync": ("lit_ddp.resilience.checkpoint_io.AtomicCheckpointIO", "false"),
    "async": ("lit_ddp.resilience.checkpoint_io.AsyncAtomicCheckpointIO", "true"),
}


def run_variant(name: str, steps: int, every: int, root: Path, ns: argparse.Namespace) -> dict[str, float]:
    """One training run of ``steps`` optimizer steps: its times (seconds) and save count."""
    plugin, async_save = VARIANTS[name]
    args = ["--trainer.devices", "1", "--trainer.max_steps", str(steps), *QUIET,
            "--trainer.limit_val_batches", "0",  # so the text samples are off too
            "--checkpoint.monitor", "step", "--checkpoint.mode", "max", "--checkpoint.save_top_k", "3",
            "--checkpoint.every_n_epochs", "0",
            *(["--model.init_args.optimizer", "adamw"] if ns.sharded else ["--trainer.strategy", "auto"]),
            *(["--model.init_args.model_type", "tutorial", "--data.init_args.batch_size", "4"] if ns.tutorial else [])]  # fmt: skip
    if plugin is None:
        args += ["--checkpoint.every_n_train_steps", "0", "--checkpoint.save_last", "false"]
    elif ns.sharded:
        args += ["--checkpoint.every_n_train_steps", str(every), "--trainer.strategy.init_args.async_save", async_save]
    else:
        args += ["--checkpoint.every_n_train_steps", str(every), "--trainer.plugins", plugin]
    configs = (str(REPO / c) for c in CONFIGS[ns.sharded])
    cli = LitDDPCLI(args=fit_command(*configs, root=root / name, args=args)[4:], run=False)
    cli.trainer.callbacks.append(StepClock(str(root / f"{name}.clock")))
    blocked: list[tuple[float, float]] = []  # (start, seconds) of each call
    saves: list[tuple[float, float]] = []
    ckpt = cli.trainer.checkpoint_callback
    ckpt.on_train_batch_end = timing(ckpt.on_train_batch_end, blocked)  # type: ignore[method-assign]
    cli.trainer.save_checkpoint = timing(cli.trainer.save_checkpoint, saves)  # type: ignore[method-assign]
    t0 = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    total = time.perf_counter() - t0  # includes teardown, i.e. waiting for async writes to finish
    events = read_clock(root / f"{name}.clock")
    # Every call of the checkpoint hook costs a little even when it does not save; the overhead is the hook
    # time above that of the no-checkpoint variant (measured the same way).
    train = events["end"][0][0] - events["start"][0][0]
    return {"train": train, "fit": total, "blocked": sum(s for _, s in blocked), "saves": len(saves)}


def _size(path: Path) -> int:
    """Bytes of a checkpoint: a file, or a sharded checkpoint's directory."""
    return sum(p.stat().st_size for p in [path, *path.rglob("*")] if p.is_file())


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    parser.add_argument("--every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of the three variants")
    parser.add_argument("--sharded", action="store_true", help="FSDP2's sharded checkpoints: DCP, sync vs async_save")
    parser.add_argument("--tutorial", action="store_true", help="the tutorial's GPT (8 x 8 x 512, 4 windows a step)")
    ns = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    with tempfile.TemporaryDirectory(prefix="ckpt_bench_") as tmp:
        # imports, allocator, first-step costs: the same model and strategy as the measured runs
        run_variant("none", 10, ns.every, Path(tmp) / "warmup", ns)
        rounds = iter(range(ns.rounds * len(VARIANTS)))

        def variant(name: str) -> dict[str, float]:
            res = run_variant(name, ns.steps, ns.every, Path(tmp) / f"r{next(rounds)}", ns)
            print(f"{name:>5}: {res}", file=sys.stderr)
            return res

        results = alternate({name: lambda name=name: variant(name) for name in VARIANTS}, ns.rounds)
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
    rows = []
    for name, runs in results.items():
        train = statistics.median(x["train"] for x in runs)
        blocked = statistics.median(x["blocked"] for x in runs) - base_blocked
        saves = int(statistics.median(x["saves"] for x in runs))
        vs_none = 100 * (train - base_train) / base_train
        rows.append([name, f"{train:.2f}", saves, f"{blocked:.3f}", f"{100 * blocked / train:.2f}", f"{vs_none:.2f}"])
    print(markdown_table(["variant", "train s", "saves", "blocked s", "blocked %", "vs none %"], rows))
    write_json(ns.json, results)


if __name__ == "__main__":
    main()
