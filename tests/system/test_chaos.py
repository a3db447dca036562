"""``lit-ddp chaos`` (issue 23): faults from outside at moments drawn from a seed, and the
verdict of a bit-for-bit comparison with an uninterrupted run; it also catches a run that does not resume
exactly. The project's torchrun and Slurm restart tests go through it: here the regression with every kind, two
agents and Slurm preemptions; minGPT (Muon + AdamW) with kills of a worker and of a checkpoint's writer under
FSDP2, and with USR1 and a lost node on two Slurm nodes, in ``tests/system/test_fsdp.py``; random SIGKILLs of
a minGPT worker under DDP per checkpoint trigger in ``tests/system/test_checkpoint_triggers.py``. Its bad uses:
``tests/unit/chaos/test_chaos.py``."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.callbacks import ForgetLoaderPosition, GradientNoise, NudgeBeforeTheCheck, NudgeOnResume, ReseedOnResume
from tests.helpers import TINY_GPT_ARGS, Runner, callback, compose, lit_ddp, noise_lines, write_callbacks_config

# 80 epochs of 28 steps on 2 processes (about 20 s here), a checkpoint every 50 steps.
REGRESSION = [
    *compose("trainer/ddp", "checkpoint/fault_tolerant", "checkpoint/exact", "regression/fault_tolerant"),
    "--trainer.max_epochs",
    "80",
]


def fault_table(stdout: str) -> list[list[str]]:
    """The rows of chaos's fault table: number, kind, target..., at s, at step, checkpoint, resumed from, redone,
    lost s."""
    lines = stdout.split("lost s")[1].splitlines()[1:]
    return [line.split() for line in lines if line.strip() and line.split()[0].isdigit()]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_chaos_under_torchrun_finds_the_run_exact(tmp_path: Path, runner: Runner, seed: int) -> None:
    """Six faults, one of each kind torchrun takes, in an order and at moments drawn from the seed: a worker
    SIGKILLed, the job SIGTERMed (relaunched), a worker frozen (the collective timeout, 20 s, then torchrun's
    30 s), the agent and its workers SIGKILLed at once (relaunched), the writer of a checkpoint SIGKILLed the
    moment its temporary file appears, a worker SIGKILLed while a validation runs. The tool exits 0 with a line
    per fault, each naming the step the job resumed from, no earlier than the checkpoint before the fault, and
    the verdict; the SIGTERMed job stopped at a step boundary and its relaunch resumed from that save, with no
    other library's hints in the log."""
    cmd = lit_ddp("chaos", "--launcher", "torchrun", "--nproc_per_node", "2", "--faults", "6", "--kinds", "kill",
                  "term", "hang", "node", "save", "validation", "--seed", str(seed), "--root", str(tmp_path), "--",
                  *REGRESSION)  # fmt: skip
    result = runner.run(cmd, timeout=540)
    assert result.returncode == 0, result.stdout[-6000:] + (tmp_path / "faulted.log").read_text()[-6000:]
    assert f"seed {seed}" in result.stdout and "identical: the faulted run ends bit for bit" in result.stdout
    rows = fault_table(result.stdout)
    assert sorted(row[1] for row in rows) == ["hang", "kill", "node", "save", "term", "validation"], result.stdout[
        -3000:
    ]
    for row in rows:  # ... at step, checkpoint before, resumed from, steps redone, seconds lost
        hit, before, resumed, redone = (int(x) for x in row[-5:-1])
        assert resumed >= before and hit >= before and redone == max(0, hit - resumed), row
        assert row[1] == "term" or float(row[-1]) > 0, row  # a preemption may save past the step it hit
    assert "the faults cost" in result.stdout
    assert re.search(r"^restore check: passed at (\d+) of \1 resumes \(", result.stdout, re.M), result.stdout[-3000:]
    # the SIGTERMed job: saved at a step boundary, failed, and its relaunch resumed from that preemption save
    log = (tmp_path / "faulted.log").read_text()
    assert "stopped by SIGTERM at a step boundary" in log, log[-5000:]
    assert re.search(r"Resuming from \S*hpc_ckpt_\d+\.ckpt", log), log[-5000:]
    assert not noise_lines(log), noise_lines(log)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_chaos_with_two_torchrun_agents_survives_a_lost_node(tmp_path: Path, runner: Runner, seed: int) -> None:
    """``--nnodes 2``: two agents of one process each meet in the tool's rendezvous store. A node fault SIGKILLs
    one agent with its worker; the other agent restarts its worker and waits, and a replacement agent joins
    (the job's own second restart, not a relaunch); a worker SIGKILLed; both in an order drawn from the seed:
    bit-identical, the table naming the agent."""
    fit = [*compose("trainer/ddp", "regression/multinode", "checkpoint/fault_tolerant"), "--trainer.max_epochs", "60"]
    cmd = lit_ddp("chaos", "--launcher", "torchrun", "--nnodes", "2", "--nproc_per_node", "1", "--faults", "2",
                  "--kinds", "node", "kill", "--seed", str(seed), "--root", str(tmp_path), "--", *fit)  # fmt: skip
    result = runner.run(cmd, timeout=360)
    log = (tmp_path / "faulted.log").read_text()
    assert result.returncode == 0, result.stdout[-6000:] + log[-6000:]
    assert "identical: the faulted run ends bit for bit" in result.stdout
    [node] = [row for row in fault_table(result.stdout) if row[1] == "node"]
    assert node[2] == "agent" and node[4] == "+", node  # agent K + 1 workers
    assert "restart 2 of this job" in log and log.count("Starting with 2 processes") == 3, log[-3000:]


