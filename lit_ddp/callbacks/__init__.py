"""Monitoring callbacks the configs name: text samples and token throughput; the GPU main job's batched optimizer
step; the model summary the CLI puts in place of Lightning's; and what keeps a resumed run's curves and progress bar
continuous (:mod:`~lit_ddp.callbacks.continuity`, which the CLI installs). (The callbacks that make a run survive are
in :mod:`lit_ddp.resilience`.)"""

from lit_ddp.callbacks.batched_step import BatchedOptimizerStep
from lit_ddp.callbacks.model_summary import MixedPrecisionModelSummary
from lit_ddp.callbacks.text_samples import TextSampleCallback
from lit_ddp.callbacks.throughput import TokenThroughputMonitor

__all__ = ["BatchedOptimizerStep", "MixedPrecisionModelSummary", "TextSampleCallback", "TokenThroughputMonitor"]
