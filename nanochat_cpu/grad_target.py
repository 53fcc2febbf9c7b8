"""Weight gradients written straight into the buffer the optimizer reads them from.

With every rank on one host the optimizer sums gradients out of shared memory (sync_shared.py,
`SharedMemorySync`), so a gradient that autograd writes into a fresh tensor has to be copied there:
a pass over every dense gradient, each step (6-7 ms of a depth-4 step on one rank, 24-28 ms at
depth 8, measured before this module existed).

Instead the optimizer gives each dense weight a *target*, its view of the shared buffer, and the
places that compute weight gradients with their own GEMMs write the result there: `linear` below
for the blocks' matrices, and the LM head's loss (`loss.py`). Autograd then adopts the tensor as
`.grad` as it is: AccumulateGrad keeps a fresh gradient that nothing else references instead of
copying it, and `grad_target` hands out a new view each time so that nothing does.

A target is handed out once, for a parameter's first gradient (its .grad is still None), and
then not again until the optimizer releases it for the next step (`release_grad_target`, from
its zero_grad). Every other gradient goes to a fresh tensor that autograd adds into .grad as
usual: the later micro-steps of gradient accumulation, and the other uses of a weight used twice
in one graph, or in a nested (reentrant checkpoint) or concurrent backward, whose gradients must
be added up, not written over each other. Gradients meant for anything but .grad
(`torch.autograd.grad`) would land in the shared buffer too: the optimizer's parameters are for
`.backward()` only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ATTRIBUTE = "_nanochat_grad_target"


def set_grad_target(param: torch.Tensor, target: torch.Tensor | None) -> None:
    """Have `param`'s gradient written into `target` (same shape, dtype and device; contiguous);
    None: autograd's own tensors again."""
    if target is not None and (target.shape != param.shape or target.dtype != param.dtype
                               or target.device != param.device or not target.is_contiguous()):
        raise ValueError(f"gradient target {tuple(target.shape)} {target.dtype} on {target.device} "
                         f"(contiguous: {target.is_contiguous()}) does not fit a parameter "
                         f"{tuple(param.shape)} {param.dtype} on {param.device}")
    setattr(param, _ATTRIBUTE, (target, False))


def release_grad_target(param: torch.Tensor) -> None:
    """Let the next backward write into `param`'s target again (call with its .grad set to None)."""
    target, _ = getattr(param, _ATTRIBUTE, (None, False))
    if target is not None:
        setattr(param, _ATTRIBUTE, (target, False))


def clear_gradients(params) -> None:
    """.grad = None and the targets released: the next backward writes each gradient afresh into
    its target (zeroing the gradients and letting autograd add into them would be 4 passes)."""
    for p in params:
        p.grad = None
        release_grad_target(p)


def grad_target(param: torch.Tensor) -> torch.Tensor | None:
    """A fresh view of `param`'s target if its gradient should be written there now, else None."""
    target, taken = getattr(param, _ATTRIBUTE, (None, False))
    if target is None or taken or param.grad is not None:
        return None
    setattr(param, _ATTRIBUTE, (target, True))
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
    """F.linear without bias; through `_Linear` only where the weight has a target.

    Compiled models keep F.linear (the compiler fuses it into its own graph), and so do autocast
    ones: under autocast `_Linear`'s backward would get a bf16 gradient for an fp32 weight and
    have to redo autocast's casts itself. Their gradients are copied into the buffer instead.
    """
    if (getattr(weight, _ATTRIBUTE, (None, False))[0] is None or torch.compiler.is_compiling()
            or torch.is_autocast_enabled(x.device.type)):
        return F.linear(x, weight)
    return _Linear.apply(x, weight)
