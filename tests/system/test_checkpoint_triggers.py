"""Every checkpoint trigger Lightning offers, alone, under faults at moments nobody chose.

For each trigger (epoch end, validation end, every N steps, every T seconds, ``last.ckpt`` only, Lightning's
``hpc_ckpt`` preemption save), under one of two layouts (the regression in one process, minGPT under torchrun
with two; ``CASES`` says which): a run is struck twice at random moments after its training starts and its trigger has saved once (``seed`` fixture; ``LIT_DDP_TEST_SEED=N`` replays the delays and the rank
struck), SIGKILL for a file trigger, SIGTERM for ``hpc`` (the file exists only once a signal asked for it). One
process is relaunched with the same command, as a user or a requeue would; torchrun restarts its group
itself. The run must end with status 0 and parameters bit-identical to an uninterrupted run, having resumed
from a file of that trigger. The same with ``accumulate_grad_batches=2`` and the time trigger, whose saves
would otherwise land inside an accumulation window.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import helpers
from tests.callbacks import MarkTrainStart
from tests.helpers import QUIET, callback, compose, load_records, tensorboard_steps, torchrun
from tests.system.test_fault_tolerance import assert_same_params, assert_same_tensorboard
from tests.system.test_reliability import Watched, workers

# Each trigger alone: ModelCheckpoint's own options, last.ckpt off unless it is the trigger.
TRIGGERS: dict[str, list[str]] = {
    "epoch_end": ["--checkpoint.every_n_epochs", "1", "--checkpoint.save_on_train_epoch_end", "true"],
    "validation_end": ["--checkpoint.every_n_epochs", "1", "--checkpoint.save_on_train_epoch_end", "false"],
    "steps": ["--checkpoint.every_n_train_steps", "7"],
    "time": ["--checkpoint.train_time_interval", "0:00:01"],
    "last": ["--checkpoint.every_n_train_steps", "7", "--checkpoint.save_top_k", "0", "--checkpoint.save_last", "true"],
    "hpc": ["--checkpoint.every_n_epochs", "0", "--checkpoint.save_top_k", "0"],
}
NO_LAST = ["--checkpoint.save_last", "false"]
# What a resume from each trigger's file prints (a regular expression over the "Resuming from" path).
RESUMED_FROM = {
    "epoch_end": r"checkpoints/epoch=\d+-step=\d+\.ckpt",
    "validation_end": r"checkpoints/epoch=\d+-step=\d+\.ckpt",
    "steps": r"checkpoints/epoch=\d+-step=\d+\.ckpt",
    "time": r"checkpoints/epoch=\d+-step=\d+\.ckpt",
    "last": r"checkpoints/last\.ckpt",
    "hpc": r"hpc_ckpt_\d+\.ckpt",
}
KILLS = 2
DELAY_S = (0.2, 2.0)  # after a start (and a first save): mid-step, mid-save, mid-validation, far from the end
# Optimizer steps for 7-10 s of training here (without accumulation), by task and number of processes: two strikes
# and the preemption agreements after them fit well inside.
STEPS = {("regression", 1): 4000, ("regression", 2): 540, ("mingpt", 1): 110, ("mingpt", 2): 110}


def task_args(task: str, text: Path, accumulate: int, processes: int, hpc: bool = False) -> list[str]:
    """Short epochs, so that every trigger fires many times; about 7 s of training here."""
    steps = STEPS[task, processes] // accumulate * (2 if hpc else 1)  # a preemption loses no steps: run longer
    common = ["--trainer.max_epochs", "-1", "--trainer.max_steps", str(steps), "--trainer.deterministic", "true",
              "--trainer.accumulate_grad_batches", str(accumulate), *QUIET]  # fmt: skip
    if task == "regression":  # 252 training samples: 8 batches of 32 per epoch (4 per rank on two), val at epoch end
        return [*compose("trainer/ddp", "regression/fault_tolerant"), "--data.num_samples", "288", *common]
    # 360 training characters, a window at each: 43 batches of 8 per epoch (22 per rank on two), val every 5 batches
    return [*compose("trainer/ddp", "mingpt/cpu", "mingpt/fault_tolerant"), "--data.path", str(text),
            "--data.block_size", "16", "--data.batch_size", "8", "--model.warmup_steps", "2",
            "--trainer.val_check_interval", "5", "--trainer.limit_val_batches", "2", *common]  # fmt: skip


def command(args: list[str], processes: int) -> list[str]:
    if processes == 1:
        return helpers.lit_ddp("fit", *args, "--trainer.devices", "1", "--trainer.strategy", "auto")
    return torchrun("--standalone", "--nproc_per_node", "2", "--max-restarts", str(KILLS + 1),
                    "--monitor-interval", "0.2", "-m", "lit_ddp", "fit", *args)  # fmt: skip


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lit_ddp.data.sources import read_embedded_text

    path = tmp_path_factory.mktemp("text") / "tiny.txt"
    path.write_text(read_embedded_text()[:400])
    return path


@pytest.fixture(scope="module")
def references(
    tmp_path_factory: pytest.TempPathFactory, text: Path
) -> Callable[[str, int, int, bool], tuple[list[dict], Path]]:
    """``references(task, processes, accumulate, hpc)``: the final records and the run directory of an uninterrupted
    run (default checkpointing; saving changes nothing a run computes), made once per module and combination."""
    made: dict[tuple[str, int, int, bool], tuple[list[dict], Path]] = {}

    def get(task: str, processes: int, accumulate: int, hpc: bool) -> tuple[list[dict], Path]:
        key = (task, processes, accumulate, hpc)
        if key not in made:
            root = tmp_path_factory.mktemp("reference")
            cb, rec = helpers.recorder_config(root, "ref")
            cmd = command([*task_args(task, text, accumulate, processes, hpc), "--config", str(cb),
                           "--trainer.default_root_dir", str(root / "run")], processes)  # fmt: skip
            out = helpers.run(cmd, 240)
            assert out.returncode == 0, out.stdout[-3000:]
            made[key] = load_records(rec), root / "run"
        return made[key]

    return get


def strike(watched: Watched, processes: int, signum: int, rng: random.Random) -> bool:
    """Sends ``signum`` to the one process, or to a random worker of torchrun; False if none was running."""
    targets = [watched.proc.pid] if processes == 1 else workers(watched.proc)
    if not targets or watched.proc.poll() is not None:
        return False
    os.kill(rng.choice(targets), signum)
    return True


def run_struck(
    runner: helpers.Runner,
    cmd: list[str],
    state: Path,
    saved: Path | None,
    processes: int,
    signum: int,
    rng: random.Random,
) -> str:
    """Runs ``cmd`` to its end, striking it ``KILLS`` times, each at a random delay after a training start
    (``MarkTrainStart``) once ``saved`` holds a checkpoint (None: at once); relaunches a struck single process.
    Returns the whole output."""
    outputs: list[str] = []
    watched = Watched(runner.start(cmd))
    for kill in range(KILLS):
        deadline = time.monotonic() + 120
        while not (state / f"started_{kill}").exists() or (saved is not None and not list(saved.glob("*.ckpt"))):
            assert watched.proc.poll() is None, f"the run ended before strike {kill}:\n{watched.output[-4000:]}"
            assert time.monotonic() < deadline, f"no training start {kill}:\n{watched.output[-4000:]}"
            time.sleep(0.05)
        time.sleep(rng.uniform(*DELAY_S))
        assert strike(watched, processes, signum, rng), f"the run ended before strike {kill}: make it longer"
        if processes == 1:
            code = watched.finish(120)
            outputs.append(watched.output)
            assert code in (-signal.SIGKILL, 128 + signal.SIGTERM), f"strike {kill}: exit {code}\n{watched.output}"
            watched = Watched(runner.start(cmd))
    code = watched.finish(300)
    outputs.append(watched.output)
    output = "".join(outputs)
    assert code == 0, f"exit {code}\n{output[-5000:]}"
    return output


# Each trigger once, under one of the two layouts: the regression in one relaunched process, minGPT (validation
# mid-epoch, dropout, the optimizer chain) under torchrun with two. The time trigger twice, alone and with
# gradient accumulation, whose saves would otherwise land inside an accumulation window; Lightning's preemption
# save under torchrun, where SIGTERM reaches one worker and every rank must agree to save. The other pairs are
# struck elsewhere at random moments: torchrun's regression by lit-ddp chaos with every kind
# (tests/system/test_chaos.py), one minGPT process with kills and a truncated last.ckpt (test_fault_tolerance.py).
# Every trigger under both layouts cost 14 minutes of make test; this half, 7.
CASES = [
    ("epoch_end", 1, "regression", 1),
    ("steps", 1, "regression", 1),
    ("last", 1, "regression", 1),
    ("time", 2, "regression", 1),
    ("validation_end", 1, "mingpt", 2),
    ("time", 1, "mingpt", 2),
    ("hpc", 1, "mingpt", 2),
]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("trigger", "accumulate", "task", "processes"), CASES, ids=[f"{t}-accumulate{a}-{k}" for t, a, k, _ in CASES]
)
def test_random_strikes_resume_exactly_from_each_trigger(
    trigger: str,
    accumulate: int,
    task: str,
    processes: int,
    tmp_path: Path,
    runner: helpers.Runner,
    references,
    text: Path,
    seed: int,
) -> None:
    rng = random.Random(seed)
    state = tmp_path / "state"
    cb, rec = helpers.recorder_config(tmp_path, "run", callback(MarkTrainStart, state_dir=str(state)))
    trigger_args = TRIGGERS[trigger] + ([] if trigger == "last" else NO_LAST)
    args = [*task_args(task, text, accumulate, processes, hpc=trigger == "hpc"), *trigger_args, "--config", str(cb),
            "--trainer.default_root_dir", str(tmp_path / "run")]  # fmt: skip
    signum = signal.SIGTERM if trigger == "hpc" else signal.SIGKILL
    saved = None if trigger == "hpc" else tmp_path / "run" / "checkpoints"
    output = run_struck(runner, command(args, processes), state, saved, processes, signum, rng)
    resumed = re.findall(r"Resuming from (\S+)", output)
    assert len(resumed) == KILLS and all(re.search(RESUMED_FROM[trigger], p) for p in resumed), resumed
    reference, reference_dir = references(task, processes, accumulate, trigger == "hpc")
    assert_same_params(load_records(rec), reference)
    if trigger == "hpc":  # our save: it waits for a validation due at its step
        assert_same_tensorboard(tmp_path / "run", reference_dir)
    else:  # Lightning skips the validation and epoch-end logging due after the batch a checkpoint was written in
        got, want = tensorboard_steps(tmp_path / "run"), tensorboard_steps(reference_dir)
        assert got.keys() == want.keys()
        for tag in [t for t in want if not t.startswith("validate/")]:
            # validation and epoch-aggregated points: each at most as often as in the reference
            if tag.startswith("val/") or tag.endswith("_epoch") or tag == "epoch":
                assert not Counter(got[tag]) - Counter(want[tag]), tag
            else:
                assert sorted(got[tag]) == sorted(want[tag]), tag
