"""Resuming on another number of processes: the global batch sequence does not depend on the world size
(lit_ddp.data.samplers.GlobalOrderSampler), so 2 x 16 and 1 x 32 train on the same samples step by step."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests import helpers
from tests.helpers import compose, load_records, recorder_config, torchrun

STEPS, STOP = 80, 30  # 56 steps per epoch (1792 samples / 32): the stop is mid-epoch, the end in epoch 2
REGRESSION = [
    *compose("trainer/ddp", "checkpoint/fault_tolerant", "regression/fault_tolerant"),
    "--model.init_args.learning_rate", "0.05",  # SGD: large enough that the parameters move a lot
    "--checkpoint.every_n_train_steps", "10",
    *helpers.QUIET,
]  # fmt: skip
LAYOUTS = {"2x16": ["--trainer.devices", "2", "--data.init_args.batch_size", "16"],
           "1x32": ["--trainer.devices", "1", "--data.init_args.batch_size", "32"]}  # fmt: skip


def fit(runner: helpers.Runner, root: Path, rec: Path, layout: str, steps: int, *extra: str) -> None:
    out = runner.fit(*REGRESSION, *LAYOUTS[layout], "--trainer.max_steps", str(steps), "--config", str(rec),
                     "--trainer.default_root_dir", str(root), *extra, timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:]


def final_params(rec_dir: Path) -> dict[str, torch.Tensor]:
    records = load_records(rec_dir)
    assert records and all(r["global_step"] == STEPS for r in records)
    return records[0]["params"]


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for name, tensor in b.items():
        torch.testing.assert_close(a[name], tensor, rtol=1e-5, atol=1e-7, msg=name)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, torch.Tensor]]]:
    """Final parameters of uninterrupted 2 x 16 and 1 x 32 runs."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    runner = helpers.Runner()
    try:
        params = {}
        for layout in LAYOUTS:
            cb, rec = recorder_config(tmp, layout)
            fit(runner, tmp / layout / "run", cb, layout, STEPS)
            params[layout] = final_params(rec)
        yield params
    finally:
        runner.close()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_same_global_batch_same_parameters(uninterrupted: dict[str, dict[str, torch.Tensor]]) -> None:
    assert_close(uninterrupted["1x32"], uninterrupted["2x16"])
    moved = max(float(t.abs().max()) for t in uninterrupted["2x16"].values())
    assert moved > 0.5, "the parameters must move for the comparison to mean something"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("first", "second"), [("2x16", "1x32"), ("1x32", "2x16")])
def test_resume_on_another_world_size(
    first: str, second: str, tmp_path: Path, runner: helpers.Runner, uninterrupted: dict
) -> None:
    """Stopped at a mid-epoch checkpoint on one layout, resumed on the other: the end equals the
    uninterrupted run of the first layout, with no flag and a warning that says what continues."""
    root = tmp_path / "run"
    cb1, _ = recorder_config(tmp_path, "first")
    fit(runner, root, cb1, first, STOP)
    cb2, rec2 = recorder_config(tmp_path, "second")
    out = runner.fit(*REGRESSION, *LAYOUTS[second], "--trainer.max_steps", str(STEPS), "--config", str(cb2),
                     "--trainer.default_root_dir", str(root), timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:]
    assert f"continues from sample {STOP * 32} of epoch 0" in out.stdout
    [record, *_] = load_records(rec2)
    assert record["start_step"] == STOP
    assert_close(final_params(rec2), uninterrupted[first])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_torchrun_resumes_on_fewer_processes_with_no_flag(
    tmp_path: Path, runner: helpers.Runner, uninterrupted: dict
) -> None:
    """``torchrun --nproc_per_node 2`` stopped mid-epoch, then the same command under ``--nproc_per_node 1``
    (no ``--trainer.devices``: the config's 2 follows torchrun) with batch 32: ends where 2 x 16 ends."""
    root = tmp_path / "run"

    def launch(nproc: int, batch: int, steps: int, name: str) -> tuple[str, Path]:
        cb, rec = recorder_config(tmp_path, name)
        cmd = torchrun("--standalone", "--nproc_per_node", str(nproc), "-m", "lit_ddp", "fit", *REGRESSION,
                       "--data.init_args.batch_size", str(batch), "--trainer.max_steps", str(steps),
                       "--config", str(cb), "--trainer.default_root_dir", str(root))  # fmt: skip
        out = runner.run(cmd, 180)
        assert out.returncode == 0, out.stdout[-3000:]
        return out.stdout, rec

    launch(2, 16, STOP, "first")
    stdout, rec = launch(1, 32, STEPS, "second")
    assert "torchrun started 1 process(es) per node on 1 node(s): trainer.devices=2 -> 1" in stdout
    assert f"continues from sample {STOP * 32} of epoch 0" in stdout
    assert load_records(rec)[0]["start_step"] == STOP
    assert_close(final_params(rec), uninterrupted["2x16"])


