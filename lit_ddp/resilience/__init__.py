"""Everything that makes a run survive, behind one door: :class:`ResilientCLI`, the LightningCLI that
``lit-ddp`` builds on.

- :mod:`~lit_ddp.resilience.checkpoint_io`: every save atomic, synchronous or in a background thread;
- :mod:`~lit_ddp.resilience.resume`: the resume point, the newest valid checkpoint of the run directory
  (:mod:`lit_ddp.run_dir`: its layout, checkpoints, lock and atomic writes), agreed by all ranks;
- :mod:`~lit_ddp.resilience.exact_resume`: each rank's RNG and train-loader state in every checkpoint;
- :mod:`~lit_ddp.resilience.periodic_checkpoint`: checkpoints every N steps and/or T seconds;
- :mod:`~lit_ddp.resilience.startup_timeout`: start-up bounded apart from the collective timeout;
- :mod:`~lit_ddp.resilience.finite_loss`: a NaN stops every rank before it reaches a checkpoint;
- :mod:`~lit_ddp.resilience.preemption`, :mod:`~lit_ddp.resilience.signals`,
  :mod:`~lit_ddp.resilience.deferred`: signals acted on at agreed step boundaries (save, requeue, exit).

The tutorial code (``models``, ``data``, ``tasks``) imports none of it.
"""

from typing import Any

__all__ = ["ResilientCLI"]


def __getattr__(name: str) -> Any:
    # Lazily: ``lit_ddp.__main__`` imports ``resilience.signals`` (standard library only) before Lightning.
    if name == "ResilientCLI":
        from lit_ddp.resilience.cli import ResilientCLI

        return ResilientCLI
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
