"""Weight gradients written straight into the buffer the optimizer reads them from.

With every rank on one host the optimizer sums gradients out of shared memory (optim's
`_step_shared`). Autograd writes each weight gradient into a fresh tensor, and the rank then copies
the parts that other ranks own into its shared buffer: a pass over every dense gradient, each
step (the LM head's share alone was 2.6 ms a step at depth 4).

Instead the optimizer gives each dense weight a *target*, its view of the shared buffer, and the
places that compute weight gradients with their own GEMMs write the result there: `linear` below
for the blocks' matrices, and the LM head's loss (`loss.py`). Autograd then adopts the tensor as
`.grad` as it is: AccumulateGrad keeps a fresh gradient that nothing else references instead of
copying it, and `grad_target` hands out a new view each time so that nothing does.

Only a parameter's first gradient of a step goes to its target (its .grad is still None then):
with gradient accumulation autograd adds the later micro-steps into .grad as usual.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ATTRIBUTE = "_nanochat_grad_target"


def set_grad_target(param: torch.Tensor, target: torch.Tensor | None) -> None:
    """Have `param`'s gradient written into `target` (same shape, dtype and device; contiguous)."""
    if target is not None and (target.shape != param.shape or target.dtype != param.dtype
                               or not target.is_contiguous()):
        raise ValueError(f"gradient target {tuple(target.shape)} {target.dtype} does not fit a parameter "
                         f"{tuple(param.shape)} {param.dtype}")
    setattr(param, _ATTRIBUTE, target)


def grad_target(param: torch.Tensor) -> torch.Tensor | None:
    """A fresh view of `param`'s target if its gradient should be written there now, else None."""
    target = getattr(param, _ATTRIBUTE, None)
    if target is None or param.grad is not None:
        return None
    return target.view(target.shape)


class _Linear(torch.autograd.Function):
    """`x @ weight.T` with the weight's gradient GEMM writing into its target."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            g, a = grad_out.reshape(-1, grad_out.size(-1)), x.reshape(-1, x.size(-1))
            target = grad_target(weight)
            grad_w = torch.mm(g.t(), a) if target is None else torch.mm(g.t(), a, out=target)
        return grad_x, grad_w


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear without bias; through `_Linear` only where the weight has a target. Compiled or
    autocast models keep F.linear (the compiler and autocast handle it themselves)."""
    if (getattr(weight, _ATTRIBUTE, None) is None or torch.compiler.is_compiling()
            or torch.is_autocast_enabled(x.device.type)):
        return F.linear(x, weight)
    return _Linear.apply(x, weight)
