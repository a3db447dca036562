"""Every documented training command, run as written, prints what the docs say it prints (issues 25 and 53).

- The README's output blocks: each block's command runs as ``scripts/readme_outputs.py`` runs it to write the block
  (a scratch directory beside the checkout's configs and venv, the same faults), and the block's lines read the
  same as the fresh run's (the script's :func:`differences`: text and integers equal, decimals within the page's
  tolerance, timings, ports and process ids and text samples left out). The quick start's run is step 5's, and
  ``lit-ddp generate`` samples from its checkpoint.
- docs/tutorial.md's "What each step prints": the step and val/loss of the first validation, and the final
  global_step and val/loss, read from the run's TensorBoard log, within the page's stated tolerance; for the
  README's steps from the run above, for the other compositions (and the README's sbatch command) from a run with a
  temporary run directory and no progress bar. minGPT's other compositions stop at their first validation
  (``--trainer.max_steps 100``: the warmup is the first 100 steps whatever max_steps is, so that validation is the
  full run's). Not run: the GPU rows (measured on a GPU machine), and the 10-minute row, whose first validation
  (step 300) comes after its cosine decay began.
"""

from __future__ import annotations

import math
import re
import shlex
import sys
from pathlib import Path

import pytest

from lit_ddp.run_dir.checkpoints import checkpoint_step
from lit_ddp.tensorboard import read_scalars
from tests.helpers import (
    QUIET,
    README,
    REPO,
    Runner,
    noise_lines,
    page_figures,
    readme_outputs,
    readme_steps,
    step_commands,
)
from tests.system.helpers_slurm import cancel, require_cluster, sbatch, wait_job_done

BIN = Path(sys.executable).parent  # the environment running the tests: .venv/bin under `make test`
TOOL = readme_outputs()
TOLERANCE, FIGURES = page_figures()
BLOCKS = {block.name: block for block in TOOL.blocks(README.read_text())}
# A run per block whose command runs on its own; step 5 shows the quick start's run, generate reads its checkpoint.
RUNS = [name for name in BLOCKS if name not in TOOL.SAME_RUN and name != "generate"]
# The README's step each block belongs to: its heading's name in docs/tutorial.md's table.
STEP_OF = {
    name: title for title, command in readme_steps().items() for name, b in BLOCKS.items() if b.command == command
}
SLURM_ROWS = [name for name, command in step_commands().items() if command.startswith("sbatch")]
OTHERS = [
    name
    for name in FIGURES
    if name not in STEP_OF.values() and not any(c in step_commands()[name] for c in ("cpu_10min.yaml", "gpu.yaml"))
]


def check_figures(name: str, root: Path, output: str, shortened: bool = False) -> None:
    """The page's figures for step ``name`` against the TensorBoard log of run directory ``root``."""
    expected = FIGURES[name]
    val = read_scalars(root, "val/loss")
    assert val, output[-5000:]
    (first_step, first_loss), (_, last_loss) = val[0], val[-1]
    assert first_step + 1 == expected["first_step"]  # TensorBoard's step is Lightning's 0-based batch index
    assert math.isclose(first_loss, expected["first_loss"], rel_tol=TOLERANCE), (first_loss, expected)
    last_step = checkpoint_step(str(root / "checkpoints" / "last.ckpt"))  # a file, or FSDP2's sharded directory
    assert last_step == expected["first_step" if shortened else "last_step"]
    if not shortened:
        assert math.isclose(last_loss, expected["last_loss"], rel_tol=TOLERANCE), (last_loss, expected)
    assert f"last validation: val/loss {last_loss:.4f}" in output, "the run's summary names its last val/loss"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", RUNS)
