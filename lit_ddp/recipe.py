"""The GPT's training recipe, used by :class:`lit_ddp.tasks.mingpt.GPTModule` and by every benchmark in ``bench/``:
parameter groups, the optimizer (AdamW, or Muon + AdamW) and the warmup + cosine learning rate. Plain torch, so a
plain loop trains with exactly what the Lightning job trains with.

Sources: minGPT's AdamW groups (``GPT.configure_optimizers``), nanoGPT's ``get_lr`` (``train.py``), both Andrej
Karpathy's (MIT); Muon is Keller Jordan's ("Muon: An optimizer for hidden layers in neural networks", 2024;
modded-nanogpt's speedrun records 3-4), as ``torch.optim.Muon``.
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
    """minGPT's AdamW groups: Linear weights decay (a weight tied to an Embedding too); biases, LayerNorm and
    Embedding weights do not. Returns ``[{"params": decay, "weight_decay": weight_decay}, {"params": no_decay,
    "weight_decay": 0.0}]``."""
    decay: dict[int, nn.Parameter] = {}
    no_decay: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if name == "weight" and isinstance(module, nn.Linear):
                decay[id(p)] = p
            else:
                no_decay.setdefault(id(p), p)
    return [
        {"params": list(decay.values()), "weight_decay": weight_decay},
        {"params": [p for key, p in no_decay.items() if key not in decay], "weight_decay": 0.0},
    ]


def muon_param_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(hidden_matrices, others)``: Muon orthogonalizes the update of a 2-D matrix, so it takes the matrices of
    the GPT's blocks (``transformer.h``); embeddings, head, norms and biases go to AdamW. Each parameter once."""
    hidden = {id(p): p for p in model.get_submodule("transformer.h").parameters() if p.ndim == 2}
    others = [p for p in model.parameters() if id(p) not in hidden]
    return list(hidden.values()), others


class OptimizerChain(torch.optim.Optimizer):
    """One ``torch.optim.Optimizer`` over several: ``step`` runs the closure once, then each optimizer's step.

    Lightning's automatic optimization takes one optimizer and ``torch.optim.Muon`` only matrices; torch has no combined
    optimizer, and torchtitan's ``OptimizersContainer`` is no ``Optimizer``, which Lightning and the LR schedulers
    require. ``param_groups`` are the optimizers' own group dicts, so a scheduler drives all of them; ``state`` is their
    union; ``state_dict`` is torch's format over all of them (FSDP2's distributed state dict maps it to names). Step
    hooks run around the whole step. Raises ValueError for no optimizer, a parameter in two of them, or a state of other
    parameter groups to load.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise ValueError("OptimizerChain needs at least one optimizer")
        params = [id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]]
        if len(params) != len(set(params)):
            raise ValueError("a parameter is in two optimizers of the chain")
        self.optimizers = list(optimizers)
        # No defaults: add_param_group only re-lists each group's params and keeps the very same dict.
        super().__init__([group for opt in self.optimizers for group in opt.param_groups], defaults={})

    @property  # type: ignore[override]
    def state(self) -> dict[torch.Tensor, Any]:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    @state.setter
    def state(self, value: Any) -> None:
        pass  # Optimizer.__init__ assigns an empty state; the chain's is its optimizers'

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        for opt in self.optimizers:
            opt.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return torch.optim.Optimizer.state_dict(self)  # torch's format, over the optimizers' groups and state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("optimizers")  # one state_dict per optimizer: older checkpoints' format
        if saved is None:  # torch's: each optimizer its own groups, and their parameters' state
            groups, saved = list(state_dict["param_groups"]), []
            for opt in self.optimizers:
                own, groups = groups[: len(opt.param_groups)], groups[len(opt.param_groups) :]
                ids = {i for group in own for i in group["params"]}
                saved.append({"state": {i: s for i, s in state_dict["state"].items() if i in ids}, "param_groups": own})
            saved[-1]["param_groups"] += groups  # none left, or another chain's
        names = [[g.get("name") for g in sd["param_groups"]] for sd in saved]
        if names != (mine := [[g.get("name") for g in opt.param_groups] for opt in self.optimizers]):
            raise ValueError(
                f"saved optimizer groups {names}, this chain's {mine}: resume with the same model.optimizer"
            )
        for opt, sd in zip(self.optimizers, saved, strict=True):
            opt.load_state_dict(sd)
        # Loading gives each optimizer new group dicts: hold those, in the same list (schedulers keep it).
        self.param_groups[:] = [group for opt in self.optimizers for group in opt.param_groups]


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
    """The GPT's optimizer; each group's ``lr`` is its peak rate (:func:`warmup_cosine_schedule` scales it).

    ``"adamw"``: AdamW over :func:`adamw_param_groups` (LearningRateMonitor: ``lr-AdamW/pg1``, ``pg2``).
    ``"muon"``: Muon over the blocks' matrices (group ``muon``) and AdamW over the rest of those groups
    (``adamw_decay``, ``adamw_no_decay``), as one :class:`OptimizerChain` (``lr-OptimizerChain/muon``, ...).
    ``learning_rate``, ``weight_decay`` and ``betas`` are AdamW's; ``muon_*`` are Muon's.

    Raises:
        ValueError: an unknown ``optimizer``.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} must be one of {', '.join(map(repr, OPTIMIZERS))}")
    groups = adamw_param_groups(model, weight_decay)
    if optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)
    hidden, others = muon_param_groups(model)
    keep = {id(p) for p in others}
    groups = [
        {**g, "params": [p for p in g["params"] if id(p) in keep], "name": f"adamw_{kind}"}
        for g, kind in zip(groups, ("decay", "no_decay"), strict=True)
    ]
    group = {"params": hidden, "name": "muon"}
    muon = torch.optim.Muon([group], lr=muon_learning_rate, momentum=muon_momentum, weight_decay=muon_weight_decay)
    adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=learning_rate, betas=betas)
    return OptimizerChain([muon, adamw])


