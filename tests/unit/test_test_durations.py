"""scripts/test_durations.py: a pytest --durations=0 log summed by tier, file and test."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.helpers import REPO

spec = importlib.util.spec_from_file_location("test_durations_script", REPO / "scripts" / "test_durations.py")
assert spec is not None and spec.loader is not None
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)

LOG = """\
============================= slowest durations ==============================
120.50s call     tests/system/test_chaos.py::test_chaos_under_slurm_survives@slurm
30.25s call     tests/system/test_fsdp.py::test_fsdp2_trains_what_ddp_trains[a b]
2.00s setup    tests/system/test_fsdp.py::test_fsdp2_trains_what_ddp_trains[a b]
0.50s call     tests/unit/test_cli.py::test_one
0.25s teardown tests/unit/test_cli.py::test_one
= 4 passed in 153.50s =
"""


def test_seconds_are_summed_per_test_tier_and_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    log = tmp_path / "test.log"
    log.write_text(LOG)
    assert script.main([str(log)]) == 0
    out = capsys.readouterr().out
    assert "| unit | 1 | 1 |" in out  # 0.50 + 0.25, rounded
    assert "| system | 1 | 32 |" in out  # the parametrized id with a space is one test: call + setup
    assert "| slurm | 1 | 120 |" in out
    assert "| all | 3 | 154 |" in out  # 153.5
    assert "| tests/system/test_fsdp.py::test_fsdp2_trains_what_ddp_trains[a b] | 32.2 |" in out


def test_a_log_without_durations_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    log = tmp_path / "test.log"
    log.write_text("= 4 passed in 1.00s =\n")
    with pytest.raises(SystemExit) as e:
        script.main([str(log)])
    assert e.value.code == 2
    assert "--durations=0" in capsys.readouterr().err
