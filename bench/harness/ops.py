"""Training steps outside a fit: :class:`AtenOps` counts their aten ops (an eager one is about one CUDA kernel
launch), :func:`train_step` is the recipe's step, :func:`recipe_model` a config's model and its optimizer."""

from __future__ import annotations

import collections
import contextlib
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.harness.launch import yaml_settings

GPU_YAML = "configs/mingpt/gpu.yaml"
VOCAB = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # Tiny Shakespeare's 65 characters


class AtenOps(TorchDispatchMode):
    """While active, counts the aten ops that :meth:`counts` accepts (here every one, views too) under the label
    :attr:`phase`; :meth:`counted` sees the output of each counted op."""

    def __init__(self) -> None:
        super().__init__()
        self.phase: Any = None
        self.ops: collections.Counter[Any] = collections.Counter()

    def counts(self, name: str, args: Any, kwargs: dict[str, Any]) -> bool:
        return True

    def counted(self, out: Any) -> None:
        pass

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        counts = self.counts(func.overloadpacket.__name__, args, kwargs)
        self.ops[self.phase] += counts
        out = func(*args, **kwargs)
        if counts:
            self.counted(out)
        return out

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def train_step(model: Any, optimizer: Any, x: torch.Tensor, y: torch.Tensor, autocast: Any = None) -> None:
    """One step of the recipe: forward (under ``autocast``, where given), backward, clipping at 1.0, the optimizer."""
    with autocast or contextlib.nullcontext():
        _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def recipe_model(*configs: str, device: str = "cpu") -> tuple[Any, torch.optim.Optimizer]:
    """The ``GPTModule`` the YAMLs configure (default gpu.yaml's; seed 0, train mode, eager) on ``device`` and the
    optimizer its recipe builds from the module's hyperparameters (:func:`lit_ddp.recipe.build_optimizer`)."""
    from lit_ddp.data.char import build_vocab
    from lit_ddp.recipe import build_optimizer
    from lit_ddp.tasks.mingpt import GPTModule

    settings = yaml_settings(*(configs or (GPU_YAML,)))
    torch.manual_seed(0)
    module = GPTModule(**{**settings["model"], "compile": False}, block_size=settings["data"]["block_size"],
                       vocab=build_vocab(VOCAB)).to(device).train()  # fmt: skip
    hp = module.hparams
    rates = ("learning_rate", "weight_decay", "muon_learning_rate", "muon_momentum", "muon_weight_decay")
    return module, build_optimizer(module.model, hp["optimizer"], betas=hp["betas"], **{k: hp[k] for k in rates})
