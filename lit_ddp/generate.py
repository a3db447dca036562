"""``lit-ddp generate``: text from a minGPT checkpoint, without the training data.

    lit-ddp generate --ckpt_path runs/mingpt/cpu/checkpoints/last.ckpt --prompt "ROMEO:" --max_new_tokens 300

The checkpoint is untrusted input: it is read with ``torch.load(weights_only=True)``, which refuses pickled
code, and must name this package's GPTModule. The vocabulary and model sizes come from the checkpoint's
``hyper_parameters``, checked against its tensors before the model takes memory
(:mod:`lit_ddp.launch.model_size`). The model is loaded onto the GPU when torch sees one (``--device`` chooses), and
samples with a key-value cache (:func:`lit_ddp.models.kv_cache.generate`).
"""

from __future__ import annotations

import math
import pickle
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from jsonargparse import ArgumentParser, Namespace

from lit_ddp.data.char import decode, encode
from lit_ddp.errors import UsageError
from lit_ddp.launch.model_size import check_model_fits, state_shapes
from lit_ddp.models import kv_cache
from lit_ddp.models.gpt import GPT
from lit_ddp.run_dir import sharded
from lit_ddp.run_dir.checkpoints import checkpoint_header
from lit_ddp.tasks.mingpt import GPTModule

DEFAULT_PROMPT = "O God, O God!"
"""What :func:`sample` continues when given no prompt (also TextSampleCallback's default)."""


MIN_TEMPERATURE = 1e-6
"""The smallest positive sampling temperature. Below it sampling is greedy but for ties, and the logits divided by it
can overflow float32 (a temperature of 1e-45 does: torch's multinomial then raises)."""


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, prefix: str = "") -> None:
    """Raises ValueError naming the first bad sampling argument (``prefix`` goes before its name, e.g. ``--``):
    ``max_new_tokens < 0``, a ``temperature`` that is not a finite number, is below 0 or between 0 and
    :data:`MIN_TEMPERATURE`, or ``top_k < 1``."""
    if max_new_tokens < 0:
        raise ValueError(f"{prefix}max_new_tokens={max_new_tokens} must be >= 0")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"{prefix}temperature={temperature} must be a finite number >= 0 (0: greedy)")
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"{prefix}temperature={temperature} must be 0 (greedy) or >= {MIN_TEMPERATURE:g} (below, the logits "
            "divided by it can overflow)"
        )
    if top_k is not None and top_k < 1:
        raise ValueError(f"{prefix}top_k={top_k} must be >= 1 (or null for no limit)")


@torch.no_grad()
def sample(
    module: GPTModule,
    prompt: str | None = None,
    max_new_tokens: int = 200,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = 0,
    *,
    model: GPT | None = None,
    precision: AbstractContextManager[Any] | None = None,
    cpu_threads: int | None = 1,
) -> str:
    """Text continuing ``prompt`` (prompt included) from a :class:`GPTModule`, local to this process, in eval mode,
    on the device of the model's parameters; :func:`lit_ddp.models.kv_cache.generate` does the sampling (the tokens
    of :meth:`lit_ddp.models.gpt.GPT.generate`, with a key-value cache).

    Args:
        module: a GPTModule with its model built (its vocabulary; its model unless ``model`` is given).
        prompt: the start of the text, in the module's vocabulary. None: ``DEFAULT_PROMPT`` less the characters
            the vocabulary lacks (its first character if none is left).
        max_new_tokens: characters to sample, ``>= 0``.
        temperature: sampling temperature; 0 is greedy.
        top_k: sample among the ``top_k`` most likely characters; None for all.
        seed: seed of a private generator (the global RNG is untouched); None uses the global RNG.
        model: the GPT to sample from in place of ``module.model``: a copy with its full parameters where the
            module's forward is collective (:func:`lit_ddp.callbacks.text_samples.sample_where_trained`).
        precision: the context the forward runs in: a trainer's ``precision_plugin.forward_context()`` (the run's
            autocast); None: full precision.
        cpu_threads: torch's intra-op threads while sampling on a CPU (restored after); None keeps torch's setting.
            One by default: each new token is a (1, 1) forward of matrix-vector products, too small to share out.
            Measured on 2 cores (torch 2.13, 200 tokens of the main job's 3x3x48 model): 0.21 s with 1 or 2
            threads alone, but 0.56 s with 1 and 6.5 s with 2 while two other 2-thread jobs ran; a 12x12x768 model
            alone, 100 tokens: 3.8 s with 1 thread, 3.6 s with 2.

    Raises:
        ValueError: a character of ``prompt`` outside the vocabulary, an empty prompt, or a bad argument.
    """
    check_sampling(max_new_tokens, temperature, top_k)
    vocab, model = module.vocab, module.model if model is None else model
    assert vocab is not None and model is not None, "the module's model is not built"
    if prompt is None:
        prompt = "".join(c for c in DEFAULT_PROMPT if c in vocab) or vocab[0]
    if not prompt:
        raise ValueError("prompt must not be empty")
    device = next(model.parameters()).device
    idx = encode(prompt, vocab).to(device)[None, :]  # (1, T)
    generator = None if seed is None else torch.Generator(device).manual_seed(seed)
    was_training, threads = model.training, torch.get_num_threads()
    model.eval()
    if device.type == "cpu" and cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    try:
        with precision or torch.autocast(device.type, enabled=False):
            out = kv_cache.generate(model, idx, max_new_tokens, temperature, top_k, generator)  # (1, T + new)
    finally:
        model.train(was_training)
        torch.set_num_threads(threads)
    return decode(out[0], vocab)


