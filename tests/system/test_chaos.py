"""``lit-ddp chaos`` (issue 23): faults from outside at moments drawn from a seed, and the
verdict of a bit-for-bit comparison with an uninterrupted run; it also catches a run that does not resume
exactly. The project's torchrun restart tests go through it (the regression with every kind, minGPT with kills
of a worker and of a checkpoint's writer). Its bad uses: ``tests/unit/launch/test_chaos.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.callbacks import NudgeOnResume
from tests.helpers import Runner, callback, compose, lit_ddp, write_callbacks_config
from tests.system.test_fault_tolerance import mingpt_args

# 80 epochs of 28 steps on 2 processes (about 20 s here), a checkpoint every 50 steps.
REGRESSION = [
    *compose("trainer/ddp", "checkpoint/fault_tolerant", "regression/fault_tolerant"),
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
    moment its temporary file appears, a worker SIGKILLed while a validation runs. The tool exits 0 with a line per fault, each naming the step the job
    resumed from, no earlier than the checkpoint before the fault, and the verdict."""
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


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_chaos_under_torchrun_finds_mingpt_exact(tmp_path: Path, runner: Runner, seed: int, tiny_text: Path) -> None:
    """minGPT (AdamW + Muon, warmup and cosine, dropout, validation every 5 steps, the throughput monitor) on a tiny
    text under torchrun: a worker SIGKILLed and a checkpoint's writer SIGKILLed mid-write, at moments drawn from
    the seed; the weights, optimizer and scheduler states and every TensorBoard scalar end bit-identical."""
    fit = mingpt_args(60, 5, tiny_text)
    cmd = lit_ddp("chaos", "--launcher", "torchrun", "--nproc_per_node", "2", "--faults", "2", "--kinds", "kill",
                  "save", "--seed", str(seed), "--root", str(tmp_path / "c"), "--", *fit)  # fmt: skip
    result = runner.run(cmd, timeout=360)
    assert result.returncode == 0, result.stdout[-6000:] + (tmp_path / "c" / "faulted.log").read_text()[-6000:]
    assert sorted(row[1] for row in fault_table(result.stdout)) == ["kill", "save"], result.stdout[-3000:]
    assert "identical: the faulted run ends bit for bit" in result.stdout


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


@pytest.mark.slurm
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_chaos_under_slurm_finds_the_run_exact(tmp_path: Path, runner: Runner, seed: int) -> None:
    """``--launcher slurm`` on the two-node local cluster, one task per node, through slurm/train.sbatch: the
    job's USR1 warning (saved, requeued by the script) and a SIGKILL of one node's task (the job fails; the tool
    submits it again, as an operator would), in an order drawn from the seed: bit-identical, exit 0."""
    fit = ["--config", "configs/regression/slurm.yaml", *compose("checkpoint/fault_tolerant")]
    fit += ["--trainer.max_epochs", "150", "--trainer.enable_model_summary", "false"]
    outputs = survives_usr1_and_a_lost_node(fit, tmp_path, runner, seed)
    # the node's task died by SIGKILL, the job failed and was submitted again
    assert ": Killed" in outputs and len(list(tmp_path.glob("faulted-*.out"))) == 2, outputs[-4000:]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_chaos_catches_a_run_that_does_not_resume_exactly(tmp_path: Path, runner: Runner, seed: int) -> None:
    """One process, a callback (by class path, as a user's would be) that changes a weight when the fit resumes:
    one kill of the process as it writes a checkpoint, and the tool exits 1 naming the first differing tensor."""
    nudge = write_callbacks_config(tmp_path / "nudge.yaml", callback(NudgeOnResume))
    fit = [*compose("regression/single_device", "checkpoint/fault_tolerant"), "--config", str(nudge)]
    fit += ["--trainer.max_epochs", "80", "--trainer.devices", "1"]
    cmd = lit_ddp(
        "chaos", "--faults", "1", "--kinds", "save", "--seed", str(seed), "--root", str(tmp_path / "c"), "--", *fit
    )
    result = runner.run(cmd, timeout=240)
    assert result.returncode == 1, result.stdout[-6000:]
    assert "DIFFERENT: first at state_dict/net." in result.stdout, result.stdout[-3000:]
