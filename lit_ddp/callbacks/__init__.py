"""Lightning callbacks, one per file: exact resume, periodic checkpoints, the finite-loss guard, text
samples and token throughput."""

from lit_ddp.callbacks.exact_resume import ExactResume
from lit_ddp.callbacks.finite_loss import FiniteLossGuard, NonFiniteLossError
from lit_ddp.callbacks.periodic_checkpoint import PeriodicCheckpoint
from lit_ddp.callbacks.text_samples import TextSampleCallback
from lit_ddp.callbacks.throughput import TokenThroughputMonitor

__all__ = [
    "ExactResume",
    "FiniteLossGuard",
    "NonFiniteLossError",
    "PeriodicCheckpoint",
    "TextSampleCallback",
    "TokenThroughputMonitor",
]
