"""Which configs ``make train`` composes: the main job on GPUs where torch sees a CUDA device, on CPUs otherwise.

    python scripts/main_job.py   # prints them, as the Makefile's CONFIGS reads them

The Makefile asks when ``make train`` runs (after its venv exists); ``make train CONFIGS="..."`` chooses instead. A
script of the repository, not of the package: nothing of lit_ddp imports it.
"""

from __future__ import annotations

import torch

DDP = "configs/trainer/ddp.yaml"
CPU_CONFIGS = (DDP, "configs/mingpt/cpu.yaml")  # DDP over 2 CPU processes (about 2 minutes on 2 cores)
GPU_CONFIGS = (DDP, "configs/mingpt/gpu.yaml")  # one process per GPU (DDP over several), eager, bf16 autocast


def default_configs() -> tuple[str, ...]:
    """:data:`GPU_CONFIGS` when ``torch.cuda.is_available()``, else :data:`CPU_CONFIGS`: paths relative to the
    repository root, in the order they compose (the DDP fragment first)."""
    return GPU_CONFIGS if torch.cuda.is_available() else CPU_CONFIGS


def main() -> None:
    """Prints :func:`default_configs`, separated by spaces."""
    print(" ".join(default_configs()))


if __name__ == "__main__":
    main()