def check_schedule(warmup_steps: int, decay_steps: int | None, min_lr_ratio: float) -> None:
    """Raises ValueError for ``warmup_steps < 0``, ``decay_steps <= warmup_steps`` or ``min_lr_ratio`` outside
    [0, 1]."""
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
    if decay_steps is not None and decay_steps <= warmup_steps:
        raise ValueError(f"decay_steps={decay_steps} must be > warmup_steps={warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio={min_lr_ratio} must be in [0, 1]")


def warmup_cosine_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, decay_steps: int | None, min_lr_ratio: float
) -> LRScheduler:
    """nanoGPT's ``get_lr`` from torch's schedulers, stepped per optimizer step: a linear warmup from
    ``lr / (warmup_steps + 1)`` to each group's peak ``lr`` (``LinearLR``), then, given ``decay_steps``, a cosine
    to ``min_lr_ratio * lr`` at step ``decay_steps`` and flat after it; without ``decay_steps``, constant.

    Raises:
        ValueError: see :func:`check_schedule`.
    """
    check_schedule(warmup_steps, decay_steps, min_lr_ratio)
    peaks = [group["lr"] for group in optimizer.param_groups]  # before LinearLR scales them down
    schedulers: list[LRScheduler] = []
    milestones: list[int] = []
    if warmup_steps > 0:
        schedulers.append(LinearLR(optimizer, 1.0 / (warmup_steps + 1), 1.0, total_iters=warmup_steps))
        milestones.append(warmup_steps)
    if decay_steps is None:
        schedulers.append(ConstantLR(optimizer, factor=1.0, total_iters=0))
        return SequentialLR(optimizer, schedulers, milestones=milestones)
    span, floor = decay_steps - warmup_steps, min_lr_ratio
    if len(set(peaks)) == 1:
        schedulers.append(CosineAnnealingLR(optimizer, T_max=span, eta_min=floor * peaks[0]))
    else:  # CosineAnnealingLR has one floor for all groups; the closed form scales each group's own peak
        schedulers.append(LambdaLR(optimizer, lambda t: floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t / span))))
    schedulers.append(LambdaLR(optimizer, lambda _: floor))  # the floor, flat
    return SequentialLR(optimizer, schedulers, milestones=[*milestones, decay_steps])
