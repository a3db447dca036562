"""Callbacks for fault-tolerant training: periodic step checkpoints and bit-exact resume."""

from lit_ddp.callbacks.exact_resume import ExactResume, resumable_sampler
from lit_ddp.callbacks.periodic_checkpoint import PeriodicCheckpoint

__all__ = ["ExactResume", "PeriodicCheckpoint", "resumable_sampler"]