def sampling_device(device: str | None = None) -> torch.device:
    """``device`` as a ``torch.device``; None: ``cuda`` when torch sees a CUDA device, else ``cpu``.

    Raises:
        ValueError: a string torch does not read as a device, or a CUDA device torch does not see.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"--device {device!r}: {e}") from e
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return parsed


GPT_CLASS_PATH = f"{GPTModule.__module__}.{GPTModule.__qualname__}"
"""The only class a checkpoint may name for ``generate``: ``lit_ddp.tasks.mingpt.GPTModule``."""


def load_gpt(ckpt_path: str | Path, map_location: str = "cpu") -> GPTModule:
    """A :class:`GPTModule` rebuilt from a checkpoint written by ``lit-ddp fit`` with it, in eval mode
    (Lightning's ``load_from_checkpoint`` with ``weights_only=True``). A sharded checkpoint's directory (FSDP2's
    ``save_distributed_checkpoint``) is consolidated first, in memory (:func:`lit_ddp.run_dir.sharded.as_file`).
    Before the model is built, its hyperparameters are checked against the checkpoint's tensors on the meta device
    (:func:`lit_ddp.launch.model_size.check_model_fits`).

    Raises:
        FileNotFoundError: ``ckpt_path`` does not exist.
        ValueError: the file is empty or not a checkpoint, cannot be loaded with ``weights_only=True``, or it is not
            a minGPT checkpoint (another class than :data:`GPT_CLASS_PATH`, no ``vocab`` in its
            ``hyper_parameters``, or hyperparameters that its state_dict does not fit: a UsageError naming sizes).
    """
    path = Path(ckpt_path)
    if not (path.is_file() or sharded.is_sharded(path)):
        raise FileNotFoundError(f"--ckpt_path {path}: no such file")
    not_gpt = f"--ckpt_path {path} is not a minGPT checkpoint (from lit-ddp fit with GPTModule)"
    if path.is_file() and path.stat().st_size == 0:
        raise ValueError(
            f"--ckpt_path {path} is empty (0 bytes), not a checkpoint: give a .ckpt that lit-ddp fit wrote"
        )
    try:  # the task that wrote it, from the header alone: another task's file would fail deep in torch.load
        hparams = checkpoint_header(str(path)).get("hyper_parameters") or {}
    except ValueError as e:
        raise ValueError(f"--ckpt_path {e}; give a .ckpt that lit-ddp fit wrote") from None
    saved_class = hparams.get("_class_path")
    if saved_class is not None and saved_class != GPT_CLASS_PATH:
        raise ValueError(f"{not_gpt}: it is a checkpoint of {saved_class}")
    try:
        source = sharded.as_file(path) if sharded.is_sharded(path) else path
        saved = state_shapes(source)
        if not hparams.get("vocab"):
            raise ValueError("no vocab in its hyper_parameters")
        check_model_fits(GPTModule, hparams, saved, f"--ckpt_path {path}", "its hyperparameters")
        module = GPTModule.load_from_checkpoint(source, map_location=map_location, weights_only=True)
    except UsageError:
        raise
    except pickle.UnpicklingError as e:
        raise ValueError(f"--ckpt_path {path}: cannot be loaded with torch.load(weights_only=True): {e}") from e
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, EOFError) as e:
        raise ValueError(f"{not_gpt}: {e}") from e
    return module.eval()


def generate(
    ckpt_path: str,
    prompt: str = DEFAULT_PROMPT,
    max_new_tokens: int = 500,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 1337,
    device: str | None = None,
) -> str:
    """Samples text from a minGPT checkpoint.

    Args:
        ckpt_path: a checkpoint written by ``lit-ddp fit --config configs/mingpt/...``.
        prompt: the start of the text; its characters must be in the checkpoint's vocabulary.
        max_new_tokens: characters to sample after the prompt (>= 0).
        temperature: > 1 more random, < 1 more conservative, 0 greedy (>= 0).
        top_k: sample only among the top_k most likely characters (>= 1); null for all.
        seed: seed of the sampling generator (same seed, same text on the same device).
        device: where the model is loaded and samples (``cpu``, ``cuda``, ``cuda:1``); null: ``cuda`` when torch
            sees a CUDA device, else ``cpu``. Full precision either way.

    Returns:
        The prompt followed by the sampled characters.

    Raises:
        FileNotFoundError: ``ckpt_path`` does not exist.
        ValueError: a bad argument (named in the message), a CUDA device torch does not see, or a file that is not
            a minGPT checkpoint.
    """
    check_sampling(max_new_tokens, temperature, top_k, prefix="--")
    if not prompt:
        raise ValueError("--prompt must not be empty")
    module = load_gpt(ckpt_path, map_location=str(sampling_device(device)))
    try:
        return sample(module, prompt, max_new_tokens, temperature, top_k, seed)
    except ValueError as e:
        raise ValueError(f"--prompt {prompt!r}: {e}") from e


def generate_parser() -> ArgumentParser:
    """The arguments of ``lit-ddp generate``, a subcommand of the ``lit-ddp`` parser
    (:class:`lit_ddp.cli.LitDDPCLI`): :func:`generate`'s signature."""
    parser = ArgumentParser(description=(generate.__doc__ or "").split("\n")[0])
    parser.add_function_arguments(generate, as_group=False)
    return parser


def generate_main(config: Namespace) -> int:
    """``lit-ddp generate`` with its parsed arguments (:func:`generate_parser`): prints the text. Returns 0.

    Raises:
        UsageError: what :func:`generate` raises for its input (exit status 2).
    """
    try:
        text = generate(**config.as_dict())
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    print(text)
    return 0
