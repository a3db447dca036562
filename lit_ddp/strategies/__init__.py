"""The project's strategies, one module per parallelism: DDP (:mod:`.ddp`), FSDP2 and tensor parallelism
(:mod:`.fsdp`), pipeline parallelism (:mod:`.pipeline`).

Configs name them from here (``lit_ddp.strategies.DDPStrategy``, ``lit_ddp.strategies.FSDP2Strategy``,
``lit_ddp.strategies.PipelineStrategy``, ``lit_ddp.strategies.gpt_tensor_parallel``), whichever module holds them.
"""

from lit_ddp.strategies.ddp import DDPStrategy, ddp_buffer_kwargs
from lit_ddp.strategies.fsdp import FSDP2Strategy, forward_is_collective, gpt_tensor_parallel
from lit_ddp.strategies.pipeline import PipelineStrategy

__all__ = [
    "DDPStrategy",
    "FSDP2Strategy",
    "PipelineStrategy",
    "ddp_buffer_kwargs",
    "forward_is_collective",
    "gpt_tensor_parallel",
]
