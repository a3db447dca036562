"""The LightningCLI hooks that install the resilience layer: the door between the tutorial and the machinery.

The run directory (``trainer.default_root_dir``) is laid out as :mod:`lit_ddp.run_dir.layout` says.
Re-running the same command resumes from the valid checkpoint with the highest step there, the same one on
every rank (:func:`lit_ddp.resilience.resume.agree_on_resume_checkpoint`).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import yaml
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

from lit_ddp.launch.environment import (
    TorchrunEnvironment,
    config_value,
    follow_slurm_port,
    follow_torchrun,
    task_gpu_accelerator,
)
from lit_ddp.launch.preflight import check_ckpt_matches_config, check_ckpt_path, run_preflight
from lit_ddp.launch.reporting import mark_running
from lit_ddp.resilience.checkpoint_io import AtomicCheckpointIO
from lit_ddp.resilience.exact_resume import ExactResume
from lit_ddp.resilience.finite_loss import FiniteLossGuard
from lit_ddp.resilience.periodic_checkpoint import PeriodicCheckpoint
from lit_ddp.resilience.preemption import PreemptionCheckpoint
from lit_ddp.resilience.resume import RESUME_AUTO, check_resumable, restart_count, resume_from_agreed_checkpoint
from lit_ddp.resilience.startup_timeout import StartupTimeout
from lit_ddp.run_dir import layout
from lit_ddp.run_dir.checkpoints import checkpoint_step, set_aside_later_checkpoints
from lit_ddp.run_dir.lock import hold_run_directory

DEFAULT_ROOT_DIR = "runs/default"
# A run of its own inside the config's run directory, <root>/<id>, unless --trainer.default_root_dir is given:
# slurm/train.sbatch sets the job id (an array task's <array job id>_<task id>), which a requeue keeps.
RUN_ID = "LIT_DDP_RUN_ID"


def checkpoint_dir(root_dir: str | None) -> str:
    """``<root_dir>/checkpoints`` (:func:`lit_ddp.run_dir.layout.checkpoint_dir`; ``runs/default`` without one):
    where the checkpoint callback writes."""
    return layout.checkpoint_dir(str(root_dir or DEFAULT_ROOT_DIR))


def default_run_directory(config_files: list[Any] | None, model_class_path: str | None) -> str:
    """The run directory of a config that sets no ``trainer.default_root_dir``: ``runs/<folder>/<name>`` of its
    step config (the last ``--config`` that names a ``model``, else the last one), as every config of ours names
    its own (``configs/mingpt/cpu.yaml``: ``runs/mingpt/cpu``); without a config file, ``runs/<model class>``;
    without either, ``runs/default``. The same command finds its run again, and two configs never resume each
    other's checkpoints (one shared ``runs/default`` did)."""
    paths = [Path(str(f)) for f in config_files or []]
    if paths:
        steps = [p for p in paths if _names_a_model(p)]
        step = (steps or paths)[-1]
        return "/".join(["runs", *([step.parent.name] if step.parent.name else []), step.stem])
    if model_class_path:
        return f"runs/{model_class_path.rsplit('.', 1)[-1].lower()}"
    return DEFAULT_ROOT_DIR


def _names_a_model(path: Path) -> bool:
    try:
        content = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(content, dict) and "model" in content


def _as_list(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, list | tuple) else [value]


