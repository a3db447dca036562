"""Slurm: the real local cluster (``slurm/local_cluster.sh``): srun, sbatch, preemption with requeue and resume.
(train_elastic.sbatch under faults: ``test_slurm_multinode.py``, through ``lit-ddp chaos``; the launch checks
against fake environments, no cluster needed: ``tests/unit/launch/``; the sbatch scripts' text:
``tests/unit/test_slurm_scripts.py``.)

Tests marked ``slurm`` skip when no cluster answers, and fail instead when ``CI=true``.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from lit_ddp.launch.reporting import USAGE_EXIT_CODE
from tests.callbacks import RecordStart
from tests.helpers import QUIET, SRUN_CONFIGS, callback, compose, lit_ddp, recorder_config
from tests.system.helpers_slurm import cancel, require_cluster, run_srun, sbatch, wait_job_done

# What slurm/train.sbatch is given (it composes configs/trainer/ddp.yaml and configs/trainer/slurm.yaml
# before it); srun by hand composes the same (tests.helpers.SRUN_CONFIGS).
CONFIG = "configs/regression/slurm.yaml"
EPOCHS = 3
STEPS_PER_EPOCH = 28  # 1792 train samples / (32 per device * 2 devices)

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
def test_sbatch_trains_mingpt(cluster, tmp_path: Path) -> None:
    """The same sbatch script runs the other task: the README's minGPT row (cpu.yaml, then slurm.yaml), a few
    steps, on the packaged Tiny Shakespeare."""
    out = tmp_path / "job.out"
    cb, record_dir = callbacks_yaml(tmp_path)
    args = ["configs/mingpt/cpu.yaml", "--config", "configs/mingpt/slurm.yaml", "--config", str(cb)]
    args += ["--trainer.default_root_dir", str(tmp_path / "run")]
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


@pytest.mark.slurm
@pytest.mark.multiprocess
def test_array_tasks_of_one_config_train_in_their_own_run_directories(cluster, tmp_path: Path) -> None:
    """A 2-task array job of one config (its trainer.default_root_dir from a config file, as a sweep's): each
    task trains from step 0 in ``<root>/<array job>_<task>`` (issue 26, item 4); with one shared directory
    the second would resume the first's checkpoints or be refused by the run-directory lock."""
    import yaml

    root = tmp_path / "runs"
    root_config = tmp_path / "root.yaml"
    root_config.write_text(yaml.safe_dump({"trainer": {"default_root_dir": str(root)}}))
    args = [CONFIG, "--config", str(root_config), "--trainer.max_epochs", "1", *QUIET]
    opts = ["-J", unique("array"), "-o", str(tmp_path / "task-%a.out"), "-N1", "--ntasks-per-node=2", "--array", "0-1"]
    job = None
    try:
        job = sbatch("slurm/train.sbatch", args, opts)
        final = {task: wait_job_done(f"{job}_{task}", 300, tmp_path / f"task-{task}.out") for task in (0, 1)}
    finally:
        cancel(job)
    assert sorted(p.name for p in root.iterdir()) == [f"{job}_0", f"{job}_1"]
    for task, info in final.items():
        log = (tmp_path / f"task-{task}.out").read_text()
        assert info["JobState"] == "COMPLETED", log[-5000:]
        assert f"Run directory: {root / f'{job}_{task}'}" in log and "Resum" not in log, log[-5000:]
        last = torch.load(root / f"{job}_{task}" / "checkpoints" / "last.ckpt", weights_only=False)
        assert last["global_step"] == STEPS_PER_EPOCH


@pytest.mark.slurm
@pytest.mark.multiprocess
@pytest.mark.parametrize("script, cpus, bind", [("train", 2, None), ("train", 1, "cores"), ("train_elastic", 4, None)])
def test_sbatch_threads_follow_cpus_per_task(cluster, tmp_path: Path, script: str, cpus: int, bind: str | None) -> None:
    """``sbatch --cpus-per-task C``: both scripts pass it on to srun (22.05's srun does not take it from the
    allocation) and each task's torch threads follow it, where Lightning would split this 2-core machine's
    cores between the node's 2 tasks, and torchrun would give each worker 1 thread (issue 26, item 5). The
    local cluster binds (task/affinity): its default binds each task to the socket (both cores here),
    ``SLURM_CPU_BIND=cores`` each task to one core of its own, and the preflight does not mistake 2 tasks of 1
    core for 2 devices on 1 core. train_elastic.sbatch's task holds the node's 2 workers: each gets C / 2 threads
    (the local nodes advertise 8 CPUs on this machine's 2 cores: 4 are 2 in the binding)."""
    out = tmp_path / "job.out"
    cb, record_dir = callbacks_yaml(tmp_path)
    args = [CONFIG, "--config", str(cb), "--trainer.default_root_dir", str(tmp_path / "run")]
    args += ["--trainer.max_epochs", "1", *QUIET]
    opts = ["-J", unique("cpus"), "-o", str(out), "-N1", "--cpus-per-task", str(cpus)]
    env = {"SLURM_CPU_BIND": bind} if bind else {}
    if script == "train_elastic":  # a step config without SLURMEnvironment; one agent, two workers
        args = ["configs/regression/torchrun.yaml", *compose("trainer/ddp"), *args[1:]]
        env |= {"NPROC_PER_NODE": "2", "RDZV_PORT": str(find_free_network_port())}
    else:
        opts.append("--ntasks-per-node=2")
    job = None
    try:
        job = sbatch(f"slurm/{script}.sbatch", args, opts, **env)
        info = wait_job_done(job, timeout=240, output=out)
    finally:
        cancel(job)
    assert info["JobState"] == "COMPLETED", out.read_text()[-5000:]
    records = starts(record_dir)
    assert len(records) == 2, records
    threads = cpus // 2 if script == "train_elastic" else cpus
    for record in records.values():
        assert (record["cpus_per_task"], record["num_threads"]) == (str(cpus), threads), record
        assert len(record["cpus"]) == min(cpus, 2), record  # torch caps threads at the CPUs it may use
    if bind == "cores":  # a core each, not the same one
        assert sorted(cpu for record in records.values() for cpu in record["cpus"]) == [0, 1], records
