"""The DDP tutorial's "real-world" step: a character-level GPT trained on Tiny Shakespeare.

Source: pytorch/examples ``distributed/minGPT-ddp`` (``trainer.py``, ``gpt2_train_cfg.yaml``), after Karpathy's
minGPT. The model is :mod:`lit_ddp.models.gpt`, the data :class:`lit_ddp.data.char.CharDataModule`, the
optimizer and schedule :mod:`lit_ddp.recipe`; text samples and throughput are callbacks the configs list.
Unlike the tutorial: the attention is causal; gradients are clipped after AMP unscaling
(``trainer.gradient_clip_val``); the vocabulary is saved in the checkpoint, so ``lit-ddp generate`` needs no data.
"""

from __future__ import annotations

from typing import Any, Literal, cast

import torch
from lightning.pytorch import LightningModule
from torchmetrics import MeanMetric

from lit_ddp.models.gpt import GPT, Block, GPTConfig
from lit_ddp.recipe import OPTIMIZERS, build_optimizer, check_schedule, warmup_cosine_schedule


class GPTModule(LightningModule):
    """Trains :class:`~lit_ddp.models.gpt.GPT` on next-character prediction.

    The GPT is built once the vocabulary is known: from ``vocab`` (a checkpoint's), else from the datamodule's at
    ``setup``, which replaces ``vocab`` (a checkpoint of another is refused as it loads) and goes into every checkpoint.
    Logged: ``train/loss`` (mean over ranks, on the steps the logger writes), ``val/loss`` (nats per character, a
    token-weighted mean over all ranks) and ``val/ppl``. ``flops_per_batch`` feeds Lightning's ThroughputMonitor.

    Args:
        model_type: size preset (``gpt-nano``, ``gpt-micro``, ``gpt-mini``, ``tutorial``).
        n_layer: overrides the preset's number of blocks.
        n_head: overrides the preset's attention heads.
        n_embd: overrides the preset's embedding width.
        block_size: context length in characters (linked from ``data.init_args.block_size``).
        dropout: dropout probability.
        bias: biases in Linear and LayerNorm layers.
        vocab: the vocabulary (character ``i`` is token ``i``), as a checkpoint holds it; None: the datamodule's.
        learning_rate: AdamW's peak learning rate (the tutorial's 3e-4).
        weight_decay: AdamW weight decay of Linear weights (the tutorial's 0.1).
        betas: AdamW betas (minGPT's (0.9, 0.95)).
        warmup_steps: optimizer steps of linear warmup to the peak rates.
        cosine_decay: after warmup, a cosine down to ``min_lr_ratio`` x the peaks; False: constant (the tutorial).
        decay_steps: optimizer step where the cosine reaches its floor; None: the end of training.
        min_lr_ratio: the cosine's floor, relative to the peaks.
        rope: rotary position embeddings instead of learned ones (:class:`~lit_ddp.models.gpt.GPTConfig`).
        optimizer: ``"adamw"`` (minGPT's) or ``"muon"`` (Muon for the blocks' matrices, AdamW for the rest):
            :func:`lit_ddp.recipe.build_optimizer`.
        muon_learning_rate: Muon's peak learning rate.
        muon_momentum: Muon's (Nesterov) momentum.
        muon_weight_decay: Muon's decoupled weight decay.
        compile: ``True`` / ``"model"``: the training forward through ``torch.compile`` (tens of seconds of compiling
            at the first step); ``"blocks"``: each ``Block`` compiled in place (regional compilation: one graph that
            every block reuses); False: eager. Validation and sampling run eagerly (no graph per batch shape).

    Raises:
        ValueError: an unknown preset or optimizer; a bad size, rate or schedule; no vocabulary, or another's at load.
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
        optimizer: str = "adamw",
        muon_learning_rate: float = 0.02,
        muon_momentum: float = 0.95,
        muon_weight_decay: float = 0.0,
        compile: bool | Literal["model", "blocks"] = False,
    ) -> None:
        super().__init__()
        for name, value in (("learning_rate", learning_rate), ("muon_learning_rate", muon_learning_rate)):
            if value <= 0:
                raise ValueError(f"{name}={value} must be > 0")
        if weight_decay < 0:
            raise ValueError(f"weight_decay={weight_decay} must be >= 0")
        self.save_hyperparameters()
        self.hp.betas = tuple(float(b) for b in betas)  # primitive, whatever the parser made of it
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} must be one of {', '.join(map(repr, OPTIMIZERS))}")
        check_schedule(warmup_steps, decay_steps, min_lr_ratio)  # now, before any process starts
        self.gpt_config = self._make_config(vocab_size=len(vocab) if vocab else 1)  # checks the sizes
        self.model: GPT | None = None
        self._forward: Any = None  # the compiled forward (a function: not a registered submodule)
        self.flops_per_batch: int | None = None
        self.val_loss = MeanMetric()
        if vocab is not None:
            self.configure_model()

    @property
    def hp(self) -> Any:  # the hyperparameters, as attributes
        return cast(Any, self.hparams)

    @property
    def vocab(self) -> str | None:
        return self.hp.vocab

    def _make_config(self, vocab_size: int) -> GPTConfig:
        hp = self.hp
        sizes = {k: hp[k] for k in ("n_layer", "n_head", "n_embd") if hp[k] is not None}
        options = {k: hp[k] for k in ("block_size", "dropout", "bias", "rope")}
        return GPTConfig.from_preset(hp.model_type, **sizes, **options, vocab_size=vocab_size)

    def setup(self, stage: str) -> None:
        vocab = getattr(getattr(self.trainer, "datamodule", None), "vocab", None)
        if vocab is None and self.vocab is None:
            raise ValueError("GPTModule needs a vocab: pass vocab=... or train with a CharDataModule")
        self.hp.vocab = vocab or self.vocab  # the data's: a --ckpt_path's (LightningCLI's) is compared as it loads

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.vocab is None:
            raise RuntimeError("configure_model() before the vocabulary is known (setup() sets it)")
        self.gpt_config = self._make_config(vocab_size=len(self.vocab))
        self.model = GPT(self.gpt_config)
        if self.hp.compile == "blocks":
            for block in [m for m in self.model.modules() if isinstance(m, Block)]:
                block.compile()
        elif self.hp.compile:
            self._forward = torch.compile(self.model.forward)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("hyper_parameters", {}).get("vocab")
        if saved is not None and self.vocab is not None and saved != self.vocab:
            raise ValueError(
                f"the checkpoint's vocabulary ({len(saved)} characters) is not the data's ({len(self.vocab)}): only "
                f"in the data {''.join(sorted(set(self.vocab) - set(saved))[:40])!r}, only in the checkpoint "
                f"{''.join(sorted(set(saved) - set(self.vocab))[:40])!r}: use it on the text it was trained on"
            )

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """``idx (B, T) -> (logits (B, T, V), loss | None)``: :meth:`GPT.forward`."""
        assert self.model is not None, "configure_model() first"
        if self.training:
            return (self._forward or self.model)(idx, targets)
        with torch.compiler.set_stance("force_eager"):  # blocks compiled in place run eagerly too
            return self.model(idx, targets)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch  # (B, T) each: this rank's shard of the global batch
        _, loss = self(x, y)
        self.flops_per_batch = self.model.flops_per_token(x.size(1)) * x.numel()  # type: ignore[union-attr]
        # Only on the steps the logger writes (should_update_logs in public terms): the mean over ranks, copied to the
        # host, where Lightning's progress bar reads it at every step without waiting for the device (a host sync).
        every = self.trainer.log_every_n_steps  # type: ignore[attr-defined]  # set by Lightning at runtime
        if every > 0 and ((self.global_step + 1) % every == 0 or self.trainer.should_stop):
            mean = self.trainer.strategy.reduce(loss.detach().clone(), reduce_op="mean")  # in place: on a copy
            self.log("train/loss", mean.cpu(), prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        _, loss = self(x, y)
        self.flops_per_batch = self.model.flops_per_token(x.size(1)) * x.numel() // 3  # type: ignore[union-attr]
        self.val_loss.update(loss, weight=x.numel())

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()  # all-reduced: the same value on every rank
        self.val_loss.reset()
        stage = "test" if self.trainer.testing else "val"
        self.log(f"{stage}/loss", loss, prog_bar=True, sync_dist=True)
        self.log(f"{stage}/ppl", torch.exp(loss), sync_dist=True)

    test_step = validation_step  # `lit-ddp test`: the held-out split (CharDataModule.test_dataloader)
    on_test_epoch_end = on_validation_epoch_end

    def configure_optimizers(self) -> Any:
        hp = self.hp
        assert self.model is not None, "configure_model() first"
        rates = ("learning_rate", "weight_decay", "muon_learning_rate", "muon_momentum", "muon_weight_decay")
        optimizer = build_optimizer(self.model, hp.optimizer, betas=tuple(hp.betas), **{k: hp[k] for k in rates})
        decay_steps = hp.decay_steps if hp.cosine_decay else None
        if hp.cosine_decay and decay_steps is None:  # the end of training
            decay_steps = max(int(self.trainer.estimated_stepping_batches), hp.warmup_steps + 1)
        scheduler = warmup_cosine_schedule(optimizer, hp.warmup_steps, decay_steps, hp.min_lr_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
