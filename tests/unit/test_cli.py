"""lit_ddp.cli: the one CLI class writes checkpoints atomically by default (:class:`AtomicCheckpointIO`) and keeps a
``CheckpointIO`` that ``trainer.plugins`` names; it places, holds and resumes the run directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_ddp.cli import cli_main
from lit_ddp.resilience.checkpoint_io import AsyncAtomicCheckpointIO, AtomicCheckpointIO
from tests.helpers import QUIET, REPO


def trainer_of(*args: str):
    cli = cli_main(["fit", *args, *QUIET, "--trainer.max_epochs", "0"])
    return cli.trainer


@pytest.mark.parametrize(
    "config",
    ["configs/regression/single_device.yaml", "configs/mingpt/cpu.yaml"],
)
def test_atomic_checkpoint_io_is_the_default(config: str, tmp_path: Path) -> None:
    one = ["--trainer.devices", "1"]  # in-process: a DDP strategy would relaunch pytest as rank 1
    trainer = trainer_of("--config", str(REPO / config), *one, "--trainer.default_root_dir", str(tmp_path))
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO


def test_another_checkpoint_io_is_kept(tmp_path: Path) -> None:
    trainer = trainer_of(
        "--config", str(REPO / "configs/regression/single_device.yaml"),
        "--trainer.plugins", "lit_ddp.resilience.checkpoint_io.AsyncAtomicCheckpointIO",
        "--trainer.default_root_dir", str(tmp_path),
    )  # fmt: skip
    assert type(trainer.strategy.checkpoint_io) is AsyncAtomicCheckpointIO


@pytest.mark.parametrize(
    ("args", "steps", "epochs"),
    [
        ([], 0, 1),  # no trigger: every epoch, as ModelCheckpoint does by default
        (["--checkpoint.every_n_train_steps", "50"], 50, 0),  # a trigger given alone is the only one
        (["--checkpoint.every_n_epochs", "2"], 0, 2),
    ],
)
def test_a_checkpoint_trigger_given_alone_is_the_only_one(
    tmp_path: Path, args: list[str], steps: int, epochs: int
) -> None:
    config = ["--config", str(REPO / "configs/mingpt/cpu.yaml"), "--trainer.devices", "1"]
    trainer = trainer_of(*config, *args, "--trainer.default_root_dir", str(tmp_path))
    ckpt = trainer.checkpoint_callback
    assert (ckpt.every_n_train_steps, ckpt.every_n_epochs) == (steps, epochs)


def test_fit_holds_the_run_directory(tmp_path: Path) -> None:
    from lit_ddp.run_dir.lock import HOLDER_FILE

    trainer_of(
        "--config", str(REPO / "configs/regression/single_device.yaml"), "--trainer.default_root_dir", str(tmp_path)
    )
    assert str(__import__("os").getpid()) in (tmp_path / HOLDER_FILE).read_text()


def test_validate_and_test_evaluate_the_run_directory(tmp_path: Path) -> None:
    """Without --ckpt_path, validate and test score the run directory's newest checkpoint, as fit resumes it;
    with none there, a warning says the untrained model is scored (issue 21, item 2)."""
    config = [
        "--config",
        str(REPO / "configs/regression/single_device.yaml"),
        "--trainer.default_root_dir",
        str(tmp_path),
    ]
    with pytest.warns(UserWarning, match="No checkpoint in .*: evaluating the untrained model"):
        untrained = cli_main(["validate", *config, *QUIET])
    assert untrained is not None
    fit = cli_main(["fit", *config, *QUIET, "--trainer.max_epochs", "2"])
    assert fit is not None
    fitted = float(fit.trainer.callback_metrics["val/loss"])
    for subcommand, key in (("validate", "val/loss"), ("test", "test/loss")):
        cli = cli_main([subcommand, *config, *QUIET])
        assert cli is not None and float(cli.trainer.callback_metrics[key]) == fitted
    assert float(untrained.trainer.callback_metrics["val/loss"]) != fitted


def test_configs_without_a_run_directory_get_their_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two configs that set no ``trainer.default_root_dir`` train in two directories named after them (one shared
    ``runs/default`` made each resume the other's checkpoints: issue 21, item 5); the same command finds its run
    again; a fragment composed after the step config does not rename it."""
    import yaml

    from lit_ddp.run_dir.layout import default_run_directory

    monkeypatch.chdir(tmp_path)
    step = yaml.safe_load((REPO / "configs/regression/single_device.yaml").read_text())
    del step["trainer"]["default_root_dir"]
    (tmp_path / "experiments").mkdir()
    for name in ("a", "b"):
        (tmp_path / "experiments" / f"{name}.yaml").write_text(yaml.safe_dump(step))
    fragment = tmp_path / "fragment.yaml"
    fragment.write_text(yaml.safe_dump({"trainer": {"max_epochs": 1}}))
    for name in ("a", "b"):
        trainer = trainer_of("--config", f"experiments/{name}.yaml", "--config", str(fragment))
        assert trainer.default_root_dir == f"runs/experiments/{name}"
        assert trainer.checkpoint_callback.dirpath == str((tmp_path / f"runs/experiments/{name}/checkpoints").resolve())
    assert cli_main(["fit", "--config", "experiments/a.yaml", *QUIET, "--trainer.max_epochs", "1"]) is not None
    assert list((tmp_path / "runs/experiments/a/checkpoints").glob("*.ckpt"))
    assert not (tmp_path / "runs/experiments/b/checkpoints").exists(), "b does not see a's checkpoints"
    assert default_run_directory([], "lit_ddp.tasks.mingpt.GPTModule") == "runs/gptmodule"
    assert default_run_directory([], None) == "runs/default"
    assert default_run_directory([Path("step.yaml")], None) == "runs/step"


def test_a_run_id_gives_each_job_its_own_run_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LIT_DDP_RUN_ID`` (slurm/train.sbatch: the job id, or an array task's ``<array job>_<task>``) puts a
    run in ``<config's root>/<id>``; ``--trainer.default_root_dir`` on the command line is taken as given."""
    import yaml

    config = tmp_path / "root.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"default_root_dir": str(tmp_path / "runs")}}))
    step = ["--config", str(REPO / "configs/regression/single_device.yaml"), "--config", str(config)]
    monkeypatch.setenv("LIT_DDP_RUN_ID", "4242_1")
    trainer = trainer_of(*step)
    assert trainer.default_root_dir == str(tmp_path / "runs" / "4242_1")
    assert trainer.checkpoint_callback.dirpath == str(tmp_path / "runs" / "4242_1" / "checkpoints")
    for given in (
        ["--trainer.default_root_dir", str(tmp_path / "mine")],
        [f"--trainer.default_root_dir={tmp_path / 'mine'}"],
    ):
        assert trainer_of(*step, *given).default_root_dir == str(tmp_path / "mine")
