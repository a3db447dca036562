"""Text samples from a fixed prompt at each validation end, into TensorBoard."""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger

from lit_ddp.generate import check_sampling, sample
from lit_ddp.strategies import forward_is_collective
from lit_ddp.tasks.mingpt import GPTModule


class TextSampleCallback(Callback):
    """At each validation end (not the sanity check), rank zero samples text from a fixed prompt of a
    :class:`GPTModule` (:func:`lit_ddp.generate.sample`) and logs it to TensorBoard as text (tag ``samples``).

    Sampling uses its own seeded generator, so training randomness is untouched.

    Args:
        prompt: the fixed prompt; None: ``lit_ddp.generate.DEFAULT_PROMPT``. A prompt with characters outside
            the module's vocabulary falls back to that default too.
        max_new_tokens: characters to sample, ``>= 0``.
        temperature: sampling temperature.
        top_k: sample among the ``top_k`` most likely characters; None for all.
        seed: seed of the sampling generator.

    Raises:
        ValueError: a bad sampling argument (:func:`lit_ddp.generate.check_sampling`), at construction.
    """

    def __init__(
        self,
        prompt: str | None = None,
        max_new_tokens: int = 200,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int = 0,
    ) -> None:
        check_sampling(max_new_tokens, temperature, top_k)
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.seed = seed
        self.last_sample: str | None = None

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not isinstance(pl_module, GPTModule) or pl_module.vocab is None:
            return
        # rank zero samples; under FSDP2 every rank does, the same tokens: each forward all-gathers the shards
        if not (trainer.is_global_zero or forward_is_collective(pl_module)):
            return
        prompt = self.prompt
        if prompt is not None and not all(c in pl_module.vocab for c in prompt):
            prompt = None  # the default
        text = sample(pl_module, prompt, self.max_new_tokens, self.temperature, self.top_k, self.seed)
        if not trainer.is_global_zero:
            return
        self.last_sample = text
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                indented = "\n".join("    " + line for line in text.splitlines())  # markdown code block
                logger.experiment.add_text("samples", indented, global_step=trainer.global_step)
