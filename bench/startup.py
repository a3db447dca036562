"""Start-up, part by part: from a process's start to its first optimizer step, ``lit-ddp fit`` against a bare
``lightning.pytorch.Trainer.fit`` of the same LightningModule and DataModule (``make bench-startup``; docs/speed.md,
"Start-up").

Each variant runs in a fresh process (``python -m bench.startup --child ...``), by turns (:func:`alternate`), on CPU,
``max_steps`` 1; rank zero writes when each part ends (``perf_counter`` seconds since the process started, the
process's start read from ``/proc``). The parts:

- ``interpreter``: the process's start to the first line of this script;
- ``torch + Lightning``: ``import lightning.pytorch, jsonargparse`` and Lightning's CLI (what any Lightning CLI pays);
- ``lit-ddp imports``: ``import lit_ddp.cli`` beyond those;
- ``parse``: LightningCLI's parse and config composition (the pre-start checks' time taken out);
- ``checks``: lit-ddp's pre-start checks (``lit_ddp.launch.preflight.run_checks``, every stage);
- ``build``: the module, data module and Trainer instantiated (lit-ddp: its callbacks, logger and checkpoint IO
  too), up to ``trainer.fit``;
- ``process group``: ``trainer.fit`` to the strategy's environment set up (its process group created);
- ``first step``: from there to the end of the first optimizer step (the data's and module's set-up, DDP's wrap,
  the resume point chosen, the first batch).

The bare fit has no ``lit-ddp imports``, ``parse`` or ``checks``. lit-ddp's own share is the sum of its parts after
``torch + Lightning`` less the bare fit's (the parts before are the same code in both, and their noise is larger than
that share). ``--configs``: the run (default: the regression of the README's step 1; ``--devices 2`` with
``configs/trainer/ddp.yaml configs/mingpt/cpu.yaml`` is ``make train``'s on 2 processes). ``--before DIR``: a third
variant, the same command with the package of another checkout (``git worktree add DIR <commit>``), by turns with the
other two: before and after in one run. Where that checkout has no single function of pre-start checks, their time
stays in its ``parse``.
"""

from __future__ import annotations

import json
import os
import sys
import time

STARTED = time.perf_counter()  # before anything else of this module: the first line it runs

import argparse  # noqa: E402 - after the first line's clock
import functools  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from bench.harness.launch import process_age  # noqa: E402

PARTS = [
    "interpreter",
    "torch + Lightning",
    "lit-ddp imports",
    "parse",
    "checks",
    "build",
    "process group",
    "first step",
]
MARKS_ENV = "BENCH_STARTUP_MARKS"
PACKAGE_ENV = "BENCH_STARTUP_PACKAGE"  # --before's checkout, first on sys.path (DDP's processes inherit it)
if os.environ.get(PACKAGE_ENV):
    sys.path.insert(0, os.environ[PACKAGE_ENV])


class Marks:
    """When each part ended, in seconds since the process started, written by rank zero at the first step."""

    def __init__(self) -> None:
        self.offset = process_age() - (time.perf_counter() - STARTED) - STARTED  # perf_counter -> process age
        self.times: dict[str, float] = {"interpreter": STARTED + self.offset}
        self.checks = 0.0
        self.package = ""

    def mark(self, part: str) -> None:
        self.times[part] = time.perf_counter() + self.offset

    def write(self) -> None:
        if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0" and MARKS_ENV in os.environ:
            Path(os.environ[MARKS_ENV]).write_text(
                json.dumps({**self.times, "checks time": self.checks, "package": self.package})
            )


MARKS = Marks()


def _first_step_callback() -> Any:
    from lightning.pytorch import Callback

    class FirstStep(Callback):
        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            MARKS.mark("process group")  # Lightning calls it once the strategy's environment is set up

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 1 and "first step" not in MARKS.times:
                MARKS.mark("first step")
                MARKS.write()

    return FirstStep()


