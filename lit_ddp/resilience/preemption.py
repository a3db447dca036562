"""Preemption handled at an optimizer-step boundary: the ranks agree, save one checkpoint, requeue, exit."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import time
from typing import Any

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from lit_ddp import compat
from lit_ddp.errors import Preempted
from lit_ddp.resilience import signals
from lit_ddp.resilience.checkpoint_io import wait_for_checkpoint_writes
from lit_ddp.resilience.deferred import DeferredFlag
from lit_ddp.run_dir.checkpoints import remove_older_hpc_checkpoints

log = logging.getLogger(__name__)

MAX_STEPS_BETWEEN_AGREEMENTS = 1000  # an int32 the all-reduce carries; far beyond any useful interval


BATCH_REQUEUE = "LIT_DDP_BATCH_REQUEUE"  # "1": the batch script requeues on exit status 128 + signum


class PreemptionCheckpoint(Callback):
    """Saves, requeues and stops when SIGUSR1 or SIGTERM arrives, at the next optimizer-step boundary.

    Lightning's SLURM handler calls ``trainer.save_checkpoint`` inside the signal handler and its SIGTERM
    handler broadcasts there, on each rank at whatever point that rank is (see :mod:`lit_ddp.resilience.signals`); this
    callback replaces only that part. Its handlers record the signal (:mod:`lit_ddp.resilience.signals`; SIGUSR1 from the
    start of ``lit-ddp fit``, SIGTERM from ``on_train_start``, when Lightning has installed its own). At
    agreed optimizer steps, about every ``agreement_interval_s`` seconds of training, each rank starts a
    non-blocking all-reduce (MAX) of "a signal was recorded here" and reads the one it started at the
    previous agreement: the agreement overlaps the steps in between instead of stalling one, and costs no
    step a wait. The steps between two agreements are agreed too: each rank proposes ``agreement_interval_s``
    over its own mean step time since the last agreement (at most twice the last interval, so that a few fast
    steps between validations do not propose an interval spanning many of them), and the all-reduce carries the smallest proposal
    to every rank with the flag, so all ranks meet at the same steps (the first agreement is after the
    first step). When any rank had a signal, all of them, at most two intervals and a step after it was
    recorded:

    1. at that step, or the next one when validation is due after it (a resume would skip that validation), save
       one checkpoint through the normal path (``trainer.save_checkpoint``: atomic, with every rank's
       RNG and loader states) as ``<default_root_dir>/hpc_ckpt_N.ckpt``, Lightning's name for it, and wait
       for an asynchronous write in flight (the checkpoint is on disk before anything else happens); the older
       ``hpc_ckpt_M.ckpt`` go (:func:`remove_older_hpc_checkpoints`);
    2. under Slurm with ``SLURMEnvironment(auto_requeue=True)`` and its requeue signal, the job is requeued:
       by the batch script once the step has ended when it says so (``LIT_DDP_BATCH_REQUEUE=1``, as
       ``slurm/train.sbatch`` does: on the host, after ``srun``, so neither a container without ``scontrol``
       nor ``srun --kill-on-bad-exit`` ending rank zero's ``scontrol`` can lose it), else by rank zero running
       ``scontrol requeue JOB`` (Lightning's command; it is part of its handler, so not callable alone);
    3. raise :class:`~lit_ddp.errors.Preempted`, which the CLI turns into exit status ``128 + signum`` without a traceback
       (SIGTERM: 143, which torchrun and Slurm read as a failure, so nothing counts the run as finished).

    A signal that lands during validation or a save is acted on one agreement later; one that lands in the
    last seconds of training, after the last agreement, lets the run finish normally (its final checkpoint is
    written as usual). Every rank takes part
    in each all-reduce (two int32; gloo on CPU, the default device's backend otherwise); the one in flight
    when training ends is waited for in ``on_train_end``. An all-reduce every step cost 0.5 % of a 80 ms
    step here (the step-time ratio of ``make bench-speed``); one a second costs nothing measurable.

    With ``handle_sigterm``, Lightning's own SIGTERM agreement goes: since Lightning 2.6 its training loop
    broadcasts rank zero's "SIGTERM received" flag before every step and reads it on the CPU
    (``_broadcast_sigterm_tensor``, Lightning PR 20825), a blocking collective per step that a plain DDP loop
    does not pay (measured here: most of Lightning's per-step cost over a plain loop under DDP; Lightning
    issue 21487, PR 21640 proposes an interval). Once this callback's handler owns SIGTERM, Lightning's flag
    can never be set, so the broadcast only costs time: ``on_train_start`` turns it off for this trainer.

    A rank that a SIGTERM finds blocked in a collective (a peer died under NCCL, which tells the survivors
    nothing, or hangs) cannot reach a step boundary: it ends itself with status 143 and one ``lit-ddp: error:``
    line once no training or validation batch has finished for ``stall_timeout_s`` seconds after the signal
    (:func:`lit_ddp.resilience.signals.watch_for_stalls`), instead of waiting for SIGKILL or the process group
    timeout. Lightning registers its own SIGTERM handler in ``trainer.fit`` before the sanity check; ours
    replaces it at once (:func:`lit_ddp.compat.after_lightning_signal_handlers`), so a SIGTERM before the first
    step is recorded too and acted on at the first agreement.

    Args:
        handle_sigterm: treat SIGTERM like a preemption notice (sites that send it before the kill).
        agreement_interval_s: seconds of training between two agreements (rounded down to whole steps, at
            least one): the longest a signal waits is about twice this plus a step. Slurm's ``KillWait``
            (30 s by default) bounds what SIGTERM leaves for the save.
        stall_timeout_s: seconds without a finished batch after a SIGTERM before the rank ends itself (longer
            than a training or validation batch takes; below the 10 s the launchers wait before SIGKILL);
            ``None``: never.

    Raises:
        ValueError: ``agreement_interval_s`` < 0, or ``stall_timeout_s`` <= 0.
    """

    def __init__(
        self, handle_sigterm: bool = True, agreement_interval_s: float = 1.0, stall_timeout_s: float | None = 5.0
    ) -> None:
        if agreement_interval_s < 0:
            raise ValueError(f"agreement_interval_s={agreement_interval_s} must be >= 0 (0: every step)")
        if stall_timeout_s is not None and stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s={stall_timeout_s} must be > 0 seconds, or None (never)")
        self.handle_sigterm = handle_sigterm
        self.agreement_interval_s = agreement_interval_s
        self.stall_timeout_s = stall_timeout_s
        # [highest signal number any rank recorded (0: none), -(fewest steps until the next agreement)]
        self._signal = DeferredFlag("max")
        self._next_step: int | None = None  # global_step of the next agreement (the same on every rank)
        self._last: tuple[float, int] | None = None  # (monotonic time, global_step) of this rank's last one
        self._deferred = 0  # a signal agreed on at a step after which validation was due

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            compat.after_lightning_signal_handlers(trainer, lambda: self._install(trainer))

    def _install(self, trainer: Trainer) -> None:
        """Our SIGUSR1 / SIGTERM handlers in place of Lightning's, and the stall watch."""
        signals.install(signal.SIGUSR1, *([signal.SIGTERM] if self.handle_sigterm else []))
        if self.handle_sigterm and self.stall_timeout_s is not None:
            try:
                signals.watch_for_stalls(self.stall_timeout_s, describe=lambda: f"rank {trainer.global_rank}")
            except RuntimeError as err:
                log.warning(str(err))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._install(trainer)  # already there since Lightning's registration; a trainer reused without setup
        self._signal, self._next_step, self._last = DeferredFlag("max"), None, None  # a new fit: agree after step one
        self._deferred = 0  # a signal agreed on at a step after which validation was due
        if self.handle_sigterm:
            compat.disable_sigterm_broadcast(trainer)  # see the class docstring

    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
        signals.beat()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        signals.watch_for_stalls(None)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        signals.beat()
        if compat.should_accumulate(trainer):
            return  # not an optimizer-step boundary
        step, signum = trainer.global_step, self._deferred
        if not signum:
            if self._next_step is not None and step < self._next_step:
                return
            agreed = self._signal.results()
            self._next_step = step + (-agreed[1] if agreed else 1)
            self._start_agreement(trainer, signals.requested())
            signum = agreed[0] if agreed else 0
            if not signum:
                return
        # Lightning validates after this hook when validation is due, and a resume from a checkpoint written here
        # skips that validation; after an epoch's last batch, a resume from here did not train as the uninterrupted
        # run (minGPT on 2 ranks, saves at steps 63 and 126 of 21-batch epochs: other weights). Save at the next
        # step boundary instead, once (every rank decides alike).
        deferred_already, self._deferred = self._deferred, 0
        last_batch = batch_idx + 1 >= trainer.num_training_batches
        if not deferred_already and (compat.validation_due(trainer) or last_batch):
            self._deferred = signum
            return
        self._agreed_last_step(trainer)  # no collective left in flight (its answer is this one's or newer)
        signals.watch_for_stalls(None)  # every rank is here: the save may take longer than a step
        path = compat.hpc_save_path(trainer)
        rank_zero_info(f"{signal.Signals(signum).name} received: saving {path} at global_step {trainer.global_step}")
        trainer.save_checkpoint(path, weights_only=False)  # the whole state; None logs a line on every rank
        wait_for_checkpoint_writes(trainer.strategy)
        if trainer.is_global_zero:
            remove_older_hpc_checkpoints(path)
        for logger in trainer.loggers:
            logger.save()
        requeued = False
        env = getattr(trainer.strategy, "cluster_environment", None)
        if isinstance(env, SLURMEnvironment) and env.auto_requeue and signum == env.requeue_signal:
            requeued = True
            if trainer.is_global_zero and os.environ.get(BATCH_REQUEUE) != "1":
                requeue_slurm_job()
        signals.clear()
        raise Preempted(signum, path, requeued)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._agreed_last_step(trainer)  # every rank ends at the same step: nothing left in flight

    def _start_agreement(self, trainer: Trainer, local: int | None) -> None:
        """Starts the all-reduce (MAX) of this rank's recorded signal (0: none) and its proposed number of
        steps until the agreement after the next one, without waiting for it."""
        now, step = time.monotonic(), trainer.global_step
        steps = 1
        if self._last is not None and step > self._last[1]:
            seconds_per_step = (now - self._last[0]) / (step - self._last[1])
            # At most twice the last interval: steps measured between two validations (or text samples) would
            # otherwise propose an interval that spans many of them, and a signal would wait through all.
            most = min(MAX_STEPS_BETWEEN_AGREEMENTS, 2 * (step - self._last[1]))
            steps = max(1, min(most, int(self.agreement_interval_s / seconds_per_step)))
        self._last = (now, step)
        self._signal.start([local or 0, -steps], trainer.strategy.root_device, trainer.world_size)

    def _agreed_last_step(self, trainer: Trainer) -> int | None:
        """The signal any rank had recorded when the all-reduce in flight was started (the highest number
        when ranks recorded different ones), or None; waits for that all-reduce."""
        return self._signal.result() or None


def requeue_slurm_job() -> None:
    """``scontrol requeue`` of this job (array jobs included), as Lightning's SLURM handler does it."""
    array_job_id = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job_id is not None:
        job_id = f"{array_job_id}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    else:
        job_id = os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_]+", job_id):
        raise RuntimeError(f"unexpected SLURM job id {job_id!r}; not requeueing")
    result = subprocess.call(["scontrol", "requeue", job_id])
    if result == 0:
        rank_zero_info(f"Requeued Slurm job {job_id}")
    else:
        log.warning(f"Requeueing Slurm job {job_id} failed with status {result}")
