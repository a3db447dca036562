"""TensorBoard: the run's logger, and reading its event files back with tensorboard's own reader.

The readers are used by the tests, the notebooks and ``scripts/plot_loss_curves.py`` (docs/monitoring.md). A run
directory holds one TensorBoard log, continued across restarts, so all event files of the directory are read
together.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from argparse import Namespace
from pathlib import Path
from typing import Any

from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard.summary import hparams as hparams_summaries

from lit_ddp import compat
from lit_ddp.run_dir import untrusted


class HParamsTensorBoardLogger(TensorBoardLogger):
    """A TensorBoardLogger that also writes the hyperparameters into the event files (the HParams
    dashboard), linked to the metrics ``hparams_metrics``.

    Lightning's logger writes them there only together with metric values: with ``default_hp_metric=False``
    and no values (as at the start of fit) the hyperparameters reach ``hparams.yaml`` alone. This logger
    writes the HParams summaries with the metric *names* only, so no placeholder scalar (``hp_metric = -1``,
    or a fake ``val/loss`` point at step 0) enters the curves.

    Args:
        hparams_metrics: scalar tags the HParams dashboard shows beside the hyperparameters.
        **kwargs: passed to :class:`~lightning.pytorch.loggers.TensorBoardLogger`.
    """

    def __init__(self, *args: Any, hparams_metrics: tuple[str, ...] = ("val/loss",), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hparams_metrics = tuple(hparams_metrics)

    @rank_zero_only
    def log_hyperparams(
        self, params: dict[str, Any] | Namespace, metrics: dict[str, Any] | None = None, step: int | None = None
    ) -> None:
        super().log_hyperparams(params, metrics, step)  # hparams.yaml (and the events when metrics are given)
        if metrics is not None or compat.default_hp_metric(self) or not self.hparams_metrics:
            return
        flat = compat.tensorboard_hparams(self, params)
        writer = compat.tensorboard_file_writer(self.experiment)
        for summary in hparams_summaries(flat, dict.fromkeys(self.hparams_metrics, 0.0)):
            writer.add_summary(summary, step)
        writer.flush()

    @rank_zero_only
    def save(self) -> None:
        """Lightning's save (the event file flushed; ``hparams.yaml`` written once), with ``hparams.yaml`` created by
        an atomic replace and never through a symbolic link (Lightning's opens the path for writing).

        Raises:
            UntrustedFileError: ``hparams.yaml`` is a symbolic link.
        """
        path = os.path.join(self.log_dir, self.NAME_HPARAMS_FILE)
        untrusted.refuse_symlink(path, "hyperparameter file")
        if "://" not in path and os.path.isdir(self.log_dir) and not os.path.lexists(path):
            with tempfile.TemporaryDirectory(dir=self.log_dir, prefix=".hparams.") as scratch:
                written = os.path.join(scratch, self.NAME_HPARAMS_FILE)
                save_hparams_to_yaml(written, self.hparams)
                os.replace(written, path)
        super().save()


def event_accumulator(run_dir: str | Path, size_guidance: dict[str, int] | None = None) -> EventAccumulator:
    """tensorboard's ``EventAccumulator`` over the event files of ``run_dir``, loaded, once each is known to be a
    regular file (a FIFO planted among them would block the reader forever; a link is not followed).

    Raises:
        UntrustedFileError: an event file is not a regular file.
    """
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(run_dir):
            if "tfevents" in entry.name:
                untrusted.refuse_irregular(entry.path, "TensorBoard event file", follow=False)
    accumulator = EventAccumulator(str(run_dir), **({} if size_guidance is None else {"size_guidance": size_guidance}))
    accumulator.Reload()
    return accumulator


def read_scalars(run_dir: str | Path, tag: str) -> list[tuple[int, float]]:
    """All ``(step, value)`` points of scalar ``tag`` (e.g. ``"val/loss"``) in ``run_dir``, by step.

    Raises:
        KeyError: ``tag`` was never logged in ``run_dir``; the message lists the tags that were.
    """
    acc = event_accumulator(run_dir, {"scalars": 0})
    tags = acc.Tags().get("scalars", [])
    if tag not in tags:
        raise KeyError(f"scalar {tag!r} not logged in {run_dir}; logged: {sorted(tags)}")
    return sorted((e.step, e.value) for e in acc.Scalars(tag))


def tags_logged_at(run_dir: str | Path, step: int, tags: list[str]) -> set[str]:
    """Which of the scalar ``tags`` have a point at ``step`` in ``run_dir`` (after TensorBoard's purges)."""
    acc = event_accumulator(run_dir, {"scalars": 0})
    known = set(acc.Tags().get("scalars", []))
    return {tag for tag in tags if tag in known and any(e.step == step for e in acc.Scalars(tag))}


def scalar_tags(run_dir: str | Path) -> list[str]:
    """The scalar tags logged in ``run_dir``."""
    acc = event_accumulator(run_dir, {"scalars": 0})
    return sorted(acc.Tags().get("scalars", []))


def read_text(run_dir: str | Path, tag: str = "samples") -> list[tuple[int, str]]:
    """All ``(step, text)`` entries of text summary ``tag`` (logged with ``add_text(tag, ...)``) in
    ``run_dir``, by step.

    Raises:
        KeyError: ``tag`` was never logged as text in ``run_dir``; the message lists the tensor tags that were.
    """
    acc = event_accumulator(run_dir, {"tensors": 0})
    name = f"{tag}/text_summary"  # the tag torch's add_text writes under
    tags = acc.Tags().get("tensors", [])
    if name not in tags:
        raise KeyError(f"text {tag!r} not logged in {run_dir}; tensor tags: {sorted(tags)}")
    return sorted((e.step, e.tensor_proto.string_val[0].decode("utf-8")) for e in acc.Tensors(name))


def read_hparams(run_dir: str | Path) -> tuple[dict[str, Any], list[str]]:
    """The hyperparameters in ``run_dir``'s event files (the HParams dashboard's data) and the metric tags
    they are linked to. A log continued across restarts holds one set per launch; tensorboard's reader keeps
    the first.

    Raises:
        KeyError: no hyperparameters were written to the event files of ``run_dir``.
    """
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = event_accumulator(run_dir)
    try:
        content = acc.PluginTagToContent("hparams")
    except KeyError:
        content = {}
    if "_hparams_/session_start_info" not in content:
        raise KeyError(f"no hyperparameters in the event files of {run_dir}")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    values = {k: getattr(v, v.WhichOneof("kind")) for k, v in start.session_start_info.hparams.items()}
    metrics: list[str] = []
    if "_hparams_/experiment" in content:
        experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
        metrics = [m.name.tag for m in experiment.metric_infos]
    return values, metrics
