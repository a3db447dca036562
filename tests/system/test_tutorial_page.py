"""Every step of the README's table, run as written, prints what docs/tutorial.md says it prints ("What each
step prints"): the step and val/loss of its first validation, and for the regression its final global_step and
val/loss, within the page's stated tolerance (issue 25).

The commands are the README's own, with a temporary run directory and no progress bar appended; minGPT's rows
stop at their first validation (``--trainer.max_steps 100``: the warmup is the first 100 steps whatever
max_steps is, so that validation is the full run's), the regression's run whole (seconds each). Not run: the
GPU row (measured on a GPU machine), and the 10-minute row, whose first validation (step 300)
comes after its cosine decay began.
"""

from __future__ import annotations

import math
import shlex
import sys
from pathlib import Path

import pytest
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from lit_ddp.run_dir.checkpoints import checkpoint_step
from lit_ddp.tensorboard import read_scalars
from tests.helpers import QUIET, REPO, Runner, noise_lines, page_figures, readme_commands, wait
from tests.system.helpers_slurm import cancel, require_cluster, sbatch, wait_job_done

BIN = Path(sys.executable).parent  # the environment running the tests: .venv/bin under `make test`


TOLERANCE, FIGURES = page_figures()
SLURM_ROWS = [name for name, command in readme_commands().items() if command.startswith("sbatch")]
RUN = [n for n in FIGURES if not any(c in readme_commands()[n] for c in ("cpu_10min.yaml", "gpu.yaml"))]  # see above


def shortened(name: str) -> bool:
    """minGPT's rows stop at their first validation (the module docstring says why that is the full run's)."""
    command = readme_commands()[name]
    return "configs/mingpt/" in command or command.startswith("make train")


def run_step(name: str, root: Path, runner: Runner, tmp_path: Path) -> str:
    """Runs the README's command for step ``name`` into run directory ``root``; returns its output."""
    words = shlex.split(readme_commands()[name])
    env = {}  # the command's leading NAME=VALUE words, as a shell reads them
    while "=" in words[0] and words[0].split("=")[0].isidentifier():
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    extra = ["--trainer.default_root_dir", str(root), *QUIET]
    if shortened(name):
        extra += ["--trainer.max_steps", str(FIGURES[name]["first_step"])]
    if words[0] == "make":  # `make train ARGS=...`: the Makefile appends ARGS to the command it runs
        words, extra = [*words, f"ARGS={shlex.join(extra)}"], []
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
    if "HEAD_HOST:29500" not in words:
        result = runner.run([*words, *extra], timeout=400, **env)
        assert result.returncode == 0, result.stdout[-5000:]
        return result.stdout
    # multinode.py: the same command on each "node" of this machine, its own --node_rank, node 0 at 127.0.0.1
    words[words.index("HEAD_HOST:29500")] = f"127.0.0.1:{find_free_network_port()}"
    agents = []
    for node_rank in ("0", "1"):
        words[words.index("--node_rank") + 1] = node_rank
        agents.append(runner.start([*words, *extra], **env))
    outputs = [wait(agent, 400) for agent in agents]
    for result in outputs:
        assert result.returncode == 0, result.stdout[-5000:]
    return "".join(result.stdout for result in outputs)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slurm] if n in SLURM_ROWS else []) for n in RUN])
def test_each_step_prints_what_the_page_says(name: str, runner: Runner, tmp_path: Path) -> None:
    if name in SLURM_ROWS:
        require_cluster()
    root = tmp_path / "run"
    output = run_step(name, root, runner, tmp_path)
    expected = FIGURES[name]
    val = read_scalars(root, "val/loss")
    assert val, output[-5000:]
    (first_step, first_loss), (_, last_loss) = val[0], val[-1]
    assert first_step + 1 == expected["first_step"]  # TensorBoard's step is Lightning's 0-based batch index
    assert math.isclose(first_loss, expected["first_loss"], rel_tol=TOLERANCE), (first_loss, expected)
    last_step = checkpoint_step(str(root / "checkpoints" / "last.ckpt"))  # a file, or FSDP2's sharded directory
    assert last_step == expected["first_step" if shortened(name) else "last_step"]
    if not shortened(name):
        assert math.isclose(last_loss, expected["last_loss"], rel_tol=TOLERANCE), (last_loss, expected)
    assert f"last validation: val/loss {last_loss:.4f}" in output, "the run's summary names its last val/loss"
    assert not noise_lines(output), noise_lines(output)


@pytest.mark.slow
def test_one_process_on_the_union_batch_prints_the_ddp_row(tmp_path: Path) -> None:
    """The page's claim for ``multigpu.py``: DDP over 2 x 32 is one process at batch 64, the same numbers."""
    from lit_ddp.cli import cli_main

    [ddp] = [FIGURES[n] for n, c in readme_commands().items() if c.endswith("configs/regression/ddp.yaml")]
    config = ["--config", str(REPO / "configs/regression/single_device.yaml"), "--data.init_args.batch_size", "64"]
    cli = cli_main(["fit", *config, "--trainer.default_root_dir", str(tmp_path), *QUIET])
    assert cli is not None and cli.trainer.global_step == ddp["last_step"]
    loss = float(cli.trainer.callback_metrics["val/loss"])
    assert math.isclose(loss, ddp["last_loss"], rel_tol=TOLERANCE), (loss, ddp)
