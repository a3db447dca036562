"""The DDP tutorial's "real-world" step: a character-level GPT trained on Tiny Shakespeare.

Source: pytorch/examples ``distributed/minGPT-ddp`` (``trainer.py``, ``gpt2_train_cfg.yaml``), itself built
on Andrej Karpathy's minGPT. The training recipe (parameter groups, optimizers, warmup + cosine decay) is
:mod:`lit_ddp.recipe`, the one the benchmarks use too; the FLOPs estimate is nanoGPT's. The data:
:class:`lit_ddp.data.char.CharDataModule`. Text samples and throughput (MFU) are callbacks that the step
configs list under ``trainer.callbacks``, not hyperparameters of this module.

Differences from the tutorial, and why:

- The tutorial's attention mask is not causal (see :mod:`lit_ddp.models.gpt`); ours is.
- The tutorial clips gradients by hand on the AMP-scaled gradients (before ``scaler.unscale_``), so the
  threshold is applied to the wrong values. Here clipping is ``trainer.gradient_clip_val``, which Lightning
  applies after unscaling.
- The vocabulary is saved in the checkpoint (``hyper_parameters["vocab"]``): ``lit-ddp generate`` needs no
  data file.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from torchmetrics import MeanMetric

from lit_ddp.data.char import decode, encode
from lit_ddp.models.gpt import GPT, PRESETS, GPTConfig
from lit_ddp.recipe import OPTIMIZERS, build_optimizer, warmup_cosine_schedule

DEFAULT_PROMPT = "O God, O God!"
"""What :meth:`GPTModule.sample` continues when given no prompt (TextSampleCallback's and ``lit-ddp generate``'s
default)."""


class GPTModule(LightningModule):
    """Trains :class:`lit_ddp.models.gpt.GPT` on next-character prediction.

    The GPT is built in ``configure_model`` once the vocabulary is known: from ``vocab`` if given (a loaded
    checkpoint), else from the datamodule after its ``setup``. The vocabulary is then stored in
    ``hparams["vocab"]`` and so in every checkpoint.

    Logged: ``train/loss`` (mean over ranks, every ``trainer.log_every_n_steps`` steps), ``val/loss`` (nats
    per character, token-weighted mean over all ranks) and ``val/ppl`` (``exp(val/loss)``). For throughput
    callbacks it sets ``flops_per_batch`` (training FLOPs of the current batch); ``sample()`` gives text.

    Args:
        model_type: size preset (``gpt-nano``, ``gpt-micro``, ``gpt-mini``, ``tutorial``).
        n_layer: overrides the preset's number of blocks.
        n_head: overrides the preset's attention heads.
        n_embd: overrides the preset's embedding width.
        block_size: context length in characters (linked from ``data.init_args.block_size``).
        dropout: dropout probability.
        bias: biases in Linear and LayerNorm layers.
        vocab: the vocabulary (character ``i`` is token ``i``); None: taken from the datamodule.
        learning_rate: AdamW's peak learning rate (the tutorial's 3e-4).
        weight_decay: AdamW weight decay of Linear weights (the tutorial's 0.1).
        betas: AdamW betas (minGPT's (0.9, 0.95)).
        warmup_steps: optimizer steps of linear warmup from 0 to ``learning_rate``.
        cosine_decay: after warmup, decay the learning rate along a cosine to ``min_lr_ratio * learning_rate``;
            False keeps it constant (the tutorial).
        decay_steps: optimizer step at which the cosine reaches its minimum; None: the end of training.
        min_lr_ratio: floor of the cosine, relative to ``learning_rate``.
        rope: rotary position embeddings instead of learned ones (:class:`GPTConfig`, RoFormer).
        qk_norm: RMSNorm of each head's q and k (:class:`GPTConfig`).
        activation: MLP nonlinearity, ``"gelu"`` (GPT-2) or ``"relu2"`` (Primer).
        tie_weights: the head shares the token embedding's weight (GPT-2); False unties it.
        zero_init_proj: residual output projections (and an untied head) start at zero.
        optimizer: ``"adamw"`` (minGPT's: AdamW over every parameter) or ``"muon"``: ``torch.optim.Muon`` for
            the blocks' 2-D weights, AdamW (``learning_rate``, ``betas``, ``weight_decay``) for the embeddings,
            head, norms and biases (:func:`lit_ddp.recipe.build_optimizer`); both follow the same warmup +
            cosine schedule.
        muon_learning_rate: Muon's peak learning rate.
        muon_momentum: Muon's (Nesterov) momentum.
        muon_weight_decay: Muon's decoupled weight decay.
        compile: run the training and validation forward through ``torch.compile`` (Inductor: C++ on CPU,
            Triton on CUDA); the compile time (tens of seconds) is paid by the first steps. Sampling and
            checkpoints use the plain module (same parameters, same state_dict keys).

    Raises:
        ValueError: an unknown preset or an invalid size, rate or schedule.
    """

    def __init__(
        self,
        model_type: str = "gpt-mini",
        n_layer: int | None = None,
        n_head: int | None = None,
        n_embd: int | None = None,
        block_size: int = 128,
        dropout: float = 0.1,
        bias: bool = True,
        vocab: str | None = None,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        cosine_decay: bool = False,
        decay_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        rope: bool = False,
        qk_norm: bool = False,
        activation: str = "gelu",
        tie_weights: bool = True,
        zero_init_proj: bool = False,
        optimizer: str = "adamw",
        muon_learning_rate: float = 0.02,
        muon_momentum: float = 0.95,
        muon_weight_decay: float = 0.0,
        compile: bool = False,
    ) -> None:
        super().__init__()
        if model_type not in PRESETS:
            raise ValueError(f"unknown model_type {model_type!r}; known: {sorted(PRESETS)}")
        if learning_rate <= 0:
            raise ValueError(f"learning_rate={learning_rate} must be > 0")
        if weight_decay < 0:
            raise ValueError(f"weight_decay={weight_decay} must be >= 0")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
        if decay_steps is not None and decay_steps <= warmup_steps:
            raise ValueError(f"decay_steps={decay_steps} must be > warmup_steps={warmup_steps}")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={min_lr_ratio} must be in [0, 1]")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} must be one of {', '.join(map(repr, OPTIMIZERS))}")
        if muon_learning_rate <= 0:
            raise ValueError(f"muon_learning_rate={muon_learning_rate} must be > 0")
        self.save_hyperparameters()
        self.hparams.betas = tuple(float(b) for b in betas)  # primitive, whatever the parser made of it
        self.gpt_config = self._make_config(vocab_size=len(vocab) if vocab else 1)  # validates the sizes
        self.model: GPT | None = None
        self._forward = None  # the compiled forward when compile=True (a function: not a registered submodule)
        self.flops_per_batch: int | None = None
        self._flops_per_token: dict[int, int] = {}  # by context length: the parameter count is fixed
        self.val_loss = MeanMetric()
        if vocab is not None:
            self.configure_model()

    def _make_config(self, vocab_size: int) -> GPTConfig:
        hp = self.hparams
        sizes = {k: v for k in ("n_layer", "n_head", "n_embd") if (v := hp[k]) is not None}
        return GPTConfig.from_preset(
            hp.model_type,
            **sizes,
            block_size=hp.block_size,
            vocab_size=vocab_size,
            dropout=hp.dropout,
            bias=hp.bias,
            **{k: hp[k] for k in ("rope", "qk_norm", "activation", "tie_weights", "zero_init_proj") if k in hp},
        )

    # ---- model construction and the vocabulary

    @property
    def vocab(self) -> str | None:
        return self.hparams.vocab

    def setup(self, stage: str) -> None:
        if self.vocab is not None:
            return
        datamodule = getattr(self.trainer, "datamodule", None)
        vocab = getattr(datamodule, "vocab", None)
        if vocab is None:
            raise ValueError("GPTModule needs a vocab: pass vocab=... or train with a CharDataModule")
        self.hparams.vocab = vocab

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.vocab is None:
            raise RuntimeError("configure_model() before the vocabulary is known (setup() sets it)")
        self.gpt_config = self._make_config(vocab_size=len(self.vocab))
        self.model = GPT(self.gpt_config)
        if self.hparams.get("compile", False):
            self._forward = torch.compile(self.model.forward)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("hyper_parameters", {}).get("vocab")
        if saved is not None and self.vocab is not None and saved != self.vocab:
            raise ValueError(
                f"the checkpoint's vocabulary ({len(saved)} characters) differs from the data's "
                f"({len(self.vocab)} characters): resume with the same text"
            )

    # ---- steps

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``idx (B, T) -> (logits (B, T, V), loss | None)``; see :meth:`GPT.forward`."""
        return self._forward(idx, targets) if self._forward is not None else self.model(idx, targets)

    def flops_per_token(self, seq_len: int) -> int:
        """:meth:`GPT.flops_per_token` at context ``seq_len``, counted once (it walks every parameter)."""
        if seq_len not in self._flops_per_token:
            self._flops_per_token[seq_len] = self.model.flops_per_token(seq_len)
        return self._flops_per_token[seq_len]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.flops_per_batch = self.flops_per_token(x.size(1)) * x.numel()  # forward + backward
        _, loss = self(x, y)
        # The mean over ranks is one all-reduce: only on the steps the logger writes. Lightning's condition
        # (its logger connector's should_update_logs) is "log_every_n_steps > 0 and ((batches that stepped + 1)
        # % log_every_n_steps == 0 or should_stop)"; before this batch's optimizer step the number of batches
        # that stepped is global_step (one optimizer, chained or not), so this is the same test in public terms.
        every = self.trainer.log_every_n_steps
        if every > 0 and ((self.global_step + 1) % every == 0 or self.trainer.should_stop):
            self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.flops_per_batch = self.flops_per_token(x.size(1)) * x.numel() // 3  # forward only
        _, loss = self(x, y)
        self.val_loss.update(loss, weight=x.numel())

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()  # all-reduced: the same value on every rank
        self.val_loss.reset()
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/ppl", torch.exp(loss), sync_dist=True)

    # ---- optimization

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        optimizer = build_optimizer(
            self.model,
            hp.optimizer,
            learning_rate=hp.learning_rate,
            weight_decay=hp.weight_decay,
            betas=tuple(hp.betas),
            muon_learning_rate=hp.muon_learning_rate,
            muon_momentum=hp.muon_momentum,
            muon_weight_decay=hp.muon_weight_decay,
        )
        decay_steps = hp.decay_steps if hp.cosine_decay else None
        if hp.cosine_decay and decay_steps is None:  # the end of training
            decay_steps = max(int(self.trainer.estimated_stepping_batches), hp.warmup_steps + 1)
        scheduler = warmup_cosine_schedule(optimizer, hp.warmup_steps, decay_steps, hp.min_lr_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- text

    @torch.no_grad()
    def sample(
        self,
        prompt: str | None = None,
        max_new_tokens: int = 200,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int | None = 0,
    ) -> str:
        """Text continuing ``prompt``, prompt included; local to this process.

        Args:
            prompt: the start of the text; every character must be in the vocabulary. None: ``DEFAULT_PROMPT``
                less the characters that are not in the vocabulary (its first character if none is left).
            max_new_tokens: characters to sample, ``>= 0``.
            temperature: sampling temperature; 0 is greedy.
            top_k: sample among the ``top_k`` most likely characters; None for all.
            seed: seed of a private generator (global RNG untouched); None uses the global RNG.

        Raises:
            ValueError: a character of ``prompt`` outside the vocabulary, an empty prompt, or a bad
                sampling argument.
        """
        if prompt is None:  # the default prompt, without characters this text lacks (else its first character)
            prompt = "".join(c for c in DEFAULT_PROMPT if c in self.vocab) or self.vocab[0]
        if not prompt:
            raise ValueError("prompt must not be empty")
        device = next(self.model.parameters()).device
        idx = encode(prompt, self.vocab).to(device)[None, :]  # (1, T)
        generator = None if seed is None else torch.Generator(device).manual_seed(seed)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.autocast(device.type, enabled=False):
                out = self.model.generate(idx, max_new_tokens, temperature, top_k, generator=generator)
        finally:
            self.model.train(was_training)
        return decode(out[0], self.vocab)
