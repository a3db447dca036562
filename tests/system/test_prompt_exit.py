"""Three one-process minGPT fits started at once, each with torch's default threads (the machine's cores, as a user's
fits get), end within 15 s of their last optimizer step, end-of-fit sample included: the sample is drawn on the
training device under a key-value cache, not recomputed token by token on a CPU that two other jobs share."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench.gpu_check import read_run_clock
from tests import helpers

LINGER_S = 15.0
STEPS = 30


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
            "--trainer.callbacks+=bench.run_clock.RunClock", f"--trainer.callbacks.init_args.path={clock}",
        )  # fmt: skip
        jobs.append((runner.track(helpers.start(cmd, env=env)), clock))
    ended: dict[int, float] = {}
    deadline = time.monotonic() + 240
    while len(ended) < 3 and time.monotonic() < deadline:
        for i, (proc, _) in enumerate(jobs):
            if i not in ended and proc.poll() is not None:
                ended[i] = time.time()
        time.sleep(0.1)
    for i, (proc, clock) in enumerate(jobs):
        out = helpers.wait(proc, 10)
        assert out.returncode == 0, out.stdout[-3000:]
        assert "sample:" in out.stdout, out.stdout[-2000:]
        steps = read_run_clock(clock)["step"]
        assert steps and steps[-1][1] == STEPS, f"job {i}: {steps[-3:]}"
        lingered = ended[i] - steps[-1][0]
        print(f"job {i}: exited {lingered:.1f} s after its last step")
        assert lingered < LINGER_S, f"job {i} exited {lingered:.1f} s after its last step:\n{out.stdout[-2000:]}"
