"""The LM head's loss: logits, nanochat's soft-cap `cap * tanh(z / cap)`, cross-entropy.

Written the plain way (`F.cross_entropy(cap * tanh(x @ W.T / cap), y)`), eager PyTorch runs the
division, tanh, scaling, log-softmax, the loss and each of their backwards as separate passes
over the whole (tokens x vocab) logits: at 1,024 tokens and a 32,768 vocabulary that is ~8 fresh
128-MB tensors per step, and a profile put it level with the LM head's GEMMs themselves.

`softcapped_cross_entropy` does the same arithmetic with one logits buffer. The loss is the last
operation of the graph, so its gradient is known in the forward: after the one logits GEMM the
buffer is walked in cache-sized row chunks that turn it, in place, into dLoss/dlogits, and the
backward runs the head's two GEMMs on it. In fp32 the incoming gradient scales the small
(tokens x width) operand of the weight's GEMM, so no pass over the (vocab x width) result is
needed for it. Same GEMMs as autograd, no second big buffer, and the elementwise work runs on
chunks that sit in cache. torch.compile fuses the plain form itself, so compiled models keep it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .grad_target import grad_target

IGNORE_INDEX = -1
# fp32 values per chunk and thread: 512 KiB, so each core's part of the chunk and of its exp() copy
# stay in its L2 while walked (2 MiB here; 1 MiB per thread measured 3-4 ms a step slower)
CHUNK_ELEMENTS_PER_THREAD = 1 << 17
# On a GPU kernel launches cost, not cache misses: few large chunks (256 MiB of fp32 values each,
# which bounds the temporaries when a large batch's logits run to gigabytes)
CUDA_CHUNK_ELEMENTS = 1 << 26
MAX_UNSHIFTED_CAP = 40.0  # sum over a 2^17 vocabulary of exp(40) is ~3e22, far below fp32's 3e38


def _chunk_losses(z: torch.Tensor, targets: torch.Tensor, cap: float, grad: bool) -> torch.Tensor:
    """Per-row losses of one chunk of raw logits `z`; with `grad`, `z` becomes dLoss_i/dz, in place.

    Seven passes over the chunk. Capped logits lie in (-cap, cap), so exp() of them can neither
    overflow nor underflow in fp32 for any cap below ~40 (nanochat's is 15): the log-sum-exp needs
    no max pass and no shift.
    """
    t = z.float()  # a copy for bf16 logits; fp32 logits are worked on in place
    t.mul_(1.0 / cap).tanh_()
    e = torch.mul(t, cap)
    if cap > MAX_UNSHIFTED_CAP:
        e.sub_(cap)
    e.exp_()
    total = e.sum(dim=1)
    lse = total.log()
    if cap > MAX_UNSHIFTED_CAP:
        lse.add_(cap)
    valid = targets != IGNORE_INDEX
    columns = targets.clamp(min=0)[:, None]  # ignored positions read column 0, then count for nothing
    picked = t.gather(1, columns).squeeze(1).mul_(cap)
    losses = torch.where(valid, lse - picked, 0.0)
    if grad:
        p = e.mul_((valid / total)[:, None])  # softmax of the capped logits; ignored rows become 0
        p.scatter_add_(1, columns, -valid[:, None].to(p.dtype))
        # d(cap * tanh(z / cap))/dz = 1 - tanh^2: dz = p * (1 - t^2), one pass written over t
        torch.ops.aten.tanh_backward.grad_input(p, t, grad_input=t)
        if t.data_ptr() != z.data_ptr():
            z.copy_(t)
    return losses


def _losses_by_chunk(z: torch.Tensor, targets: torch.Tensor, cap: float, grad: bool) -> torch.Tensor:
    """Per-row losses of the whole logits buffer, walked in cache-sized row chunks."""
    per_chunk = CUDA_CHUNK_ELEMENTS if z.is_cuda else CHUNK_ELEMENTS_PER_THREAD * torch.get_num_threads()
    rows = max(1, per_chunk // z.size(1))
    return torch.cat([_chunk_losses(z[s:s + rows], targets[s:s + rows], cap, grad)
                      for s in range(0, z.size(0), rows)])

class _SoftcappedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, cap: float,
                vocab: int) -> torch.Tensor:
        z = x @ weight[:vocab].t()  # (N, vocab); becomes dLoss/dz chunk by chunk (scaled by 1/valid below)
        losses = _losses_by_chunk(z, targets, cap, grad=True)
        valid = (targets != IGNORE_INDEX).sum().clamp(min=1)
        ctx.save_for_backward(z, x, weight, valid)
        return losses.sum() / valid

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        z, x, weight, valid = ctx.saved_tensors
        vocab = z.size(1)
        scale = grad_loss / valid
        grad_x = (z @ weight[:vocab].to(z.dtype)).to(x.dtype).mul_(scale)  # (N, d): small, scaled after
        # the whole (padded) weight's gradient, written in place: slicing the weight before the
        # call instead would make autograd zero a second full-size buffer and copy this one into it.
        # Into the optimizer's shared buffer where it has given one (grad_target.py).
        grad_w = grad_target(weight)
        if grad_w is None:
            grad_w = torch.empty_like(weight)
        grad_w[vocab:].zero_()  # padding rows never score
        if z.dtype == torch.float32:  # (vocab, d): the scale rides on the small operand, before the GEMM
            torch.mm(z.t(), x * scale, out=grad_w[:vocab])
        else:  # bf16 logits: a scaled bf16 x would be rounded once more; scale in fp32 after
            grad_w[:vocab].copy_(z.t() @ x.to(z.dtype)).mul_(scale)
        return grad_x, grad_w, None, None, None


def softcapped_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, cap: float,
                             reduction: str = "mean", vocab: int | None = None) -> torch.Tensor:
    """Cross-entropy of `cap * tanh(x @ weight[:vocab].T / cap)` against `targets` (-1 = ignored).

    x: (N, d) final hidden states; weight: (V, d), the LM head, of which the first `vocab` rows
    (default: all) are the real vocabulary and the rest padding that never scores and gets a zero
    gradient; targets: (N,). reduction "mean" (over non-ignored positions, differentiable) or
    "none" (per position, for evaluation without gradients).
    """
    vocab = weight.size(0) if vocab is None else vocab
    if not 0 < vocab <= weight.size(0):
        raise ValueError(f"vocab={vocab}: the head has {weight.size(0)} rows")
    if torch.compiler.is_compiling():  # the compiler fuses the plain form into a few kernels itself
        logits = cap * torch.tanh((x @ weight[:vocab].t()).float() / cap)
        return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction=reduction)
    if reduction == "mean":
        return _SoftcappedCrossEntropy.apply(x, weight, targets, cap, vocab)
    if reduction != "none" or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        raise ValueError(f"reduction={reduction!r}: 'mean', or 'none' without gradients")
    return _losses_by_chunk(x @ weight[:vocab].t(), targets, cap, grad=False)
