"""The DDP tutorial's "real-world" step: a character-level GPT trained on Tiny Shakespeare.

Source: pytorch/examples ``distributed/minGPT-ddp`` (``char_dataset.py``, ``trainer.py``,
``gpt2_train_cfg.yaml``), itself built on Andrej Karpathy's minGPT; training recipe details (parameter
groups, warmup + cosine decay, FLOPs estimate) from Karpathy's minGPT and nanoGPT.

Differences from the tutorial, and why:

- The tutorial's attention mask is not causal (see :mod:`lit_ddp.models.gpt`); ours is.
- The tutorial splits overlapping windows with ``random_split``, so every validation window shares all but
  one character with some training window. Here the text is split contiguously first: validation text
  never appears in training.
- The tutorial clips gradients by hand on the AMP-scaled gradients (before ``scaler.unscale_``), so the
  threshold is applied to the wrong values. Here clipping is ``trainer.gradient_clip_val``, which Lightning
  applies after unscaling.
- The vocabulary is saved in the checkpoint (``hyper_parameters["vocab"]``): ``lit-ddp generate`` needs no
  data file.
"""

from __future__ import annotations

import hashlib
import math
import os
import posixpath
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchmetrics import MeanMetric

from lit_ddp.callbacks import resumable_sampler
from lit_ddp.models.gpt import GPT, PRESETS, GPTConfig, adamw_param_groups

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
DATA_ENV = "LIT_DDP_DATA"
"""Environment variable (a path or URL) that overrides the default text; ``make train DATA=...`` sets it."""
DEFAULT_CACHE_DIR = "~/.cache/lit_ddp"
DEFAULT_PROMPT = "O God, O God!"


# --------------------------------------------------------------------------------------------------------
# Vocabulary


def build_vocab(text: str) -> str:
    """The vocabulary of ``text``: its distinct characters, sorted; character ``vocab[i]`` is token ``i``."""
    return "".join(sorted(set(text)))


def encode(text: str, vocab: str) -> torch.Tensor:
    """Token ids of ``text`` under a sorted ``vocab`` (as :func:`build_vocab` makes it): int64 of shape
    ``(len(text),)``, vectorized (no per-character Python work).

    Raises:
        ValueError: ``text`` holds characters outside ``vocab`` (named in the message).
    """
    if not text:
        return torch.zeros(0, dtype=torch.long)
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    table = np.frombuffer(vocab.encode("utf-32-le"), dtype=np.uint32)  # sorted, as build_vocab makes it
    ids = np.searchsorted(table, codes)
    ids_clipped = np.minimum(ids, len(table) - 1)
    bad = table[ids_clipped] != codes
    if bad.any():
        missing = sorted({chr(c) for c in codes[bad][:1000]})
        raise ValueError(f"characters {missing!r} are not in the vocabulary of {len(vocab)} characters")
    return torch.from_numpy(ids.astype(np.int64))


def decode(ids: torch.Tensor | list[int], vocab: str) -> str:
    """Text of token ids ``(T,)``: the inverse of :func:`encode`."""
    return "".join(vocab[i] for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids))


# --------------------------------------------------------------------------------------------------------
# Data


