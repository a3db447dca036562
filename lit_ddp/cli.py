"""The ``lit-ddp`` command: a LightningCLI whose run directory is ``trainer.default_root_dir``.

Layout of a run directory (``trainer.default_root_dir``)::

    <root>/config.yaml                 the resolved config of the last launch
    <root>/hparams.yaml, events.out.*  TensorBoard logs (one log, continued across restarts)
    <root>/checkpoints/*.ckpt          ModelCheckpoint files, plus last.ckpt
    <root>/hpc_ckpt_N.ckpt             Lightning's Slurm requeue checkpoint (only under Slurm)

Re-running the same command resumes from the valid checkpoint with the highest step there, the same one on
every rank (see :func:`lit_ddp.checkpointing.agree_on_resume_checkpoint`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import LearningRateMonitor, ProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info

from lit_ddp.callbacks import ExactResume, FiniteLossGuard, PeriodicCheckpoint
from lit_ddp.callbacks.preemption import PreemptionCheckpoint
from lit_ddp.checkpointing import (
    RESUME_AUTO,
    AgreedResumeConnector,
    AtomicCheckpointIO,
    check_resumable,
)
from lit_ddp.elastic import init_process_group_on_shared_store
from lit_ddp.preflight import (
    check_ckpt_matches_config,
    check_ckpt_path,
    check_config_files,
    follow_torchrun,
    run_preflight,
)
from lit_ddp.reporting import mark_running, report
from lit_ddp.tensorboard import HParamsTensorBoardLogger

DEFAULT_ROOT_DIR = "runs/default"
PROGRESS_BAR_REFRESH_STEPS = 10  # steps between redraws of the default progress bar
DEFAULT_SEED = 1337


def checkpoint_dir(root_dir: str | None) -> str:
    """``<root_dir>/checkpoints``: where ModelCheckpoint writes."""
    root = str(root_dir or DEFAULT_ROOT_DIR)
    return root.rstrip("/") + "/checkpoints"


class LitDDPCLI(LightningCLI):
    """LightningCLI with the project's defaults.

    - ``checkpoint.*`` configures a ModelCheckpoint (:class:`~lit_ddp.callbacks.PeriodicCheckpoint`, which
      also takes ``every_n_train_steps`` and ``train_time_interval`` together) whose ``dirpath`` is linked to
      ``<trainer.default_root_dir>/checkpoints``; the tutorial's ``save_every`` is
      ``checkpoint.every_n_epochs``.
    - ``lr_monitor.*`` configures a LearningRateMonitor.
    - ``exact_resume.*`` configures :class:`~lit_ddp.callbacks.ExactResume` (RNG and loader states per rank).
    - The logger defaults to a TensorBoardLogger writing straight into ``trainer.default_root_dir``
      (no ``version_N`` folders), so a restart continues the same log; hyperparameters go into the event
      files too (:class:`~lit_ddp.tensorboard.HParamsTensorBoardLogger`).
    - Every checkpoint is written atomically (:class:`~lit_ddp.checkpointing.AtomicCheckpointIO`) unless
      ``trainer.plugins`` names another ``CheckpointIO`` (e.g. ``AsyncAtomicCheckpointIO``).
    - ``fit`` without ``--ckpt_path`` resumes from the newest valid checkpoint of the run directory.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("seed_everything_default", DEFAULT_SEED)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("auto_configure_optimizers", False)
        # A NaN/inf loss stops training with a message naming the step; the last good checkpoint is kept.
        # A preemption signal saves, requeues (Slurm) and stops at the next optimizer step, on every rank.
        kwargs.setdefault("trainer_defaults", {"callbacks": [FiniteLossGuard(), PreemptionCheckpoint()]})
        super().__init__(LightningModule, LightningDataModule, *args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(PeriodicCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.save_last": True,
                "checkpoint.save_top_k": -1,
                "checkpoint.every_n_epochs": 1,
                "trainer.default_root_dir": DEFAULT_ROOT_DIR,
            }
        )
        parser.link_arguments("trainer.default_root_dir", "checkpoint.dirpath", compute_fn=checkpoint_dir)
        parser.add_lightning_class_args(LearningRateMonitor, "lr_monitor")
        parser.set_defaults({"lr_monitor.logging_interval": "step"})
        # Per-rank RNG and loader states in every checkpoint: a resume is bit-exact (lit_ddp.callbacks).
        parser.add_lightning_class_args(ExactResume, "exact_resume")
        # Facts the data decides reach the model through links (skipped when a class lacks the argument).
        parser.link_arguments("data.init_args.block_size", "model.init_args.block_size")

    def _parse_ckpt_path(self) -> None:
        # LightningCLI reads --ckpt_path's hyperparameters here, before any hook: check the file first.
        subcommand = self.config.get("subcommand")
        if subcommand:
            check_ckpt_path(self.config[subcommand].get("ckpt_path"))
            check_ckpt_matches_config(self.config[subcommand].get("ckpt_path"), self.config[subcommand].get("model"))
        super()._parse_ckpt_path()

    def before_instantiate_classes(self) -> None:
        # Mis-launches, devices / precision this machine cannot run, a busy MASTER_PORT: one clear message
        # and exit 2 before anything starts (lit_ddp.preflight). --ckpt_path was checked in _parse_ckpt_path.
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.get("trainer") is not None and (change := follow_torchrun(config.trainer)):
            rank_zero_info(change)  # torchrun's --nproc_per_node / --nnodes decide the layout
        run_preflight(config.get("trainer"))

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer_config = self._get(self.config_init, "trainer", default={})
        logger = trainer_config.get("logger")
        if logger is None or logger is True:
            kwargs["logger"] = HParamsTensorBoardLogger(
                save_dir=str(trainer_config.get("default_root_dir") or DEFAULT_ROOT_DIR),
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
            kwargs["callbacks"] = [*callbacks, TQDMProgressBar(refresh_rate=PROGRESS_BAR_REFRESH_STEPS)]
        plugins = trainer_config.get("plugins")
        plugins = [] if plugins is None else list(plugins) if isinstance(plugins, list | tuple) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        mark_running()  # from here on, failures are reported by the rank they happen on
        strategy = self.trainer.strategy
        if isinstance(strategy, DDPStrategy):  # torchrun's shared store: a prefix per restart (lit_ddp.elastic)
            init_process_group_on_shared_store(strategy._get_process_group_backend(), strategy._timeout)
        config = self.config_init[self.subcommand]
        check_ckpt_path(config.get("ckpt_path"))
        if config.get("ckpt_path") is None:
            # Resolved once every rank has joined: rank zero picks, every rank checks it can read the file.
            root = self.trainer.default_root_dir
            check_resumable(root, checkpoint_dir(root))  # before the logger writes anything
            self.trainer._checkpoint_connector = AgreedResumeConnector(self.trainer, checkpoint_dir(root))
            config["ckpt_path"] = RESUME_AUTO

    def after_fit(self) -> None:
        """Rank zero prints the best monitored value, the checkpoint path, and a text sample when the model
        has a ``sample()`` method (local to rank zero: no collective calls)."""
        if not self.trainer.is_global_zero:
            return
        ckpt = self.trainer.checkpoint_callback
        if ckpt is not None and ckpt.best_model_score is not None:
            print(f"best {ckpt.monitor}: {float(ckpt.best_model_score):.4f}")
        if ckpt is not None and (ckpt.best_model_path or ckpt.last_model_path):
            print(f"checkpoint: {ckpt.best_model_path or ckpt.last_model_path}")
        if callable(getattr(self.model, "sample", None)):
            print(f"sample:\n{self.model.sample()}")


def cli_main(args: list[str] | None = None) -> LitDDPCLI | None:
    """Entry point of ``lit-ddp`` and ``python -m lit_ddp``.

    Args:
        args: command-line arguments without the program name; ``None`` reads ``sys.argv``.
    """
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] == "generate":
        from lit_ddp.generate import generate_main

        generate_main(argv[1:])
        return None
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # args=None lets LightningCLI read sys.argv itself (passing both makes it warn).
    return report(lambda: check_config_files(argv) or LitDDPCLI(args=None if args is None else argv))


def main() -> None:
    """The ``lit-ddp`` console script: :func:`cli_main`, returning nothing (so the exit status is 0)."""
    cli_main()
