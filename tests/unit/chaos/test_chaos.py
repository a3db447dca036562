"""``lit-ddp chaos``'s bad uses (one ``lit-ddp: error:`` line, status 2), its schedule and its comparisons; whole
runs under faults: ``tests/system/test_chaos.py``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.tensorboard import SummaryWriter

from lit_ddp.chaos.cli import chaos_parser, check, checkpoint_interval, deterministic, plan, print_faults, run_faulted
from lit_ddp.chaos.compare import compare_scalars, first_difference
from lit_ddp.chaos.job import Fault, Job
from lit_ddp.chaos.replica_groups import current_pids, group_dirs, print_group_faults
from lit_ddp.cli import cli_main
from lit_ddp.run_dir import events

FIT = ["--", "--config", "configs/regression/single_device.yaml"]


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--faults", "2"], "needs the run's fit arguments after `--`"),
        (["--faults", "2", "--"], "needs the run's fit arguments after `--`"),
        (["--faults", "0", *FIT], "--faults 0: give at least 1"),
        (
            ["--kinds", "hang", *FIT],
            "--kinds hang: --launcher single injects kill, term, save, validation (one process",
        ),
        (["--launcher", "torchrun", "--kinds", "kill", "usr1", *FIT], "--kinds usr1: --launcher torchrun injects"),
        (["--rtol", "-1", *FIT], "--rtol -1.0: give 0 (bit for bit) or a positive"),
        (
            ["--nnodes", "2", *FIT],
            "--nodes 2: give 1 for --launcher single and torchft, at least 1 for torchrun and slurm",
        ),
        (["--launcher", "torchft", "--replica_groups", "1", *FIT], "--replica_groups 1: give at least 2"),
        (
            ["--launcher", "torchft", "--kinds", "kill", "term", *FIT],
            "--kinds term: --launcher torchft injects kill, node, hang, heal, lighthouse (a group's worker killed",
        ),
        (["--launcher", "torchft", "--rtol", "0.1", *FIT], "--launcher torchft compares by --calibrated K"),
        (
            ["--launcher", "slurm", "--sbatch", "slurm/train_elastic.sbatch", "--kinds", "usr1", *FIT],
            "--kinds usr1: --launcher slurm with slurm/train_elastic.sbatch injects kill, hang, node, term, validation",
        ),
    ],
)
def test_bad_use_gets_one_line_and_status_2(argv: list[str], says: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["chaos", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.count("lit-ddp: error:") == 1 and says in err, err


def test_slurm_without_sbatch_is_named(tmp_path: Path, monkeypatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without Slurm's commands
    with pytest.raises(SystemExit) as exit_:
        cli_main(["chaos", "--launcher", "slurm", *FIT])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("lit-ddp: error:") == 1
    assert "--launcher slurm needs Slurm's sbatch on PATH (none here)" in err, err


def test_a_run_without_step_checkpoints_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A finished run whose only checkpoint is last.ckpt (no periodic saves): no fault could come before its end."""
    (tmp_path / "ref" / "checkpoints").mkdir(parents=True)
    (tmp_path / "ref" / "checkpoints" / "last.ckpt").write_bytes(b"")
    with pytest.raises(SystemExit) as exit_:
        cli_main(["chaos", "--root", str(tmp_path / "c"), "--reference", str(tmp_path / "ref"), *FIT])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("lit-ddp: error:") == 1
    assert "writes no step checkpoint" in err and "--checkpoint.every_n_train_steps N" in err, err


def test_an_earlier_faulted_run_is_not_reused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "faulted").mkdir()
    with pytest.raises(SystemExit) as exit_:
        cli_main(["chaos", "--root", str(tmp_path), *FIT])
    assert exit_.value.code == 2 and "exists (an earlier chaos run)" in capsys.readouterr().err


def test_the_same_seed_plans_the_same_faults(seed: int) -> None:
    """Same seed, same schedule: kinds, delays and targets; K faults of K kinds inject every kind once."""
    kinds = ["kill", "term", "hang", "node", "save"]
    assert plan(seed, 7, kinds) == plan(seed, 7, kinds)
    assert plan(seed, 7, kinds) != plan(seed + 1, 7, kinds)
    assert sorted(f.kind for f in plan(seed, 5, kinds)) == sorted(kinds)
    assert all(0 <= f.delay < 1 and 0 <= f.target < 1 for f in plan(seed, 7, kinds))


