"""bench/gpu_check.py's bookkeeping: its time boxes fit the 7-minute budget, the parts it runs, and how it reads the
runs' clocks and the reference's log (the GPU runs themselves are checked by its dry run: BENCH_GPU_DRY=1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.gpu_check import (
    BOXES,
    BUDGET_S,
    GROUPS,
    PARTS,
    RUNNERS,
    Row,
    chosen_parts,
    mean_after_first,
    reference_evals,
    seconds_to_marks,
    table,
)
from bench.harness.clock import read_clock


def test_each_half_fits_the_budget_in_order_of_value() -> None:
    for group, parts in GROUPS.items():
        assert BOXES["setup"][0] + sum(BOXES[p][0] for p in parts) <= BUDGET_S == 420, group
        assert list(parts) == [p for p in PARTS if p in parts], group  # the table's order
    assert sorted(p for parts in GROUPS.values() for p in parts) == sorted(set(PARTS) - {"setup"})  # each once
    assert PARTS[:3] == ("setup", "main", "reference")  # the speed figures first: a run cut short still has them
    assert set(RUNNERS) == set(PARTS)


def test_chosen_parts_keep_the_table_order_and_the_setup() -> None:
    assert chosen_parts(None) == list(PARTS)
    assert chosen_parts("generate, main") == ["setup", "main", "generate"]
    assert chosen_parts("speed") == ["setup", *GROUPS["speed"]]
    assert chosen_parts("path main") == ["setup", "main", *GROUPS["path"]]
    with pytest.raises(ValueError, match="unknown part"):
        chosen_parts("main fast")


def test_run_clock_file(tmp_path: Path) -> None:
    clock = tmp_path / "clock.txt"
    lines = ["start 100.0 42 99.5", "step 101.5 1 42", "step 102.0 2 42", "val 103.0 2 1.62", "tput 103.1 2 1.5e6 nan",
             "step 104.0 3 42", "step 104.5 4 42", "val 10"]  # fmt: skip
    clock.write_text("\n".join(lines))
    events = read_clock(clock)
    assert events["start"] == [(100.0, 42.0, 99.5)] and [e[:2] for e in events["step"]] == [
        (101.5, 1),
        (102, 2),
        (104, 3),
        (104.5, 4),
    ]
    assert events["val"] == [(103.0, 2.0, 1.62)] and events["end"] == []  # the half-written line is left out
    assert events["span"] == [(101.5, 102.0), (104.0, 104.5)]  # not across the validation
    assert mean_after_first([e[3] for e in events["tput"]]) is None  # no MFU logged (nan)
    assert read_clock(tmp_path / "missing")["step"] == []


def test_marks_from_the_reference_log() -> None:
    log = "step     0      9.3 s  train/loss 4.2000  val/loss 4.1900\n"
    log += "step   250     41.0 s  train/loss 1.6000  val/loss 1.7500\n"
    log += "step   500     47.5 s  train/loss 1.3000  val/loss 1.4600\n"
    marks = seconds_to_marks(reference_evals(log))
    assert marks == {1.70: 47.5, 1.55: 47.5, 1.50: 47.5, 1.4697: 47.5}
    assert seconds_to_marks([(10.0, 1.6), (20.0, 1.52)])[1.55] == 20.0
    assert mean_after_first([5.0, 1.0, 3.0]) == 2.0 and mean_after_first([4.0]) == 4.0


def test_table_is_one_line_per_part() -> None:
    text = table([Row("main", "ok", "a | b", wall=51.2, box=75)], "## header")
    assert text.splitlines()[-1] == "| main | 51 (75) | ok | a / b |"
