"""The text a :class:`~lit_ddp.data.char.CharDataModule` will read, checked before any process starts.

Unchecked, a local file that is not UTF-8 fails in every rank's ``setup``, after the processes have started, with
Python's "'utf-8' codec can't decode byte 0xe9 in position 3" and no file name. Here the CLI reads it once, in
chunks, before it builds anything, and refuses it in one line naming the file and the byte offset
(:func:`check_utf8`). A URL's text is read where it is downloaded (``prepare_data``), not here.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lit_ddp.data.sources import DATA_ENV, EMBEDDED
from lit_ddp.errors import UsageError
from lit_ddp.launch.environment import config_value

TEXT_DATA_CLASSES = ("lit_ddp.data.char.CharDataModule", "lit_ddp.data.device_char.DeviceCharDataModule")
"""The data modules whose ``path`` (else ``$LIT_DDP_DATA``) is a text: :class:`~lit_ddp.data.sources.TextSource`."""


def check_utf8(path: str | os.PathLike[str], chunk_bytes: int = 1 << 20) -> None:
    """Reads ``path`` as UTF-8, ``chunk_bytes`` at a time (none of its text is kept).

    Raises:
        UsageError: the file is not UTF-8; the message names ``path`` and the first byte offset that is not.
        OSError: the file cannot be opened or read.
    """
    decoder, read = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        while True:
            chunk, held = f.read(chunk_bytes), len(decoder.getstate()[0])  # held: a character the last chunk cut
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:  # e.object: the bytes held, then the chunk
                raise UsageError(
                    f"data {path} is not UTF-8 text: byte {read - held + e.start} (0x{e.object[e.start]:02x}): "
                    f"{e.reason}; convert it (e.g. iconv -f latin1 -t utf-8 {path} > text.txt) or give another text"
                ) from None
            if not chunk:
                return
            read += len(chunk)


def check_text_data(data_config: Any, env: Mapping[str, str] | None = None) -> None:
    """:func:`check_utf8` of the local text file that the ``data`` section of the parsed config will read, if its
    class is one of :data:`TEXT_DATA_CLASSES`. A missing file is left to the data module, which names it.

    Raises:
        UsageError: the file is not UTF-8.
    """
    if config_value(data_config, "class_path") not in TEXT_DATA_CLASSES:
        return
    env = os.environ if env is None else env
    source = config_value(config_value(data_config, "init_args"), "path") or env.get(DATA_ENV) or EMBEDDED
    path = Path(os.path.expanduser(str(source)))
    if source != EMBEDDED and "://" not in str(source) and path.is_file():
        check_utf8(path)
