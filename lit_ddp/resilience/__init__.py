"""Everything that makes a run survive: callbacks, checkpoint IO and the resume point, which the ``lit-ddp``
command (:class:`lit_ddp.cli.LitDDPCLI`) installs.

- :mod:`~lit_ddp.resilience.checkpoint_io`: every save atomic, synchronous or in a background thread;
- :mod:`~lit_ddp.resilience.state`: what a fit's training state is, how it is captured and put back at one point,
  from a checkpoint file (a resume) or a live peer (a torchft heal);
- a resume, in the order it runs: :mod:`~lit_ddp.resilience.resume` chooses the checkpoint (the run directory's
  newest valid one, :mod:`lit_ddp.run_dir` listing it, listed once, chosen on rank zero, agreed by every rank,
  handed to Lightning); Lightning loads it and calls :mod:`~lit_ddp.resilience.exact_resume`'s hooks, which carry
  each rank's part of the state and have :func:`lit_ddp.resilience.state.put_back` finish the restore before the
  first step (loops and loaders, metrics, RNG, the restore check of :mod:`~lit_ddp.resilience.restore_check`); then
  :mod:`~lit_ddp.resilience.report` says what it did;
- :mod:`~lit_ddp.resilience.periodic_checkpoint`: checkpoints every N steps and/or T seconds;
- :mod:`~lit_ddp.resilience.startup_timeout`: start-up bounded apart from the collective timeout;
- :mod:`~lit_ddp.resilience.finite_loss`: a NaN stops every rank before it reaches a checkpoint;
- :mod:`~lit_ddp.resilience.preemption`, :mod:`~lit_ddp.resilience.signals`,
  :mod:`~lit_ddp.resilience.deferred`: signals acted on at agreed step boundaries (save, requeue, exit).

The tutorial code (``models``, ``data``, ``tasks``) imports none of it.
"""
