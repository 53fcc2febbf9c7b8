"""The LM head's loss: logits, nanochat's soft-cap `cap * tanh(z / cap)`, cross-entropy.

Written the plain way (`F.cross_entropy(cap * tanh(x @ W.T / cap), y)`), eager PyTorch runs the
division, tanh, scaling, log-softmax, the loss and each of their backwards as separate passes
over the whole (tokens x vocab) logits: at 1,024 tokens and a 32,768 vocabulary that is ~8 fresh
128-MB tensors per step, and a profile put it level with the LM head's GEMMs themselves.

`softcapped_cross_entropy` does the same arithmetic with one logits buffer per block of rows. The
loss is the last operation of the graph, so its gradient is known in the forward: the forward
makes a block's logits with one GEMM, walks them in cache-sized row chunks that turn them, in
place, into dLoss/dlogits, and runs the head's two gradient GEMMs on them straight away. So no
(tokens x vocab) buffer outlives its block: at 16,384 tokens a step and a 32,768 vocabulary the
logits would be 2 GiB, kept from the forward to the backward (measured at depth 6: peak RSS
8,951 -> 7,283 MiB). backward() only scales the two gradients by the incoming one. Same GEMMs as
autograd, and the elementwise work runs on chunks that sit in cache. torch.compile fuses the
plain form itself, so compiled models keep it.
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
# Rows of logits made at once: 128 MiB of fp32 values, all of them at 1,024 tokens and a 32,768
# vocabulary; at 16,384 tokens a step the 2-GiB logits never exist whole (peak RSS, see above)
LOGITS_BLOCK_ELEMENTS = 1 << 25
# tanh is written with exp: torch's CPU tanh goes through MKL's vector library, which an AVX2 AMD
# EPYC runs at 0.56 G values/s, the exp form at 0.95 (measured with four cheap passes after the
# exp; r below needs two). sigmoid and exp2 are faster still but give a different last bit at the
# end of each thread's range of elements (a scalar tail), so a row's loss would depend on how the
# batch is split into ranks
# (sigmoid_backward, below, is plain arithmetic: its tail computes what its vector loop does).


def _chunk_losses(u: torch.Tensor, targets: torch.Tensor, cap: float, grad: bool) -> torch.Tensor:
    """Per-row losses of one chunk of scaled logits `u = 2z / cap`; with `grad`, `u` becomes
    dLoss_i/dz / 4, in place.

    The 2 / cap rides in the GEMM that makes `u` (its input is scaled, N x d values, not N x V), and
    the factor 4 in the scale backward() applies. Everything else is in terms of
    r = 1 / (1 + exp(u)): the capped logit is cap * tanh(z / cap) = cap - 2 cap r, its exp shifted
    by the cap is exp(-2 cap r), in (exp(-2 cap), 1], which needs no max pass and cannot overflow
    (nor underflow in fp32 for caps below ~43; nanochat's is 15), and its derivative is
    4 r (1 - r). Eight passes over the chunk, two of them exp.
    """
    r = u.float()  # a copy for bf16 logits; fp32 logits are worked on in place
    r.exp_().add_(1.0).reciprocal_()  # exp's overflow to inf gives r = 0, tanh = 1
    e = torch.mul(r, -2.0 * cap).exp_()
    total = e.sum(dim=1)
    valid = targets != IGNORE_INDEX
    columns = targets.clamp(min=0)[:, None]  # ignored positions read column 0, then count for nothing
    # lse - picked = (log(total) + cap) - (cap - 2 cap r_target)
    picked = r.gather(1, columns).squeeze(1).mul_(2.0 * cap)
    losses = torch.where(valid, total.log().add_(picked), 0.0)
    if grad:
        p = e.mul_((valid / total)[:, None])  # softmax of the capped logits; ignored rows become 0
        p.scatter_add_(1, columns, -valid[:, None].to(p.dtype))
        # dLoss/dz = p * (1 - tanh^2) = p * 4 r (1 - r): the 4 waits for backward(); one pass over r
        torch.ops.aten.sigmoid_backward.grad_input(p, r, grad_input=r)
        if r.data_ptr() != u.data_ptr():
            u.copy_(r)
    return losses


def _losses_by_chunk(u: torch.Tensor, targets: torch.Tensor, cap: float, grad: bool) -> torch.Tensor:
    """Per-row losses of the whole scaled logits buffer, walked in cache-sized row chunks."""
    per_chunk = CUDA_CHUNK_ELEMENTS if u.is_cuda else CHUNK_ELEMENTS_PER_THREAD * torch.get_num_threads()
    rows = max(1, per_chunk // u.size(1))
    return torch.cat([_chunk_losses(u[s:s + rows], targets[s:s + rows], cap, grad)
                      for s in range(0, u.size(0), rows)])


def _scaled_logits(x: torch.Tensor, head: torch.Tensor, cap: float) -> torch.Tensor:
    """u = 2 (x @ head.T) / cap, the scaling done on x's (N x d) values instead of the (N x V) logits.
    Under bf16 autocast bf16, as autograd's own matmul would make them."""
    return (x * (2.0 / cap)) @ head.t()


def _row_blocks(n: int, vocab: int) -> list[slice]:
    """The rows of logits made at once (LOGITS_BLOCK_ELEMENTS each), over n rows."""
    rows = max(1, LOGITS_BLOCK_ELEMENTS // vocab)
    return [slice(s, s + rows) for s in range(0, n, rows)]


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, add: bool) -> None:
    """out = a @ b, or out += a @ b with `add`; straight into `out` where the dtypes agree."""
    if a.dtype == out.dtype:
        if add:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
        return
    product = a @ b
    if add:
        out.add_(product)
    else:
        out.copy_(product)


class _SoftcappedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, cap: float,
                vocab: int) -> torch.Tensor:
        # The whole backward runs here, block by block of rows, so no (N x vocab) buffer outlives
        # its block: the GEMM makes the block's logits, the chunk walk turns them into dLoss/dz,
        # and the head's two gradient GEMMs consume them. Only the (N x d) and (V x d) gradients
        # wait for backward(), which scales them.
        grad_x = torch.empty_like(x)
        # the whole (padded) weight's gradient: into the optimizer's shared buffer where it has
        # given one (grad_target.py); slicing the weight before the call instead would make
        # autograd zero a second full-size buffer and copy this one into it
        grad_w = grad_target(weight)
        if grad_w is None:
            grad_w = torch.empty_like(weight)
        grad_w[vocab:].zero_()  # padding rows never score
        head = weight[:vocab]
        losses, head_z = [], None
        for i, rows in enumerate(_row_blocks(x.size(0), vocab)):
            xb = x[rows]
            z = _scaled_logits(xb, head, cap)
            losses.append(_losses_by_chunk(z, targets[rows], cap, grad=True))  # z is now dLoss/dlogits / 4
            head_z = head.to(z.dtype) if head_z is None else head_z
            with torch.autocast(x.device.type, enabled=False):  # the dtypes are chosen here
                _mm_into(grad_x[rows], z, head_z, add=False)
                _mm_into(grad_w[:vocab], z.t(), xb.to(z.dtype), add=i > 0)
        valid = (targets != IGNORE_INDEX).sum().clamp(min=1)
        # handed to backward() alone: autograd adopts the weight's gradient as .grad only if nothing
        # else holds it (else it copies it, out of the optimizer's buffer too)
        ctx.grads, ctx.valid = [grad_x, grad_w], valid
        return torch.cat(losses).sum() / valid

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.grads is None:
            raise RuntimeError("the soft-capped loss makes its gradients in the forward and hands them to one "
                               "backward: backpropagate it once (retain_graph=True and a second backward are not "
                               "supported)")
        (grad_x, grad_w), ctx.grads = ctx.grads, None
        scale = grad_loss * 4.0 / ctx.valid  # the chunks' gradients are a quarter of dLoss/dlogits
        return grad_x.mul_(scale), grad_w.mul_(scale), None, None, None


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
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if reduction == "mean" and needs_grad:
        return _SoftcappedCrossEntropy.apply(x, weight, targets, cap, vocab)
    if reduction not in ("mean", "none") or needs_grad:
        raise ValueError(f"reduction={reduction!r}: 'mean', or 'none' without gradients")
    losses = torch.cat([_losses_by_chunk(_scaled_logits(x[rows], weight[:vocab], cap), targets[rows], cap, grad=False)
                        for rows in _row_blocks(x.size(0), vocab)])
    if reduction == "none":
        return losses
    return losses.sum() / (targets != IGNORE_INDEX).sum().clamp(min=1)
