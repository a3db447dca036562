"""What a replica group that (re)joins the quorum takes from a live peer: :class:`PeerState`.

torchft's manager asks a state function of the peer it heals from and hands the result to a load function on the
healing group, both registered once (``Manager.register_state_dict_fn``). :class:`PeerState` is that pair for a
Lightning fit: the training state a resume from disk restores (module, optimizers, schedulers, the loop's position,
RNG streams, metric sums; :class:`lit_ddp.resilience.restore.ResumeState`'s helpers for the last two), taken live,
put back at one point, at the start of the step the groups then take together. The train loaders' positions are
not transferred (a loader is mid-iteration when a heal arrives): a healed group reads on from its own position.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer

from lit_ddp import compat
from lit_ddp.resilience import restore


class PeerState:
    """The state of one replica group's fit that a healing group takes from it.

    Args:
        trainer: the fit's Trainer (its strategy holds the optimizers, its loop the position).
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        """The fit's state now, at the start of a step (called on the peer, in torchft's quorum thread, while its
        main thread waits for the quorum)."""
        trainer = self.trainer
        module = trainer.lightning_module
        return {
            "module": module.state_dict(),
            "optimizers": [opt.state_dict() for opt in trainer.optimizers],
            "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "loop": {
                "optimizer_steps": compat.optimizer_steps(trainer),
                "batches_that_stepped": compat.batches_that_stepped(trainer),
            },
            "rng": restore.capture_rng(trainer.strategy.root_device),
            "metrics": restore.metric_states(module),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Puts a peer's :meth:`state_dict` into this fit, at the start of a step (before its forward): module,
        optimizers, schedulers, the loop's step counts, the metrics' running sums, then the RNG streams."""
        trainer = self.trainer
        module = trainer.lightning_module
        module.load_state_dict(state["module"])
        for opt, saved in zip(trainer.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(saved)
        for config, saved in zip(trainer.lr_scheduler_configs, state["schedulers"], strict=True):
            config.scheduler.load_state_dict(saved)
        compat.set_optimizer_steps(trainer, int(state["loop"]["optimizer_steps"]))
        compat.set_batches_that_stepped(trainer, int(state["loop"]["batches_that_stepped"]))
        if state["metrics"]:
            restore.restore_metric_states(module, state["metrics"])
        restore.restore_rng(state["rng"], trainer.strategy.root_device, trainer.local_rank)
