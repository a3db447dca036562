"""The GPU main job's optimizer step in few kernel launches: Muon's matrices orthogonalized in stacks
(:class:`lit_ddp.compat.BatchedMuon`) and AdamW ``fused``, put in place of the recipe's optimizers before the first
step. ``configs/mingpt/gpu.yaml`` names the callback; the recipe (:mod:`lit_ddp.recipe`), which the tutorial reads,
keeps ``torch.optim.Muon``.

Counted on a CPU (``tests/unit/test_muon.py``, ``make bench-launches``): gpu.yaml's optimizer step dispatches 81
aten ops this way (about one CUDA kernel launch each), 749 with ``torch.optim.Muon`` and CUDA's ``foreach`` AdamW.
"""

from __future__ import annotations

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lit_ddp import compat


def batch_optimizer_step(optimizer: torch.optim.Optimizer, adamw_fused: bool | None = None) -> torch.optim.Optimizer:
    """``optimizer`` (an :class:`~lit_ddp.recipe.OptimizerChain` or one optimizer) stepping in fewer kernels, changed
    in place and returned: each ``torch.optim.Muon`` in the chain becomes a :class:`~lit_ddp.compat.BatchedMuon` over
    the very same parameter groups (the dicts the chain and its schedulers hold) and state, unless this torch's own
    Muon batches (:func:`~lit_ddp.compat.torch_muon_is_batched`); each AdamW steps ``fused`` where ``adamw_fused``
    says so, by default where every parameter is on a CUDA device (a CPU's fused kernel rounds otherwise than its
    default loop, by an ulp: a CPU keeps torch's default). A Muon alone, outside a chain, stays torch's: the Trainer's
    schedulers hold it. Before the first step: a state loaded later (a resume) keeps its own AdamW kernel, by torch's
    rule, and loads into BatchedMuon as into torch's Muon.

    Raises:
        ValueError: an optimizer that has stepped (its state is not empty).
    """
    chained = hasattr(optimizer, "optimizers")
    inner = optimizer.optimizers if chained else [optimizer]  # type: ignore[attr-defined]
    if any(opt.state for opt in inner):
        raise ValueError("batch_optimizer_step before the first step: the optimizer has a state already")
    for i, opt in enumerate(inner):
        if chained and type(opt) is torch.optim.Muon and not compat.torch_muon_is_batched():
            batched = compat.BatchedMuon(opt.param_groups)  # torch's add_param_group keeps each dict: the same ones
            batched.defaults = opt.defaults
            inner[i] = batched
        elif isinstance(opt, torch.optim.AdamW):
            params = [p for group in opt.param_groups for p in group["params"]]
            if adamw_fused if adamw_fused is not None else all(p.device.type == "cuda" for p in params):
                for group in opt.param_groups:
                    group.update(fused=True, foreach=False)
    return optimizer


class BatchedOptimizerStep(Callback):
    """:func:`batch_optimizer_step` on the Trainer's optimizers at ``on_fit_start``: after the strategy has built them
    (and moved the model to its device), before a checkpoint's state is loaded into them.

    Args:
        adamw_fused: AdamW fused (True), as built (False), or fused where every parameter is on CUDA (None).
    """

    def __init__(self, adamw_fused: bool | None = None) -> None:
        self.adamw_fused = adamw_fused

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for optimizer in trainer.optimizers:
            batch_optimizer_step(optimizer, self.adamw_fused)
