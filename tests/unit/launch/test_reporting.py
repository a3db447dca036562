"""lit_ddp.launch.reporting: which failures print one line and which keep their traceback, and their exit codes."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.rank_zero import rank_zero_only

from lit_ddp.errors import NonFiniteLossError, Preempted, UsageError
from lit_ddp.launch import reporting
from lit_ddp.launch.preflight import check_launch
from tests.helpers import SRUN_2, without


def run_reported(fn, running: bool) -> int:
    def wrapped():
        if running:
            reporting.mark_running()
        fn()

    with pytest.raises(SystemExit) as exc:
        reporting.report(wrapped)
    return int(exc.value.code)


def torch_value_error() -> None:
    F.cross_entropy(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))  # torch raises ValueError


def our_bad_value() -> None:
    from lit_ddp.data.char import CharDataModule

    CharDataModule(block_size=0)


def test_a_torch_value_error_during_fit_keeps_its_traceback(capsys: pytest.CaptureFixture) -> None:
    assert run_reported(torch_value_error, running=True) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "cross_entropy" in err
    assert err.strip().splitlines()[-1].startswith("lit-ddp: error: rank 0 on ")


def test_our_own_bad_value_during_fit_is_one_line(capsys: pytest.CaptureFixture) -> None:
    assert run_reported(our_bad_value, running=True) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "block_size=0 must be a positive integer" in err


@pytest.mark.parametrize("running", [False, True])
def test_errors_carry_their_exit_code(capsys: pytest.CaptureFixture, running: bool) -> None:
    def usage() -> None:
        raise UsageError("bad value")

    def nan() -> None:
        raise NonFiniteLossError("loss became nan")

    assert run_reported(usage, running) == 2
    assert run_reported(nan, running) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_preempted_exits_128_plus_signal(capsys: pytest.CaptureFixture) -> None:
    import signal

    def preempted() -> None:
        raise Preempted(signal.SIGTERM, "run/hpc_ckpt_1.ckpt", requeued=False)

    assert run_reported(preempted, running=True) == 143
    assert "stopped by SIGTERM" in capsys.readouterr().err


def test_report_prints_once_and_exits(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    env = without(SRUN_2, "SLURM_NTASKS_PER_NODE")
    for rank in (0, 1):
        monkeypatch.setattr(rank_zero_only, "rank", rank)  # as Lightning sets it from SLURM_PROCID in each task
        with pytest.raises(SystemExit) as exc:
            reporting.report(partial(check_launch, {"devices": 2}, {**env, "SLURM_PROCID": str(rank)}))
        assert exc.value.code == reporting.USAGE_EXIT_CODE
    err = capsys.readouterr().err
    assert err.count("lit-ddp: error:") == 1, err  # task 0 only


def test_only_torch_reports_a_lost_peer() -> None:
    """A lost connection counts as "another rank went away" only when torch says so (issue 21, item 8)."""
    import torch.distributed as dist

    from lit_ddp.launch.reporting import is_peer_lost

    def download() -> None:
        raise ConnectionRefusedError("[Errno 111] Connection refused")  # e.g. an HTTP error in prepare_data

    def s3_write() -> None:
        try:
            raise OSError("Connection reset by peer")
        except OSError as e:
            raise RuntimeError("s3fs could not write the checkpoint") from e

    for fn in (download, s3_write):
        with pytest.raises(Exception) as exc:
            fn()
        assert not is_peer_lost(exc.value)
    assert is_peer_lost(dist.DistBackendError("NCCL communicator was aborted on rank 1"))
    try:
        raise dist.DistNetworkError("Connection closed by peer")
    except dist.DistNetworkError as e:
        wrapped = RuntimeError("training step failed")
        wrapped.__cause__ = e
        assert is_peer_lost(wrapped)