def sha256_of(path: str | Path) -> str:
    """Hex sha256 of a local file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_url(source: str) -> bool:
    """True for fsspec URLs (``https://``, ``s3://``, ``file://``, ``memory://``...), False for plain paths."""
    return "://" in source


def download(url: str, cache_dir: str | Path, sha256: str | None = None) -> Path:
    """Copies ``url`` (any fsspec URL) into ``cache_dir`` once and returns the local path.

    The file is named after a hash of the URL; a download goes to a temporary name and is renamed when
    complete and verified, so a crash never leaves a partial file under the final name. An existing cached
    file is reused without network access.

    Args:
        url: where the text lives.
        cache_dir: local directory; created if missing.
        sha256: expected hex sha256 of the file; None skips the check.

    Raises:
        ValueError: the downloaded (or cached) file's sha256 differs from ``sha256``.
    """
    cache = Path(os.path.expanduser(str(cache_dir)))
    cache.mkdir(parents=True, exist_ok=True)
    name = posixpath.basename(url.rstrip("/")) or "data.txt"
    target = cache / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{name}"
    if not target.exists():
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        rank_zero_info(f"Downloading {url} to {target}")
        try:
            with fsspec.open(url, "rb") as src, open(tmp, "wb") as dst:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    dst.write(chunk)
            if sha256 is not None and (got := sha256_of(tmp)) != sha256:
                raise ValueError(f"sha256 mismatch for {url}: expected {sha256}, got {got}")
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    if sha256 is not None and (got := sha256_of(target)) != sha256:
        raise ValueError(f"sha256 mismatch for cached {target} ({url}): expected {sha256}, got {got}")
    return target


class CharWindows(Dataset):
    """Windows of a token tensor: item ``i`` is ``(x, y) = (data[s : s + T], data[s + 1 : s + T + 1])``
    with ``s = i * stride`` and ``T = block_size``; both int64 of shape ``(T,)``, slices of ``data``.

    Args:
        data: token ids ``(N,)``.
        block_size: window length T.
        stride: distance between window starts (1: every position, as the tutorial; T: disjoint windows).

    Raises:
        ValueError: ``data`` shorter than ``block_size + 1`` tokens.
    """

    def __init__(self, data: torch.Tensor, block_size: int, stride: int = 1) -> None:
        if data.numel() < block_size + 1:
            raise ValueError(f"{data.numel()} tokens are too few for one window of block_size={block_size} + 1")
        self.data = data
        self.block_size = block_size
        self.stride = stride

    def __len__(self) -> int:
        return (self.data.numel() - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = i * self.stride
        chunk = self.data[s : s + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CharDataModule(LightningDataModule):
    """Characters of a text file as next-token prediction windows (the tutorial's ``CharDataset``).

    The text comes from ``data``, else the ``LIT_DDP_DATA`` environment variable, else Tiny Shakespeare.
    A URL is downloaded once (``prepare_data``, local rank zero) into ``cache_dir``; a plain path is read in
    place. In ``setup`` every rank builds the vocabulary of the whole text (unlike the tutorial, which
    builds it after truncating, so a prompt may use any character of the file), encodes the first
    ``truncate`` fraction into one int64 tensor, and splits it contiguously: the first ``train_split`` for training, the rest for
    validation, so no validation window overlaps training text. Training windows start at every position
    (as the tutorial); validation windows are disjoint (stride ``block_size``), which estimates the same
    loss ``block_size`` times cheaper. A batch is ``(x, y)``, both ``(B, T)`` int64.

    Args:
        data: path or fsspec URL of a UTF-8 text; None: ``$LIT_DDP_DATA``, else Tiny Shakespeare.
        sha256: expected hex sha256 of the file; None: checked only for the default Tiny Shakespeare URL.
        cache_dir: where URLs are downloaded to.
        block_size: context length T in characters (linked to the model's ``block_size``).
        batch_size: windows per device and step (the tutorial's 216).
        train_split: fraction of the text used for training, in (0, 1).
        truncate: fraction of the text used at all, in (0, 1] (the tutorial's ``truncate: 0.05``).
        num_workers: DataLoader worker processes per rank.

    Raises:
        ValueError: a size or fraction out of range (at construction); a split too short for one window
            or a sha256 mismatch (in ``prepare_data`` / ``setup``).
    """

    def __init__(
        self,
        data: str | None = None,
        sha256: str | None = None,
        cache_dir: str = DEFAULT_CACHE_DIR,
        block_size: int = 128,
        batch_size: int = 64,
        train_split: float = 0.9,
        truncate: float = 1.0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be a positive integer")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be a positive integer (windows per device)")
        if not 0.0 < train_split < 1.0:
            raise ValueError(f"train_split={train_split} must be in (0, 1)")
        if not 0.0 < truncate <= 1.0:
            raise ValueError(f"truncate={truncate} must be in (0, 1]")
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be >= 0")
        self.save_hyperparameters()
        # A missing local file is reported now, before any DDP process is launched (reading waits for setup).
        if not is_url(self.source) and not Path(os.path.expanduser(self.source)).is_file():
            raise FileNotFoundError(f"data file {self.source} does not exist (set data, ${DATA_ENV} or DATA=...)")
        self.vocab: str | None = None
        self.train_set: CharWindows | None = None
        self.val_set: CharWindows | None = None

    @property
    def source(self) -> str:
        """The path or URL the text is read from."""
        return self.hparams.data or os.environ.get(DATA_ENV) or TINY_SHAKESPEARE_URL

    @property
    def expected_sha256(self) -> str | None:
        if self.hparams.sha256 is not None:
            return self.hparams.sha256
        return TINY_SHAKESPEARE_SHA256 if self.source == TINY_SHAKESPEARE_URL else None

    def local_path(self) -> Path:
        """The local file holding the text (for a URL: its cache file, downloaded if missing)."""
        if is_url(self.source):
            return download(self.source, self.hparams.cache_dir, self.expected_sha256)
        path = Path(os.path.expanduser(self.source))
        if not path.is_file():
            raise FileNotFoundError(f"data file {path} does not exist (set data, ${DATA_ENV} or DATA=...)")
        if self.expected_sha256 is not None and (got := sha256_of(path)) != self.expected_sha256:
            raise ValueError(f"sha256 mismatch for {path}: expected {self.expected_sha256}, got {got}")
        return path

    def prepare_data(self) -> None:
        self.local_path()

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        path = self.local_path()
        text = path.read_text(encoding="utf-8")
        if not text:
            raise ValueError(f"data file {path} is empty; give a text file with at least a few thousand characters")
        self.vocab = build_vocab(text)  # of the whole text: truncate never shrinks what a prompt may use
        text = text[: int(len(text) * hp.truncate)]
        data = encode(text, self.vocab)
        n_train = int(data.numel() * hp.train_split)
        if data.numel() - n_train <= hp.block_size:
            raise ValueError(
                f"block_size={hp.block_size} is at least as long as the validation split ({data.numel() - n_train} "
                f"characters of {path} with truncate={hp.truncate}, train_split={hp.train_split}); use "
                f"block_size < {data.numel() - n_train}, more text or a larger truncate"
            )
        self.train_set = CharWindows(data[:n_train], hp.block_size, stride=1)
        self.val_set = CharWindows(data[n_train:], hp.block_size, stride=hp.block_size)

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters (after ``setup``)."""
        if self.vocab is None:
            raise RuntimeError("vocab_size is known after setup()")
        return len(self.vocab)

    def train_dataloader(self) -> StatefulDataLoader:
        return StatefulDataLoader(
            self.train_set,
            batch_size=self.hparams.batch_size,
            # Resumable shuffling under DDP too (Lightning's DistributedSamplerWrapper loses its state).
            sampler=resumable_sampler(self.train_set),
            drop_last=True,
            num_workers=self.hparams.num_workers,
        )

    def val_dataloader(self) -> StatefulDataLoader:
        return StatefulDataLoader(
            self.val_set,
            batch_size=self.hparams.batch_size,
            shuffle=False,
            num_workers=self.hparams.num_workers,
        )


# --------------------------------------------------------------------------------------------------------
# Callbacks


class GPTThroughputMonitor(ThroughputMonitor):
    """Lightning's ThroughputMonitor for ``(x, y)`` token batches: samples/s, tokens/s (``items_per_sec``),
    FLOPs/s from the module's ``flops_per_batch``, and MFU against ``available_flops`` when known.

    Args:
        available_flops: peak FLOP/s of one device (one process); None: Lightning's table (GPUs only).
            On CPU, measure it with ``python -m bench.matmul_peak``.
        window_size: batches the rates are averaged over (rates appear once this many have run).
    """

    def __init__(self, available_flops: float | None = None, window_size: int = 20, **kwargs: Any) -> None:
        super().__init__(
            batch_size_fn=lambda batch: batch[0].size(0),
            length_fn=lambda batch: batch[0].numel(),
            window_size=window_size,
            **kwargs,
        )
        self._available_flops_override = available_flops

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self._available_flops_override is not None:
            self.available_flops = self._available_flops_override
            for throughput in self._throughputs.values():
                throughput.available_flops = self._available_flops_override


class TextSampleCallback(Callback):
    """At each validation end (not the sanity check), rank zero samples text from a fixed prompt and logs it
    to TensorBoard as text (tag ``samples``) and to the console at debug level.

    Sampling uses its own seeded generator, so training randomness is untouched.

    Args:
        prompt: the fixed prompt.
        max_new_tokens: characters to sample.
        temperature: sampling temperature.
        top_k: sample among the ``top_k`` most likely characters; None for all.
        seed: seed of the sampling generator.
    """

    def __init__(
        self,
        prompt: str = DEFAULT_PROMPT,
        max_new_tokens: int = 200,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int = 0,
    ) -> None:
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.seed = seed
        self.last_sample: str | None = None

    @rank_zero_only
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not hasattr(pl_module, "sample"):
            return
        text = pl_module.sample(self.prompt, self.max_new_tokens, self.temperature, self.top_k, self.seed)
        self.last_sample = text
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                indented = "\n".join("    " + line for line in text.splitlines())  # markdown code block
                logger.experiment.add_text("samples", indented, global_step=trainer.global_step)


# --------------------------------------------------------------------------------------------------------
# Model


class GPTModule(LightningModule):
    """Trains :class:`lit_ddp.models.gpt.GPT` on next-character prediction.

    The GPT is built in ``configure_model`` once the vocabulary is known: from ``vocab`` if given (a loaded
    checkpoint), else from the datamodule after its ``setup``. The vocabulary is then stored in
    ``hparams["vocab"]`` and so in every checkpoint.

    Logged: ``train/loss`` (per step, mean over ranks), ``val/loss`` (nats per character, token-weighted
    mean over all ranks) and ``val/ppl`` (``exp(val/loss)``); throughput (``train/device/items_per_sec`` is
    tokens/s per process, ``train/items_per_sec`` over all processes; FLOPs/s and MFU when a peak is
    known); a text sample at each validation end.

    Args:
        model_type: size preset (``gpt-nano``, ``gpt-micro``, ``gpt-mini``, ``tutorial``).
        n_layer: overrides the preset's number of blocks.
        n_head: overrides the preset's attention heads.
        n_embd: overrides the preset's embedding width.
        block_size: context length in characters (linked from ``data.init_args.block_size``).
        dropout: dropout probability.
        bias: biases in Linear and LayerNorm layers.
        vocab: the vocabulary (character ``i`` is token ``i``); None: taken from the datamodule.
        learning_rate: AdamW peak learning rate (the tutorial's 3e-4).
        weight_decay: AdamW weight decay of Linear weights (the tutorial's 0.1).
        betas: AdamW betas (minGPT's (0.9, 0.95)).
        warmup_steps: optimizer steps of linear warmup from 0 to ``learning_rate``.
        cosine_decay: after warmup, decay the learning rate along a cosine to ``min_lr_ratio * learning_rate``;
            False keeps it constant (the tutorial).
        decay_steps: optimizer step at which the cosine reaches its minimum; None: the end of training.
        min_lr_ratio: floor of the cosine, relative to ``learning_rate``.
        sample_prompt: prompt of the text sample at each validation end.
        sample_tokens: characters sampled at each validation end; 0 turns sampling off.
        available_flops: peak FLOP/s of one device (process), for MFU; see ``bench/matmul_peak.py``.

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
        sample_prompt: str = DEFAULT_PROMPT,
        sample_tokens: int = 200,
        available_flops: float | None = None,
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
        if sample_tokens < 0:
            raise ValueError(f"sample_tokens={sample_tokens} must be >= 0")
        self.save_hyperparameters()
        self.hparams.betas = tuple(float(b) for b in betas)  # primitive, whatever the parser made of it
        self.gpt_config = self._make_config(vocab_size=len(vocab) if vocab else 1)  # validates the sizes
        self.model: GPT | None = None
        self.flops_per_batch: int | None = None
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
        return self.model(idx, targets)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.flops_per_batch = self.model.flops_per_token(x.size(1)) * x.numel()  # forward + backward
        _, loss = self(x, y)
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.flops_per_batch = self.model.flops_per_token(x.size(1)) * x.numel() // 3  # forward only
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
        optimizer = torch.optim.AdamW(
            adamw_param_groups(self.model, hp.weight_decay), lr=hp.learning_rate, betas=tuple(hp.betas)
        )
        total = hp.decay_steps
        if hp.cosine_decay and total is None:
            total = max(int(self.trainer.estimated_stepping_batches), hp.warmup_steps + 1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, hp.warmup_steps, hp.cosine_decay, total, hp.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_callbacks(self) -> list[Callback]:
        callbacks: list[Callback] = [GPTThroughputMonitor(available_flops=self.hparams.available_flops)]
        if self.hparams.sample_tokens > 0:
            callbacks.append(TextSampleCallback(self.hparams.sample_prompt, self.hparams.sample_tokens))
        return callbacks

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
        """Text continuing ``prompt`` (default: ``sample_prompt``), prompt included; local to this process.

        Args:
            prompt: the start of the text; every character must be in the vocabulary.
            max_new_tokens: characters to sample, ``>= 0``.
            temperature: sampling temperature; 0 is greedy.
            top_k: sample among the ``top_k`` most likely characters; None for all.
            seed: seed of a private generator (global RNG untouched); None uses the global RNG.

        Raises:
            ValueError: a character of ``prompt`` outside the vocabulary, an empty prompt, or a bad
                sampling argument.
        """
        prompt = self.hparams.sample_prompt if prompt is None else prompt
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


def lr_factor(step: int, warmup_steps: int, cosine_decay: bool, decay_steps: int | None, min_ratio: float) -> float:
    """Learning-rate multiplier at optimizer step ``step``: linear warmup over ``warmup_steps``, then constant
    or (``cosine_decay``) a cosine from 1 down to ``min_ratio`` at ``decay_steps``, flat afterwards
    (nanoGPT's ``get_lr``)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if not cosine_decay or decay_steps is None:
        return 1.0
    if step >= decay_steps:
        return min_ratio
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_ratio + 0.5 * (1.0 - min_ratio) * (1.0 + math.cos(math.pi * progress))
