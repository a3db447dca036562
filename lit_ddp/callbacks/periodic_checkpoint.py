"""ModelCheckpoint that saves every N steps *and/or* every T seconds of training."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint


class PeriodicCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint``, with ``every_n_train_steps`` and ``train_time_interval`` allowed together.

    ``ModelCheckpoint.on_train_batch_end`` already saves when either trigger fires; only its constructor
    rejects the combination. With both set, a checkpoint is written at every N-th optimizer step and whenever
    T has passed since the last save (the time decision is rank zero's, broadcast to all ranks). Everything
    else (``save_last``, ``save_top_k``, ``monitor``, file names) is ``ModelCheckpoint``'s. To keep the
    newest K step checkpoints: ``monitor="step", mode="max", save_top_k=K``.

    Args:
        every_n_train_steps: save after every this many optimizer steps (``None`` or 0: never by steps).
        train_time_interval: save when this much time has passed since the last save (``None``: never by time).
        *args: positional arguments of ``ModelCheckpoint``.
        **kwargs: other keyword arguments of ``ModelCheckpoint``.
    """

    def __init__(
        self,
        *args: Any,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        both = bool(every_n_train_steps) and train_time_interval is not None
        super().__init__(
            *args,
            every_n_train_steps=every_n_train_steps,
            train_time_interval=None if both else train_time_interval,
            **kwargs,
        )
        self._train_time_interval = train_time_interval
