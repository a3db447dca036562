"""Launching and failure reporting: checks before any process starts (:mod:`~lit_ddp.launch.preflight`),
what torchrun and Slurm decide (:mod:`~lit_ddp.launch.environment`), the errors lit-ddp explains
(:mod:`~lit_ddp.launch.errors`) and how a failure reaches the user (:mod:`~lit_ddp.launch.reporting`)."""
