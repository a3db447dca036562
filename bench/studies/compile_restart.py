"""What torch.compile's on-disk caches save a restart (answered in docs/speed.md, "Restarts and the compile cache"):
the compiled main job on 2 processes under torchrun, a worker SIGKILLed 3-6 s into training, kill to the first step
after it (:func:`bench.recovery.measure`), with Inductor's caches in a fresh ``TORCHINDUCTOR_CACHE_DIR`` and without
(``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``).

    python -m bench.studies.compile_restart          # about 3 minutes here (make bench-compile-restart)
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path
from unittest import mock

from bench.recovery import measure

CONFIGS = ["configs/trainer/ddp.yaml", "configs/mingpt/cpu.yaml", "configs/checkpoint/fault_tolerant.yaml"]
FIT = ["--model.init_args.compile", "true", "--checkpoint.every_n_train_steps", "20"]


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=None, help="replays the kill moments (printed)")
    parser.add_argument("--log", type=Path, default=None, help="the jobs' output, appended (default: discarded)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"seed {seed}; {' '.join(CONFIGS)} {' '.join(FIT)}, torchrun, 2 processes, one SIGKILL", flush=True)
    rng = random.Random(seed)
    results: dict[str, dict[str, float]] = {}
    for mode in ("cache", "no cache"):
        with tempfile.TemporaryDirectory() as tmp:
            caches = {"TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}  # cold for the first launch
            caches |= {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"} if mode == "no cache" else {}
            with mock.patch.dict(os.environ, caches):
                results[mode] = measure(
                    "kill", 30, rng, Path(tmp) / "work", configs=CONFIGS, fit_args=FIT, log=args.log
                )
        print(f"{mode:9s} kill to first step {results[mode]['recovery']:5.1f} s", flush=True)
    ratio = results["cache"]["recovery"] / results["no cache"]["recovery"]
    print(f"restart with the compile cache / without: {ratio:.2f}x")
    return results


if __name__ == "__main__":
    main()