def survives_usr1_and_a_lost_node(fit: list[str], root: Path, runner: Runner, seed: int) -> str:
    """``lit-ddp chaos --launcher slurm`` of ``fit`` (slurm/train.sbatch's step config first) on the two-node local
    cluster, one task per node, with a USR1 warning and a lost node in an order drawn from ``seed``; asserts it
    requeued, ends bit-identical and exits 0. Returns the faulted jobs' output."""
    from tests.system.helpers_slurm import require_cluster, slurm_env

    require_cluster(nodes=2)
    cmd = lit_ddp("chaos", "--launcher", "slurm", "--nodes", "2", "--nproc_per_node", "1", "--faults", "2",
                  "--kinds", "usr1", "node", "--seed", str(seed), "--root", str(root), "--", *fit)  # fmt: skip
    result = runner.run(cmd, timeout=540, **{k: v for k, v in slurm_env().items() if k.startswith("LIT_DDP")})
    outputs = "".join(p.read_text() for p in sorted(root.glob("faulted-*.out")))
    assert result.returncode == 0, result.stdout[-4000:] + outputs[-4000:]
    assert sorted(row[1] for row in fault_table(result.stdout)) == ["node", "usr1"], result.stdout[-3000:]
    assert "requeueing" in outputs and "identical: the faulted run ends bit for bit" in result.stdout
    return outputs


def unkind_cluster(tmp: Path) -> dict[str, str]:
    """The environment of jobs on a cluster less kind than the local one: a controller that takes 5 s to answer
    ``scontrol`` inside a job (first on the batch script's PATH; chaos's own calls, outside any job, stay quick),
    and steps that run as in a container without Slurm's tools (``LIT_DDP_PYTHON``: this Python with the venv
    alone on PATH, no ``scontrol``)."""
    slow = tmp / "slow_controller"
    slow.mkdir(parents=True)
    (slow / "scontrol").write_text(
        f'#!/bin/sh\n[ -n "$SLURM_JOB_ID" ] && sleep 5\nexec {shutil.which("scontrol")} "$@"\n'
    )
    container = tmp / "container_python"
    container.write_text(f'#!/bin/sh\nPATH={Path(sys.executable).parent} exec {sys.executable} "$@"\n')
    for script in (slow / "scontrol", container):
        script.chmod(0o755)
    return {"PATH": f"{slow}{os.pathsep}{os.environ['PATH']}", "LIT_DDP_PYTHON": str(container)}


