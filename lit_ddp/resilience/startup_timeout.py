"""Two timeouts where DDP has one: a long one for start-up, the strategy's own for a stuck collective.

Lightning creates the process group with the strategy's ``timeout`` (``configs/trainer/ddp.yaml``: 5 minutes, so
that a hung peer becomes an error instead of a hang), and that one timeout also bounds everything before the
first step: the rendezvous (every rank's imports, a slow container start on one node), the ranks' agreement on
the resume checkpoint and each rank's read of it from shared storage. :class:`StartupTimeout` gives that part
its own, longer bound (torch's and Lightning's default, 30 minutes) and sets the strategy's timeout once every
rank has reached training (or evaluation), at a barrier: torch's ``init_process_group`` and Lightning's strategies
take one timeout for both. Checkpoint saves stay under the collective timeout: rank zero writes at disk speed
(docs/fault_tolerance.md, "Atomic saves"), minutes only for checkpoints of hundreds of GB.
"""

from __future__ import annotations

from datetime import timedelta

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_debug

from lit_ddp import compat


class StartupTimeout(Callback):
    """Bounds a run's start-up by ``timeout`` instead of the strategy's collective timeout.

    The start-up is everything from the rendezvous to the start of training (``fit``) or of the evaluation
    loop (``validate`` / ``test``): process-group creation, the resume agreement, the checkpoint restore and
    the sanity check. Then every rank meets at a barrier and the process group takes the strategy's timeout,
    which from there bounds how long a rank waits for a stuck peer. Nothing changes when the strategy has no
    timeout (one device) or a longer one than ``timeout``.

    Args:
        timeout: the bound of the start-up (a ``timedelta``; on the command line ``H:MM:SS``:
            ``--startup.timeout 0:30:00``).

    Raises:
        ValueError: ``timeout`` is not positive.
    """

    def __init__(self, timeout: timedelta = timedelta(minutes=30)) -> None:
        if timeout <= timedelta(0):
            raise ValueError(f"startup.timeout={timeout} must be positive (e.g. 0:30:00)")
        self.timeout = timeout
        self._collective: timedelta | None = None  # the strategy's timeout while the start-up one is in force

    def arm(self, trainer: Trainer) -> None:
        """Before ``trainer.fit/validate/test`` creates the process group: create it with the start-up timeout."""
        configured = compat.strategy_timeout(trainer.strategy)
        if self._collective is None and configured is not None and configured < self.timeout:
            self._collective = configured
            compat.set_strategy_timeout(trainer.strategy, self.timeout)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._started(trainer)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "validate":  # within fit, on_train_start decides
            self._started(trainer)

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._started(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._disarm(trainer)

    def _started(self, trainer: Trainer) -> None:
        if self._collective is None:
            return
        # Every rank has restored its checkpoint: from here, a rank that waits longer than the collective timeout
        # waits for a peer that is stuck or gone.
        trainer.strategy.barrier("lit_ddp_startup_done")
        compat.set_process_group_timeout(self._collective)
        rank_zero_debug(f"start-up done: collectives time out after {self._collective}")
        self._disarm(trainer)

    def _disarm(self, trainer: Trainer) -> None:
        if self._collective is not None:
            compat.set_strategy_timeout(trainer.strategy, self._collective)
            self._collective = None
