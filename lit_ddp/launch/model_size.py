"""The model a checkpoint's hyperparameters build, measured against the tensors the checkpoint holds before it takes
any memory.

``lit-ddp generate`` builds its GPTModule from a checkpoint's ``hyper_parameters``, and LightningCLI puts the
hyperparameters of a ``--ckpt_path`` file into the model's arguments before ``fit``, ``validate`` or ``test`` build
it. Left to that, a checkpoint whose hyperparameters ask for ``n_layer=10000, n_embd=100000`` makes the process
allocate and initialize petabytes until the kernel kills it, before anything compares the model with the
checkpoint. Here the model is first built on torch's meta device (shapes, no memory) and refused in one line,
naming the sizes, unless its state_dict has the checkpoint's keys and shapes and it holds no more than
:data:`EXTRA_BYTES` outside them (the rotary tables a ``block_size`` sizes). The meta build itself stops after a
few tensors more than the checkpoint holds: a million blocks would take minutes and gigabytes of Python objects.
"""

from __future__ import annotations

import importlib
import inspect
import os
from typing import IO, Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)

from lit_ddp.errors import UsageError
from lit_ddp.launch.environment import config_value
from lit_ddp.run_dir import layout, untrusted

EXTRA_BYTES = 1 << 30
"""Bytes a model may hold outside its state_dict (non-persistent buffers) beyond its state_dict's own size."""
TENSORS_PER_ENTRY, EXTRA_TENSORS = 4, 1000
"""The meta build stops once it has registered more than ``4 x`` the checkpoint's state_dict entries ``+ 1000``
parameters and buffers: that model cannot be the checkpoint's."""
BUILD_ERRORS = (TypeError, ValueError, RuntimeError, AttributeError, KeyError, IndexError, OverflowError)
"""What a constructor raises for hyperparameters it cannot build."""


class _TooManyTensors(Exception):
    """The meta build registered more tensors than the checkpoint could hold."""


def state_shapes(source: str | os.PathLike[str] | IO[bytes]) -> dict[str, tuple[int, ...]]:
    """The shapes of a checkpoint's ``state_dict`` entries, read by :func:`lit_ddp.run_dir.untrusted.load`: a local
    file memory-mapped (no tensor is read), a file object (a sharded checkpoint made one, in memory) read and rewound.

    Raises:
        UntrustedFileError: the file holds more than tensors and plain data.
        RuntimeError, EOFError, ValueError, OSError: it is not a ``torch.save`` archive.
    """
    checkpoint = untrusted.load(source, mmap=True)  # the one loading policy; a local file memory-mapped
    if not isinstance(source, str | os.PathLike):
        source.seek(0)
    state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    return {str(k): tuple(v.shape) for k, v in (state or {}).items() if isinstance(v, torch.Tensor)}


