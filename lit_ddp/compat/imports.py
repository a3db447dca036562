"""The installed torch and Lightning versions, and the one way compat imports a private name.

As Lightning's own ``lightning/fabric/utilities/imports.py`` gates its torch workarounds by version: a
workaround here states the versions known to need it and turns itself off where a version has fixed its bug.
"""

from __future__ import annotations

import importlib
from typing import Any

import lightning
import torch
from packaging.version import Version

TORCH_VERSION = Version(torch.__version__)
"""The installed torch, local tag included (``2.13.0+cpu``)."""
LIGHTNING_VERSION = Version(lightning.__version__)


def lightning_minor(major: int, minor: int) -> bool:
    """Whether the installed Lightning is ``major.minor``, any patch release."""
    return LIGHTNING_VERSION.release[:2] == (major, minor)


def private(module: str, name: str) -> Any:
    """``module.name``, a private name of torch or Lightning, imported by the workaround that uses it when it runs:
    a version that renames it fails that workaround, saying what is missing, and not every command at import.

    Raises:
        ImportError: the installed torch or Lightning has no ``module.name``.
    """
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as missing:
        library = module.partition(".")[0]
        version = {"torch": TORCH_VERSION, "lightning": LIGHTNING_VERSION}.get(library, "?")
        raise ImportError(
            f"{library} {version} has no {module}.{name}, a private name lit_ddp.compat uses (known there on torch "
            "2.9.1 to 2.15.0, Lightning 2.6.6): install a torch and Lightning in pyproject.toml's range, or see "
            "docs/development.md's table of compat's workarounds"
        ) from missing
