"""ReLU², written to keep less for its backward.

At the batch a CPU user runs for days (16,384 tokens a step, one micro-step, as upstream nanochat's
CPU recipe does) the activations autograd keeps are most of a run's memory, and a laptop has 16 GB.
Written plainly, `relu(h).square()` keeps relu's output for both backwards, beside the square that
the MLP's projection keeps anyway: 4 x width floats a token and layer, 600 MB at depth 6 and 16,384
tokens a step. `relu_squared` computes the square in place in the first projection's output (which
nothing keeps) and keeps only the result: since relu(h) = sqrt(relu(h)^2), the gradient 2 relu(h)
is read back from it. (The rotary embedding keeps nothing of its own: its multiplications by
constant tables keep only the tables.) Compiled models keep the plain form, which the compiler
fuses and recomputes itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _ReluSquared(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        out = h.relu_().square_()  # in place: the projection's output is needed by nothing else
        ctx.mark_dirty(h)
        ctx.save_for_backward(out)  # the next projection keeps this tensor anyway: no extra memory
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (out,) = ctx.saved_tensors
        return out.sqrt().mul_(grad).mul_(2.0)  # d relu(h)^2 / dh = 2 relu(h) = 2 sqrt(out)


def relu_squared(h: torch.Tensor) -> torch.Tensor:
    """relu(h)^2, overwriting h (the output of a layer that nothing else reads)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return F.relu(h).square()
    return _ReluSquared.apply(h)
