"""``lit-ddp chaos``'s bad uses (one ``lit-ddp: error:`` line, status 2) and its checkpoint comparison; whole runs
under faults: ``tests/system/test_chaos.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lit_ddp.cli import cli_main
from lit_ddp.launch.chaos import first_difference

FIT = ["--", "--config", "configs/regression/single_device.yaml"]


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--faults", "2"], "needs the run's fit arguments after `--`"),
        (["--faults", "2", "--"], "needs the run's fit arguments after `--`"),
        (["--faults", "0", *FIT], "--faults 0: give at least 1"),
        (["--kinds", "hang", *FIT], "--kinds hang needs --launcher torchrun"),
    ],
)
def test_bad_use_gets_one_line_and_status_2(argv: list[str], says: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["chaos", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.count("lit-ddp: error:") == 1 and says in err, err


def test_an_earlier_faulted_run_is_not_reused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "faulted").mkdir()
    with pytest.raises(SystemExit) as exit_:
        cli_main(["chaos", "--root", str(tmp_path), *FIT])
    assert exit_.value.code == 2 and "exists (an earlier chaos run)" in capsys.readouterr().err


def test_first_difference_names_the_entry() -> None:
    a = {"state_dict": {"net.weight": torch.zeros(2), "net.bias": torch.ones(1)}, "global_step": 5}
    assert first_difference(a, {**a}) is None
    nudged = {"state_dict": {**a["state_dict"], "net.bias": torch.ones(1) + 1e-7}, "global_step": 5}
    assert first_difference(a, nudged) == "/state_dict/net.bias"
    assert first_difference([1, {"lr": 0.1}], [1, {"lr": 0.2}]) == "[1]/lr"
    assert first_difference(torch.zeros(2), torch.zeros(3)) == ""