def child_lit_ddp(configs: list[str], devices: int, root: str) -> None:
    import jsonargparse  # noqa: F401
    import lightning.pytorch  # noqa: F401
    import lightning.pytorch.cli  # noqa: F401

    MARKS.mark("torch + Lightning")
    from lit_ddp import cli

    MARKS.mark("lit-ddp imports")
    MARKS.package = str(Path(cli.__file__).resolve().parents[1])
    checks = getattr(cli, "run_checks", None)  # absent in an older checkout (--before)

    def timed_checks(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return checks(*args, **kwargs)  # type: ignore[misc]
        finally:
            MARKS.checks += time.perf_counter() - t0

    if checks is not None:
        cli.run_checks = timed_checks  # type: ignore[attr-defined]  # the CLI's own reference

    class Timed(cli.LitDDPCLI):
        def before_instantiate_classes(self) -> None:
            MARKS.mark("parse")
            super().before_instantiate_classes()

        def before_fit(self) -> None:
            MARKS.mark("build")
            super().before_fit()

        def instantiate_trainer(self, **kwargs: Any) -> Any:
            kwargs.setdefault("callbacks", [])
            trainer = super().instantiate_trainer(**kwargs)
            trainer.callbacks.append(_first_step_callback())
            return trainer

    args = ["fit", *(a for c in configs for a in ("--config", c)), "--trainer.devices", str(devices)]
    args += ["--trainer.max_steps", "1", "--trainer.default_root_dir", root, "--trainer.enable_progress_bar", "false"]
    cli.LitDDPCLI = Timed  # type: ignore[misc]  # what cli_main builds: the command as users run it
    cli.cli_main(args)


def child_lightning(configs: list[str], devices: int, root: str) -> None:
    import jsonargparse  # noqa: F401
    import lightning.pytorch  # noqa: F401
    import lightning.pytorch.cli  # noqa: F401

    MARKS.mark("torch + Lightning")
    import importlib

    import yaml
    from lightning.pytorch import Trainer, seed_everything

    def built(section: dict[str, Any]) -> Any:
        module, _, name = section["class_path"].rpartition(".")
        return getattr(importlib.import_module(module), name)(**(section.get("init_args") or {}))

    merged: dict[str, Any] = {}
    for path in configs:
        for key, value in (yaml.safe_load(Path(path).read_text()) or {}).items():
            merged[key] = value if key in ("model", "data") else {**merged.get(key, {}), **(value or {})}
    data_args = merged["data"].get("init_args") or {}
    if "block_size" in data_args:  # the link LitDDPCLI makes (data's block_size is the model's)
        merged["model"]["init_args"] = {
            **(merged["model"].get("init_args") or {}),
            "block_size": data_args["block_size"],
        }
    seed_everything(1337)
    model, data = built(merged["model"]), built(merged["data"])
    trainer = Trainer(accelerator="cpu", devices=devices, max_steps=1, default_root_dir=root,
                      enable_progress_bar=False, callbacks=[_first_step_callback()])  # fmt: skip
    MARKS.mark("build")
    trainer.fit(model, data)


def measure(variant: str, configs: list[str], devices: int, package: str | None = None) -> dict[str, float]:
    """One fresh process of ``variant`` (``lit-ddp`` or ``Lightning``): the seconds of each part; ``package``: the
    checkout whose ``lit_ddp`` it imports (else this one's)."""
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as work:
        marks = Path(work, "marks.json")
        cmd = [sys.executable, "-m", "bench.startup", "--child", variant, "--devices", str(devices),
               "--root", str(Path(work, "run")), "--configs", *configs]  # fmt: skip
        env = {**os.environ, MARKS_ENV: str(marks), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        env.pop(PACKAGE_ENV, None)
        if package is not None:  # its lit_ddp; bench.startup itself from this checkout
            env[PACKAGE_ENV] = package
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or not marks.exists():
            raise RuntimeError(f"{variant} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        times = json.loads(marks.read_text())
    if package is not None and times["package"] != package:
        raise RuntimeError(f"{variant} imported lit_ddp from {times['package']}, not {package}")
    seconds: dict[str, float] = {}
    previous = 0.0
    for part in PARTS:
        if part in times:
            seconds[part] = times[part] - previous
            previous = times[part]
    if "parse" in seconds:  # the checks run inside the parse (two stages) and before the build (one)
        seconds["checks"] = times["checks time"]
        seconds["parse"] -= times["checks time"]
    seconds["total"] = previous
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["configs/regression/single_device.yaml"])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes of each variant, by turns")
    parser.add_argument("--child", choices=["lit-ddp", "Lightning"], help=argparse.SUPPRESS)
    parser.add_argument("--before", metavar="DIR", help="another checkout, measured by turns with this one")
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        (child_lit_ddp if args.child == "lit-ddp" else child_lightning)(args.configs, args.devices, args.root)
        return 0
    from bench.harness.measure import alternate, markdown_table

    print(f"start-up of {' + '.join(args.configs)} on {args.devices} CPU process(es), {args.rounds} rounds by turns")
    variants: dict[str, Callable[[], dict[str, float]]] = {
        v: functools.partial(measure, v, args.configs, args.devices) for v in ("lit-ddp", "Lightning")
    }
    if args.before:
        package = str(Path(args.before).resolve())
        before = functools.partial(measure, "lit-ddp", args.configs, args.devices, package)
        variants = {"lit-ddp before": before, **variants}
    runs = alternate(variants, args.rounds)
    median = {v: {p: statistics.median(r[p] for r in rs) for p in rs[0]} for v, rs in runs.items()}
    rows = [[p, *(f"{median[v][p]:.2f}" if p in median[v] else "-" for v in median)] for p in [*PARTS, "total"]]
    print(markdown_table(["part (median s)", *median], rows))
    # The parts after torch + Lightning's imports: the interpreter and those imports are the same code in every
    # variant, and their noise (tenths of a second here) would hide lit-ddp's own share in the totals.
    after = PARTS[2:]
    bare = sum(median["Lightning"].get(p, 0.0) for p in after)
    for v in [v for v in median if v.startswith("lit-ddp")]:
        mine = sum(median[v].get(p, 0.0) for p in after)
        print(
            f"{v}: its own share of launch to the first step {mine - bare:.2f} s ({' + '.join(after)}: "
            f"{mine:.2f} s against a bare Trainer.fit's {bare:.2f} s; totals {median[v]['total']:.2f} s and "
            f"{median['Lightning']['total']:.2f} s)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
