"""The GPT's training recipe, the one used by :class:`lit_ddp.tasks.mingpt.GPTModule` and by every benchmark in
``bench/``: parameter groups, the optimizer (AdamW, or Muon + AdamW) and the warmup + cosine learning rate.

Plain torch (no Lightning), so a plain loop trains with exactly what the Lightning job trains with, and a
benchmark measures the product rather than a copy of it.

Sources: the AdamW parameter groups are minGPT's (``GPT.configure_optimizers``: Linear weights decay, biases,
LayerNorm and Embedding weights do not); the schedule is nanoGPT's ``get_lr`` (``train.py``: linear warmup,
cosine decay to a floor), both Andrej Karpathy's, MIT-licensed; Muon is Keller Jordan's ("Muon: An optimizer
for hidden layers in neural networks", 2024; modded-nanogpt's speedrun records 3-4), as ``torch.optim.Muon``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LambdaLR, LinearLR, LRScheduler, SequentialLR

OPTIMIZERS = ("adamw", "muon")


def adamw_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """minGPT's AdamW parameter groups: weights of Linear layers decay; biases, LayerNorm and Embedding
    weights do not. A weight tied between an Embedding and a Linear (the GPT head) decays, as in minGPT.

    Returns:
        ``[{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]``.
    """
    decay: dict[int, nn.Parameter] = {}
    no_decay: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if name == "weight" and isinstance(module, nn.Linear):
                decay[id(p)] = p
            else:
                no_decay.setdefault(id(p), p)
    for key in decay:
        no_decay.pop(key, None)
    return [
        {"params": list(decay.values()), "weight_decay": weight_decay},
        {"params": list(no_decay.values()), "weight_decay": 0.0},
    ]


def muon_param_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Splits a :class:`~lit_ddp.models.gpt.GPT`'s parameters for Muon + AdamW: Muon orthogonalizes the
    update of a 2-D matrix, so it takes the blocks' (``model.transformer.h``) matrices; the embeddings, the
    head, norms and biases go to AdamW.

    Returns:
        ``(hidden_matrices, others)``: every parameter once (a tied embedding/head counts once, in ``others``).
    """
    hidden = {id(p): p for p in model.get_submodule("transformer.h").parameters() if p.ndim == 2}
    others = [p for p in model.parameters() if id(p) not in hidden]
    return list(hidden.values()), others


class OptimizerChain(torch.optim.Optimizer):
    """One ``torch.optim.Optimizer`` over several: ``step`` runs the closure once, then each optimizer's step.

    Why our own: Lightning's automatic optimization takes one optimizer, and ``torch.optim.Muon`` only takes
    2-D matrices, so the embeddings, head, norms and biases need a second optimizer (AdamW). torch has no
    combined optimizer, and torchtitan's ``OptimizersContainer`` is not a dependency of ours (nor a
    ``torch.optim.Optimizer``, which Lightning and torch's LR schedulers require).

    ``param_groups`` holds the optimizers' own group dicts (the same objects, so an LR scheduler that scales
    each group's ``initial_lr`` drives all of them, and LearningRateMonitor sees them all; after
    ``load_state_dict``, which gives each optimizer new group dicts, the chain holds those); ``state`` is the
    union of their states; ``state_dict`` holds one entry per optimizer, so a checkpoint restores each
    exactly. Step hooks registered on the chain run around the whole chained step; state-dict hooks belong on
    the inner optimizers (the chain's own ``state_dict`` / ``load_state_dict`` do not run them).

    Args:
        optimizers: the optimizers, stepped in this order; no parameter may be in two of them.

    Raises:
        ValueError: no optimizer, or a parameter in two of them.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise ValueError("OptimizerChain needs at least one optimizer")
        seen: set[int] = set()
        for opt in optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) in seen:
                        raise ValueError(f"a parameter of shape {tuple(p.shape)} is in two optimizers")
                    seen.add(id(p))
        self.optimizers = list(optimizers)
        # No defaults: add_param_group then only re-lists each group's params and appends the very same dict.
        super().__init__([group for opt in self.optimizers for group in opt.param_groups], defaults={})

    @property  # type: ignore[override]
    def state(self) -> dict[torch.Tensor, Any]:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    @state.setter
    def state(self, value: Any) -> None:
        # Optimizer.__init__ assigns an empty defaultdict; the chain keeps no state of its own (each optimizer
        # keeps its own, which the getter merges), so the assignment is ignored.
        pass

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores each optimizer from its entry of :meth:`state_dict`.

        Raises:
            ValueError: the saved state holds another number of optimizers (another ``optimizer`` choice).
        """
        saved = state_dict.get("optimizers")
        if not isinstance(saved, list) or len(saved) != len(self.optimizers):
            raise ValueError(
                f"the saved optimizer state holds {len(saved) if isinstance(saved, list) else 'no'} optimizers, "
                f"this chain has {len(self.optimizers)}: resume with the same model.optimizer"
            )
        for opt, sd in zip(self.optimizers, saved, strict=True):
            opt.load_state_dict(sd)
        # torch's load_state_dict gives each optimizer new group dicts: hold those (schedulers and LearningRateMonitor
        # read them), in the same list object, in case something kept a reference to it.
        self.param_groups[:] = [group for opt in self.optimizers for group in opt.param_groups]

    def __repr__(self) -> str:
        return f"OptimizerChain({', '.join(type(o).__name__ for o in self.optimizers)})"


def build_optimizer(
    model: nn.Module,
    optimizer: str = "adamw",
    *,
    learning_rate: float = 3e-4,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    muon_learning_rate: float = 0.02,
    muon_momentum: float = 0.95,
    muon_weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """The GPT's optimizer. Each group's ``lr`` is its peak rate; :func:`warmup_cosine_schedule` scales it.

    - ``"adamw"``: ``torch.optim.AdamW`` over minGPT's two groups (:func:`adamw_param_groups`, unnamed:
      LearningRateMonitor logs ``lr-AdamW/pg1``, ``lr-AdamW/pg2``).
    - ``"muon"``: ``torch.optim.Muon`` for the blocks' matrices (group ``"muon"``) and AdamW for the rest, in
      minGPT's groups less those matrices (``"adamw_decay"``, ``"adamw_no_decay"``; an empty one is left out),
      stepped as one :class:`OptimizerChain` (LearningRateMonitor: ``lr-OptimizerChain/muon``, ...).

    Args:
        model: a :class:`~lit_ddp.models.gpt.GPT` (``"muon"`` needs its ``transformer.h`` blocks).
        optimizer: ``"adamw"`` or ``"muon"``.
        learning_rate: AdamW's peak learning rate.
        weight_decay: AdamW's decoupled weight decay of Linear weights.
        betas: AdamW's betas.
        muon_learning_rate: Muon's peak learning rate.
        muon_momentum: Muon's (Nesterov) momentum.
        muon_weight_decay: Muon's decoupled weight decay.

    Raises:
        ValueError: an unknown ``optimizer``.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} must be one of {', '.join(map(repr, OPTIMIZERS))}")
    groups = adamw_param_groups(model, weight_decay)
    betas = (float(betas[0]), float(betas[1]))
    if optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)
    hidden, others = muon_param_groups(model)
    keep = {id(p) for p in others}
    groups = [
        {**g, "params": [p for p in g["params"] if id(p) in keep], "name": f"adamw_{kind}"}
        for g, kind in zip(groups, ("decay", "no_decay"), strict=True)
    ]
    muon = torch.optim.Muon(
        [{"params": hidden, "name": "muon"}],
        lr=muon_learning_rate,
        momentum=muon_momentum,
        weight_decay=muon_weight_decay,
    )
    adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=learning_rate, betas=betas)
    return OptimizerChain([muon, adamw])


def warmup_cosine_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, decay_steps: int | None, min_lr_ratio: float
) -> LRScheduler:
    """nanoGPT's ``get_lr`` from torch's schedulers, stepped once per optimizer step: a linear warmup from
    ``lr / (warmup_steps + 1)`` to ``lr`` over ``warmup_steps`` (``LinearLR``), then, if ``decay_steps`` is
    given, a cosine down to ``min_lr_ratio * lr`` at step ``decay_steps`` (``CosineAnnealingLR``) and flat
    afterwards; without ``decay_steps`` the rate stays at ``lr`` after the warmup.

    Args:
        optimizer: each group's ``lr`` is its peak rate (groups may differ, e.g. Muon's and AdamW's).
        warmup_steps: optimizer steps of warmup (0: none).
        decay_steps: the optimizer step where the cosine reaches its floor, ``> warmup_steps``; None: no decay.
        min_lr_ratio: the floor relative to the peak, in [0, 1].

    Raises:
        ValueError: ``warmup_steps < 0``, ``decay_steps <= warmup_steps`` or ``min_lr_ratio`` outside [0, 1].
    """
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
    if decay_steps is not None and decay_steps <= warmup_steps:
        raise ValueError(f"decay_steps={decay_steps} must be > warmup_steps={warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio={min_lr_ratio} must be in [0, 1]")
    peaks = {group["lr"] for group in optimizer.param_groups}
    peak = optimizer.param_groups[0]["lr"]
    schedulers: list[LRScheduler] = []
    milestones: list[int] = []
    if warmup_steps > 0:
        schedulers.append(LinearLR(optimizer, 1.0 / (warmup_steps + 1), 1.0, total_iters=warmup_steps))
        milestones.append(warmup_steps)
    if decay_steps is None:
        schedulers.append(ConstantLR(optimizer, factor=1.0, total_iters=0))
    else:
        span = decay_steps - warmup_steps
        if len(peaks) == 1:
            schedulers.append(CosineAnnealingLR(optimizer, T_max=span, eta_min=min_lr_ratio * peak))
        else:  # CosineAnnealingLR has one floor for all groups; the closed form scales each group's own peak
            schedulers.append(
                LambdaLR(
                    optimizer, lambda t: min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t / span))
                )
            )
        milestones.append(decay_steps)
        schedulers.append(LambdaLR(optimizer, lambda _: min_lr_ratio))  # the floor, flat
    return SequentialLR(optimizer, schedulers, milestones=milestones)
