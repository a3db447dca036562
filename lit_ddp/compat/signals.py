"""Lightning's signal handling: its SIGTERM broadcast inside the training step (turned off: lit-ddp agrees on a
stop at a step boundary), installing handlers after Lightning's own, and ending a process at once."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, cast

from lightning.pytorch import Trainer


def disable_sigterm_broadcast(trainer: Trainer) -> bool:
    """Turns off Lightning's blocking per-step SIGTERM broadcast for this trainer; returns whether it was there.

    Since Lightning 2.6 the training loop broadcasts rank zero's "SIGTERM received" flag before every step
    and reads it on the CPU (``_broadcast_sigterm_tensor``, Lightning PR 20825): a blocking collective per step
    (Lightning issue 21487, open on 2.6.6; PR 21640 proposes an interval). Only called while lit-ddp's handler
    (:class:`lit_ddp.resilience.preemption.PreemptionCheckpoint`'s) owns SIGTERM, when Lightning's flag can never be
    set; a Lightning without the broadcast leaves nothing to turn off.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if not hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        return False
    cast(Any, epoch_loop)._broadcast_sigterm_tensor = _no_sigterm_broadcast  # an instance attribute over the method
    return True


def _no_sigterm_broadcast() -> None:
    """Stands in for Lightning's per-step SIGTERM broadcast."""


def after_lightning_signal_handlers(trainer: Trainer, install: Callable[[], None]) -> None:
    """Calls ``install`` right after Lightning registers its signal handlers in this trainer's next run.

    ``trainer.fit`` registers them (``_signal_connector.register_signal_handlers``) after restoring the
    checkpoint and before the sanity check; no public hook runs between that and ``on_train_start``. Its SIGTERM
    handler broadcasts inside the handler, wherever the rank is (a collective that can interleave with DDP's),
    and sets a flag only the per-step broadcast reads, which :func:`disable_sigterm_broadcast` turns off: a
    SIGTERM in that window would be lost."""
    connector = cast(Any, trainer)._signal_connector
    register = type(connector).register_signal_handlers

    def register_then_install() -> None:
        register(connector)
        install()

    connector.register_signal_handlers = register_then_install  # an instance attribute over the method


def exit_now(code: int) -> None:
    """Ends the process at once (``os._exit``), without cleanup that would wait on a dead peer's collectives."""
    os._exit(code)
