"""Three one-process minGPT fits started at once, each with torch's default threads (the machine's cores, as a user's
fits get), end within 15 s of their last optimizer step, end-of-fit sample included: the sample is drawn on the
training device under a key-value cache, not recomputed token by token on a CPU that two other jobs share, with one
thread (``lit_ddp.generate.sample``'s ``cpu_threads``: with torch's two here, the sample took 3 to 10 s of a fit's
end, and once 36 s in CI). A job still alive 15 s after its last step has its stacks in the failure (py-spy)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.harness.clock import read_clock
from bench.harness.launch import clock_args
from tests import helpers

LINGER_S = 15.0
STEPS = 30


def stacks(pid: int) -> str:
    """Every thread's stack of a live process by ``py-spy dump`` (a dev dependency), or why there is none."""
    exe = shutil.which("py-spy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if exe is None:
        return "(no py-spy to dump the stacks)"
    try:
        dump = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "(py-spy dump timed out)"
    return dump.stdout + dump.stderr


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_three_fits_at_once_exit_promptly(tmp_path: Path, runner: helpers.Runner) -> None:
    env = helpers.subprocess_env()
    env.pop("OMP_NUM_THREADS", None)  # torch's default threads, not the test workers' one
    jobs = []
    for i in range(3):
        clock = tmp_path / f"clock{i}.txt"
        cmd = helpers.lit_ddp(
            "fit", "--config", str(helpers.CONFIGS / "mingpt" / "cpu.yaml"), "--trainer.devices", "1",
            "--trainer.max_steps", str(STEPS), "--trainer.default_root_dir", str(tmp_path / f"run{i}"), *helpers.QUIET,
            *clock_args(clock),
        )  # fmt: skip
        jobs.append((runner.track(helpers.start(cmd, env=env)), clock))
    ended: dict[int, float] = {}
    dumps: dict[int, str] = {}  # the stacks of a job still alive LINGER_S after its last step
    deadline = time.monotonic() + 240
    while len(ended) < 3 and time.monotonic() < deadline:
        now = time.time()
        for i, (proc, clock) in enumerate(jobs):
            if i in ended:
                continue
            if proc.poll() is not None:
                ended[i] = now
                continue
            steps = read_clock(clock)["step"]
            if i not in dumps and steps and steps[-1][1] == STEPS and now - steps[-1][0] > LINGER_S:
                dumps[i] = stacks(proc.pid)
        time.sleep(0.1)

    for i, (proc, clock) in enumerate(jobs):
        out = helpers.wait(proc, 10)
        assert out.returncode == 0, out.stdout[-3000:]
        assert "sample:" in out.stdout, out.stdout[-2000:]
        events = read_clock(clock)
        steps, end = events["step"], events["end"]
        assert steps and steps[-1][1] == STEPS, f"job {i}: {steps[-3:]}"
        last = steps[-1][0]
        lingered = ended[i] - last
        fit_end = f"{end[0][0] - last:.1f} s" if end else "none"
        print(f"job {i}: exited {lingered:.1f} s after its last step (fit end after {fit_end})")
        assert lingered < LINGER_S, (
            f"job {i} exited {lingered:.1f} s after its last step (fit end after {fit_end}):\n"
            f"{out.stdout[-2000:]}\n{dumps.get(i, '')}"
        )
