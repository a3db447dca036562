"""Several torch optimizers driven as one, so Lightning's automatic optimization can train with Muon + AdamW.

Lightning's automatic optimization takes one optimizer; ``torch.optim.Muon`` only takes 2-D matrices, so the
embeddings, head, norms and biases need a second optimizer (AdamW). torch has no combined optimizer and
torchtitan's ``OptimizersContainer`` is not a dependency of ours (nor a ``torch.optim.Optimizer``, which
Lightning and torch's LR schedulers require), hence this small class of our own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class OptimizerChain(torch.optim.Optimizer):
    """One ``torch.optim.Optimizer`` over several: ``step`` runs the closure once, then each optimizer's step.

    ``param_groups`` is the list of every optimizer's groups (the same dicts, so an LR scheduler that scales
    each group's ``initial_lr`` drives all of them, and LearningRateMonitor sees them all); ``state`` is
    their union; ``state_dict`` holds one entry per optimizer, so a checkpoint restores each exactly.

    Args:
        optimizers: the optimizers, stepped in this order; no parameter may be in two of them.

    Raises:
        ValueError: no optimizer, or a parameter in two of them.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:  # noqa: D107 (no Optimizer.__init__)
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
        self.defaults = {}
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, Any]:  # type: ignore[override]
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
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

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        saved = state_dict.get("optimizers")
        if not isinstance(saved, list) or len(saved) != len(self.optimizers):
            raise ValueError(
                f"the saved optimizer state holds {len(saved) if isinstance(saved, list) else 'no'} optimizers, "
                f"this chain has {len(self.optimizers)}: resume with the same model.optimizer"
            )
        for opt, sd in zip(self.optimizers, saved, strict=True):
            opt.load_state_dict(sd)

    def __repr__(self) -> str:
        return f"OptimizerChain({', '.join(type(o).__name__ for o in self.optimizers)})"
