"""The ``lit-ddp`` command: LightningCLI with the tutorial's defaults and runs that survive kills, preemption and
restarts.

    lit-ddp fit --config configs/trainer/ddp.yaml --config configs/mingpt/cpu.yaml
    lit-ddp generate --ckpt_path runs/mingpt/cpu/checkpoints/last.ckpt --prompt "ROMEO:"
    lit-ddp chaos --faults 2 -- --config configs/regression/single_device.yaml

A config names a LightningModule (``model``, from :mod:`lit_ddp.tasks`), a LightningDataModule (``data``,
from :mod:`lit_ddp.data`) and the ``trainer``; Lightning's Trainer starts one process per device, wraps the
model in DDP and gives each rank its shard of the data. The callbacks that make a run survive come from
:mod:`lit_ddp.resilience`, the run directory's layout from :mod:`lit_ddp.run_dir`; how failures are reported is
:func:`lit_ddp.launch.reporting.report`.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
from jsonargparse import ArgumentParser, Namespace
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator, CUDAAccelerator
from lightning.pytorch.callbacks import (
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    TQDMProgressBar,
)
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities import rank_zero_info

from lit_ddp.callbacks.continuity import CurvesContinue, ResumedEpochProgress
from lit_ddp.callbacks.model_summary import MixedPrecisionModelSummary
from lit_ddp.callbacks.text_samples import FitEndSample
from lit_ddp.launch.environment import (
    TorchrunEnvironment,
    config_value,
    follow_slurm_port,
    follow_torchrun,
    task_gpu_accelerator,
)
from lit_ddp.launch.preflight import run_checks
from lit_ddp.launch.reporting import mark_running, report, silence_library_noise
from lit_ddp.resilience.checkpoint_io import AtomicCheckpointIO, confine, is_inside, not_writable_error, refused_write
from lit_ddp.resilience.exact_resume import ExactResume
from lit_ddp.resilience.finite_loss import FiniteLossGuard
from lit_ddp.resilience.periodic_checkpoint import PeriodicCheckpoint
from lit_ddp.resilience.preemption import PreemptionCheckpoint
from lit_ddp.resilience.replica_check import ReplicaCheck
from lit_ddp.resilience.resume import start_from
from lit_ddp.resilience.startup_timeout import StartupTimeout
from lit_ddp.run_dir import layout, untrusted
from lit_ddp.run_dir.atomic import write_atomic
from lit_ddp.run_dir.checkpoints import checkpoint_step
from lit_ddp.run_dir.lock import hold_run_directory
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


TOOLS: dict[str, tuple[str, str, str, str]] = {
    "generate": ("lit_ddp.generate", "generate_parser", "generate_main", "Text from a minGPT checkpoint, without the training data"),
    "chaos": ("lit_ddp.chaos.cli", "chaos_parser", "chaos_main", "Does your run survive faults exactly? Trains it with and without them"),
}  # fmt: skip
"""Subcommands beside Lightning's that run a tool and end, without a Trainer: their module, their arguments' parser
and their entry point there (the parsed arguments in, the exit status out), and their help line. A tool's module is
imported only when the command asks for it (:func:`tool`)."""


def tool(name: str) -> tuple[Callable[[], ArgumentParser], Callable[[Namespace], int]]:
    """The parser and entry point of the tool subcommand ``name`` (:data:`TOOLS`), its module imported now."""
    module, parser, main = TOOLS[name][:3]
    loaded = importlib.import_module(module)
    return getattr(loaded, parser), getattr(loaded, main)


class ToolExit(SystemExit):
    """A tool subcommand (:data:`TOOLS`) has run: the command ends with its exit status, as after ``--help``."""


class CLIParser(LightningArgumentParser):
    """LightningCLI's parser, keeping the subcommands action it adds (jsonargparse's own reference to it is
    private), so :data:`TOOLS` join ``fit``, ``validate``, ``test`` and ``predict`` in one parser."""

    subcommands_action: Any = None

    def add_subcommands(self, required: bool = True, dest: str = "subcommand", **kwargs: Any) -> Any:
        self.subcommands_action = super().add_subcommands(required, dest, **kwargs)
        return self.subcommands_action


def checkpoint_dir(root_dir: str | None) -> str:
    """``<root_dir>/checkpoints`` (``runs/default`` without one): where the checkpoint callback writes."""
    return layout.checkpoint_dir(str(root_dir or layout.DEFAULT_ROOT))


def _as_list(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, list | tuple) else [value]


class LitDDPCLI(LightningCLI):
    """LightningCLI with the project's defaults.

    - any LightningModule / LightningDataModule by ``class_path``; the seed defaults to 1337;
    - ``data.init_args.block_size`` is linked to ``model.init_args.block_size`` (the data decides it);
    - ``lr_monitor.*`` configures a LearningRateMonitor;
    - ``checkpoint.*`` configures the checkpoint callback (:class:`PeriodicCheckpoint`, a ModelCheckpoint that
      also takes ``every_n_train_steps`` and ``train_time_interval`` together) writing to
      ``<trainer.default_root_dir>/checkpoints``; the tutorial's ``save_every`` is ``checkpoint.every_n_epochs``.
      With no trigger set it saves every epoch (ModelCheckpoint's default); a trigger given alone
      (``--checkpoint.every_n_train_steps 50``) is the only one;
    - the run directory: ``trainer.default_root_dir``, else named after the config, and with ``LIT_DDP_RUN_ID``
      set the job's own inside it (:func:`lit_ddp.run_dir.layout.run_directory`); ``fit`` holds it (one live job
      per run directory) and, without ``--ckpt_path``, resumes from its newest valid checkpoint, the same on every
      rank (:func:`lit_ddp.resilience.resume.start_from`); ``validate`` / ``test`` evaluate that checkpoint;
    - :class:`ExactResume` carries each rank's RNG, loader and metric state (``exact_resume``); ``startup.timeout``
      bounds the start-up (rendezvous, resume, restore) apart from the collective timeout (:class:`StartupTimeout`);
      ``replica_check.every_n_steps`` how often the DDP ranks compare their parameters and optimizer states, and they
      do before every save too (:class:`ReplicaCheck`; 0: never);
    - every trainer gets :class:`FiniteLossGuard` and :class:`PreemptionCheckpoint`, and writes every checkpoint
      atomically (:class:`AtomicCheckpointIO`) unless ``trainer.plugins`` names another ``CheckpointIO``; a write the
      run directory's file system refuses (read-only, full) ends in one line naming it and the checkpoint kept;
    - before anything is instantiated, the launch, the machine and ``--ckpt_path`` are checked
      (:mod:`lit_ddp.launch.preflight`), and under torchrun the layout follows torchrun;
    - the logger defaults to a TensorBoardLogger writing straight into the run directory (no ``version_N``
      folders), so a restart continues the same log; hyperparameters go into the event files too
      (:class:`~lit_ddp.tensorboard.HParamsTensorBoardLogger`);
    - ``fit`` ends by printing the last validation's ``val/*`` values, the best monitored value with its step and
      file (unless the monitor is ``step``: keep-the-newest), the last checkpoint and its step, and a text sample
      (minGPT), drawn on the training device before Lightning's teardown
      (:class:`~lit_ddp.callbacks.text_samples.FitEndSample`);
    - ``float32_matmul_precision`` (``highest``, ``high``, ``medium``) is torch's for float32 matrix products; unset,
      ``high`` (TF32) on CUDA devices, torch's default elsewhere (:func:`set_float32_matmul_precision`);
    - the model summary is :class:`~lit_ddp.callbacks.model_summary.MixedPrecisionModelSummary`, Lightning's without
      its false warning under mixed precision.

    Raises:
        ToolExit: a tool subcommand (:data:`TOOLS`) has run; its code is the tool's exit status.
        UsageError: a check before anything is instantiated (the launch and machine, ``--ckpt_path``, the text, the
            run directory held by another job), or ``--weights_only false`` (an ``UntrustedFileError``).
        RunDirectoryNotWritable: the run directory's file system refused a write.
        LitDDPError: what the run itself stops with (no valid checkpoint, a failed restore check, a non-finite
            loss, a preemption signal: :mod:`lit_ddp.errors`).
    """

    run_root: str | None = None  # the run directory, once the config names it
    given_header: dict[str, Any] | None = None  # --ckpt_path's, read once when the arguments are parsed

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = kwargs.get("args", args[0] if args else None)
        self.argv = [str(a) for a in (sys.argv[1:] if given is None else given if isinstance(given, list) else [])]
        kwargs.setdefault("seed_everything_default", DEFAULT_SEED)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("auto_configure_optimizers", False)
        kwargs.setdefault("parser_class", CLIParser)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})  # a restart rewrites config.yaml
        kwargs.setdefault("save_config_callback", AtomicSaveConfig)
        # A NaN/inf loss stops training with a message naming the step; the last good checkpoint is kept.
        # A preemption signal saves, requeues (Slurm) and stops at an agreed optimizer step, on every rank.
        # After ExactResume's put-back (the callbacks the parser adds, checkpoint and exact_resume among them, come
        # first): the progress bar of a resumed run continues the killed run's.
        defaults = [FiniteLossGuard(), PreemptionCheckpoint(), ResumedEpochProgress()]
        kwargs.setdefault("trainer_defaults", {"callbacks": defaults})
        self.fit_end_sample = FitEndSample()
        try:
            super().__init__(LightningModule, LightningDataModule, *args, **kwargs)
        except (OSError, RuntimeError) as e:  # a write that the run directory's file system refused: one line
            refused, root = refused_write(e), self.run_root
            if root is None or refused is None or not is_inside(refused.filename, root):
                raise
            raise not_writable_error(refused, os.fsdecode(refused.filename), root) from e

    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
    ) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        subcommands = getattr(self.parser, "subcommands_action", None)
        if add_subcommands and subcommands is not None:
            asked = next((a for a in self.argv if not a.startswith("-")), None)
            for name, (*_, help) in TOOLS.items():
                # The tool asked for gets its parser (its module imported); the others a parser for the help line only.
                parser = tool(name)[0]() if name == asked else ArgumentParser(description=help)
                subcommands.add_subcommand(name, parser, help=help)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(PeriodicCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.save_top_k": -1})
        parser.link_arguments("trainer.default_root_dir", "checkpoint.dirpath", compute_fn=checkpoint_dir)
        parser.add_lightning_class_args(ExactResume, "exact_resume")
        parser.add_lightning_class_args(StartupTimeout, "startup")
        parser.add_lightning_class_args(ReplicaCheck, "replica_check")
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

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        if subcommand in TOOLS:  # before LightningCLI reads a checkpoint or builds a Trainer
            raise ToolExit(tool(subcommand)[1](self.config[subcommand]))
        # LightningCLI reads --ckpt_path's hyperparameters right after parsing: check the file first.
        if subcommand:
            config = self.config[subcommand]
            if config.get("trainer") is not None:
                self._place_run(config, sys.argv[1:] if args is None else args)
            self.given_header = run_checks("parsed", config=config)

    @staticmethod
    def _place_run(config: Any, args: Any) -> None:
        argv = args if isinstance(args, list | tuple) else []
        root, why = layout.run_directory(
            config.trainer.get("default_root_dir"),
            config.get("config"),
            config_value(config.get("model"), "class_path"),
            root_on_command_line=any(str(a).split("=")[0] == "--trainer.default_root_dir" for a in argv),
        )
        if why:
            config.trainer.default_root_dir = root
            config.checkpoint.dirpath = checkpoint_dir(root)
            rank_zero_info(f"Run directory: {root} ({why})")

    def before_instantiate_classes(self) -> None:
        # Mis-launches, devices / precision this machine cannot run, a MASTER_ADDR that does not resolve, a busy
        # MASTER_PORT, a --ckpt_path its model does not fit, a text that is not UTF-8: one clear message and exit 2
        # before anything starts.
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.get("trainer") is not None and (change := follow_torchrun(config.trainer)):
            rank_zero_info(change)  # torchrun's --nproc_per_node / --nnodes decide the layout
        run_checks(
            "built", config=config, training=self.subcommand == "fit"
        )  # LightningCLI has read --ckpt_path's hyperparameters into the model's
        if change := follow_slurm_port():  # a port per job step, not Lightning's one per job
            rank_zero_info(change)
        if config.get("trainer") is not None:  # where a refused write is reported in one line (__init__)
            self.run_root = str(config.trainer.default_root_dir)
        if self.subcommand == "fit":  # one live job per run directory (rank zero holds it until it exits)
            hold_run_directory(str(config.trainer.default_root_dir))

    def option(self, config: Any, key: str, default: Any = None) -> Any:
        """``key`` of the running subcommand's part of ``config`` (``self.config`` or ``self.config_init``), or
        ``default``: what Lightning's private ``LightningCLI._get`` reads."""
        return (config[self.subcommand] if self.subcommand else config).get(key, default)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer_config = self.option(self.config_init, "trainer", default={})
        plugins = _as_list(trainer_config.get("plugins"))
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            plugins.append(AtomicCheckpointIO())
        if "TORCHELASTIC_RUN_ID" in os.environ and not any(isinstance(p, ClusterEnvironment) for p in plugins):
            plugins.append(TorchrunEnvironment())  # nodes may run different numbers of processes
        kwargs["plugins"] = plugins
        if accelerator := task_gpu_accelerator(trainer_config.get("accelerator")):
            kwargs["accelerator"] = accelerator  # srun bound one GPU to each task: cuda:0, not cuda:LOCAL_RANK
            rank_zero_info("Slurm bound one GPU to each task (CUDA_VISIBLE_DEVICES): each trains on its cuda:0")
        logger = trainer_config.get("logger")
        if logger is None or logger is True:
            kwargs["logger"] = HParamsTensorBoardLogger(
                save_dir=str(trainer_config["default_root_dir"]),  # parse_arguments gives it a default
                name="",
                version="",
                default_hp_metric=False,
            )
        # Lightning's default bar redraws after every step (about 0.5 ms of Python per step here, measured with
        # py-spy on a tiny model): every PROGRESS_BAR_REFRESH_STEPS steps is enough. A user's bar is kept.
        callbacks = _as_list(trainer_config.get("callbacks"))
        if trainer_config.get("enable_progress_bar") is not False and not any(
            isinstance(c, ProgressBar) for c in callbacks
        ):
            callbacks.append(TQDMProgressBar(refresh_rate=PROGRESS_BAR_REFRESH_STEPS))
        if isinstance(self.model, GPTModule):
            callbacks.append(self.fit_end_sample)
        # Before the callbacks the parser adds (the learning-rate monitor logs at each batch's start): TensorBoard's
        # purge marker of a resumed run must precede the first point it logs.
        callbacks.append(CurvesContinue())
        if trainer_config.get("enable_model_summary") is not False and not any(
            isinstance(c, ModelSummary) for c in callbacks
        ):  # ours in place of Lightning's, which then neither adds its own nor says that it found one
            callbacks.append(MixedPrecisionModelSummary())
            kwargs["enable_model_summary"] = False
        kwargs["callbacks"] = callbacks
        trainer = super().instantiate_trainer(**kwargs)
        # Checkpoints removed only inside the run; loaded only where they fit the model (untrusted input).
        confine(trainer.strategy.checkpoint_io, str(trainer_config["default_root_dir"]), self.model)
        set_float32_matmul_precision(self.option(self.config, "float32_matmul_precision"), trainer.accelerator)
        return trainer

    def before_fit(self) -> None:
        self._start_run(fit=True)

    def before_validate(self) -> None:
        self._start_run(fit=False)

    def before_test(self) -> None:
        self._start_run(fit=False)

    def _start_run(self, fit: bool) -> None:
        """Failures reported per rank from here on; the start-up timeout armed; the checkpoint to start from
        (:func:`~lit_ddp.resilience.resume.start_from`)."""
        mark_running()
        config = self.config_init[self.subcommand]
        startup = config.get("startup")  # the trainer's callback, as LightningCLI made it
        if isinstance(startup, StartupTimeout):
            startup.arm(self.trainer)  # before the process group exists
        if not fit:  # an evaluation restores the weights only: the fit callbacks' states do not concern it
            warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`, callbacks used")
        else:  # a fit resumes from the run directory's checkpoints: that they exist is the design, not a mistake
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
        given = config.get("ckpt_path")
        step = None if self.given_header is None else self.given_header.get("global_step")
        given_step = step if isinstance(step, int) else None
        config["ckpt_path"] = start_from(
            self.trainer, None if given is None else str(given), fit=fit, given_step=given_step
        )

    def after_fit(self) -> None:
        """Rank zero prints the last validation's ``val/*`` values, the best monitored value (unless the monitor is
        ``step``, which keeps the newest), its step and file, the last checkpoint with its step, and the text
        sample :class:`FitEndSample` drew when the model is a GPT."""
        if not self.trainer.is_global_zero:
            return
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("val/")}
        if metrics:  # none when the run had nothing left to train
            print("last validation: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())))
        ckpt = self.trainer.checkpoint_callback
        if isinstance(ckpt, ModelCheckpoint):
            if ckpt.monitor not in (None, "step") and ckpt.best_model_score is not None and ckpt.best_model_path:
                best = ckpt.best_model_path
                print(f"best {ckpt.monitor}: {float(ckpt.best_model_score):.4f} at global_step {checkpoint_step(best)}")
                print(f"best checkpoint: {best}")
            if ckpt.last_model_path:
                last = ckpt.last_model_path
                print(f"last checkpoint: {last} (global_step {checkpoint_step(last)})")
        if self.fit_end_sample.text is not None:
            print(f"sample:\n{self.fit_end_sample.text}")


class AtomicSaveConfig(SaveConfigCallback):
    """LightningCLI's ``config.yaml`` of the run, written by an atomic replace (a kill mid-write leaves the previous
    one) and never through a symbolic link (jsonargparse opens the path for writing). Always overwritten (a restart
    rewrites it), as one file."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        log_dir = trainer.log_dir  # a broadcast: every rank
        if self.save_to_log_dir and log_dir is not None and trainer.is_global_zero:
            path = os.path.join(log_dir, self.config_filename)
            untrusted.refuse_symlink(path, "run's config file")
            write_atomic(path, self.parser.dump(self.config, skip_none=False).encode())
        if trainer.is_global_zero:
            self.save_config(trainer, pl_module, stage)
            self.already_saved = True
        self.already_saved = trainer.strategy.broadcast(self.already_saved)


def cli_main(args: list[str] | None = None) -> LitDDPCLI | None:
    """The command, from Python (the tests, a notebook) or behind ``lit-ddp`` / ``python -m lit_ddp``
    (:mod:`lit_ddp.__main__`): the CLI after a Lightning subcommand, ``None`` after a tool (:data:`TOOLS`) that
    succeeded.

    Args:
        args: command-line arguments without the program name; ``None`` reads ``sys.argv``.

    Raises:
        SystemExit: a bad use (status 2), a failure (see :func:`lit_ddp.launch.reporting.report`), a tool's non-zero
            status.
    """
    argv = sys.argv[1:] if args is None else list(args)
    untrusted.force_weights_only()  # every torch.load of this process and its workers, a library's too
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    silence_library_noise()

    def run() -> LitDDPCLI:
        run_checks("arguments", argv=argv)
        # args=None lets LightningCLI read sys.argv itself (passing both makes it warn).
        return LitDDPCLI(args=None if args is None else argv)

    try:
        return report(run)
    except ToolExit as done:
        if done.code:
            raise SystemExit(done.code) from None
        return None


def main() -> None:
    """:func:`cli_main`, returning nothing (so the exit status is 0): what ``lit_ddp.__main__.main`` (the ``lit-ddp``
    console script and ``python -m lit_ddp``) calls once it has checked the launchers' variables."""
    cli_main()
