"""Launching and failure reporting: checks before any process starts (:mod:`~lit_ddp.launch.preflight`),
what torchrun and Slurm decide (:mod:`~lit_ddp.launch.environment`) and how a failure reaches the user
(:mod:`~lit_ddp.launch.reporting`, which prints the errors of :mod:`lit_ddp.errors` in one line)."""