def test_readme_block_is_what_its_command_prints(name: str, tmp_path: Path) -> None:
    """Block ``name`` (and the blocks shown from the same run, or reading it) against a fresh run, then the page's
    figures for its step from that run's TensorBoard log."""
    scratch = TOOL.scratch_dir(tmp_path)
    text = TOOL.run(name, BLOCKS[name].command, scratch)
    problems = TOOL.differences(name, BLOCKS[name].shown, TOOL.shown_lines(name, text), TOLERANCE)
    for other, source in TOOL.SAME_RUN.items():
        if source == name:
            assert TOOL.resolve(BLOCKS[other].command) == TOOL.resolve(BLOCKS[name].command)
            problems += TOOL.differences(other, BLOCKS[other].shown, TOOL.shown_lines(other, text), TOLERANCE)
    if name == "quickstart":  # generate samples from the quick start's checkpoint
        sample = TOOL.run("generate", BLOCKS["generate"].command, scratch)
        assert sample.startswith("ROMEO:") and len(sample) > 150, sample  # 200 characters, some of them blanks
        problems += TOOL.differences("generate", BLOCKS["generate"].shown, TOOL.shown_lines("generate", sample), 0)
    assert not problems, "\n".join(problems)
    assert not noise_lines(text), noise_lines(text)
    [root] = re.findall(r"^last checkpoint: (\S+)/checkpoints/last\.ckpt", text, re.M)
    for shown in [name, *(o for o, s in TOOL.SAME_RUN.items() if s == name)]:
        if shown in STEP_OF:
            check_figures(STEP_OF[shown], scratch / root, text)


def shortened(name: str) -> bool:
    """minGPT's other compositions stop at their first validation (the module docstring says why)."""
    return "configs/mingpt/" in step_commands()[name]


def run_step(name: str, root: Path, runner: Runner, tmp_path: Path) -> str:
    """Runs the documented command ``name`` into run directory ``root``; returns its output."""
    words = shlex.split(step_commands()[name])
    env = {}  # the command's leading NAME=VALUE words, as a shell reads them
    while "=" in words[0] and words[0].split("=")[0].isidentifier():
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    extra = ["--trainer.default_root_dir", str(root), *QUIET]
    if shortened(name):
        extra += ["--trainer.max_steps", str(FIGURES[name]["first_step"])]
    if words[0] == "sbatch":
        out = tmp_path / "job.out"
        script = words.index("slurm/train.sbatch")
        job = sbatch(words[script], [*words[script + 1 :], *extra], [*words[1:script], "-o", str(out)])
        try:
            info = wait_job_done(job, timeout=400, output=out)
        finally:
            cancel(job)
        assert info["JobState"] == "COMPLETED", out.read_text()[-5000:]
        return out.read_text()
    words = [str(BIN / Path(w).name) if w.startswith(".venv/bin/") else w for w in words]
    result = runner.run([*words, *extra], timeout=400, **env)
    assert result.returncode == 0, result.stdout[-5000:]
    return result.stdout


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slurm] if n in SLURM_ROWS else []) for n in OTHERS]
)
def test_each_composition_prints_what_the_page_says(name: str, runner: Runner, tmp_path: Path) -> None:
    if name in SLURM_ROWS:
        nodes = shlex.split(step_commands()[name])
        require_cluster(nodes=int(nodes[nodes.index("--nodes") + 1]))
    root = tmp_path / "run"
    output = run_step(name, root, runner, tmp_path)
    check_figures(name, root, output, shortened(name))
    assert not noise_lines(output), noise_lines(output)


@pytest.mark.slow
def test_one_process_on_the_union_batch_prints_the_ddp_step(tmp_path: Path) -> None:
    """Step 2's claim: DDP over 2 x 32 is one process at batch 64, the same numbers."""
    from lit_ddp.cli import cli_main

    [ddp] = [FIGURES[n] for n, c in step_commands().items() if c.endswith("configs/regression/ddp.yaml")]
    config = ["--config", str(REPO / "configs/regression/single_device.yaml"), "--data.init_args.batch_size", "64"]
    cli = cli_main(["fit", *config, "--trainer.default_root_dir", str(tmp_path), *QUIET])
    assert cli is not None and cli.trainer.global_step == ddp["last_step"]
    loss = float(cli.trainer.callback_metrics["val/loss"])
    assert math.isclose(loss, ddp["last_loss"], rel_tol=TOLERANCE), (loss, ddp)