def unique_window_text(path: Path, seed: int, length: int = 1405) -> Path:
    """A text whose 16-character windows are all distinct (random characters of an 80-character alphabet), so
    that a window's content names its index. 1405 characters: 1264 for training (train_split 0.9), i.e.
    1248 = 78 x 16 windows of 16 + 1."""
    rng = random.Random(seed)
    alphabet = [chr(c) for c in range(40, 120)]
    path.write_text("".join(rng.choice(alphabet) for _ in range(length)), encoding="utf-8")
    return path


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_mingpt_two_processes_then_one_sees_every_window_once(
    tmp_path: Path, runner: helpers.Runner, seed: int
) -> None:
    text = unique_window_text(tmp_path / "text.txt", seed)
    args = [
        *compose("trainer/ddp", "mingpt/cpu", "checkpoint/fault_tolerant", "mingpt/fault_tolerant"),
        *helpers.TINY_GPT_ARGS, "--data.init_args.path", str(text), "--data.init_args.truncate", "1.0",
        "--trainer.limit_val_batches", "0", "--checkpoint.every_n_train_steps", "10",
        "--trainer.max_epochs", "1", "--trainer.max_steps", "-1",
        "--trainer.default_root_dir", str(tmp_path / "run"),
    ]  # fmt: skip
    cb1, rec1 = recorder_config(tmp_path, "two")
    out = runner.fit(*args, "--trainer.devices", "2", "--trainer.max_steps", "30", "--config", str(cb1), timeout=180)
    assert out.returncode == 0, out.stdout[-3000:]
    cb2, rec2 = recorder_config(tmp_path, "one")
    out = runner.fit(*args, "--trainer.devices", "1", "--data.init_args.batch_size", "16", "--config", str(cb2),
                     timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:]

    data = text.read_text(encoding="utf-8")[:1264]
    index = {data[i : i + 16]: i for i in range(len(data) - 16)}
    assert len(index) == 1248, "the windows of the text are distinct"
    vocab = "".join(sorted(set(text.read_text(encoding="utf-8"))))
    fed = [r["epochs"][0] for r in (*load_records(rec1), *load_records(rec2))]
    seen = Counter(index["".join(vocab[t] for t in row.tolist())] for x in fed for row in x)
    assert sum(seen.values()) == 1248 and set(seen.values()) == {1}, "every training window exactly once"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("first", "second", "stop"), [(32, 64, 20), (64, 32, 10)])
def test_resume_with_another_global_batch_sees_every_sample_once(
    first: int, second: int, stop: int, tmp_path: Path, runner: helpers.Runner
) -> None:
    """One process, 1,792 training samples: stopped mid-epoch with one batch size, resumed with the other (a
    requeue onto more nodes at the same per-device batch is this case). Together the two runs train on each
    sample of the epoch exactly once, the epoch ends in a validation, and the resume says what changed."""
    from tests.callbacks import RecordMetrics

    root = tmp_path / "run"
    args = [*REGRESSION, "--trainer.devices", "1", "--trainer.max_epochs", "1", "--trainer.default_root_dir", str(root)]
    cb1, rec1 = recorder_config(tmp_path, "first")
    out = runner.fit(*args, "--data.init_args.batch_size", str(first), "--trainer.max_steps", str(stop),
                     "--checkpoint.every_n_train_steps", str(stop), "--config", str(cb1), timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:]
    metrics = tmp_path / "metrics"
    cb2, rec2 = recorder_config(tmp_path, "second", helpers.callback(RecordMetrics, out_dir=str(metrics)))
    out = runner.fit(*args, "--data.init_args.batch_size", str(second), "--config", str(cb2), timeout=180)
    assert out.returncode == 0, out.stdout[-3000:]
    assert f"Resuming with a global batch of {second} samples ({second} x 1 processes); the checkpoint's was {first}" in out.stdout  # fmt: skip

    fed = torch.cat([load_records(rec)[0]["epochs"][0] for rec in (rec1, rec2)])  # (samples, 20)
    assert fed.shape[0] == 1792, f"{fed.shape[0]} samples trained on; the epoch has 1792"
    assert torch.unique(fed, dim=0).shape[0] == 1792, "a sample was repeated"
    [record] = load_records(rec2)
    assert record["start_step"] == stop and record["global_step"] == stop + (1792 - stop * first) // second
    assert json.loads((metrics / "rank0.json").read_text())["global_step"] == record["global_step"]
