"""Finding the checkpoint a run resumes from, the same one on every rank.

Lightning's ``ckpt_path="last"`` only looks for ``last.ckpt`` and silently starts from scratch when it is
missing or unreadable. A run directory here holds ``checkpoints/*.ckpt`` (ModelCheckpoint) and, under
Slurm, ``hpc_ckpt_N.ckpt`` (Lightning's requeue save); the newest *valid* one of all of them is the resume
point. No library offers this, hence our own code. Writing is :mod:`lit_ddp.resilience.checkpoint_io`.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import socket
import time
import zipfile
from collections.abc import Mapping
from typing import Any

import fsspec
import torch.distributed as dist
from fsspec.core import url_to_fs
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_ddp import compat
from lit_ddp.errors import NoValidCheckpointError, ResumePointError
from lit_ddp.resilience import sharded

log = logging.getLogger(__name__)


def _join(fs: fsspec.AbstractFileSystem, root: str, *parts: str) -> str:
    return fs.sep.join([root.rstrip(fs.sep), *parts])


def is_valid_checkpoint(path: str) -> bool:
    """Whether ``path`` is a complete ``torch.save`` archive (zip with intact CRCs), or a sharded checkpoint's
    directory with such a ``meta.pt`` and every shard its DCP metadata names (:mod:`lit_ddp.resilience.sharded`).

    Reads the whole file once (bytes), not the tensors into memory. A file truncated while being written,
    or one that is not a torch checkpoint at all, is invalid.
    """
    if sharded.is_sharded(path) and not sharded.shards_complete(path):
        return False
    try:
        with fsspec.open(sharded.meta_path(path), "rb") as f, zipfile.ZipFile(f) as zf:
            names = zf.namelist()
            if not any(n.endswith("/data.pkl") or n == "data.pkl" for n in names):
                return False
            return zf.testzip() is None
    except (OSError, zipfile.BadZipFile, EOFError, ValueError, RuntimeError):
        return False


class _HeaderUnpickler(pickle.Unpickler):
    """Unpickles a checkpoint's ``data.pkl`` without its tensors and without running any code: every class
    but ``OrderedDict`` becomes an inert placeholder, every tensor storage ``None``."""

    class _Opaque:
        def __init__(self, *args: Any, **kwargs: Any) -> None: ...

        def __setstate__(self, state: Any) -> None: ...

    def find_class(self, module: str, name: str) -> Any:
        return collections.OrderedDict if (module, name) == ("collections", "OrderedDict") else self._Opaque

    def persistent_load(self, pid: Any) -> None:
        return None


def checkpoint_header(path: str) -> dict[str, Any]:
    """A checkpoint's dictionary without its tensors (they are ``None``), reading only its ``data.pkl``
    record (a few KB), locally or through fsspec, and running no code from the file. For a sharded checkpoint's
    directory, that of its ``meta.pt`` (all but the parameters and optimizer states).

    Raises:
        ValueError: not a readable torch checkpoint.
    """
    try:
        with fsspec.open(sharded.meta_path(path), "rb") as f, zipfile.ZipFile(f) as zf:
            name = next((n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if name is None:
                raise ValueError(f"{path} has no data.pkl")
            with zf.open(name) as pkl:
                data = _HeaderUnpickler(pkl).load()
    except (OSError, zipfile.BadZipFile, EOFError, pickle.UnpicklingError, RuntimeError) as e:
        raise ValueError(f"{path} is not a readable checkpoint: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a checkpoint dictionary")
    return data


def checkpoint_step(path: str) -> int:
    """The ``global_step`` recorded in a checkpoint (:func:`checkpoint_header`: the tensors are not read).

    Raises:
        ValueError: not a readable torch checkpoint with a ``global_step``.
    """
    step = checkpoint_header(path).get("global_step")
    if not isinstance(step, int):
        raise ValueError(f"{path} records no global_step")
    return step


_KIND_ORDER = {"last": 0, "hpc": 1, "step": 2}  # equal steps are the same point; prefer last.ckpt, then hpc


def _kind(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    return "last" if name == "last.ckpt" else "hpc" if name.startswith("hpc_ckpt_") else "step"


def checkpoint_candidates(root_dir: str, checkpoint_dir: str | None = None) -> list[str]:
    """All ``*.ckpt`` files of a run, highest recorded step first (see :func:`ranked_checkpoints`)."""
    return [path for _, path in ranked_checkpoints(root_dir, checkpoint_dir)]


def ranked_checkpoints(root_dir: str, checkpoint_dir: str | None = None) -> list[tuple[int, str]]:
    """All ``*.ckpt`` files of a run as ``(global_step, path)``, highest step first; for equal steps
    ``last.ckpt``, then ``hpc_ckpt_N.ckpt``, then by name. File times play no part (a copied run directory or
    an object store with 1-second times reorders them). A file whose step cannot be read gets step -1, so it
    comes last (and fails validation there).

    Args:
        root_dir: the run directory (``trainer.default_root_dir``); ``hpc_ckpt_*.ckpt`` are looked for here.
        checkpoint_dir: the ModelCheckpoint directory; defaults to ``<root_dir>/checkpoints``.
    """
    root_dir = str(root_dir)
    fs, _ = url_to_fs(root_dir)
    ckpt_dir = str(checkpoint_dir) if checkpoint_dir is not None else _join(fs, root_dir, "checkpoints")
    # Paths are spelled as the run directory was given (relative stays relative): every rank resolves the
    # chosen one itself, and messages name what the user wrote.
    names = [_join(fs, ckpt_dir, n) for n in _names(fs, ckpt_dir) if n.endswith(".ckpt")]
    names += [_join(fs, root_dir, n) for n in _names(fs, root_dir) if n.startswith("hpc_ckpt_") and n.endswith(".ckpt")]
    found: dict[str, tuple[int, int, str]] = {}
    for name in names:
        try:
            step = checkpoint_step(name)
        except ValueError:
            step = -1
        found[name] = (step, _KIND_ORDER[_kind(name)], name)
    ordered = sorted(found.values(), key=lambda t: (-t[0], t[1], t[2]))
    return [(step, name) for step, _, name in ordered]


def _names(fs: fsspec.AbstractFileSystem, directory: str) -> list[str]:
    """The entry names (files and directories) of ``directory``, local or through fsspec; none if it is missing.
    Listed afresh: an object store's filesystem (s3fs) keeps each listing, and other processes write here."""
    path = url_to_fs(directory)[1]
    fs.invalidate_cache(path)
    try:
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
    except FileNotFoundError:
        return []