def init_kwargs(cls: type, hparams: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``hparams`` that ``cls.__init__`` takes, as Lightning's ``load_from_checkpoint`` keeps them."""
    params = inspect.signature(cls).parameters  # of __init__, less self
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {k: v for k, v in hparams.items() if not k.startswith("_")}
    return {k: v for k, v in hparams.items() if k in params}


def build_on_meta(cls: type[nn.Module], kwargs: dict[str, Any], max_tensors: int) -> nn.Module:
    """``cls(**kwargs)`` on the meta device, then its ``configure_model()`` where it builds layers without a trainer.

    Raises:
        _TooManyTensors: it registered more than ``max_tensors`` parameters and buffers (it stops there).
        Exception: what the constructor raises.
    """
    registered = 0

    def count(*_: Any) -> None:
        nonlocal registered
        registered += 1
        if registered > max_tensors:
            raise _TooManyTensors

    hooks = [register_module_parameter_registration_hook(count), register_module_buffer_registration_hook(count)]
    try:
        with torch.device("meta"):
            module = cls(**kwargs)
            configure = getattr(module, "configure_model", None)
            try:
                if callable(configure):
                    configure()
            except BUILD_ERRORS:
                pass  # it needs what only a trainer gives (GPTModule: the data's vocabulary): compared as built
    finally:
        for hook in hooks:
            hook.remove()
    return module


def _shape(shape: tuple[int, ...]) -> str:
    return f"({', '.join(map(str, shape))})"


def _bytes(n: float) -> str:
    units = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB"]
    while n >= 1024 and len(units) > 1:
        n, units = n / 1024, units[1:]
    return f"{n:.0f} bytes" if units[0] == "bytes" else f"{n:.1f} {units[0]}"


def first_difference(model: dict[str, tuple[int, ...]], saved: dict[str, tuple[int, ...]]) -> str | None:
    """The first entry whose shape differs between a model's state_dict and a checkpoint's, or that one lacks."""
    for key, shape in model.items():
        if key in saved and saved[key] != shape:
            return f"{key} is {_shape(shape)} in the model, {_shape(saved[key])} in the checkpoint"
    for key, shape in model.items():
        if key not in saved:
            return f"the model's {key} {_shape(shape)} is not in the checkpoint"
    for key, shape in saved.items():
        if key not in model:
            return f"the checkpoint's {key} {_shape(shape)} is not in the model"
    return None


def check_model_fits(
    cls: type[nn.Module], hparams: dict[str, Any], saved: dict[str, tuple[int, ...]], what: str, built_from: str
) -> None:
    """Builds ``cls`` from ``hparams`` on the meta device (:func:`build_on_meta`) and compares its state_dict with
    the checkpoint's shapes ``saved`` (:func:`state_shapes`).

    Args:
        cls: the module class the hyperparameters are for.
        hparams: its arguments (entries it does not take are left out).
        saved: the checkpoint's state_dict shapes.
        what: the checkpoint, as the messages name it (``--ckpt_path PATH``).
        built_from: where the arguments come from, for the messages (``its hyperparameters``).

    Raises:
        UsageError: the hyperparameters do not build a ``cls``, or the model they build does not fit the checkpoint
            (naming the first entry that differs and both sizes), or holds more than :data:`EXTRA_BYTES` outside
            its state_dict.
    """
    name, limit = cls.__name__, TENSORS_PER_ENTRY * len(saved) + EXTRA_TENSORS
    refused = "refused before building it: give a checkpoint that lit-ddp fit wrote, with the hyperparameters it saved"
    try:
        module = build_on_meta(cls, init_kwargs(cls, hparams), limit)
    except _TooManyTensors:
        raise UsageError(
            f"{what}: {built_from} build a {name} of more than {limit:,} tensors, but the checkpoint's state_dict "
            f"holds {len(saved):,}; {refused}"
        ) from None
    except BUILD_ERRORS as e:
        raise UsageError(f"{what}: {built_from} do not build a {name} ({type(e).__name__}: {e})") from None
    state = module.state_dict()
    model = {k: tuple(v.shape) for k, v in state.items()}
    model_bytes = sum(v.numel() * v.element_size() for v in state.values())
    if (difference := first_difference(model, saved)) is not None:
        model_values, saved_values = sum(v.numel() for v in state.values()), sum(map(_numel, saved.values()))
        raise UsageError(
            f"{what} does not fit the {name} {built_from} build: {difference}; the model would hold "
            f"{model_values:,} values ({_bytes(model_bytes)}), the checkpoint holds {saved_values:,}; {refused}"
        )
    outside = sum(b.numel() * b.element_size() for key, b in module.named_buffers() if key not in model)
    if outside > model_bytes + EXTRA_BYTES:
        raise UsageError(
            f"{what}: the {name} {built_from} build would hold {_bytes(outside)} outside its state_dict (buffers), "
            f"more than its {_bytes(model_bytes)} state_dict + {_bytes(EXTRA_BYTES)}; {refused}"
        )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def check_ckpt_builds_model(ckpt_path: str | None, model_config: Any) -> None:
    """The model an explicit ``--ckpt_path`` file's hyperparameters configure (LightningCLI has put them into the
    model's arguments: call this after it parsed them), against the file's state_dict, before the model is built
    (:func:`check_model_fits`). Only lit_ddp's own LightningModules: another class's constructor may do more than
    build layers (download weights), and runs once. A directory or a remote file: LightningCLI reads no
    hyperparameters from those, the config alone builds the model.

    Raises:
        UsageError: what :func:`check_model_fits` raises, or a file that ``torch.load(weights_only=True)`` refuses.
    """
    if ckpt_path is None or str(ckpt_path) in layout.CKPT_PATH_KEYWORDS or not os.path.isfile(str(ckpt_path)):
        return
    class_path = config_value(model_config, "class_path")
    if not isinstance(class_path, str) or not class_path.startswith("lit_ddp."):
        return
    module_name, _, class_name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    init_args = config_value(model_config, "init_args")
    kwargs = dict(init_args.as_dict() if hasattr(init_args, "as_dict") else init_args or {})
    kwargs.update(config_value(model_config, "dict_kwargs") or {})
    try:
        saved = state_shapes(str(ckpt_path))
    except Exception as e:  # noqa: BLE001 - any reason torch gives: one line naming it
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise UsageError(
            f"--ckpt_path {ckpt_path} cannot be read with torch.load(weights_only=True): {reason}"
        ) from None
    check_model_fits(cls, kwargs, saved, f"--ckpt_path {ckpt_path}", "the config and its hyperparameters")
