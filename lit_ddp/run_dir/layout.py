"""Where a run directory is and the names of its entries: every other module builds these paths from here.

    <root>/config.yaml                 the resolved config of the last launch
    <root>/hparams.yaml, events.out.*  TensorBoard logs (one log, continued across restarts)
    <root>/checkpoints/*.ckpt          checkpoint files (ModelCheckpoint), plus last.ckpt
    <root>/hpc_ckpt_N.ckpt             the preemption checkpoint (Lightning's name for it)
    <root>/set_aside/<UTC time>/       checkpoints of later steps than an explicit --ckpt_path's
    <root>/lit_ddp_events.jsonl        what happened to the run (resumes, restore checks), one JSON line each
    <root>/.lit_ddp.lock               the lock of the job that uses the run directory
    <root>/.lit_ddp.holder.json        that job's host, pid and start time

A checkpoint is a file, or a sharded checkpoint's directory of the same name (:mod:`lit_ddp.run_dir.sharded`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

DEFAULT_ROOT = "runs/default"
"""The run directory of a command with neither a config file nor a model class."""
RUN_ID = "LIT_DDP_RUN_ID"
"""Set, a run is ``<root>/<id>``: one per Slurm job (``slurm/train.sbatch`` sets the job id, which a requeue keeps)."""

CKPT_PATH_KEYWORDS = ("last", "best", "hpc", "registry")
"""``--ckpt_path`` values Lightning resolves itself to a checkpoint of the run (not file names)."""
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
EVENTS = "lit_ddp_events.jsonl"
"""What happened to the run, one JSON record a line (:mod:`lit_ddp.run_dir.events`)."""
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


def default_run_directory(config_files: Sequence[Any] | None, model_class_path: str | None) -> str:
    """The run directory of a config that sets no ``trainer.default_root_dir``: ``runs/<folder>/<name>`` of its
    step config (the last ``--config`` that names a ``model``, else the last one), as every config of ours names
    its own (``configs/mingpt/cpu.yaml``: ``runs/mingpt/cpu``); without a config file, ``runs/<model class>``;
    without either, ``runs/default``. The same command finds its run again, and two configs never resume each
    other's checkpoints."""
    paths = [Path(str(f)) for f in config_files or []]
    if paths:
        step = ([p for p in paths if _names_a_model(p)] or paths)[-1]
        return "/".join(["runs", *([step.parent.name] if step.parent.name else []), step.stem])
    if model_class_path:
        return f"runs/{model_class_path.rsplit('.', 1)[-1].lower()}"
    return DEFAULT_ROOT


def run_directory(
    root: str | None,
    config_files: Sequence[Any] | None,
    model_class_path: str | None,
    root_on_command_line: bool,
    env: Mapping[str, str] | None = None,
) -> tuple[str, str]:
    """The run directory of a parsed config and why it is not the configured ``root`` (``""`` when it is).

    Without ``root``: :func:`default_run_directory`. With ``LIT_DDP_RUN_ID`` set in ``env`` and no
    ``--trainer.default_root_dir`` on the command line: ``<root>/<LIT_DDP_RUN_ID>``, the job's own inside it."""
    env = os.environ if env is None else env
    why = ""
    if not root:
        root, why = default_run_directory(config_files, model_class_path), "trainer.default_root_dir is not set"
    if (run_id := env.get(RUN_ID, "")) and not root_on_command_line:
        root, why = os.path.join(str(root), run_id), f"{RUN_ID}={run_id}"
    return str(root), why


def _names_a_model(path: Path) -> bool:
    try:
        content = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(content, dict) and "model" in content