def find_resume_checkpoint(root_dir: str, checkpoint_dir: str | None = None) -> str | None:
    """The valid checkpoint with the highest recorded step, or ``None`` when the run has none yet.

    Each candidate's small ``data.pkl`` record is read for its step; only the chosen file is then read in
    full (its CRCs). An invalid one (e.g. truncated by a kill) is skipped with a warning naming it.

    Raises:
        NoValidCheckpointError: checkpoints exist but none is valid; training must not silently restart
            from scratch over them.
    """
    candidates = ranked_checkpoints(root_dir, checkpoint_dir)
    for step, path in candidates:
        # A file whose step cannot be read at all (step -1) ranks last, but is named all the same: it is most
        # likely the newest one, cut short by a kill.
        if step < 0:
            log.warning("Checkpoint %s is truncated or unreadable; falling back to an older one.", path)
    for step, path in candidates:
        if step < 0:
            break
        if is_valid_checkpoint(path):
            return path
        log.warning("Checkpoint %s is truncated or unreadable; falling back to an older one.", path)
    if candidates:
        raise _no_valid_checkpoint(root_dir, candidates)
    return None


def _no_valid_checkpoint(root_dir: str, candidates: list[tuple[int, str]]) -> NoValidCheckpointError:
    return NoValidCheckpointError(
        f"None of the {len(candidates)} checkpoint(s) in {root_dir} can be read "
        f"({', '.join(p for _, p in candidates)}). Delete or move them to start from scratch, or pass "
        "--ckpt_path to a valid checkpoint."
    )


def check_resumable(root_dir: str, checkpoint_dir: str | None = None) -> None:
    """Fail before anything is written when the run directory holds checkpoints and not one of them has a
    readable header (a cheap early form of :func:`find_resume_checkpoint`'s refusal: no file is read in full).

    Raises:
        NoValidCheckpointError: every checkpoint there is unreadable.
    """
    candidates = ranked_checkpoints(root_dir, checkpoint_dir)
    if candidates and all(step < 0 for step, _ in candidates):
        raise _no_valid_checkpoint(root_dir, candidates)


RESUME_AUTO = "lit-ddp:resume-auto"
"""``ckpt_path`` value that :func:`resume_from_agreed_checkpoint` replaces with the agreed resume checkpoint."""


def agree_on_resume_checkpoint(trainer: Any, root_dir: str, checkpoint_dir: str) -> str | None:
    """Rank zero chooses the resume checkpoint (:func:`find_resume_checkpoint`); the choice is broadcast and
    every rank checks that it can read that file. Collective: every rank must call it.

    Raises:
        NoValidCheckpointError: on every rank, when rank zero finds checkpoints but none is valid.
        ResumePointError: on every rank, when some rank cannot read the chosen file; the message names the
            path and each such rank and host.
    """
    choice: tuple[str | None, str | None] = (None, None)
    if trainer.is_global_zero:
        try:
            choice = (find_resume_checkpoint(root_dir, checkpoint_dir), None)
        except NoValidCheckpointError as e:
            choice = (None, str(e))
    path, error = trainer.strategy.broadcast(choice, src=0)
    if error is not None:
        raise NoValidCheckpointError(error)
    if path is None:
        return None
    try:
        checkpoint_step(path)
        readable = True
    except ValueError:
        readable = False
    mine = (trainer.global_rank, socket.gethostname(), readable)
    everyone: list[Any] = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    blind = [f"rank {r} on {host}" for r, host, ok in everyone if not ok]
    if blind:
        raise ResumePointError(
            f"rank 0 chose to resume from {path}, which {', '.join(blind)} cannot read: the run directory "
            f"({root_dir}) must be on storage that every node shares, with the same path on each"
        )
    return path


