"""Where a text comes from: the Tiny Shakespeare embedded in the package, a local path, or any fsspec URL
(``https://``, ``s3://``...), downloaded once into a sha256-checked cache.

Tiny Shakespeare (Karpathy's char-rnn ``tinyshakespeare/input.txt``, 1,115,394 bytes) ships gzipped inside the
package, so training and the tests need no network. ``$LIT_DDP_DATA`` (a path or URL) overrides it.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import posixpath
from importlib import resources
from pathlib import Path

import fsspec

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TINY_SHAKESPEARE_BYTES = 1_115_394
EMBEDDED_TEXT = "tinyshakespeare.txt.gz"  # package data of lit_ddp.data (434 KB)
DATA_ENV = "LIT_DDP_DATA"  # a path or URL that replaces the embedded text; `make train DATA=...` sets it
DEFAULT_CACHE_DIR = "~/.cache/lit_ddp"
EMBEDDED = "embedded"  # the source name of the embedded text


def sha256_of(path: str | Path) -> str:
    """Hex sha256 of a local file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_url(source: str) -> bool:
    """True for fsspec URLs (``https://``, ``s3://``, ``memory://``...), False for plain paths."""
    return "://" in source


def read_embedded_text() -> str:
    """The embedded Tiny Shakespeare, checked against its sha256 (ValueError if damaged: reinstall)."""
    data = gzip.decompress(resources.files("lit_ddp.data").joinpath(EMBEDDED_TEXT).read_bytes())
    if (got := hashlib.sha256(data).hexdigest()) != TINY_SHAKESPEARE_SHA256:
        raise ValueError(f"the embedded {EMBEDDED_TEXT} is damaged (sha256 {got}); reinstall lit_ddp")
    return data.decode("utf-8")


def download(url: str, cache_dir: str | Path, sha256: str | None = None) -> Path:
    """The local copy of ``url`` in ``cache_dir``, downloaded once: to a temporary name, renamed when complete
    and verified, so a crash never leaves a partial file under the final name.

    Raises:
        ValueError: the downloaded (or cached) file's sha256 differs from ``sha256`` (None: not checked).
    """
    cache = Path(os.path.expanduser(str(cache_dir)))
    cache.mkdir(parents=True, exist_ok=True)
    name = posixpath.basename(url.rstrip("/")) or "data.txt"
    target = cache / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{name}"
    if not target.exists():
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        print(f"Downloading {url} to {target}", flush=True)  # local rank zero only (prepare_data)
        try:
            with fsspec.open(url, "rb") as src, open(tmp, "wb") as dst:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    dst.write(chunk)
            if sha256 is not None and (got := sha256_of(tmp)) != sha256:
                raise ValueError(f"sha256 mismatch for {url}: expected {sha256}, got {got}")
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    if sha256 is not None and (got := sha256_of(target)) != sha256:
        raise ValueError(f"sha256 mismatch for cached {target} ({url}): expected {sha256}, got {got}")
    return target


def check_local_text(path: str | Path) -> Path:
    """``path`` (``~`` expanded) if it is a file; FileNotFoundError or IsADirectoryError naming it otherwise."""
    p = Path(os.path.expanduser(str(path)))
    if p.is_dir():
        raise IsADirectoryError(f"data path {p} is a directory; give the text file itself (e.g. {p}/input.txt)")
    if not p.is_file():
        raise FileNotFoundError(
            f"data file {p} does not exist; give data.init_args.path (or ${DATA_ENV}, or make train DATA=...) "
            "a text file, or leave it unset for the embedded Tiny Shakespeare"
        )
    return p


class TextSource:
    """A DataModule's text: ``path`` (local or fsspec URL), else ``$LIT_DDP_DATA``, else the embedded Tiny
    Shakespeare, checked against ``sha256`` where given or known. A bad local path raises FileNotFoundError or
    IsADirectoryError at construction, before any process starts."""

    def __init__(self, path: str | None = None, sha256: str | None = None, cache_dir: str = DEFAULT_CACHE_DIR) -> None:
        self.source = path or os.environ.get(DATA_ENV) or EMBEDDED
        known = TINY_SHAKESPEARE_SHA256 if self.source in (TINY_SHAKESPEARE_URL, EMBEDDED) else None
        self.sha256 = sha256 if sha256 is not None else known
        self.cache_dir = cache_dir
        if self.source != EMBEDDED and not is_url(self.source):
            check_local_text(self.source)

    def local_path(self) -> Path | None:
        """The local file (a URL's cache file, downloaded if missing), sha256-checked; None for the embedded text."""
        if self.source == EMBEDDED:
            return None
        if is_url(self.source):
            return download(self.source, self.cache_dir, self.sha256)
        path = check_local_text(self.source)
        if self.sha256 is not None and (got := sha256_of(path)) != self.sha256:
            raise ValueError(f"sha256 mismatch for {path}: expected {self.sha256}, got {got}")
        return path

    def read(self) -> str:
        """The whole text."""
        path = self.local_path()
        return read_embedded_text() if path is None else path.read_text(encoding="utf-8")
