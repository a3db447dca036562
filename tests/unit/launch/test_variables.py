"""lit_ddp.launch.variables and lit_ddp.errors.int_from_env: a launcher variable that is not a number is refused in
one line that names it, before Lightning (which parses ``RANK`` as it is imported) reads it (issue 50, item 7)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lit_ddp.errors import UsageError, int_from_env
from lit_ddp.launch.variables import LAUNCH_VARIABLES, check_launch_variables
from tests.helpers import REPO


def test_int_from_env_names_the_variable() -> None:
    assert int_from_env("RANK", {}) is None
    assert int_from_env("RANK", {"RANK": "3"}) == 3
    for bad in ("x", "", "1.5", "-1"):
        with pytest.raises(UsageError, match=rf"RANK={bad!r} is not a whole number >= 0"):
            int_from_env("RANK", {"RANK": bad})


@pytest.mark.parametrize("name", list(LAUNCH_VARIABLES))
def test_each_launch_variable_is_checked(name: str) -> None:
    check_launch_variables({name: "7"})
    with pytest.raises(UsageError, match=rf"^{name}='x' is not a whole number"):
        check_launch_variables({name: "x"})


def test_the_cli_refuses_a_bad_rank_in_one_line(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """In process, through ``cli_main`` (Lightning is imported already here) and ``python -m lit_ddp``'s ``main``."""
    from lit_ddp import __main__
    from lit_ddp.cli import cli_main

    monkeypatch.setenv("NODE_RANK", "x")
    monkeypatch.setattr(sys, "argv", ["lit-ddp", "fit"])
    for call in (lambda: cli_main(["fit"]), __main__.main):
        with pytest.raises(SystemExit) as exc:
            call()
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "lit-ddp: error: NODE_RANK='x' is not a whole number >= 0" in err and "Traceback" not in err


def test_rank_x_is_refused_before_lightning_is_imported() -> None:
    """``RANK=x lit-ddp fit``: Lightning's ``int(os.environ["RANK"])`` at import ended in a ValueError traceback that
    named no variable; ``python -m lit_ddp`` now refuses it first (a second, no Lightning import)."""
    env = {"PATH": "/usr/bin:/bin", "RANK": "x", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "lit_ddp", "fit"], env=env, capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.splitlines() == [
        "lit-ddp: error: RANK='x' is not a whole number >= 0 (this process's global rank, which torchrun and "
        "Lightning's launcher set): unset it, or give it a number such as RANK=0"
    ]
