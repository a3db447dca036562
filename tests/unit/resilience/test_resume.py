"""lit_ddp.resilience.resume: which checkpoint a run resumes from. The newest valid one by recorded step
(file times lie once a run directory is copied), a truncated one skipped with a warning, none: a fresh start,
only unreadable ones: a clear error. (What the CLI does with them: ``tests/system/test_fault_tolerance_atomic.py``.)"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from lit_ddp.resilience.resume import NoValidCheckpointError, choose_checkpoint


def _ckpt(path: Path, mtime: float, valid: bool = True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": int(mtime)}, path)
    if not valid:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    os.utime(path, (mtime, mtime))
    return path


def test_truncated_last_falls_back_with_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpts = tmp_path / "checkpoints"
    _ckpt(ckpts / "epoch=0-step=4.ckpt", 1000)
    good = _ckpt(ckpts / "epoch=0-step=8.ckpt", 2000)
    _ckpt(ckpts / "last.ckpt", 3000, valid=False)
    with caplog.at_level(logging.WARNING):
        assert choose_checkpoint(str(tmp_path)) == str(good)
    assert str(ckpts / "last.ckpt") in caplog.text


def test_no_checkpoints_means_fresh_start(tmp_path: Path) -> None:
    assert choose_checkpoint(str(tmp_path)) is None


def test_garbage_only_is_a_clear_error(tmp_path: Path) -> None:
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    (ckpts / "last.ckpt").write_bytes(b"not a checkpoint")
    _ckpt(ckpts / "epoch=0-step=4.ckpt", 1000, valid=False)
    with pytest.raises(NoValidCheckpointError, match=r"None of the 2 checkpoint\(s\).*--ckpt_path"):
        choose_checkpoint(str(tmp_path))


def save_steps(directory: Path, steps: dict[str, int]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, step in steps.items():
        torch.save({"global_step": step, "epoch": 0}, directory / name)


def test_resume_order_is_by_recorded_step_not_file_time(tmp_path: Path) -> None:
    """Copied run directories and 1-second object-store times reorder files; the recorded step does not."""
    run = tmp_path / "run"
    save_steps(run / "checkpoints", {"epoch=0-step=9.ckpt": 9, "epoch=0-step=12.ckpt": 12, "last.ckpt": 12})
    save_steps(run, {"hpc_ckpt_9.ckpt": 9, "hpc_ckpt_10.ckpt": 10})
    now = time.time()
    for age, path in enumerate(sorted(run.rglob("*.ckpt"), reverse=True)):  # step=9 newest, last.ckpt oldest
        os.utime(path, (now - age, now - age))
    assert choose_checkpoint(str(run)) == str(run / "checkpoints" / "last.ckpt")
    copy = tmp_path / "copy"
    shutil.copytree(run, copy, copy_function=shutil.copy)  # new, nearly equal times
    for path in copy.rglob("*.ckpt"):
        os.utime(path, (now, now))
    assert choose_checkpoint(str(copy)) == str(copy / "checkpoints" / "last.ckpt")
    (copy / "checkpoints" / "last.ckpt").unlink()
    assert choose_checkpoint(str(copy)) == str(copy / "checkpoints" / "epoch=0-step=12.ckpt")
    for name in ("epoch=0-step=12.ckpt",):
        (copy / "checkpoints" / name).unlink()
    assert choose_checkpoint(str(copy)) == str(copy / "hpc_ckpt_10.ckpt"), "hpc_ckpt_10 beats hpc_ckpt_9"


def test_a_resume_warns_about_each_changed_hyperparameter(tmp_path: Path) -> None:
    """An automatic resume with an edited learning rate names the hyperparameter and the optimizer setting the
    restore keeps (issue 21, item 5), and the run trains with the checkpoint's rate; resumed again, the
    hyperparameters match but the restored rate still is not the config's: only that is said again."""
    import warnings

    from lit_ddp.cli import cli_main
    from tests.helpers import QUIET, REPO

    config = [
        "--config",
        str(REPO / "configs/regression/single_device.yaml"),
        "--trainer.default_root_dir",
        str(tmp_path),
    ]
    cli_main(["fit", *config, *QUIET, "--trainer.max_epochs", "1"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = cli_main(["fit", *config, *QUIET, "--trainer.max_epochs", "2", "--model.init_args.learning_rate", "0.002"])  # fmt: skip
    messages = [str(w.message) for w in caught]
    assert any("written with model.init_args.learning_rate=0.001; the config now says 0.002" in m for m in messages)
    assert any(
        "continue with the checkpoint's settings" in m and "param_groups[0].lr: 0.001 (the config gives 0.002)" in m
        for m in messages
    ), messages
    assert cli is not None and cli.trainer.optimizers[0].param_groups[0]["lr"] == 0.001, "the warning tells the truth"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli_main(["fit", *config, *QUIET, "--trainer.max_epochs", "3", "--model.init_args.learning_rate", "0.002"])
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "written with model.init_args" in m], (
        "the saved hyperparameters are the config's"
    )
    assert [m for m in messages if "(the config gives 0.002)" in m], "the optimizer still runs at the restored rate"


def test_every_resume_warns_when_the_restored_schedule_differs_from_the_config(tmp_path: Path) -> None:
    """A longer ``max_steps`` moves the end of minGPT's cosine (its decay_steps follow the run's length), but the
    restored scheduler keeps the checkpoint's: an explicit ``--ckpt_path`` resume says so, naming the setting
    (issue 21, item 5); a resume with the same settings says nothing."""
    import warnings

    from lit_ddp.cli import cli_main
    from tests.helpers import REPO, TINY_GPT_ARGS

    config = ["--config", str(REPO / "configs/mingpt/cpu.yaml"), *TINY_GPT_ARGS, "--trainer.devices", "1", "--checkpoint.save_top_k", "-1", "--trainer.default_root_dir", str(tmp_path / "a")]  # fmt: skip
    short = ["--trainer.max_steps", "6", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1"]
    cli_main(["fit", *config, *short, "--model.init_args.warmup_steps", "2", "--checkpoint.every_n_train_steps", "2"])
    first = min((tmp_path / "a" / "checkpoints").glob("epoch=*step=*.ckpt"), key=lambda p: int(p.stem.split("=")[-1]))
    other = ["--trainer.default_root_dir", str(tmp_path / "b"), "--ckpt_path", str(first)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli_main(["fit", *config, *short, "--model.init_args.warmup_steps", "2", *other, "--trainer.max_steps", "9"])
    [warning] = [str(w.message) for w in caught if "checkpoint's settings" in str(w.message)]
    assert f"Resuming from {first}" in warning and "_milestones: [2, 6] (the config gives [2, 9])" in warning, warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli_main(["fit", *config, *short, "--model.init_args.warmup_steps", "2", *other[:2], "--ckpt_path", str(first)])  # fmt: skip
    assert not [w for w in caught if "checkpoint's settings" in str(w.message)]


def test_an_explicit_ckpt_path_is_honoured_once_per_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``fit --ckpt_path X`` rolls back once: the checkpoints of later steps than X's are set aside (never deleted), so
    a restart does not jump forward onto the abandoned continuation; a restart of the same job (torchrun's or a
    Slurm requeue's restart count) resumes from what the job saved since X, or from X while it saved nothing
    (issue 21, item 5)."""
    from lit_ddp.cli import cli_main
    from lit_ddp.resilience.resume import restart_count
    from lit_ddp.run_dir.checkpoints import checkpoint_step
    from tests.helpers import QUIET, REPO

    run = tmp_path / "run"
    config = ["--config", str(REPO / "configs/regression/single_device.yaml"), "--trainer.default_root_dir", str(run), "--checkpoint.every_n_epochs", "1", *QUIET]  # fmt: skip
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    cli_main(["fit", *config, "--trainer.max_epochs", "3"])
    ckpts = run / "checkpoints"
    [first, second, third] = sorted(ckpts.glob("epoch=*.ckpt"))
    old_last_step = checkpoint_step(str(ckpts / "last.ckpt"))

    with pytest.warns(UserWarning, match=r"abandoned continuation and are moved to .*set_aside"):
        cli_main(["fit", *config, "--trainer.max_epochs", "2", "--ckpt_path", str(first)])
    [aside] = (run / "set_aside").iterdir()
    assert {p.name for p in aside.iterdir()} == {second.name, third.name, "last.ckpt"}
    assert checkpoint_step(str(aside / "last.ckpt")) == old_last_step
    assert checkpoint_step(str(ckpts / "last.ckpt")) == checkpoint_step(str(second))  # the new continuation
    caplog.set_level(logging.INFO)
    caplog.clear()

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the same command, restarted by the launcher
    assert restart_count() == 1
    cli_main(["fit", *config, "--trainer.max_epochs", "3", "--ckpt_path", str(first)])
    assert f"Resuming from {ckpts / 'last.ckpt'}" in caplog.text
    assert len(list((run / "set_aside").iterdir())) == 1, "a restart sets nothing aside"

    fresh = tmp_path / "fresh"  # a restart before the job saved anything: X again
    cli_main(["fit", *config, "--trainer.default_root_dir", str(fresh), "--trainer.max_epochs", "2", "--ckpt_path", str(first)])  # fmt: skip
    assert f"Resuming from {first}" in caplog.text
    # Lightning's names are Lightning's choice, not a file to roll back to
    caplog.clear()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    cli_main(["fit", *config, "--trainer.max_epochs", "4", "--ckpt_path", "last"])
    assert "set_aside" not in caplog.text and len(list((run / "set_aside").iterdir())) == 1
    # a rollback to the newest step, spelled another way: nothing is later, so nothing (not X itself, not the
    # last.ckpt of its step) is set aside, and the run resumes from it
    [newest] = [
        p for p in ckpts.glob("epoch=*.ckpt") if checkpoint_step(str(p)) == checkpoint_step(str(ckpts / "last.ckpt"))
    ]
    respelled = run / "checkpoints" / ".." / "checkpoints" / newest.name
    cli_main(["fit", *config, "--trainer.max_epochs", "4", "--ckpt_path", str(respelled)])
    assert newest.exists() and (ckpts / "last.ckpt").exists() and len(list((run / "set_aside").iterdir())) == 1
