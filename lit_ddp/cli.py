"""The ``lit-ddp`` command: LightningCLI with the tutorial's defaults.

    lit-ddp fit --config configs/trainer/ddp.yaml --config configs/mingpt/cpu.yaml

A config names a LightningModule (``model``, from :mod:`lit_ddp.tasks`), a LightningDataModule (``data``,
from :mod:`lit_ddp.data`) and the ``trainer``; Lightning's Trainer starts one process per device, wraps the
model in DDP and gives each rank its shard of the data. What makes a run survive kills, preemption and
restarts is the base class, :class:`lit_ddp.resilience.ResilientCLI`; how failures are reported is
:func:`lit_ddp.launch.reporting.report`.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Literal

import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator, CUDAAccelerator
from lightning.pytorch.callbacks import LearningRateMonitor, ModelSummary, ProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningArgumentParser

from lit_ddp.callbacks.model_summary import MixedPrecisionModelSummary
from lit_ddp.callbacks.text_samples import FitEndSample
from lit_ddp.generate import generate_main
from lit_ddp.launch.preflight import check_config_files
from lit_ddp.launch.reporting import report, silence_library_noise
from lit_ddp.resilience import ResilientCLI
from lit_ddp.tasks.mingpt import GPTModule
from lit_ddp.tensorboard import HParamsTensorBoardLogger

DEFAULT_SEED = 1337
PROGRESS_BAR_REFRESH_STEPS = 10  # steps between redraws of the default progress bar
# float32 matrix products on CUDA where the config chooses none: TF32 tensor cores, Lightning's and Inductor's advice.
CUDA_FLOAT32_MATMUL_PRECISION = "high"


def set_float32_matmul_precision(configured: str | None, accelerator: Accelerator) -> None:
    """``torch.set_float32_matmul_precision(configured)``; with none configured, ``"high"`` (TF32) on a CUDA
    accelerator unless this process has already chosen one (torch's is not ``"highest"``), and nothing elsewhere:
    CPU results stay as they are. Lightning prints a tip on every CUDA run that leaves torch's default."""
    if configured is None:
        if not isinstance(accelerator, CUDAAccelerator) or torch.get_float32_matmul_precision() != "highest":
            return
        configured = CUDA_FLOAT32_MATMUL_PRECISION
    torch.set_float32_matmul_precision(configured)


class LitDDPCLI(ResilientCLI):
    """LightningCLI with the project's defaults.

    - any LightningModule / LightningDataModule by ``class_path``; the seed defaults to 1337;
    - ``data.init_args.block_size`` is linked to ``model.init_args.block_size`` (the data decides it);
    - ``lr_monitor.*`` configures a LearningRateMonitor;
    - the logger defaults to a TensorBoardLogger writing straight into ``trainer.default_root_dir`` (no
      ``version_N`` folders), so a restart continues the same log; hyperparameters go into the event files
      too (:class:`~lit_ddp.tensorboard.HParamsTensorBoardLogger`);
    - ``fit`` ends by printing the best monitored value with its step and file, the last checkpoint and its
      step, and a text sample (minGPT), drawn on the training device before Lightning's teardown
      (:class:`~lit_ddp.callbacks.text_samples.FitEndSample`);
    - ``float32_matmul_precision`` (``highest``, ``high``, ``medium``) is torch's for float32 matrix products; unset,
      ``high`` (TF32) on CUDA devices, torch's default elsewhere (:func:`set_float32_matmul_precision`);
    - the model summary is :class:`~lit_ddp.callbacks.model_summary.MixedPrecisionModelSummary`, Lightning's without
      its false warning under mixed precision.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("seed_everything_default", DEFAULT_SEED)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("auto_configure_optimizers", False)
        self.fit_end_sample = FitEndSample()
        super().__init__(LightningModule, LightningDataModule, *args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_lightning_class_args(LearningRateMonitor, "lr_monitor")
        parser.set_defaults({"lr_monitor.logging_interval": "step"})
        # Facts the data decides reach the model through links (skipped when a class lacks the argument).
        parser.link_arguments("data.init_args.block_size", "model.init_args.block_size")
        parser.add_argument(
            "--float32_matmul_precision",
            type=Literal["highest", "high", "medium"] | None,
            default=None,
            help="torch.set_float32_matmul_precision before the trainer runs; null: high (TF32) on CUDA devices, "
            "torch's default (highest) elsewhere",
        )

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer_config = self.option(self.config_init, "trainer", default={})
        logger = trainer_config.get("logger")
        if logger is None or logger is True:
            kwargs["logger"] = HParamsTensorBoardLogger(
                save_dir=str(trainer_config["default_root_dir"]),  # ResilientCLI gives it a default
                name="",
                version="",
                default_hp_metric=False,
            )
        # Lightning's default bar redraws after every step (about 0.5 ms of Python per step here, measured with
        # py-spy on a tiny model): every PROGRESS_BAR_REFRESH_STEPS steps is enough. A user's bar is kept.
        callbacks = trainer_config.get("callbacks")
        callbacks = [] if callbacks is None else list(callbacks) if isinstance(callbacks, list | tuple) else [callbacks]
        if trainer_config.get("enable_progress_bar") is not False and not any(
            isinstance(c, ProgressBar) for c in callbacks
        ):
            callbacks.append(TQDMProgressBar(refresh_rate=PROGRESS_BAR_REFRESH_STEPS))
        if isinstance(self.model, GPTModule):
            callbacks.append(self.fit_end_sample)
        if trainer_config.get("enable_model_summary") is not False and not any(
            isinstance(c, ModelSummary) for c in callbacks
        ):  # ours in place of Lightning's, which then neither adds its own nor says that it found one
            callbacks.append(MixedPrecisionModelSummary())
            kwargs["enable_model_summary"] = False
        kwargs["callbacks"] = callbacks
        trainer = super().instantiate_trainer(**kwargs)
        set_float32_matmul_precision(self.option(self.config, "float32_matmul_precision"), trainer.accelerator)
        return trainer

    def after_fit(self) -> None:
        """Rank zero prints the best monitored value (unless the monitor is ``step``: keep-the-newest), its step and
        file, the last checkpoint, and the text sample :class:`FitEndSample` drew when the model is a GPT."""
        super().after_fit()  # the checkpoints: best monitored value, its step and file; the last one
        if self.trainer.is_global_zero and self.fit_end_sample.text is not None:
            print(f"sample:\n{self.fit_end_sample.text}")


def cli_main(args: list[str] | None = None) -> LitDDPCLI | None:
    """Entry point of ``lit-ddp`` and ``python -m lit_ddp`` (``generate`` goes to :mod:`lit_ddp.generate`,
    ``chaos`` to :mod:`lit_ddp.chaos.cli`).

    Args:
        args: command-line arguments without the program name; ``None`` reads ``sys.argv``.
    """
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] == "generate":
        generate_main(argv[1:])
        return None
    if argv and argv[0] == "chaos":  # an operator's tool: imported only when asked for
        from lit_ddp.chaos.cli import chaos_main

        raise SystemExit(chaos_main(argv[1:]))
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    silence_library_noise()

    def run() -> LitDDPCLI:
        check_config_files(argv)
        # args=None lets LightningCLI read sys.argv itself (passing both makes it warn).
        return LitDDPCLI(args=None if args is None else argv)

    return report(run)


def main() -> None:
    """The ``lit-ddp`` console script: :func:`cli_main`, returning nothing (so the exit status is 0)."""
    cli_main()
