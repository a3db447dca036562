"""Lightning's logging: the logger connector's step-level logging (when it logs, a point pending at a save), the
hyperparameters TensorBoard shows, and torch's ``SummaryWriter`` file writer for events it has no method for."""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger

from lit_ddp.compat.imports import private
from lit_ddp.compat.loops import batches_that_stepped, should_accumulate


def should_update_logs(trainer: Trainer) -> bool:
    """Whether the logger writes this step (``trainer.log_every_n_steps``, or the last step): Lightning's own
    decision, which callbacks that time or sync only logged steps must follow exactly."""
    return bool(trainer._logger_connector.should_update_logs)


def log_metrics(trainer: Trainer, metrics: dict[str, Any], step: int | None = None) -> None:
    """Logs ``metrics`` as Lightning's own callbacks do (its logger connector): to every logger, at ``step`` (None:
    the global step), and into ``trainer.logged_metrics``. ``LightningModule.log`` cannot be called from a
    callback's batch-end hook of another stage, and the loggers' own ``log_metrics`` skips ``logged_metrics``."""
    trainer._logger_connector.log_metrics(metrics, step=step)


def pending_train_step_log(trainer: Trainer) -> tuple[int, dict[str, float]] | None:
    """``(step, metrics)`` of the point Lightning will log for the current training batch, asked during
    ``on_train_batch_end`` (Lightning logs it after that hook, ``update_train_step_metrics``); None when it logs
    nothing for this batch. Collective where the metrics are ``sync_dist``: every rank must ask."""
    connector = trainer._logger_connector
    if should_accumulate(trainer) or connector._first_loop_iter is None or not connector.should_update_logs:
        return None
    metrics = convert_tensors_to_scalars(dict(connector.metrics["log"]))
    if not metrics:
        return None
    step = metrics.pop("step", None)
    if step is None:  # as LoggerConnector.log_metrics adds it
        metrics.setdefault("epoch", trainer.current_epoch)
        step = batches_that_stepped(trainer)
    return int(step), {k: float(v) for k, v in metrics.items()}


def flatten_hparams(params: Any) -> dict[str, Any]:
    """Hyperparameters flattened as Lightning's loggers do it (``_convert_params`` + ``_flatten_dict``)."""
    logger = "lightning.fabric.utilities.logger"
    return private(logger, "_flatten_dict")(private(logger, "_convert_params")(params))


def tensorboard_hparams(logger: TensorBoardLogger, params: Any) -> dict[str, Any]:
    """``params`` flattened and sanitized (non-scalars as strings) as ``TensorBoardLogger.log_hyperparams`` writes
    them (:func:`flatten_hparams`, then the logger's ``_sanitize_params``)."""
    return dict(logger._sanitize_params(flatten_hparams(params)))


def default_hp_metric(logger: TensorBoardLogger) -> bool:
    """The logger's ``default_hp_metric`` argument (kept private by ``TensorBoardLogger``)."""
    return bool(logger._default_hp_metric)


def tensorboard_file_writer(summary_writer: Any) -> Any:
    """The ``FileWriter`` behind torch's ``SummaryWriter``, for events it has no method for (an HParams summary
    without values, a ``SessionLog.START`` purge marker)."""
    return summary_writer._get_file_writer()