class ResilientCLI(LightningCLI):
    """LightningCLI with runs that survive kills, preemption and restarts.

    - ``checkpoint.*`` configures a ModelCheckpoint (:class:`PeriodicCheckpoint`, which also takes
      ``every_n_train_steps`` and ``train_time_interval`` together) writing to
      ``<trainer.default_root_dir>/checkpoints``; the tutorial's ``save_every`` is ``checkpoint.every_n_epochs``.
      With no trigger set it saves every epoch (ModelCheckpoint's default); a trigger given alone
      (``--checkpoint.every_n_train_steps 50``) is the only one.
    - Without ``trainer.default_root_dir`` the run directory is named after the config
      (:func:`default_run_directory`). With ``LIT_DDP_RUN_ID`` set and no ``--trainer.default_root_dir`` on
      the command line it is ``<root>/<LIT_DDP_RUN_ID>`` (one per Slurm job: ``slurm/train.sbatch``).
    - ``exact_resume.*`` configures :class:`ExactResume` (RNG and loader states per rank).
    - ``startup.timeout`` bounds the start-up (rendezvous, resume, restore) instead of the strategy's collective
      timeout (:class:`StartupTimeout`).
    - Every trainer gets :class:`FiniteLossGuard` and :class:`PreemptionCheckpoint` (``trainer_defaults``), and
      writes every checkpoint
      atomically (:class:`AtomicCheckpointIO`) unless ``trainer.plugins`` names another ``CheckpointIO``.
    - Before anything is instantiated: the launch, the machine and ``--ckpt_path`` are checked
      (:mod:`lit_ddp.launch.preflight`), and under torchrun the layout follows torchrun.
    - ``fit`` without ``--ckpt_path`` resumes from the newest valid checkpoint of the run directory, the same on
      every rank.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})  # a restart rewrites config.yaml
        # A NaN/inf loss stops training with a message naming the step; the last good checkpoint is kept.
        # A preemption signal saves, requeues (Slurm) and stops at an agreed optimizer step, on every rank.
        kwargs.setdefault("trainer_defaults", {"callbacks": [FiniteLossGuard(), PreemptionCheckpoint()]})
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(PeriodicCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.save_last": True,
                "checkpoint.save_top_k": -1,
            }
        )
        parser.link_arguments("trainer.default_root_dir", "checkpoint.dirpath", compute_fn=checkpoint_dir)
        parser.add_lightning_class_args(ExactResume, "exact_resume")
        parser.add_lightning_class_args(StartupTimeout, "startup")

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        # LightningCLI reads --ckpt_path's hyperparameters right after parsing: check the file first.
        subcommand = self.config.get("subcommand")
        if subcommand:
            config = self.config[subcommand]
            if config.get("trainer") is not None:
                self._place_run(config, sys.argv[1:] if args is None else args)
            check_ckpt_path(config.get("ckpt_path"))
            check_ckpt_matches_config(config.get("ckpt_path"), config.get("model"))

    @staticmethod
    def _place_run(config: Any, args: Any) -> None:
        """Sets the run directory where the config names none (after the config) and, with ``LIT_DDP_RUN_ID``
        and no ``--trainer.default_root_dir`` in ``args``, to the job's own inside it."""
        root, why = config.trainer.get("default_root_dir"), ""
        if not root:
            root = default_run_directory(config.get("config"), config_value(config.get("model"), "class_path"))
            why = "trainer.default_root_dir is not set"
        run_id = os.environ.get(RUN_ID, "")
        argv = args if isinstance(args, list | tuple) else []
        if run_id and not any(str(a).split("=")[0] == "--trainer.default_root_dir" for a in argv):
            root, why = os.path.join(str(root), run_id), f"{RUN_ID}={run_id}"
        if why:
            config.trainer.default_root_dir = root
            config.checkpoint.dirpath = checkpoint_dir(root)
            rank_zero_info(f"Run directory: {root} ({why})")

    def before_instantiate_classes(self) -> None:
        # Mis-launches, devices / precision this machine cannot run, a busy MASTER_PORT: one clear message and
        # exit 2 before anything starts.
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.get("trainer") is not None and (change := follow_torchrun(config.trainer)):
            rank_zero_info(change)  # torchrun's --nproc_per_node / --nnodes decide the layout
        run_preflight(config.get("trainer"))
        if change := follow_slurm_port():  # a port per job step, not Lightning's one per job
            rank_zero_info(change)
        if self.subcommand == "fit":  # one live job per run directory (rank zero holds it until it exits)
            hold_run_directory(str(config.trainer.default_root_dir))

    def option(self, config: Any, key: str, default: Any = None) -> Any:
        """``key`` of the running subcommand's part of ``config`` (``self.config`` or ``self.config_init``), or
        ``default``: what Lightning's private ``LightningCLI._get`` reads."""
        return (config[self.subcommand] if self.subcommand else config).get(key, default)

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        trainer_config = self.option(self.config_init, "trainer", default={})
        plugins = _as_list(trainer_config.get("plugins"))
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            plugins = [*plugins, AtomicCheckpointIO()]
        if "TORCHELASTIC_RUN_ID" in os.environ and not any(isinstance(p, ClusterEnvironment) for p in plugins):
            plugins = [*plugins, TorchrunEnvironment()]  # nodes may run different numbers of processes
        kwargs["plugins"] = plugins
        if accelerator := task_gpu_accelerator(trainer_config.get("accelerator")):
            kwargs["accelerator"] = accelerator  # srun bound one GPU to each task: cuda:0, not cuda:LOCAL_RANK
            rank_zero_info("Slurm bound one GPU to each task (CUDA_VISIBLE_DEVICES): each trains on its cuda:0")
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        self._start_run(resume=True)

    def after_fit(self) -> None:
        """Rank zero prints the last validation's ``val/*`` values, the best monitored value (unless the monitor
        is ``step``, which keeps the newest), its step and file, and the last checkpoint with its step."""
        if not self.trainer.is_global_zero:
            return
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("val/")}
        if metrics:  # none when the run had nothing left to train
            print("last validation: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())))
        ckpt = self.trainer.checkpoint_callback
        if not isinstance(ckpt, ModelCheckpoint):
            return
        if ckpt.monitor not in (None, "step") and ckpt.best_model_score is not None and ckpt.best_model_path:
            best = ckpt.best_model_path
            print(f"best {ckpt.monitor}: {float(ckpt.best_model_score):.4f} at global_step {checkpoint_step(best)}")
            print(f"best checkpoint: {best}")
        if ckpt.last_model_path:
            print(f"last checkpoint: {ckpt.last_model_path} (global_step {checkpoint_step(ckpt.last_model_path)})")

    def before_validate(self) -> None:
        self._start_run(resume=False)

    def before_test(self) -> None:
        self._start_run(resume=False)

    def _start_run(self, resume: bool) -> None:
        """Failures reported per rank from here on; without
        ``--ckpt_path``, the run directory's newest valid checkpoint (``fit`` resumes it, ``validate`` / ``test``
        evaluate it; a warning says when there is none), chosen once every rank has joined.

        ``fit --ckpt_path X`` is honoured once per job: its first attempt resumes from X and sets the run
        directory's checkpoints of later steps than X's aside (:func:`set_aside_later_checkpoints`); a torchrun
        restart or Slurm requeue of the same job resumes from what it saved since (X while it saved nothing)."""
        mark_running()
        startup = self.config_init[self.subcommand].get("startup")  # the trainer's callback, as LightningCLI made it
        if isinstance(startup, StartupTimeout):
            startup.arm(self.trainer)  # before the process group exists
        if not resume:  # an evaluation restores the weights only: the fit callbacks' states do not concern it
            warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`, callbacks used")
        else:  # a fit resumes from the run directory's checkpoints: that they exist is the design, not a mistake
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
        config = self.config_init[self.subcommand]
        root, given = self.trainer.default_root_dir, config.get("ckpt_path")
        if given in ("last", "best", "hpc", "registry"):
            return  # Lightning's own choice by name, as the user asked
        if given is not None and resume and restart_count() == 0:
            if self.trainer.is_global_zero:  # a rollback: the newer files are abandoned
                set_aside_later_checkpoints(root, checkpoint_dir(root), str(given))
            self.trainer.strategy.barrier("lit_ddp_later_checkpoints_moved")
        elif given is None or resume:  # the run directory; a restarted job's --ckpt_path only until it saved
            check_resumable(root, checkpoint_dir(root))  # before the logger writes anything
            resume_from_agreed_checkpoint(
                self.trainer, checkpoint_dir(root), required=not resume, given=None if given is None else str(given)
            )
            config["ckpt_path"] = RESUME_AUTO
