"""Finding the checkpoint a run resumes from.

Lightning's ``ckpt_path="last"`` only looks for ``last.ckpt`` and silently starts from scratch when it is
missing or unreadable. A run directory here holds ``checkpoints/*.ckpt`` (ModelCheckpoint) and, under
Slurm, ``hpc_ckpt_N.ckpt`` (Lightning's requeue save); the newest *valid* one of all of them is the resume
point. No library offers this, hence our own code.
"""

from __future__ import annotations

import logging
import zipfile
from collections.abc import Iterable

import fsspec
from fsspec.core import url_to_fs

log = logging.getLogger(__name__)


class NoValidCheckpointError(RuntimeError):
    """Checkpoints exist in the run directory but none of them can be read."""


def _join(fs: fsspec.AbstractFileSystem, root: str, *parts: str) -> str:
    return fs.sep.join([root.rstrip(fs.sep), *parts])


def is_valid_checkpoint(path: str) -> bool:
    """Whether ``path`` is a complete ``torch.save`` archive (zip with intact CRCs).

    Reads the whole file once (bytes), not the tensors into memory. A file truncated while being written,
    or one that is not a torch checkpoint at all, is invalid.
    """
    try:
        with fsspec.open(path, "rb") as f, zipfile.ZipFile(f) as zf:
            names = zf.namelist()
            if not any(n.endswith("/data.pkl") or n == "data.pkl" for n in names):
                return False
            return zf.testzip() is None
    except (OSError, zipfile.BadZipFile, EOFError, ValueError, RuntimeError):
        return False


def checkpoint_candidates(root_dir: str, checkpoint_dir: str | None = None) -> list[str]:
    """All ``*.ckpt`` files of a run, newest (by modification time) first.

    Args:
        root_dir: the run directory (``trainer.default_root_dir``); ``hpc_ckpt_*.ckpt`` are looked for here.
        checkpoint_dir: the ModelCheckpoint directory; defaults to ``<root_dir>/checkpoints``.
    """
    fs, root = url_to_fs(str(root_dir))
    dirs = [checkpoint_dir if checkpoint_dir is not None else _join(fs, str(root_dir), "checkpoints")]
    found: list[tuple[float, int, str]] = []
    hpc = [p for p in _ls(fs, root) if p.rsplit("/", 1)[-1].startswith("hpc_ckpt_")]
    for d in dirs:
        _, dpath = url_to_fs(str(d))
        for p in [*_ls(fs, dpath), *hpc]:
            if not p.endswith(".ckpt"):
                continue
            info = fs.info(p)
            mtime = info.get("mtime") or info.get("LastModified") or info.get("created") or 0
            if hasattr(mtime, "timestamp"):
                mtime = mtime.timestamp()
            # On equal times prefer last.ckpt, which ModelCheckpoint writes after the numbered one.
            name = p if "file" in _protocols(fs) else fs.unstrip_protocol(p)
            found.append((float(mtime), int(p.endswith("/last.ckpt")), name))
    found.sort(reverse=True)
    return _dedupe(p for _, _, p in found)


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def _ls(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    try:
        return [p for p in fs.ls(path, detail=False)]
    except FileNotFoundError:
        return []


def _dedupe(paths: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for p in paths:
        seen.setdefault(p, None)
    return list(seen)


def find_resume_checkpoint(root_dir: str, checkpoint_dir: str | None = None) -> str | None:
    """The newest valid checkpoint of a run, or ``None`` when the run has none yet.

    An invalid newer checkpoint (e.g. truncated by a kill) is skipped with a warning naming it.

    Raises:
        NoValidCheckpointError: checkpoints exist but none is valid; training must not silently restart
            from scratch over them.
    """
    candidates = checkpoint_candidates(root_dir, checkpoint_dir)
    for path in candidates:
        if is_valid_checkpoint(path):
            return path
        log.warning("Checkpoint %s is truncated or unreadable; falling back to an older one.", path)
    if candidates:
        raise NoValidCheckpointError(
            f"None of the {len(candidates)} checkpoint(s) in {root_dir} can be read ({', '.join(candidates)}). "
            "Delete or move them to start from scratch, or pass --ckpt_path to a valid checkpoint."
        )
    return None
