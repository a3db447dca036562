"""Evaluation does not depend on the number of processes: ``validate``, ``test`` and the ``val/loss`` that ``fit``
logs are the same on 1 process as on 3 (the regression) and on 2 (minGPT), on validation splits that 2 and 3 do
not divide (each rank takes its own items once: :func:`lit_ddp.data.samplers.evaluation_sampler`; Lightning's
padded ``DistributedSampler`` would count some twice, and more of them the more processes there are)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lit_ddp.data.char import CharDataModule
from lit_ddp.data.regression import RegressionDataModule
from tests import helpers
from tests.helpers import TINY_GPT_ARGS, compose, lit_ddp, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

GLOBAL_BATCH = 6  # 6, 3 or 2 per process: the same training step on 1, 2 and 3 processes
TASKS = {
    "regression": [
        *compose("trainer/ddp", "regression/ddp"),
        "--data.init_args.num_samples", "1000", "--data.init_args.val_fraction", "0.125",  # 125 items
        *helpers.QUIET,
    ],
    "mingpt": [*compose("trainer/ddp", "mingpt/cpu"), *TINY_GPT_ARGS],  # 139 validation windows
}  # fmt: skip
# The world size each task is evaluated on besides 1: each launch of a few processes costs seconds of start-up.
WORLD_SIZE = {"regression": 3, "mingpt": 2}
NOISE = (*helpers.NOISE, "callbacks used to create", "train data continues")  # and fit's lines
VAL_ITEMS = {
    "regression": lambda: RegressionDataModule(num_samples=1000, val_fraction=0.125),
    "mingpt": lambda: CharDataModule(block_size=16, truncate=0.02),
}


def launch(procs: int, *args: str) -> list[str]:
    """One process without a launcher; more under torchrun (as a user with more processes than cores does)."""
    if procs == 1:
        return lit_ddp(*args, "--trainer.devices", "1")
    return torchrun("--standalone", "--nproc_per_node", str(procs), "-m", "lit_ddp", *args)


def recorded(directory: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted(directory.glob("rank*.json"))]


@pytest.mark.parametrize("task", TASKS)
def test_validate_test_and_fit_val_loss_equal_on_1_and_more_processes(
    task: str, tmp_path: Path, runner: helpers.Runner
) -> None:
    dm = VAL_ITEMS[task]()
    dm.setup("fit")
    many = WORLD_SIZE[task]
    assert len(dm.val_set) % many, f"{len(dm.val_set)} validation items: {many} divides them"

    def run(procs: int, command: str, name: str, *extra: str) -> dict[str, float]:
        out_dir = tmp_path / name
        callbacks = [
            "--trainer.callbacks+=tests.callbacks.RecordMetrics",
            f"--trainer.callbacks.init_args.out_dir={out_dir}",
        ]
        args = [command, *TASKS[task], "--data.init_args.batch_size", str(GLOBAL_BATCH // procs), *callbacks, *extra]
        out = runner.run(launch(procs, *args), timeout=240)
        assert out.returncode == 0, out.stdout[-3000:]
        if command != "fit":  # only lines about what the user ran (issue 21, item 9)
            assert not [line for line in out.stdout.splitlines() if any(n in line for n in NOISE)], out.stdout[-3000:]
        records = recorded(out_dir)
        assert [r["world_size"] for r in records] == [procs] * procs
        scores = [{k: v for k, v in r["metrics"].items() if k.startswith(("val/", "test/"))} for r in records]
        assert scores[0] and all(s == scores[0] for s in scores), f"ranks disagree: {scores}"
        return scores[0]

    fit_root = tmp_path / "fit1"
    fits, validates, tests = {}, {}, {}
    for procs in (1, many):
        root = tmp_path / f"fit{procs}"
        fits[procs] = run(procs, "fit", f"fit{procs}_metrics", "--trainer.max_steps", "1",
                          "--trainer.val_check_interval", "1", "--trainer.default_root_dir", str(root))  # fmt: skip
    ckpt = fit_root / "checkpoints" / "last.ckpt"
    for procs in (1, many):
        root = str(tmp_path / f"eval{procs}")
        validates[procs] = run(procs, "validate", f"validate{procs}", "--ckpt_path", str(ckpt), "--trainer.default_root_dir", root)  # fmt: skip
        tests[procs] = run(procs, "test", f"test{procs}", "--ckpt_path", str(ckpt), "--trainer.default_root_dir", root)  # fmt: skip
    print({"fit": fits, "validate": validates, "test": tests})
    assert fits[many]["val/loss"] == pytest.approx(fits[1]["val/loss"], rel=1e-6)
    assert validates[many]["val/loss"] == pytest.approx(validates[1]["val/loss"], rel=1e-6)
    assert tests[many]["test/loss"] == pytest.approx(tests[1]["test/loss"], rel=1e-6)
    assert validates[1]["val/loss"] == pytest.approx(tests[1]["test/loss"], rel=1e-6)  # the same split
    assert validates[1]["val/loss"] == pytest.approx(fits[1]["val/loss"], rel=1e-6)  # the checkpoint fit scored
