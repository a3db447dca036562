"""torch's Muon: :class:`BatchedMuon`, ``torch.optim.Muon`` stepped in stacks of equally shaped matrices with torch's
private ``_foreach`` ops, for the batched step torch's own lacks (open upstream pull requests: pytorch/pytorch#195566,
#187131, #187132); :func:`torch_muon_is_batched` says where a torch has one, and :func:`muon_per_matrix` is torch's
own step, for the parameters a stack cannot hold (DTensor shards).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lit_ddp.compat.imports import private

# Shape legend: S matrices in a stack, m <= n their rows and columns after tall ones are transposed.


@functools.cache
def torch_muon_is_batched() -> bool:
    """Whether this torch's own ``torch.optim.Muon`` has a batched (``foreach``) step: then
    :func:`lit_ddp.callbacks.batched_step.batch_optimizer_step` keeps torch's Muon instead of :class:`BatchedMuon`.
    False on torch 2.9 to 2.15: Muon takes no ``foreach`` and its functional ``muon`` raises "Foreach is not supported
    for Muon yet"; open pull requests add one (pytorch/pytorch#195566, #187131). Tried, not read off a version: Muon
    built with ``foreach=True`` steps a tiny matrix on the CPU; True where that works. A ``foreach`` that still
    orthogonalizes one matrix at a time (#187131 alone) passes too: ``tests/unit/test_compat.py`` fails where this
    turns True, to look before torch's is taken."""
    p = torch.nn.Parameter(torch.zeros(2, 2))
    p.grad = torch.ones(2, 2)
    try:
        torch.optim.Muon([p], foreach=True).step()  # type: ignore[call-arg]  # no such argument on 2.9 to 2.15
    except (TypeError, RuntimeError):  # an unknown argument; "not supported yet"
        return False
    return True


def muon_per_matrix(
    params: list[torch.Tensor], grads: list[torch.Tensor], bufs: list[torch.Tensor], group: Any
) -> None:
    """``torch.optim.Muon``'s step over one group's parameters with gradients, one matrix at a time: its functional
    ``muon`` (in the private ``torch.optim._muon`` on 2.9 to 2.15), given the group's settings that it takes (their
    names differ between versions: ``use_addmm`` comes and goes). :class:`BatchedMuon`'s step for
    DTensor parameters, whose shards it cannot stack."""
    muon = private("torch.optim._muon", "muon")
    settings = {k: group[k] for k in inspect.signature(muon).parameters if k in group and k != "params"}
    muon(params, grads, bufs, **settings, has_complex=False)


def _adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """``torch.optim.Muon``'s rate for a matrix of ``shape`` (rows, columns): ``lr * sqrt(max(1, rows / columns))``
    (Keller Jordan's, ``None`` or ``"original"``) or ``lr * 0.2 * sqrt(max(rows, columns))`` (Moonshot's
    ``"match_rms_adamw"``)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


@dataclass
class _Stack:
    """The matrices of one shape, dtype and device as one bf16 tensor ``(S, m, n)``, wide ones (and square) first,
    then tall ones transposed, with the buffers and views of their Newton-Schulz iteration. Kept from step to step,
    so that a step dispatches neither an allocation nor a view for it."""

    index: list[int]  # each matrix's position in its group's list of parameters with gradients, in stack order
    wide: int  # how many come first untransposed
    x: tuple[Tensor, Tensor]  # (S, m, n) bf16: the iterate, written by turns
    xt: tuple[Tensor, Tensor]  # (S, n, m): their transposes (views)
    gram: Tensor  # (S, m, m) bf16: A = X X^T
    poly: Tensor  # (S, m, m) bf16: b A + c A A
    into: list[Tensor]  # where the updates go: x[0][:wide] (wide, m, n), x[0][wide:].mT (tall, n, m)
    results: tuple[list[Tensor], list[Tensor]]  # the same two views of x[0], of x[1]
    outs: list[Tensor]  # the orthogonalized updates, contiguous in the parameters' dtype and layout
    updates: list[Tensor]  # outs by matrix, in stack order: (rows, cols) as each parameter

    @classmethod
    def build(cls, params: list[Tensor], wide: list[int], tall: list[int]) -> _Stack:
        first = params[(wide or tall)[0]]
        m, n = sorted(first.shape)
        x = tuple(torch.empty(len(wide) + len(tall), m, n, dtype=torch.bfloat16, device=first.device) for _ in "01")

        def parts(t: Tensor) -> list[Tensor]:
            return [view for view, part in ((t[: len(wide)], wide), (t[len(wide) :].mT, tall)) if part]

        outs = [torch.empty_like(v, dtype=first.dtype, memory_format=torch.contiguous_format) for v in parts(x[0])]
        return cls(
            index=wide + tall,
            wide=len(wide),
            x=(x[0], x[1]),
            xt=(x[0].mT, x[1].mT),
            gram=torch.empty(len(wide) + len(tall), m, m, dtype=torch.bfloat16, device=first.device),
            poly=torch.empty(len(wide) + len(tall), m, m, dtype=torch.bfloat16, device=first.device),
            into=parts(x[0]),
            results=(parts(x[0]), parts(x[1])),
            outs=outs,
            updates=[u for out in outs for u in out.unbind(0)],
        )

    def orthogonalize(self, updates: list[Tensor], coefficients: tuple[float, float, float], steps: int, eps: float):
        """Newton-Schulz on the stacked ``updates`` (in stack order), into :attr:`updates`."""
        a, b, c = coefficients
        parts = [part for part in (updates[: self.wide], updates[self.wide :]) if part]
        for into, part in zip(self.into, parts, strict=True):
            into.copy_(torch.stack(part))  # one stack in the updates' dtype, then to bf16 (tall ones transposed)
        x = self.x[0]
        x.div_(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp_(min=eps))  # each by its (S, 1, 1) norm
        for k in range(steps):
            x, xt = self.x[k % 2], self.xt[k % 2]
            torch.bmm(x, xt, out=self.gram)  # A = X X^T
            torch.baddbmm(self.gram, self.gram, self.gram, beta=b, alpha=c, out=self.poly)  # B = b A + c A A
            torch.baddbmm(x, self.poly, x, beta=a, out=self.x[(k + 1) % 2])  # X <- a X + B X
        for out, result in zip(self.outs, self.results[steps % 2], strict=True):
            out.copy_(result)


def _is_dtensor(t: Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class BatchedMuon(torch.optim.Muon):
    """``torch.optim.Muon`` whose step orthogonalizes the matrices of each shape together: a few dozen kernels a step
    where torch's launches hundreds.

    ``torch.optim.Muon`` (torch 2.9 to 2.15) has no batched path: its step loops over the matrices, each with its
    own momentum, bf16 conversion, norm and Newton-Schulz iteration (about 29 small kernels a matrix: 700 aten ops
    for the 24 block matrices of ``configs/mingpt/gpu.yaml``), and its functional ``foreach`` raises "Foreach is not
    supported for Muon yet". Open upstream pull requests add one: pytorch/pytorch#195566 (a batched
    Newton-Schulz behind ``foreach``), #187131 (a ``foreach`` path that still orthogonalizes one matrix at a time)
    and #187132 (batched Newton-Schulz for square groups); :func:`torch_muon_is_batched` says where a torch has one.

    Sources: Muon is Keller Jordan's ("Muon: An optimizer for hidden layers in neural networks", 2024;
    github.com/KellerJordan/Muon); a stack of equally shaped matrices orthogonalized by batched matrix products is
    modded-nanogpt's (github.com/KellerJordan/modded-nanogpt: its ``zeropower_via_newtonschulz5`` takes
    ``(..., m, n)`` and its Muon groups parameters by size). The math is ``torch.optim.Muon``'s
    (``torch/optim/_muon.py``), step for step: the momentum ``lerp`` and Nesterov's, Newton-Schulz in bf16 on the
    matrix with fewer rows than columns (tall ones transposed) in its ``addmm`` form, the decoupled weight decay at the
    group's rate, the rate scaled by each matrix's own shape (``adjust_lr_fn``). Batched products round as torch's
    per-matrix ones or within bf16 rounding of them (``tests/unit/test_muon.py``: on a CPU the wide and square
    matrices bit for bit, a tall one, stacked transposed where torch multiplies a transposed view, to about 2e-3 of
    its update); a torch whose Muon has ``use_addmm=False`` (``b * A + c * A @ A``) differs by bf16 rounding too.

    Its constructor is ``torch.optim.Muon``'s (arguments, defaults, checks: inherited), and so are its
    ``param_groups`` and its state (one ``momentum_buffer`` per parameter): a ``state_dict`` of either loads into
    the other. Each group's matrices are stacked by shape, dtype and device after tall ones are transposed (the
    6 x 6 x 384 GPT of ``configs/mingpt/gpu.yaml``: 6 of (384, 1152), 6 of (384, 384), 12 of (384, 1536)); a
    step runs the momentum of the whole group with ``torch._foreach_*`` ops, one Newton-Schulz iteration per stack
    with batched products (``bmm``, ``baddbmm``), the weight decay as one ``_foreach_mul_`` and the update as one
    ``_foreach_add_`` per distinct scaled rate. The stacks' buffers (two bf16 copies of the stacked matrices and
    one in the parameters' dtype) are kept between steps, and rebuilt where the parameters with gradients change.

    A group holding DTensors (FSDP2, tensor parallelism) steps as ``torch.optim.Muon`` steps it, one full matrix at
    a time (:func:`muon_per_matrix`): a stack of shards would orthogonalize pieces.
    """

    _stacks: dict[int, tuple[tuple[Any, ...], list[_Stack]]]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Muon step of every group, as ``torch.optim.Muon.step``; returns the ``closure``'s loss (or None).

        Raises:
            RuntimeError: a complex parameter or a sparse gradient (torch's Muon refuses both).
            ValueError: a group with ``ns_steps >= 100``, ``ns_coefficients`` other than three, or a gradient that
                is not 2-D (torch's checks and messages).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for i, group in enumerate(self.param_groups):
            params, grads, bufs = self._gather(group)
            if not params:
                continue
            if any(_is_dtensor(p) for p in params):
                muon_per_matrix(params, grads, bufs, group)
            else:
                self._step_stacked(i, group, params, grads, bufs)
        return loss

    def _gather(self, group: dict[str, Any]) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """The group's parameters with gradients, the gradients and momentum buffers (made at the first step), with
        ``torch.optim.Muon``'s checks."""
        params, grads, bufs = [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if torch.is_complex(p):
                raise RuntimeError("Muon does not support complex parameters")
            if p.grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            bufs.append(state["momentum_buffer"])
        return params, grads, bufs

    def _stacks_of(self, i: int, params: list[Tensor]) -> list[_Stack]:
        """Group ``i``'s stacks, built again where its parameters with gradients differ from the last step's."""
        key = tuple((id(p), p.shape, p.dtype, p.device) for p in params)
        cached = self.__dict__.setdefault("_stacks", {}).get(i)
        if cached is None or cached[0] != key:
            by_shape: dict[tuple[Any, ...], tuple[list[int], list[int]]] = {}
            for j, p in enumerate(params):
                rows, cols = p.shape
                by_shape.setdefault((p.device, p.dtype, min(rows, cols), max(rows, cols)), ([], []))[
                    rows > cols
                ].append(j)
            cached = self._stacks[i] = (key, [_Stack.build(params, wide, tall) for wide, tall in by_shape.values()])
        return cached[1]

    def _step_stacked(
        self, i: int, group: dict[str, Any], params: list[Tensor], grads: list[Tensor], bufs: list[Tensor]
    ) -> None:
        if group["ns_steps"] >= 100:
            raise ValueError("Number of steps must be less than 100 for computational efficiency")
        if len(group["ns_coefficients"]) != 3:
            raise ValueError("Coefficients must be a tuple of exactly 3 values")
        if any(g.ndim != 2 for g in grads):
            raise ValueError("Param gradient must be a 2D matrix")
        lr, momentum = float(group["lr"]), group["momentum"]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
        if lr * group["weight_decay"] != 0:  # torch multiplies by 1.0 too: the same parameters
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        by_rate: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
        for stack in self._stacks_of(i, params):
            stack.orthogonalize(
                [updates[j] for j in stack.index], group["ns_coefficients"], group["ns_steps"], group["eps"]
            )
            for j, update in zip(stack.index, stack.updates, strict=True):
                rate = _adjusted_lr(lr, group["adjust_lr_fn"], params[j].shape)
                ps, us = by_rate.setdefault(rate, ([], []))
                ps.append(params[j])
                us.append(update)
        for rate, (ps, us) in by_rate.items():
            torch._foreach_add_(ps, us, alpha=-rate)