def test_faults_come_at_steps_within_the_checkpoint_interval(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The interval is the median gap between the kept step checkpoints (or the only one's step); the table gives
    the steps a fault cost (the step it hit less the step resumed from; none after a preemption that saved past
    it) and "-" where the job never trained the fault's step again."""
    (tmp_path / "checkpoints").mkdir()
    for name in ("epoch=3-step=100.ckpt", "epoch=5-step=150.ckpt", "epoch=7-step=200.ckpt", "last.ckpt"):
        (tmp_path / "checkpoints" / name).touch()
    assert checkpoint_interval(tmp_path) == 50
    (tmp_path / "checkpoints" / "epoch=6-step=201.ckpt").touch()  # a save moved past a validation
    (tmp_path / "checkpoints" / "epoch=7-step=200.ckpt").unlink()
    (tmp_path / "checkpoints" / "epoch=8-step=250.ckpt").touch()
    assert checkpoint_interval(tmp_path) == 50  # gaps 49, 50, 51
    (tmp_path / "checkpoints" / "epoch=6-step=201.ckpt").unlink()
    (tmp_path / "checkpoints" / "epoch=8-step=250.ckpt").unlink()
    (tmp_path / "checkpoints" / "epoch=7-step=200.ckpt").touch()
    (tmp_path / "checkpoints" / "epoch=3-step=100.ckpt").unlink()
    (tmp_path / "checkpoints" / "epoch=5-step=150.ckpt").unlink()
    assert checkpoint_interval(tmp_path) == 200
    kill = {"kind": "kill", "target": "rank 1", "t": 8.25, "step": 350, "at": 372, "pid": 1, "lost": 3.04}
    term = {"kind": "term", "target": "rank 0", "t": 20.0, "step": 400, "at": 410, "pid": 2, "lost": None}
    print_faults([kill, term], [350, 413])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert rows == [["1", "kill", "rank", "1", "8.2", "372", "350", "350", "22", "3.0"],
                    ["2", "term", "rank", "0", "20.0", "410", "400", "413", "0", "-"]]  # fmt: skip


class _JobWhoseProbeDiesWithItsWriter:
    """A job as ``run_faulted`` sees it, whose rank zero is killed as it writes where it is: after each fault the
    job's progress cannot be read once; it then resumes from its newest checkpoint and saves the next one."""

    def __init__(self, root: Path, faults: int) -> None:
        self.root, self.faults, self.step, self.injected = root, faults, 0, []
        self.unreadable = False
        (root / "checkpoints").mkdir()
        self._save(50)

    def _save(self, step: int) -> None:
        (self.root / "checkpoints" / f"step={step}.ckpt").touch()
        self.step = step

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def poll(self) -> int | None:
        return 0 if len(self.injected) == self.faults else None  # it finishes after the last fault

    def progress(self) -> tuple[str, int, int] | None:
        if self.unreadable:
            self.unreadable = False
            return None
        self.step += 1
        return "train", self.step, 1 + len(self.injected)

    def wait_for_step(self, step: int, deadline: float) -> tuple[str, int, int] | None:
        self.step = max(self.step, step)
        return "train", self.step, 1 + len(self.injected)

    def inject(self, fault: Fault, deadline: float) -> str:
        self.injected.append((fault.kind, self.step))
        self.unreadable = True
        events.record(self.root, events.RESUMED, path="last.ckpt", global_step=self.step // 50 * 50)
        self._save(self.step // 50 * 50 + 50)
        return "rank 0"

    def output(self) -> str:
        return ""


def test_a_fault_counts_once_when_the_job_cannot_say_where_it_hit(tmp_path: Path) -> None:
    """A fault injected is never injected again, even when the job cannot tell right after it which step it hit
    (its rank zero killed as it wrote that): the step the job had reached just before stands for it."""
    job = _JobWhoseProbeDiesWithItsWriter(tmp_path, faults=2)
    schedule = [Fault("kill", 0.5, 0.0), Fault("kill", 0.2, 0.0)]
    faults, _ = run_faulted(job, schedule, every=50, span=5.0, timeout=30.0)  # type: ignore[arg-type]
    assert [kind for kind, _ in job.injected] == ["kill", "kill"]
    assert [f["at"] for f in faults] == [step for _, step in job.injected] == [75, 110]


def test_first_difference_names_the_entry() -> None:
    a = {"state_dict": {"net.weight": torch.zeros(2), "net.bias": torch.ones(1)}, "global_step": 5}
    assert first_difference(a, {**a}) is None
    nudged = {"state_dict": {**a["state_dict"], "net.bias": torch.ones(1) + 1e-7}, "global_step": 5}
    assert first_difference(a, nudged) == "/state_dict/net.bias"
    assert first_difference(a, nudged, rtol=1e-5) is None  # --rtol: a run that cannot be exact
    assert first_difference([1, {"lr": 0.1}], [1, {"lr": 0.2}]) == "[1]/lr"
    assert first_difference(torch.zeros(2), torch.zeros(3)) == ""


def test_compare_scalars_names_the_first_differing_point(tmp_path: Path) -> None:
    """The last value at each step counts (a resumed run logs the steps it redoes again); timing scalars differ
    between any two runs and are left out."""
    for name, losses, redo in (("a", [3.0, 2.0, 1.0], None), ("b", [3.0, 2.0, 1.0], 9.0), ("c", [3.0, 2.5, 1.0], None)):
        with SummaryWriter(str(tmp_path / name)) as writer:
            for step, loss in enumerate(losses):
                writer.add_scalar("train/loss", loss if redo is None or step != 1 else redo, step)
                writer.add_scalar("train/tokens_per_sec", 1000.0 + ord(name), step)
            if redo is not None:  # a resume from step 1 logs step 1 again, now right
                writer.add_scalar("train/loss", losses[1], 1)
    assert compare_scalars(tmp_path / "a", tmp_path / "b") is None
    assert compare_scalars(tmp_path / "a", tmp_path / "c") == "tensorboard/train/loss at step 1 (2.0 vs 2.5)"


def test_the_writer_of_a_checkpoint_is_found_under_a_relative_run_directory(tmp_path: Path, monkeypatch) -> None:
    """``save`` faults find the process holding a checkpoint's temporary file open; the run directory may be given
    relative (the default ``runs/chaos/<seed>``) while /proc names files absolutely. The run lock's own temporary
    file is not a checkpoint."""
    import os
    import time

    from lit_ddp.chaos.job import writer_of_temporary_checkpoint

    monkeypatch.chdir(tmp_path)
    root = Path("runs/faulted")
    (root / "checkpoints").mkdir(parents=True)
    with open(root / "..lit_ddp.holder.json.x1.tmp", "w"):
        assert writer_of_temporary_checkpoint(root, [os.getpid()], time.monotonic() + 0.2) is None
    with open(root / "checkpoints" / ".epoch=0-step=5.ckpt.ab12.tmp", "w"):
        assert writer_of_temporary_checkpoint(root, [os.getpid()], time.monotonic() + 5) == os.getpid()


def test_deterministic_reads_the_run_s_saved_config(tmp_path: Path) -> None:
    """A DIFFERENT verdict on a run with the kernels its device chose points to configs/checkpoint/exact.yaml."""
    assert not deterministic(tmp_path)  # no config.yaml
    (tmp_path / "config.yaml").write_text("trainer:\n  deterministic: false\n")
    assert not deterministic(tmp_path)
    (tmp_path / "config.yaml").write_text("trainer:\n  deterministic: true\n")
    assert deterministic(tmp_path)


def test_torchft_runs_under_its_launcher_with_the_calibrated_comparison(tmp_path: Path) -> None:
    """``--launcher torchft``: ``python -m lit_ddp.ft.launch`` with R groups (of one process unless
    ``--nproc_per_node`` says otherwise), each group's restarts, the fit's
    arguments after ``--`` (a leading ``fit`` as the launcher takes them), no run directory of the tool's (the
    launcher gives each group ``<root>/group_<i>``); ``kill`` by default, compared by ``--calibrated 3``."""
    argv = ["--launcher", "torchft", "--replica_groups", "3", "--faults", "2", "--heartbeat_timeout_ms", "1000",
            "--root", str(tmp_path), "--", "fit", "--config", "configs/trainer/torchft.yaml"]  # fmt: skip
    args, fit = check(chaos_parser().parse_args(argv))
    assert fit == ["--config", "configs/trainer/torchft.yaml"]
    assert args.kinds == ["kill"] and args.calibrated == 3.0 and args.max_restarts == 2
    cmd = Job(args, fit, tmp_path / "faulted", faulted=True).cmd
    assert cmd[1:13] == ["-m", "lit_ddp.ft.launch", "--replica_groups", "3", "--nproc_per_group", "1",
                         "--root", str(tmp_path / "faulted"), "--max_restarts", "2",
                         "--heartbeat_timeout_ms", "1000"]  # fmt: skip
    assert cmd[13:17] == ["--", "fit", "--config", "configs/trainer/torchft.yaml"]
    assert "--trainer.default_root_dir" not in cmd


def test_the_torchft_table_reads_the_launcher_s_records(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The groups' pids and run directories come from the launcher's records (the newest start of each); the table
    gives per fault the group hit, the survivors' restarts, their longest pause, their steps while the group was
    down and the seconds until it was back ("-": never)."""
    events.record(tmp_path, events.LIGHTHOUSE_STARTED, pid=9, address="http://127.0.0.1:1")
    for group, pid in (("group_0", 10), ("group_1", 11), ("group_1", 12)):
        events.record(tmp_path, events.GROUP_STARTED, group=group, pid=pid, run_dir=f"runs/x/{group}")
    records = events.read(tmp_path)
    assert current_pids(records) == {"group_0": 10, "group_1": 12}
    assert group_dirs(records) == [Path("runs/x/group_0"), Path("runs/x/group_1")]
    back = {"kind": "kill", "group": "group_1", "pid": 11, "t": 8.25, "step": 180, "restarts": 0, "stall": 2.04,
            "during": 44, "back": 3.71}  # fmt: skip
    never = {**back, "kind": "node", "restarts": 1, "during": 220, "back": None}
    print_group_faults([back, never])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert rows == [["1", "kill", "group_1", "pid", "11", "8.2", "180", "0", "2.0", "44", "3.7"],
                    ["2", "node", "group_1", "pid", "11", "8.2", "180", "1", "2.0", "220", "-"]]  # fmt: skip


def test_processes_per_node_default_to_one_per_torchft_group_and_two_elsewhere() -> None:
    for launcher, nproc in (("torchft", 1), ("torchrun", 2), ("single", 2)):
        args, _ = check(chaos_parser().parse_args(["--launcher", launcher, *FIT]))
        assert args.nproc_per_node == nproc, launcher


def test_a_kill_in_a_group_of_several_processes_hits_its_torchrun_s_worker_of_the_highest_rank() -> None:
    """``kill`` under a torchft group of 2 processes SIGKILLs the agent's child whose RANK is 1, not the agent nor
    rank 0; ``node`` SIGKILLs the agent and both; a group whose workers are not all up is not hit yet."""
    from lit_ddp.chaos.job import children, rank_of
    from lit_ddp.chaos.replica_groups import inject

    def running(pid: int) -> bool:  # a killed child stays a zombie until the fake agent, asleep, would reap it
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    spawn = (
        "import os, subprocess, sys, time\n"
        "time.sleep(0.5)\n"  # the workers come a moment after the agent, as torchrun's do
        "workers = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        " env=dict(os.environ, RANK=str(r))) for r in range(2)]\n"
        "time.sleep(60)\n"
    )
    for kind in ("kill", "node"):
        agent = subprocess.Popen([sys.executable, "-c", spawn], start_new_session=True)
        try:
            assert kind == "node" or inject(Fault(kind, 0.0, 0.0), agent.pid, nproc=2) is None
            deadline = time.monotonic() + 30
            while len(workers := children(agent.pid)) < 2 or 1 not in map(rank_of, workers):
                assert time.monotonic() < deadline, "the fake torchrun's workers did not start"
                time.sleep(0.05)
            by_rank = {rank_of(pid): pid for pid in workers}
            hit = inject(Fault(kind, 0.0, 0.0), agent.pid, nproc=2)
            time.sleep(0.5)
            if kind == "kill":
                assert hit == by_rank[1] and not running(by_rank[1])
                assert running(agent.pid) and running(by_rank[0])
            else:
                assert hit == agent.pid and not any(running(pid) for pid in (agent.pid, *by_rank.values()))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(timeout=10)