@pytest.mark.slurm
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_chaos_under_slurm_survives_preemptions_on_an_unkind_cluster(tmp_path: Path, runner: Runner, seed: int) -> None:
    """``--launcher slurm`` through slurm/train.sbatch, the regression as 1 node x 2 tasks, preempted three times
    (``scancel --signal=USR1`` at moments drawn from the seed: mid-step, mid-save or mid-validation) on a cluster
    whose controller takes 5 s to answer and whose steps have no ``scontrol`` (:func:`unkind_cluster`). Each
    time both tasks save at an agreed step, the batch script (never a step) requeues the job, and the rerun
    resumes; the job ends bit-identical to the uninterrupted one, with one preemption checkpoint left (each
    removing the one before). Two nodes, a lost node and FSDP2: ``tests/system/test_fsdp.py``."""
    from tests.system.helpers_slurm import require_cluster, slurm_env

    require_cluster(nodes=1)
    fit = ["--config", "configs/regression/slurm.yaml", *compose("checkpoint/fault_tolerant")]
    fit += ["--trainer.max_epochs", "150", "--trainer.enable_model_summary", "false"]
    env = {k: v for k, v in slurm_env().items() if k.startswith("LIT_DDP")} | unkind_cluster(tmp_path / "cluster")
    cmd = lit_ddp("chaos", "--launcher", "slurm", "--nodes", "1", "--nproc_per_node", "2", "--faults", "3",
                  "--kinds", "usr1", "--seed", str(seed), "--root", str(tmp_path / "c"), "--", *fit)  # fmt: skip
    result = runner.run(cmd, timeout=540, **env)
    logs = [p.read_text() for p in (tmp_path / "c").glob("faulted-*.out")]
    assert result.returncode == 0, result.stdout[-4000:] + "".join(logs)[-4000:]
    [log] = logs  # one job, requeued in place
    assert [row[1] for row in fault_table(result.stdout)] == ["usr1"] * 3, result.stdout[-3000:]
    assert "identical: the faulted run ends bit for bit" in result.stdout, result.stdout[-3000:]
    assert log.count("SIGUSR1 received: saving") == 3, log[-5000:]
    # requeued by the batch script (its scontrol 5 s slow), never by a step (none has scontrol)
    assert log.count("preempted (SIGUSR1), checkpoint saved: requeueing") == 3, log[-5000:]
    assert [p.name for p in (tmp_path / "c" / "faulted").glob("hpc_ckpt_*.ckpt")] == ["hpc_ckpt_3.ckpt"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("breaker", [NudgeOnResume, NudgeBeforeTheCheck], ids=["after_the_check", "at_load"])
def test_chaos_catches_a_run_that_does_not_resume_exactly(
    tmp_path: Path, runner: Runner, seed: int, breaker: type
) -> None:
    """One process, a callback (by class path, as a user's would be) that changes a weight on resume: after the
    resumed fit's first step (past the restore check), where one kill of the process as it writes a checkpoint makes
    the tool exit 1 naming the first differing tensor; or before the first step, where the restore check stops every
    launch of the faulted job and the tool exits 1 with the check's line."""
    nudge = write_callbacks_config(tmp_path / "nudge.yaml", callback(breaker))
    fit = [*compose("regression/single_device", "checkpoint/fault_tolerant"), "--config", str(nudge)]
    fit += ["--trainer.max_epochs", "80", "--trainer.devices", "1"]
    cmd = lit_ddp(
        "chaos", "--faults", "1", "--kinds", "save", "--seed", str(seed), "--root", str(tmp_path / "c"), "--", *fit
    )
    result = runner.run(cmd, timeout=240)
    assert result.returncode == 1, result.stdout[-6000:]
    if breaker is NudgeOnResume:
        assert "restore check: passed at 1 of 1 resumes" in result.stdout, result.stdout[-3000:]
        assert "DIFFERENT: first at state_dict/net." in result.stdout, result.stdout[-3000:]
    else:
        assert "the faulted job failed with status 1" in result.stdout, result.stdout[-3000:]
        assert re.search(r"^restore check: the state restored from \S+ differs from the one saved there, first at "
                         r"parameters/net\.", result.stdout, re.M), result.stdout[-3000:]  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    "breaker", [None, ReseedOnResume, ForgetLoaderPosition], ids=["resume", "reseeded_resume", "epoch_restarted"]
)
def test_calibrated_chaos_judges_runs_with_nondeterministic_kernels(
    tmp_path: Path, runner: Runner, seed: int, breaker: type | None
) -> None:
    """minGPT with dropout, made nondeterministic by gradient noise from the OS (as a GPU's fast kernels are): the
    real resume is within K x the spread of two uninterrupted runs at every logged step; one that reseeds torch's RNG
    at its first batch (past the restore check) is not, nor one whose sampler starts its epoch over, and either is
    found at the first logged step after its first resume. K=4: of 3 x 3,420 judgements of runs as good as a rerun
    (docs/chaos.md, "Which K", and one count like it), 6 fell outside K = 3 and none outside 3.5; the breakers' parameters lay 12 and 17
    times the spread from the first run's at that step."""
    extra = [callback(GradientNoise, scale=1e-6)] + ([callback(breaker)] if breaker else [])
    callbacks = write_callbacks_config(tmp_path / "callbacks.yaml", *extra)
    fit = [*compose("mingpt/cpu", "checkpoint/fault_tolerant", "mingpt/fault_tolerant"), *TINY_GPT_ARGS,
           "--config", str(callbacks), "--trainer.devices", "1", "--trainer.max_steps", "150",
           "--trainer.log_every_n_steps", "5", "--trainer.val_check_interval", "50", "--trainer.limit_val_batches", "2",
           "--checkpoint.every_n_train_steps", "25"]  # fmt: skip
    cmd = lit_ddp("chaos", "--calibrated", "4", "--faults", "2", "--kinds", "kill", "save", "--seed", str(seed),
                  "--root", str(tmp_path / "c"), "--", *fit)  # fmt: skip
    result = runner.run(cmd, timeout=400)
    print(result.stdout[-3000:])
    assert "two uninterrupted runs: train loss" in result.stdout, result.stdout[-6000:]
    if breaker is None:
        assert result.returncode == 0, result.stdout[-6000:]
        assert "restore check: passed at 2 of 2 resumes" in result.stdout, result.stdout[-3000:]
        assert "within 4 x the spread of two uninterrupted runs" in result.stdout
    else:
        assert result.returncode == 1, result.stdout[-6000:]
        first_resume = re.search(r"^resumed from step (\d+)", result.stdout, re.M)
        assert first_resume, result.stdout[-3000:]
        found = re.search(r"^DIFFERENT: first at parameters at step \d+, the first logged step after the resume from "
                          r"step (\d+):", result.stdout, re.M)  # fmt: skip
        assert found and found.group(1) == first_resume.group(1), result.stdout[-3000:]
