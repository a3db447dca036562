"""Everything that makes a run survive: callbacks, checkpoint IO and the resume point, which the ``lit-ddp``
command (:class:`lit_ddp.cli.LitDDPCLI`) installs.

- :mod:`~lit_ddp.resilience.checkpoint_io`: every save atomic, synchronous or in a background thread;
- :mod:`~lit_ddp.resilience.resume`: the resume point, the newest valid checkpoint of the run directory
  (:mod:`lit_ddp.run_dir`: its layout, checkpoints, lock and atomic writes), agreed by all ranks, and what a
  resume reports;
- :mod:`~lit_ddp.resilience.exact_resume`: each rank's RNG and train-loader state in every checkpoint;
- :mod:`~lit_ddp.resilience.periodic_checkpoint`: checkpoints every N steps and/or T seconds;
- :mod:`~lit_ddp.resilience.startup_timeout`: start-up bounded apart from the collective timeout;
- :mod:`~lit_ddp.resilience.finite_loss`: a NaN stops every rank before it reaches a checkpoint;
- :mod:`~lit_ddp.resilience.preemption`, :mod:`~lit_ddp.resilience.signals`,
  :mod:`~lit_ddp.resilience.deferred`: signals acted on at agreed step boundaries (save, requeue, exit).

The tutorial code (``models``, ``data``, ``tasks``) imports none of it.
"""
