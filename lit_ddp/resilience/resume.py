"""Which checkpoint a run starts from: the same one on every rank, handed to Lightning.

Lightning's ``ckpt_path="last"`` only looks for ``last.ckpt`` and silently starts from scratch when it is missing or
unreadable; each rank chooses for itself. Here, in the order a ``fit`` meets them:

1. :func:`list_candidates`: the run directory's checkpoints, highest recorded step first, listed once (before the
   process group exists; a directory whose every checkpoint is unreadable stops the run here, before anything
   is written);
2. :func:`choose`: rank zero takes the newest valid one of them;
3. :func:`agree`: the choice is broadcast and every rank checks that it can read it;
4. :func:`start_from`: what ``trainer.fit/validate/test`` is given as ``ckpt_path``: a marker that Lightning's
   checkpoint connector resolves through steps 2 and 3 once the process group exists, or the user's
   ``--ckpt_path`` (a rollback sets later checkpoints aside).

What a resume then puts back is :mod:`lit_ddp.resilience.state`.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_ddp import compat
from lit_ddp.errors import NoValidCheckpointError, ResumePointError, int_from_env
from lit_ddp.run_dir import layout, untrusted
from lit_ddp.run_dir.checkpoints import (
    checkpoint_step,
    ranked_checkpoints,
    set_aside_later_checkpoints,
    why_not_valid,
)

log = logging.getLogger(__name__)

RESUME_AUTO = "lit-ddp:resume-auto"
"""The ``ckpt_path`` :func:`start_from` gives Lightning in place of a path: resolved to the agreed checkpoint once
every rank has joined."""


def list_candidates(root_dir: str, checkpoint_dir: str | None = None) -> list[tuple[int, str]]:
    """The run's checkpoints as ``(global_step, path)``, highest step first
    (:func:`lit_ddp.run_dir.checkpoints.ranked_checkpoints`: headers only, no tensors; step -1 for an unreadable one).

    Raises:
        NoValidCheckpointError: the run directory holds checkpoints and not one has a readable header (training must
            not silently restart from scratch over them).
    """
    candidates = ranked_checkpoints(root_dir, checkpoint_dir)
    if candidates and all(step < 0 for step, _ in candidates):
        raise _no_valid_checkpoint(root_dir, candidates)
    return candidates


def choose(candidates: list[tuple[int, str]], root_dir: str) -> tuple[int, str] | None:
    """The valid checkpoint with the highest recorded step among ``candidates`` (:func:`list_candidates`), as
    ``(step, path)``, or None when there are none. Only the chosen file is read in full, its bytes checked against
    the digests written with them (:func:`~lit_ddp.run_dir.checkpoints.why_not_valid`); one that is not valid (cut
    short by a kill, or damaged since it was saved) is named in one line, with what is wrong with it, and the next one
    tried.

    Raises:
        NoValidCheckpointError: there are candidates and none is valid.
        UntrustedFileError: a candidate is a planted sharded checkpoint (:mod:`lit_ddp.run_dir.untrusted`).
    """
    for step, path in candidates:
        # A file whose step cannot be read at all (step -1) ranks last, but is named all the same: it is most
        # likely the newest one, cut short by a kill.
        if step < 0:
            log.warning("Checkpoint %s %s; falling back to an older one.", path, why_not_valid(path) or "is unreadable")
    for step, path in candidates:
        if step < 0:
            break
        why = why_not_valid(path)
        if why is None:
            return step, path
        log.warning("Checkpoint %s %s; falling back to an older one.", path, why)
    if candidates:
        raise _no_valid_checkpoint(root_dir, candidates)
    return None


def choose_checkpoint(root_dir: str, checkpoint_dir: str | None = None) -> str | None:
    """:func:`list_candidates` then :func:`choose`, in one process: the checkpoint a run in ``root_dir`` resumes from.

    Raises:
        NoValidCheckpointError: checkpoints exist but none is valid.
    """
    chosen = choose(list_candidates(root_dir, checkpoint_dir), root_dir)
    return None if chosen is None else chosen[1]


def _no_valid_checkpoint(root_dir: str, candidates: list[tuple[int, str]]) -> NoValidCheckpointError:
    return NoValidCheckpointError(
        f"None of the {len(candidates)} checkpoint(s) in {root_dir} can be read "
        f"({', '.join(p for _, p in candidates)}). Delete or move them to start from scratch, or pass "
        "--ckpt_path to a valid checkpoint."
    )


def agree(trainer: Any, choice: tuple[tuple[int, str] | None, str | None]) -> tuple[int, str] | None:
    """Rank zero's ``choice`` (its ``(step, path)`` or None, and the error it met or None), broadcast; every other
    rank checks that it can read the path (its header, the one read of it there). Collective: every rank must call
    it (others pass anything).

    Raises:
        NoValidCheckpointError: on every rank, when rank zero found checkpoints but none is valid.
        ResumePointError: on every rank, when some rank cannot read the chosen file; the message names the
            path and each such rank and host.
    """
    chosen, error = trainer.strategy.broadcast(choice, src=0)
    if error is not None:
        raise NoValidCheckpointError(error)
    if chosen is None:
        return None
    step, path = chosen
    readable = True
    if not trainer.is_global_zero:
        try:
            readable = checkpoint_step(path) == step
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
            f"({trainer.default_root_dir}) must be on storage that every node shares, with the same path on each"
        )
    return step, path


def start_from(trainer: Trainer, ckpt_path: str | None, fit: bool, given_step: int | None = None) -> str | None:
    """The ``ckpt_path`` to hand Lightning: without one, :data:`RESUME_AUTO`, the run directory's newest valid
    checkpoint, chosen once every rank has joined (``fit`` resumes it, ``validate`` / ``test`` evaluate it; a
    warning says when there is none); Lightning's names (``last``, ``best``, ``hpc``, ``registry``) as given; a
    local path made absolute (Lightning takes a relative path that starts with "http" for a URL).

    ``fit`` with a path is honoured once per job: its first attempt resumes from it and sets the run directory's
    checkpoints of later steps aside (:func:`~lit_ddp.run_dir.checkpoints.set_aside_later_checkpoints`); a torchrun
    restart or Slurm requeue of the same job resumes from what it saved since (the path while it saved nothing).
    ``given_step``: the ``global_step`` of ``ckpt_path``, where the caller read its header already (else read here).
    Collective: every rank must call it.

    Raises:
        NoValidCheckpointError: the run directory holds checkpoints and none has a readable header.
    """
    root = trainer.default_root_dir
    if ckpt_path in layout.CKPT_PATH_KEYWORDS:
        return ckpt_path
    if ckpt_path is not None:
        ckpt_path = untrusted.local_path(ckpt_path)
    if ckpt_path is not None and not fit:
        return ckpt_path
    if ckpt_path is not None and given_step is None:
        given_step = checkpoint_step(ckpt_path)
    if ckpt_path is not None and fit and restart_count() == 0:
        if trainer.is_global_zero:  # a rollback: the newer files are abandoned
            set_aside_later_checkpoints(root, layout.checkpoint_dir(root), str(ckpt_path), int(given_step or 0))
        trainer.strategy.barrier("lit_ddp_later_checkpoints_moved")
        return ckpt_path
    candidates = list_candidates(root, layout.checkpoint_dir(root))  # before the logger writes anything
    given = ckpt_path

    def resolve() -> str | None:  # once the process group exists (Lightning's checkpoint connector calls it)
        choice: tuple[tuple[int, str] | None, str | None] = (None, None)
        if trainer.is_global_zero:
            try:
                choice = (choose(candidates, root), None)
            except NoValidCheckpointError as e:
                choice = (None, str(e))
        chosen = agree(trainer, choice)
        path = None if chosen is None else chosen[1]
        if given is not None and given_step is not None and (chosen is None or chosen[0] < given_step):
            path = given  # this job has saved nothing since it started from --ckpt_path
        if path is not None:
            path = untrusted.local_path(path)
            rank_zero_info(f"{'Resuming from' if fit else 'Evaluating'} {path}")
        elif not fit:
            rank_zero_warn(
                f"No checkpoint in {root}: evaluating the untrained model. Give --ckpt_path, or the "
                "trainer.default_root_dir of the run to evaluate."
            )
        return path

    compat.install_resume_resolver(trainer, RESUME_AUTO, resolve)
    return RESUME_AUTO


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times the launcher has restarted this job: torchrun's ``TORCHELASTIC_RESTART_COUNT`` plus
    Slurm's ``SLURM_RESTART_COUNT`` (requeues); 0 for its first attempt.

    Raises:
        UsageError: one of them is not a whole number (named).
    """
    return sum(int_from_env(key, env) or 0 for key in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))
