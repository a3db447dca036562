"""The model summary at the start of ``fit``, without a false warning under mixed precision."""

from __future__ import annotations

import warnings

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary


class MixedPrecisionModelSummary(ModelSummary):
    """Lightning's ``ModelSummary`` callback (the table of layers and parameter counts), quiet under ``16-mixed`` and
    ``bf16-mixed``.

    Lightning 2.6's summary knows the bits per parameter of ``32-true``, ``bf16-true`` and the like, but not of the
    mixed precisions: for those it warns "Precision bf16-mixed is not supported by the model summary. Estimated model
    size in MB will not be accurate. Using 32 bits instead." Mixed precision keeps the parameters in float32 (autocast
    casts copies for each operation), so 32 bits is their size and the estimate is exact: here the summary is made
    without that warning; any other precision Lightning does not know still warns. :class:`lit_ddp.cli.LitDDPCLI`
    puts it in place of Lightning's default summary.

    Args:
        max_depth: layer nesting shown (Lightning's ``ModelSummary``); 0 turns the table off.
    """

    def __init__(self, max_depth: int = 1) -> None:
        super().__init__(max_depth=max_depth)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        with warnings.catch_warnings():
            if str(trainer.precision) in ("16-mixed", "bf16-mixed"):
                warnings.filterwarnings(
                    "ignore", message=f"Precision {trainer.precision} is not supported by the model"
                )
            super().on_fit_start(trainer, pl_module)
