"""Text samples drawn where the model trains: at each validation end into TensorBoard (:class:`TextSampleCallback`),
and at the end of training, the one ``lit-ddp fit`` prints (:class:`FitEndSample`)."""

from __future__ import annotations

from typing import cast

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lit_ddp.generate import check_sampling, sample
from lit_ddp.models.gpt import GPT, GPTConfig
from lit_ddp.strategies import forward_is_collective
from lit_ddp.tasks.mingpt import GPTModule


def sample_where_trained(
    trainer: Trainer,
    module: GPTModule,
    prompt: str | None = None,
    max_new_tokens: int = 200,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
) -> str | None:
    """Rank zero's :func:`lit_ddp.generate.sample` from ``module`` in the middle of a run: on the strategy's root
    device, under the run's precision (the precision plugin's ``forward_context()``: its autocast), with the key-value
    cache. Call it on every rank; the others get None.

    Where the forward is collective (FSDP2 shards, tensor-parallel ``DTensor``:
    :func:`lit_ddp.strategies.forward_is_collective`), sampling through it would all-gather or all-reduce on every
    rank for every token. Instead every rank joins one gather of the full parameters into a plain copy of the GPT on
    rank zero, which then samples alone. The copy costs one model's memory on rank zero's device while it samples.
    """
    assert module.model is not None, "the module's model is not built"
    collective = forward_is_collective(module)
    if not (trainer.is_global_zero or collective):
        return None
    model = _full_copy(module.model, trainer, trainer.strategy.root_device) if collective else None
    if not trainer.is_global_zero:
        return None
    precision = trainer.precision_plugin.forward_context()
    return sample(module, prompt, max_new_tokens, temperature, top_k, seed, model=model, precision=precision)


def _full_copy(model: nn.Module, trainer: Trainer, device: torch.device) -> GPT | None:
    """A plain GPT with ``model``'s full parameters on ``device`` on rank zero, None elsewhere; a collective (one
    all-gather per parameter, whatever the number of tokens sampled next). A strategy that splits the model
    (:class:`lit_ddp.strategies.PipelineStrategy`, FSDP2's) gathers it itself (``full_model_state``)."""
    gather = getattr(trainer.strategy, "full_model_state", None)
    if gather is not None:
        state = gather(model)
    else:  # rank zero alone gets the tensors (host)
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not trainer.is_global_zero:
        return None
    dtype = next(model.parameters()).dtype  # the shards' (bf16 under bf16-true)
    with torch.device(device):
        copy = GPT(cast(GPTConfig, model.config)).to(dtype)
    copy.load_state_dict(state)
    return copy.eval()


class TextSampleCallback(Callback):
    """At each validation end (not the sanity check), rank zero samples text from a fixed prompt of a
    :class:`GPTModule` (:func:`sample_where_trained`) and logs it to TensorBoard as text (tag ``samples``).

    Sampling uses its own seeded generator, so training randomness is untouched.

    Args:
        prompt: the fixed prompt; None: ``lit_ddp.generate.DEFAULT_PROMPT``. A prompt with characters outside
            the module's vocabulary falls back to that default too.
        max_new_tokens: characters to sample, ``>= 0``.
        temperature: sampling temperature.
        top_k: sample among the ``top_k`` most likely characters; None for all.
        seed: seed of the sampling generator.
        every_n_validations: sample at every this many validations (the 1st, the (n+1)-th...): frequent validations
            (``configs/mingpt/gpu.yaml``'s) need not pay a sample each (200 tokens: 0.85 s on an H200).

    Raises:
        ValueError: a bad sampling argument (:func:`lit_ddp.generate.check_sampling`), or ``every_n_validations`` < 1,
            at construction.
    """

    def __init__(
        self,
        prompt: str | None = None,
        max_new_tokens: int = 200,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int = 0,
        every_n_validations: int = 1,
    ) -> None:
        check_sampling(max_new_tokens, temperature, top_k)
        if every_n_validations < 1:
            raise ValueError(f"every_n_validations={every_n_validations} must be >= 1")
        self.every_n_validations = every_n_validations
        self._validations = 0  # since this fit's start (sanity checks aside)
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.seed = seed
        self.last_sample: str | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._validations = 0

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not isinstance(pl_module, GPTModule) or pl_module.vocab is None:
            return
        self._validations += 1
        if (self._validations - 1) % self.every_n_validations:
            return
        prompt = self.prompt
        if prompt is not None and not all(c in pl_module.vocab for c in prompt):
            prompt = None  # the default
        text = sample_where_trained(
            trainer, pl_module, prompt, self.max_new_tokens, self.temperature, self.top_k, self.seed
        )
        if text is None:  # not rank zero
            return
        self.last_sample = text
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                indented = "\n".join("    " + line for line in text.splitlines())  # markdown code block
                logger.experiment.add_text("samples", indented, global_step=trainer.global_step)


class FitEndSample(Callback):
    """The text sample ``lit-ddp fit`` prints at its end (:class:`lit_ddp.cli.LitDDPCLI` adds this callback for a
    :class:`GPTModule` and prints :attr:`text`): :func:`sample_where_trained` with its defaults, drawn in
    ``on_train_end``, the last hook before Lightning's teardown moves the model to the CPU (``on_fit_end`` and the
    CLI's ``after_fit`` come after it). A fit that had nothing left to train (a finished run launched again) draws
    none."""

    def __init__(self) -> None:
        self.text: str | None = None
        """The sample, on rank zero, once training has ended."""

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if isinstance(pl_module, GPTModule) and pl_module.vocab is not None:
            self.text = sample_where_trained(trainer, pl_module)
