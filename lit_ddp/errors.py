"""User mistakes: checks that run before anything starts, and one clear message per mistake.

Every check raises :class:`UsageError` naming the bad value and what would be right; :func:`report` turns
that (and the ``ValueError`` / ``FileNotFoundError`` raised by the tasks' own argument checks, and
Lightning's ``MisconfigurationException``) into one ``lit-ddp: error: ...`` line on stderr and an exit
status: 2 for usage errors, 1 for failures during training (:class:`NonFiniteLossError`, unreadable
checkpoints). Set ``LIT_DDP_DEBUG=1`` to get the full traceback instead.
"""

from __future__ import annotations

import errno
import math
import os
import socket
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer

from lit_ddp.checkpointing import NoValidCheckpointError, is_valid_checkpoint

USAGE_EXIT_CODE = 2
FAILURE_EXIT_CODE = 1


class UsageError(ValueError):
    """A value given on the command line or in a config is wrong; the message says what would be right."""


class NonFiniteLossError(RuntimeError):
    """The training loss (or a parameter about to be checkpointed) became NaN or infinite."""


def _get(config: Any, key: str, default: Any = None) -> Any:
    return config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)


def check_trainer(trainer: Any, cpu_count: int | None = None, cuda_available: bool | None = None) -> None:
    """Checks ``trainer.devices`` and ``trainer.precision`` against this machine before any process starts.

    Raises:
        UsageError: more CPU processes than cores, or ``16-mixed`` / ``16`` precision on CPU.
    """
    if trainer is None:
        return
    cpu_count = (os.cpu_count() or 1) if cpu_count is None else cpu_count
    cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
    accelerator = str(_get(trainer, "accelerator", "auto") or "auto").lower()
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not cuda_available)
    if not on_cpu:
        return
    devices = _get(trainer, "devices", "auto")
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if isinstance(devices, int) and devices > cpu_count:
        raise UsageError(
            f"trainer.devices={devices} but this machine has {cpu_count} CPU core(s): on CPU each device is one "
            f"process, so use trainer.devices <= {cpu_count} (or trainer.accelerator=gpu on a GPU machine)"
        )
    precision = str(_get(trainer, "precision", None))
    if precision in ("16-mixed", "16", "16-true"):
        raise UsageError(
            f"trainer.precision={precision} is for GPUs; on CPU use trainer.precision=bf16-mixed or 32-true"
        )


def check_master_port(env: dict[str, str] | None = None) -> None:
    """Checks that a user-set ``MASTER_PORT`` is free before Lightning launches its DDP processes.

    Only for the process that launches the others itself (not under torchrun, srun, or in a launched
    child), since there the port is legitimately held by the launcher or rank 0. Without this check Lightning
    fails in rank 0 and leaves its already launched second process waiting for a peer.

    Raises:
        UsageError: the port is in use.
    """
    env = dict(os.environ) if env is None else env
    port = env.get("MASTER_PORT")
    launched = any(k in env for k in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_STEP_ID"))
    if port is None or launched:
        return
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"MASTER_PORT={port!r} is not a TCP port number (1-65535)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((env.get("MASTER_ADDR", "127.0.0.1"), int(port)))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return
            raise UsageError(
                f"MASTER_PORT={port} is already in use by another process (an earlier run still alive?); "
                "pick a free port, e.g. MASTER_PORT=29511, or unset MASTER_PORT and Lightning finds one"
            ) from None


def check_ckpt_path(ckpt_path: str | None) -> None:
    """Checks an explicit ``--ckpt_path`` before training starts (Lightning would fail after launching).

    Raises:
        UsageError: the file does not exist, or is truncated / not a torch checkpoint.
    """
    if ckpt_path is None or ckpt_path in ("last", "best", "hpc", "registry"):
        return
    import fsspec

    fs, path = fsspec.core.url_to_fs(str(ckpt_path))
    if not fs.exists(path):
        raise UsageError(
            f"--ckpt_path {ckpt_path} does not exist; give a .ckpt file of a run (e.g. <run>/checkpoints/last.ckpt)"
        )
    if not is_valid_checkpoint(str(ckpt_path)):
        raise UsageError(
            f"--ckpt_path {ckpt_path} is truncated or not a checkpoint (not a complete torch.save archive); "
            "pick another .ckpt from the run's checkpoints/ directory"
        )


class FiniteLossGuard(Callback):
    """Stops training when the loss becomes NaN or infinite, naming the step, before it is checkpointed.

    Every step, the ranks agree (one all-reduce of a flag) on whether any rank's loss is non-finite, so all
    ranks stop together instead of one hanging in the next collective. At each checkpoint save the
    parameters are checked too, so a non-finite update never overwrites the last good checkpoint (Lightning
    runs checkpoint callbacks after this one).

    Raises:
        NonFiniteLossError: from ``on_train_batch_end`` or ``on_save_checkpoint``.
    """

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        bad = loss is not None and not bool(torch.isfinite(loss.detach()).all())
        if trainer.strategy.reduce_boolean_decision(bad, all=False):
            value = float(loss.detach().float().mean()) if loss is not None else math.nan
            raise NonFiniteLossError(
                f"train loss became {value} at global_step {trainer.global_step} (epoch {trainer.current_epoch}, "
                f"batch {batch_idx}); training stopped and the last good checkpoint is kept. Lower the learning "
                "rate or set trainer.gradient_clip_val"
            )

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        for name, p in pl_module.named_parameters():
            if not bool(torch.isfinite(p.detach()).all()):
                raise NonFiniteLossError(
                    f"parameter {name} became non-finite at global_step {trainer.global_step}; the checkpoint was "
                    "not written and the last good one is kept. Lower the learning rate or set "
                    "trainer.gradient_clip_val"
                )


def report(fn: Callable[[], Any]) -> Any:
    """Runs ``fn``; a user mistake becomes one ``lit-ddp: error: ...`` line and exit status 2 (1 for failures
    during training), instead of a traceback."""
    if os.environ.get("LIT_DDP_DEBUG"):
        return fn()
    try:
        return fn()
    except (NonFiniteLossError, NoValidCheckpointError) as e:
        _exit(e, FAILURE_EXIT_CODE)
    except (UsageError, MisconfigurationException, ValueError, FileNotFoundError) as e:
        _exit(e, USAGE_EXIT_CODE)


def _message(e: BaseException) -> str:
    """The user's part of an error: jsonargparse wraps an ``__init__``'s ValueError in a report listing every
    subtype of the ``model`` / ``data`` union it tried; keep only the reasons that are not about ``None``."""
    text = str(e)
    if "Does not validate against any of the Union subtypes" in text:
        reasons = [
            line.strip()[2:] for line in text.splitlines() if line.strip().startswith("- ") and "NoneType" not in line
        ]
        if reasons:
            return "; ".join(reasons)
    return text


def _exit(e: BaseException, code: int) -> NoReturn:
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    # A usage error is the same on every rank: one message (rank zero's) is enough.
    if code != USAGE_EXIT_CODE or not getattr(rank_zero_only, "rank", 0):
        print(f"lit-ddp: error: {_message(e)}", file=sys.stderr)
        print("(set LIT_DDP_DEBUG=1 for the full traceback)", file=sys.stderr)
        sys.stderr.flush()
    raise SystemExit(code)
