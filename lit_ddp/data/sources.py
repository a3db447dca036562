"""Where a text comes from: the Tiny Shakespeare embedded in the package, a local path, or any fsspec URL
(``https://``, ``s3://``...), downloaded once through fsspec's file cache.

Tiny Shakespeare (Karpathy's char-rnn ``tinyshakespeare/input.txt``, 1,115,394 bytes) ships gzipped inside the
package, so training and the tests need no network. ``$LIT_DDP_DATA`` (a path or URL) overrides it.
"""

from __future__ import annotations

import gzip
import hashlib
import os
from importlib import resources
from pathlib import Path

import fsspec

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
EMBEDDED_TEXT = "tinyshakespeare.txt.gz"  # package data of lit_ddp.data (434 KB)
DATA_ENV = "LIT_DDP_DATA"  # a path or URL that replaces the embedded text; `make train DATA=...` sets it
DEFAULT_CACHE_DIR = "~/.cache/lit_ddp"
EMBEDDED = "embedded"  # the source name of the embedded text


def read_embedded_text() -> str:
    """The embedded Tiny Shakespeare (unchecked: :meth:`TextSource.read` checks its sha256)."""
    return gzip.decompress(resources.files("lit_ddp.data").joinpath(EMBEDDED_TEXT).read_bytes()).decode("utf-8")


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
    IsADirectoryError at construction, before any process starts.

    A URL is read through fsspec's ``filecache`` into ``cache_dir/<hash of the URL>/``: downloaded once, then
    served from there (offline too). A download that did not finish is not in the cache's index, so it is
    fetched again; a copy that fails the sha256 check is removed.
    """

    def __init__(self, path: str | None = None, sha256: str | None = None, cache_dir: str = DEFAULT_CACHE_DIR) -> None:
        self.source = path or os.environ.get(DATA_ENV) or EMBEDDED
        known = TINY_SHAKESPEARE_SHA256 if self.source in (TINY_SHAKESPEARE_URL, EMBEDDED) else None
        self.sha256 = sha256 if sha256 is not None else known
        url_key = hashlib.sha256(self.source.encode()).hexdigest()[:16]
        self.cache_storage = Path(os.path.expanduser(cache_dir)) / url_key
        if self.source != EMBEDDED and "://" not in self.source:
            check_local_text(self.source)

    def read(self) -> str:
        """The whole text. Raises ValueError on a sha256 mismatch (naming both digests)."""
        cached = None
        if self.source == EMBEDDED:
            data, where = read_embedded_text().encode("utf-8"), f"the embedded {EMBEDDED_TEXT} (reinstall lit_ddp)"
        elif "://" in self.source:
            if not self.cache_storage.exists():
                print(f"Downloading {self.source} into {self.cache_storage}", flush=True)
            options = {"cache_storage": str(self.cache_storage), "expiry_time": False}
            cached = fsspec.open(f"filecache::{self.source}", "rb", filecache=options)
            with cached as f:
                data, where = f.read(), self.source
        else:
            path = check_local_text(self.source)
            data, where = path.read_bytes(), str(path)
        if self.sha256 is not None and (got := hashlib.sha256(data).hexdigest()) != self.sha256:
            if cached is not None:
                cached.fs.clear_cache()  # the next read downloads again
            raise ValueError(f"sha256 mismatch for {where}: expected {self.sha256}, got {got}")
        return data.decode("utf-8")
