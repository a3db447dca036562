"""Slurm: the launch checks (no cluster needed), then the real local cluster (``slurm/local_cluster.sh``):
srun, sbatch, preemption with requeue and resume, and torchrun's elastic restarts under sbatch.

Tests marked ``slurm`` skip when no cluster answers, and fail instead when ``CI=true``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid
from functools import partial
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.fabric.utilities.rank_zero import rank_zero_only

from lit_ddp.cli import cli_main
from lit_ddp.launch.environment import devices_per_node, follow_torchrun
from lit_ddp.launch.errors import UsageError
from lit_ddp.launch.preflight import check_launch
from lit_ddp.launch.reporting import USAGE_EXIT_CODE, report
from tests.callbacks import KillAtEpochStart, RecordStart
from tests.helpers import QUIET, REPO, callback, compose, lit_ddp, recorder_config
from tests.helpers_slurm import cancel, require_cluster, run_srun, sbatch, wait_job_done

# What slurm/train.sbatch is given (it composes configs/trainer/ddp.yaml and configs/trainer/slurm.yaml
# before it), and the same composition for srun by hand.
CONFIG = "configs/regression/slurm.yaml"
SRUN_CONFIGS = compose("trainer/ddp", "trainer/slurm", "regression/slurm")
EPOCHS = 3
STEPS_PER_EPOCH = 28  # 1792 train samples / (32 per device * 2 devices)
SLURM_PLUGIN = [{"class_path": "lightning.pytorch.plugins.environments.SLURMEnvironment"}]

# ---------------------------------------------------------------------------------------------------------
# Launch checks against fake environments (fast, no cluster)
# ---------------------------------------------------------------------------------------------------------

SRUN_2 = {  # srun -J train -N1 --ntasks-per-node=2, task 0
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "train",
    "SLURM_STEP_ID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_NNODES": "1",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_PROCID": "0",
}


def without(env: dict[str, str], *keys: str) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in keys}


GOOD = {
    "no Slurm, no plugin": ({}, {"devices": 2}),
    "srun, plugin": (SRUN_2, {"devices": 2, "num_nodes": 1, "plugins": SLURM_PLUGIN}),
    "srun, detected": (SRUN_2, {"devices": "2", "num_nodes": 1}),
    "srun, devices auto": (SRUN_2, {"devices": "auto", "plugins": SLURM_PLUGIN}),
    "torchrun in a job": (
        {**without(SRUN_2, "SLURM_NTASKS_PER_NODE"), "SLURM_NTASKS": "1", "TORCHELASTIC_RUN_ID": "7"},
        {"devices": 2},
    ),
    "interactive shell, one task": (
        {**SRUN_2, "SLURM_JOB_NAME": "bash", "SLURM_NTASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1"},
        {"devices": 2},
    ),
    "batch script, one task": (
        without(
            {**SRUN_2, "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1"}, "SLURM_STEP_ID", "SLURM_STEP_TASKS_PER_NODE"
        ),
        {"devices": 1},
    ),
}

BAD = {
    "srun -n 2": (
        without({**SRUN_2}, "SLURM_NTASKS_PER_NODE"),
        {"devices": 2, "plugins": SLURM_PLUGIN},
        r"--ntasks=2 .*`--nodes 1 --ntasks-per-node=2` instead of `-n 2`",
    ),
    "ntasks-per-node 1, devices 2": (
        {**SRUN_2, "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_STEP_TASKS_PER_NODE": "1"},
        {"devices": 2, "plugins": SLURM_PLUGIN},
        r"--ntasks-per-node=1\) but trainer.devices=2.*--ntasks-per-node=2 or pass --trainer.devices 1",
    ),
    "detected, devices list": (
        SRUN_2,
        {"devices": [0, 1, 2]},
        r"--ntasks-per-node=2\) but trainer.devices=\[0, 1, 2\]",
    ),
    "nodes 1, num_nodes 2": (
        SRUN_2,
        {"devices": 2, "num_nodes": 2, "plugins": SLURM_PLUGIN},
        r"--nodes=1\) but trainer.num_nodes=2.*--nodes=2 or pass --trainer.num_nodes 1",
    ),
    "srun bash -c": (
        {**SRUN_2, "SLURM_JOB_NAME": "bash"},
        {"devices": 2},
        r"runs 2 tasks but the job is named 'bash'.*srun -J",
    ),
    "batch script without srun": (
        without(SRUN_2, "SLURM_STEP_ID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NUM_NODES"),
        {"devices": 2, "plugins": SLURM_PLUGIN},
        r"SLURM_NTASKS=2, not an srun step.*Prepend srun",
    ),
    "plugin outside Slurm": ({}, {"devices": 2, "plugins": SLURM_PLUGIN}, r"not a Slurm job.*sbatch slurm/train"),
    "plugin under torchrun": (
        {"TORCHELASTIC_RUN_ID": "7"},
        {"devices": 2, "plugins": SLURM_PLUGIN},
        r"started by torchrun.*SLURMEnvironment",
    ),
}


@pytest.mark.parametrize("env,trainer", GOOD.values(), ids=GOOD.keys())
def test_good_launches_pass(env: dict, trainer: dict) -> None:
    check_launch(trainer, env)


@pytest.mark.parametrize("env,trainer,match", BAD.values(), ids=BAD.keys())
def test_bad_launches_name_the_fix(env: dict, trainer: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        check_launch(trainer, env)


def test_devices_per_node() -> None:
    assert [devices_per_node(d) for d in (2, "2", [0, 1], "0,1,", "auto", -1, None)] == [2, 2, 2, 2, None, None, None]


def test_trainer_layout_follows_torchrun() -> None:
    torchrun_1 = {"TORCHELASTIC_RUN_ID": "7", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2"}
    trainer = {"devices": 2, "num_nodes": 1}
    assert follow_torchrun(trainer, torchrun_1) == (
        "torchrun started 1 process(es) per node on 2 node(s): trainer.devices=2 -> 1, trainer.num_nodes=1 -> 2"
    )
    assert trainer == {"devices": 1, "num_nodes": 2}
    assert follow_torchrun(trainer, torchrun_1) is None  # already matching
    assert follow_torchrun({"devices": 2}, {"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "1"}) is None  # no torchrun
    auto = {"devices": "auto", "num_nodes": 1}
    follow_torchrun(auto, {**torchrun_1, "LOCAL_WORLD_SIZE": "2"})
    assert auto == {"devices": 2, "num_nodes": 1}


def test_report_prints_once_and_exits(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    env = without(SRUN_2, "SLURM_NTASKS_PER_NODE")
    for rank in (0, 1):
        monkeypatch.setattr(rank_zero_only, "rank", rank)  # as Lightning sets it from SLURM_PROCID in each task
        with pytest.raises(SystemExit) as exc:
            report(partial(check_launch, {"devices": 2}, {**env, "SLURM_PROCID": str(rank)}))
        assert exc.value.code == USAGE_EXIT_CODE
    err = capsys.readouterr().err
    assert err.count("lit-ddp: error:") == 1, err  # task 0 only


def test_cli_refuses_slurm_config_outside_slurm(monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path) -> None:
    for key in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(key)
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", *SRUN_CONFIGS, "--trainer.default_root_dir", str(tmp_path), *QUIET])
    assert exc.value.code == USAGE_EXIT_CODE
    assert "not a Slurm job" in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing was started"


def test_sbatch_scripts_as_the_issue_asks() -> None:
    for name in ("local_cluster.sh", "train.sbatch", "train_elastic.sbatch"):
        subprocess.run(["bash", "-n", str(REPO / "slurm" / name)], check=True, timeout=30)
    train = (REPO / "slurm" / "train.sbatch").read_text()
    elastic = (REPO / "slurm" / "train_elastic.sbatch").read_text()
    for line in ("#SBATCH --signal=SIGUSR1@90", "#SBATCH --requeue", "#SBATCH --open-mode=append"):
        assert line in train
    # srun python -m lit_ddp fit, the fragments (configs/trainer/*.yaml) composed before CONFIG
    assert re.search(r"srun .*\"\$PYTHON\" -m lit_ddp fit[\s\\]+(--config \S+\s+)*--config \"\$CONFIG\"", train)
    assert re.search(r"torchrun.*--nnodes \"\$SLURM_NNODES\" --nproc_per_node \"\$NPROC\"", elastic)
    assert "--max-restarts" in elastic and "--rdzv_backend c10d" in elastic and ":${RDZV_PORT:-29500}" in elastic
    for text in (train, elastic):  # site details belong on the sbatch command line
        assert not re.search(r"^#SBATCH +(--partition|-p |--account|-A )", text, re.M)


# ---------------------------------------------------------------------------------------------------------
# The real local cluster
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> None:
    require_cluster()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def callbacks_yaml(directory: Path, *extra: tuple[str, dict]) -> tuple[Path, Path]:
    """RecordRun and RecordStart into one record directory, plus ``extra``: (fragment, record directory)."""
    record_dir = directory / "callbacks" / "rec"
    return recorder_config(directory, "callbacks", callback(RecordStart, out_dir=str(record_dir)), *extra)


def starts(record_dir: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(record_dir.glob("start_*.json"))}


@pytest.mark.slurm
@pytest.mark.multiprocess
def test_srun_trains_with_slurm_environment(cluster, tmp_path: Path) -> None:
    name = unique("t")
    cb, record_dir = callbacks_yaml(tmp_path)
    cmd = ["srun", "-J", name, "-N1", "--ntasks-per-node=2", *lit_ddp("fit")]
    cmd += [*SRUN_CONFIGS, "--config", str(cb), "--trainer.default_root_dir", str(tmp_path / "run")]
    result = run_srun([*cmd, "--trainer.max_epochs", "1", *QUIET], timeout=180, job_name=name)
    assert result.returncode == 0, result.stdout[-5000:]
    for rank in (0, 1):
        record = torch.load(record_dir / f"rank{rank}.pt", weights_only=False)
        assert record["world_size"] == 2
        assert record["global_rank"] == rank
        assert record["cluster_environment"] == "SLURMEnvironment"
        assert record["global_step"] == STEPS_PER_EPOCH
    assert "SLURM auto-requeueing enabled" in result.stdout


MISLAUNCHES = {
    "srun -n 2": (["-n", "2"], [], "without --ntasks-per-node", "--ntasks-per-node=2"),
    "ntasks-per-node 1 != devices 2": (["-N1", "--ntasks-per-node=1"], [], "trainer.devices=2", "--ntasks-per-node=2"),
    "nodes 1 != num_nodes 2": (
        ["-N1", "--ntasks-per-node=2"],
        ["--trainer.num_nodes", "2"],
        "trainer.num_nodes=2",
        "--trainer.num_nodes 1",
    ),
    "srun bash -c": (["-N1", "--ntasks-per-node=2"], "bash", "job is named 'bash'", "srun -J"),
}


@pytest.mark.slurm
@pytest.mark.parametrize("srun_args,extra,bad,fix", MISLAUNCHES.values(), ids=MISLAUNCHES.keys())
def test_mislaunch_fails_fast_with_one_message(cluster, tmp_path: Path, srun_args, extra, bad, fix) -> None:
    name = unique("mis")
    lit = lit_ddp("fit", *SRUN_CONFIGS, "--trainer.default_root_dir", str(tmp_path))
    if extra == "bash":  # the job takes its name from the program: "bash", i.e. interactive for Lightning
        cmd = ["srun", *srun_args, "bash", "-c", " ".join([*lit, *QUIET])]
    else:
        cmd = ["srun", "-J", name, *srun_args, *lit, *extra, *QUIET]
    result = run_srun(cmd, timeout=120, job_name="bash" if extra == "bash" else name)
    assert result.returncode == USAGE_EXIT_CODE, result.stdout[-5000:]
    errors = [line for line in result.stdout.splitlines() if "lit-ddp: error:" in line]
    assert len(errors) == 1, result.stdout[-5000:]
    assert bad in errors[0] and fix in errors[0], errors[0]
    assert "Traceback" not in result.stdout


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, Path]:
    """An sbatch job of slurm/train.sbatch run to the end: (final job info, its output file, record dir)."""
    tmp = tmp_path_factory.mktemp("sbatch_reference")
    cb, record_dir = callbacks_yaml(tmp)
    out = tmp / "job.out"
    args = [CONFIG, "--config", str(cb), "--trainer.default_root_dir", str(tmp / "run")]
    args += ["--trainer.max_epochs", str(EPOCHS), *QUIET]
    job = None
    try:
        job = sbatch("slurm/train.sbatch", args, ["-J", unique("ref"), "-o", str(out), "-N1", "--ntasks-per-node=2"])
        info = wait_job_done(job, timeout=240, output=out)
    finally:
        cancel(job)
    return info, out, record_dir


@pytest.mark.slurm
@pytest.mark.multiprocess
def test_sbatch_completes_with_training_log(uninterrupted) -> None:
    info, out, record_dir = uninterrupted
    log = out.read_text()
    assert info["JobState"] == "COMPLETED", log[-5000:]
    assert info["Restarts"] == "0"
    assert "[train.sbatch] job" in log and "SLURM auto-requeueing enabled" in log
    assert f"`Trainer.fit` stopped: `max_epochs={EPOCHS}` reached." in log
    record = torch.load(record_dir / "rank0.pt", weights_only=False)
    assert (record["world_size"], record["cluster_environment"]) == (2, "SLURMEnvironment")
    assert record["global_step"] == EPOCHS * STEPS_PER_EPOCH


@pytest.mark.slurm
@pytest.mark.multiprocess
def test_elastic_sbatch_survives_a_killed_worker(cluster, tmp_path: Path) -> None:
    root, out = tmp_path / "run", tmp_path / "job.out"
    kill = callback(KillAtEpochStart, epoch=1, rank=1, marker=str(tmp_path / "killed"))
    cb, record_dir = callbacks_yaml(tmp_path, kill)
    # CONFIG is the step config; the DDP fragment (strategy only) composed after it changes no layout.
    args = ["configs/regression/torchrun.yaml", *compose("trainer/ddp"), "--config", str(cb)]
    args += ["--trainer.default_root_dir", str(root)]
    args += ["--trainer.max_epochs", str(EPOCHS), "--checkpoint.every_n_epochs", "1", *QUIET]
    job = None
    try:
        job = sbatch(
            "slurm/train_elastic.sbatch",
            args,
            ["-J", unique("elastic"), "-o", str(out), "-N1"],
            NPROC_PER_NODE="2",
            MAX_RESTARTS="2",
            RDZV_PORT=str(find_free_network_port()),
        )
        info = wait_job_done(job, timeout=300, output=out)
    finally:
        cancel(job)
    log = out.read_text()
    assert info["JobState"] == "COMPLETED", log[-5000:]
    assert (tmp_path / "killed").exists(), "the worker was killed"
    runs = starts(record_dir)
    for rank in (0, 1):
        first, second = runs[f"start_r0_t0_rank{rank}"], runs[f"start_r0_t1_rank{rank}"]
        assert first["global_step"] == 0 and first["cluster_environment"] == "TorchElasticEnvironment"
        assert second["global_step"] == STEPS_PER_EPOCH, "restarted workers resume from epoch 1's checkpoint"
        assert second["world_size"] == 2
    record = torch.load(record_dir / "rank0.pt", weights_only=False)
    assert record["global_step"] == EPOCHS * STEPS_PER_EPOCH


@pytest.mark.slurm
@pytest.mark.multiprocess
def test_sbatch_trains_mingpt(cluster, tmp_path: Path) -> None:
    """The same sbatch script runs the other task: minGPT with configs/mingpt/slurm.yaml, a few steps, on the
    packaged Tiny Shakespeare."""
    out = tmp_path / "job.out"
    cb, record_dir = callbacks_yaml(tmp_path)
    args = ["configs/mingpt/slurm.yaml", "--config", str(cb), "--trainer.default_root_dir", str(tmp_path / "run")]
    args += ["--data.init_args.truncate", "0.1"]
    args += ["--trainer.max_steps", "5", "--trainer.limit_val_batches", "2", *QUIET]
    job = None
    try:
        job = sbatch("slurm/train.sbatch", args, ["-J", unique("gpt"), "-o", str(out), "-N1", "--ntasks-per-node=2"])
        info = wait_job_done(job, timeout=240, output=out)
    finally:
        cancel(job)
    assert info["JobState"] == "COMPLETED", out.read_text()[-5000:]
    record = torch.load(record_dir / "rank1.pt", weights_only=False)
    assert (record["world_size"], record["cluster_environment"], record["global_step"]) == (2, "SLURMEnvironment", 5)
