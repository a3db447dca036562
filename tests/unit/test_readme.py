"""The README as the tutorial (issue 53): the series' five steps in its order under its titles, each with the script
it replaces, a YAML excerpt, a command of lines of at most 100 characters and an output block that
``scripts/readme_outputs.py`` writes (``tests/system/test_tutorial_page.py`` runs the commands); every command names
programs, make targets and files that exist; every ``make stepN`` runs its step's command; docs/your_model.md's code
excerpts are those of the file they name. What every page must hold true (paths, keys, YAML excerpts, links):
``tests/unit/test_docs.py``."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import README, REPO, readme_outputs, readme_steps

TOOL = readme_outputs()
BIN = Path(sys.executable).parent
# The original series' steps (pytorch/examples distributed/ddp-tutorial-series and minGPT-ddp), in its order.
SERIES = [
    ("1. Single GPU training", "single_gpu.py"),
    ("2. Multi-GPU training with DDP", "multigpu.py"),
    ("3. Fault-tolerant distributed training with torchrun", "multigpu_torchrun.py"),
    ("4. Multinode training", "multinode.py"),
    ("5. Training a GPT-like model with DDP", "minGPT"),
]
PAGES = [README, REPO / "slurm" / "README.md", REPO / "docs" / "your_model.md", REPO / "docs" / "tutorial.md"]
MAX_COMMAND_LINE = 100


def sections(text: str) -> dict[str, str]:
    return {part.splitlines()[0].strip(): part for part in re.split(r"^## ", text, flags=re.M)[1:]}


def fences(text: str, language: str) -> list[str]:
    return [m[1] for m in re.finditer(rf"^```{language}\n(.*?)^```\n", text, re.M | re.S)]


def test_the_five_steps_in_the_series_order() -> None:
    """Five numbered sections in the series' order, each naming the script it replaces, with a YAML excerpt, one
    command and an output block; then "Where to go next" and "Troubleshooting", last."""
    text = README.read_text()
    titles = list(sections(text))
    numbered = [t for t in titles if re.match(r"\d\. ", t)]
    assert numbered == [title for title, _ in SERIES]
    for title, script in SERIES:
        section = sections(text)[title]
        assert f"Replaces `{script}" in section, f"{title}: names the script it replaces"
        assert fences(section, "yaml") and fences(section, "bash"), title
        assert re.search(r"<!-- output: step\d -->", section), f"{title}: an output block"
    assert titles[-2:] == ["Where to go next", "Troubleshooting"]
    assert titles.index("Quick start") < titles.index(SERIES[0][0])


def test_output_blocks_are_written_by_the_script() -> None:
    """Every output block is one the script writes (its selection of lines), none empty, and the quick start's run
    is step 5's command."""
    blocks = {b.name: b for b in TOOL.blocks(README.read_text())}
    assert set(blocks) == set(TOOL.SHOWN)
    assert all(b.shown for b in blocks.values()), [n for n, b in blocks.items() if not b.shown]
    for name, source in TOOL.SAME_RUN.items():
        assert TOOL.resolve(blocks[name].command) == TOOL.resolve(blocks[source].command)


def test_a_block_reads_the_same_wherever_other_processes_lines_fall() -> None:
    """step3's block against a fresh run in which another line fell between torchrun's two lines about the killed
    worker (a full suite run's did): the same block. A shown line missing, or one more, is a difference."""
    block = {b.name: b for b in TOOL.blocks(README.read_text())}["step3"].shown
    closing = next(i for i, line in enumerate(block) if "closing signal" in line)
    assert "failed (exitcode" in block[closing + 1]  # adjacent in the documented run
    interleaved = [*block[: closing + 1], "...", *block[closing + 1 :]]
    assert TOOL.differences("step3", block, interleaved, 0.0) == []
    assert TOOL.differences("step3", block, [line for line in block if "closing signal" not in line], 0.0)
    assert TOOL.differences("step3", block, [*block, "Resuming from runs/x/checkpoints/last.ckpt"], 0.0)


def readme_command_lines() -> list[str]:
    return [line for fence in fences(README.read_text(), "bash") for line in fence.splitlines()]


def test_readme_command_lines_are_short() -> None:
    long = [line for line in readme_command_lines() if len(line) > MAX_COMMAND_LINE]
    assert not long, long


def test_readme_commands_name_what_exists() -> None:
    """Each README command runs a program of the venv, a make target of the Makefile, sbatch or pip, and every file
    it names (configs, scripts, notebooks) is in the checkout."""
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    text = README.read_text()
    commands = [c for fence in fences(text, "bash") for c in TOOL.commands(fence)]
    commands += [c for c in re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```\n", "", text, flags=re.M | re.S))]
    for command in commands:
        try:
            words = shlex.split(command)
        except ValueError:
            continue  # prose in backticks, not a command
        if not words:
            continue
        program = next((w for w in words if not re.match(r"^\w+=", w)), "")
        if program.startswith(".venv/bin/"):
            assert (BIN / Path(program).name).exists(), command
        elif program == "make":
            assert set(words[1:2]) <= targets, command
        for word in words:
            if re.fullmatch(r"(configs|slurm|scripts|notebooks|examples)/[\w./-]+", word):
                assert (REPO / word).exists(), f"{command}: {word}"


def make_dry_run(target: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    out = subprocess.run(
        ["make", "-n", "-o", f"{BIN}/.installed", target, f"BIN={BIN}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    return " ".join(TOOL.commands(out)).replace(str(BIN), ".venv/bin")


@pytest.mark.parametrize("step", range(1, 6))
def test_make_step_runs_the_readmes_command(step: int) -> None:
    """``make stepN`` runs step N's command as the README prints it (step 4: both agents, on this machine)."""
    [command] = [c for title, c in readme_steps().items() if title == SERIES[step - 1][0]]
    assert command in make_dry_run(f"step{step}")


def test_your_model_page_quotes_the_example() -> None:
    """docs/your_model.md's code excerpts are lines of examples/your_model.py, as they stand there."""
    source = (REPO / "examples" / "your_model.py").read_text()
    excerpts = fences((REPO / "docs" / "your_model.md").read_text(), "python")
    assert excerpts and all(excerpt in source for excerpt in excerpts)
