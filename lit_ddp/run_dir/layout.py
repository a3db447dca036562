"""The names of a run directory's entries: every other module builds these paths from here.

    <root>/config.yaml                 the resolved config of the last launch
    <root>/hparams.yaml, events.out.*  TensorBoard logs (one log, continued across restarts)
    <root>/checkpoints/*.ckpt          checkpoint files (ModelCheckpoint), plus last.ckpt
    <root>/hpc_ckpt_N.ckpt             the preemption checkpoint (Lightning's name for it)
    <root>/set_aside/<UTC time>/       checkpoints of later steps than an explicit --ckpt_path's
    <root>/.lit_ddp.lock               the lock of the job that uses the run directory
    <root>/.lit_ddp.holder.json        that job's host, pid and start time

A checkpoint is a file, or a sharded checkpoint's directory of the same name (:mod:`lit_ddp.run_dir.sharded`).
"""

from __future__ import annotations

import re

CHECKPOINTS = "checkpoints"
"""The folder of the checkpoint callback's files, in the run directory."""
CKPT_SUFFIX = ".ckpt"
LAST = "last.ckpt"
"""The checkpoint callback's newest checkpoint (Lightning's ``ModelCheckpoint.CHECKPOINT_NAME_LAST``)."""
HPC_PREFIX = "hpc_ckpt_"
HPC_NAME = re.compile(r"hpc_ckpt_(\d+)\.ckpt")
"""``hpc_ckpt_N.ckpt``, in the run directory itself: Lightning's name for the preemption checkpoint."""
HPC_GLOB = "hpc_ckpt_*.ckpt"
STEP_IN_NAME = re.compile(r"step=(\d+)")
"""The step in a step checkpoint's name (``epoch=0-step=50.ckpt``)."""
SET_ASIDE = "set_aside"
LOCK_FILE = ".lit_ddp.lock"
HOLDER_FILE = ".lit_ddp.holder.json"  # apart from the lock file, which filelock truncates when it opens it


def checkpoint_dir(root: str) -> str:
    """``<root>/checkpoints``, spelled as ``root`` is (a local path or an fsspec URL; relative stays relative)."""
    return str(root).rstrip("/") + "/" + CHECKPOINTS


def last_checkpoint(root: str) -> str:
    """``<root>/checkpoints/last.ckpt``."""
    return checkpoint_dir(root) + "/" + LAST


def is_checkpoint_name(name: str) -> bool:
    """Whether an entry of the checkpoints folder is a checkpoint (``*.ckpt``: temporary files are not)."""
    return name.endswith(CKPT_SUFFIX)


def is_hpc_name(name: str) -> bool:
    """Whether an entry of the run directory is a preemption checkpoint (``hpc_ckpt_*.ckpt``)."""
    return name.startswith(HPC_PREFIX) and name.endswith(CKPT_SUFFIX)


def checkpoint_kind(name: str) -> str:
    """``"last"`` (``last.ckpt``), ``"hpc"`` (``hpc_ckpt_N.ckpt``) or ``"step"`` (any other checkpoint)."""
    return "last" if name == LAST else "hpc" if name.startswith(HPC_PREFIX) else "step"
