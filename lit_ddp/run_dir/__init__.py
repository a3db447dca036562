"""The run directory (``trainer.default_root_dir``): its layout, its checkpoints and the lock of the job using it.

- :mod:`~lit_ddp.run_dir.layout`: the names of its entries (``checkpoints/``, ``last.ckpt``, ``hpc_ckpt_N.ckpt``,
  ``set_aside/``, the lock);
- :mod:`~lit_ddp.run_dir.checkpoints`: listing and ranking checkpoints, their headers and validity, setting later
  ones aside, removing superseded preemption checkpoints;
- :mod:`~lit_ddp.run_dir.lock`: one live job per run directory;
- :mod:`~lit_ddp.run_dir.atomic`, :mod:`~lit_ddp.run_dir.sharded`: files and sharded checkpoint directories that
  appear whole or not at all;
- :mod:`~lit_ddp.run_dir.untrusted`, :mod:`~lit_ddp.run_dir.inert`: how files someone else may have written are
  read (weights-only, checked first, headers and DCP metadata without an unpickler).

It imports nothing of the package but :mod:`lit_ddp.errors` and :mod:`lit_ddp.compat`, so every layer may use it.
"""