def resume_from_agreed_checkpoint(
    trainer: Trainer, checkpoint_dir: str, required: bool = False, given: str | None = None
) -> None:
    """Makes ``trainer.fit/validate/test(ckpt_path=RESUME_AUTO)`` start from the checkpoint the ranks agree on
    once the process group exists (:func:`agree_on_resume_checkpoint`); Lightning's own choice
    (``ckpt_path="last"`` / ``"hpc"``) is per rank and by file name or time. ``required``: warn when the run
    directory has none (an evaluation would score the untrained weights). ``given``: the job's explicit
    ``--ckpt_path``, on a restart of that job: the run directory's checkpoint wins only from its step on."""

    def resolve() -> str | None:
        path = agree_on_resume_checkpoint(trainer, trainer.default_root_dir, checkpoint_dir)
        if given is not None and (path is None or checkpoint_step(path) < checkpoint_step(given)):
            path = given  # this job has saved nothing since it started from --ckpt_path
        if path is not None:
            rank_zero_info(f"{'Evaluating' if required else 'Resuming from'} {path}")
            if not required and trainer.is_global_zero:
                warn_changed_hyperparameters(path, dict(trainer.lightning_module.hparams))
        elif required:
            rank_zero_warn(
                f"No checkpoint in {trainer.default_root_dir}: evaluating the untrained model. Give --ckpt_path, or "
                "the trainer.default_root_dir of the run to evaluate."
            )
        return path

    compat.install_resume_resolver(trainer, RESUME_AUTO, resolve)


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times the launcher has restarted this job: torchrun's ``TORCHELASTIC_RESTART_COUNT`` plus
    Slurm's ``SLURM_RESTART_COUNT`` (requeues); 0 for its first attempt."""
    env = os.environ if env is None else env
    return sum(int(env.get(key) or 0) for key in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


def set_aside_later_checkpoints(root_dir: str, checkpoint_dir: str, given: str) -> list[str]:
    """Moves every checkpoint of the run directory of a later step than ``given``'s into
    ``<root_dir>/set_aside/<UTC time>/``: resuming from an older checkpoint abandons them, and a later automatic
    resume (a restart, a requeue) must not jump forward onto them. ``given`` itself, however it is spelled, and
    its step's other files (``last.ckpt`` beside ``epoch=N-step=S.ckpt``) stay. Nothing is deleted. Returns the
    moved paths. Rank zero only, before anything of the run is written."""
    step = checkpoint_step(given)
    later = [p for s, p in ranked_checkpoints(root_dir, checkpoint_dir) if s > step]
    if not later:
        return []
    fs, _ = url_to_fs(str(root_dir))
    target = _join(fs, str(root_dir), "set_aside", time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    fs.makedirs(url_to_fs(target)[1], exist_ok=True)
    for path in later:
        fs.mv(url_to_fs(path)[1], url_to_fs(_join(fs, target, path.rsplit("/", 1)[-1]))[1])
    rank_zero_warn(
        f"Resuming from {given} (step {step}): its run directory's {len(later)} checkpoint(s) of later steps "
        f"belong to the abandoned continuation and are moved to {target}, so that no automatic resume "
        f"returns to them: {', '.join(later)}"
    )
    return later


def warn_changed_hyperparameters(path: str, configured: dict[str, Any]) -> list[str]:
    """Warns, key by key, where the config's model hyperparameters differ from those the checkpoint was written
    with: the model is built from the config, while a resume restores the optimizer and LR scheduler states, which
    keep the checkpoint's rates and schedule (:func:`lit_ddp.resilience.resume_report.warn_restored_settings`
    names them). Returns the keys.
    """
    saved = checkpoint_header(path).get("hyper_parameters") or {}
    changed = [
        k for k, v in configured.items() if k in saved and not k.startswith("_") and _plain(saved[k]) != _plain(v)
    ]
    for key in changed:
        rank_zero_warn(
            f"Resuming from {path}, written with model.init_args.{key}={saved[key]!r}; the config now says "
            f"{configured[key]!r}: the model is built with the config's value, the restored optimizer and "
            "learning-rate schedule keep the checkpoint's settings (a warning lists those that differ)."
        )
    return changed


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, list | tuple) else value
