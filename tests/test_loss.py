"""The fused LM-head loss equals the plain soft-capped cross-entropy, values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanochat_cpu import loss
from nanochat_cpu.loss import IGNORE_INDEX, softcapped_cross_entropy

CAP = 15.0


def plain(x, w, y, reduction="mean", cap=CAP):
    return F.cross_entropy(cap * torch.tanh((x @ w.t()).float() / cap), y, ignore_index=IGNORE_INDEX,
                           reduction=reduction)


def inputs(n=300, d=48, v=5000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen).requires_grad_()
    w = (torch.randn(v, d, generator=gen) * 0.4).requires_grad_()  # logits well into tanh's bend
    y = torch.randint(0, v, (n,), generator=gen)
    y[::7] = IGNORE_INDEX
    return x, w, y


def loss_tolerance(dtype: torch.dtype) -> float:
    """bf16 logits: ours are made from x scaled by 2 / cap, so they round to bf16 at other points than
    the plain form's; each loss is 1e-5 to 1e-4 off the float64 one (measured on these inputs)."""
    return 1e-5 if dtype == torch.float32 else 2e-4


@pytest.mark.parametrize("cap", [CAP, 3.0, 60.0])  # 60: exp(-2 cap r) down in fp32's subnormals
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_and_gradients_match_the_plain_form(dtype, cap):
    x, w, y = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        want = plain(x, w, y, cap=cap)
        got = softcapped_cross_entropy(x, w, y, cap)
    want_gx, want_gw = torch.autograd.grad(want * 3, (x, w))
    got_gx, got_gw = torch.autograd.grad(got * 3, (x, w))
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: both round the logits' gradient to bf16
    assert got.dtype == torch.float32 and got.item() == pytest.approx(want.item(), rel=loss_tolerance(dtype))
    for g, ref in ((got_gx, want_gx), (got_gw, want_gw)):
        assert g.dtype == torch.float32
        assert (g - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_of_logits_give_the_same_loss_and_gradients(monkeypatch, dtype):
    """At 16,384 tokens a step the logits are made a block of rows at a time: 300 rows in blocks of
    128, 128 and 44 must give what one block gives, the weight's gradient summed over the blocks."""
    x, w, y = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        want = plain(x, w, y)
        monkeypatch.setattr(loss, "LOGITS_BLOCK_ELEMENTS", 128 * w.size(0))
        got = softcapped_cross_entropy(x, w, y, CAP)
    want_gx, want_gw = torch.autograd.grad(want * 0.5, (x, w))
    got_gx, got_gw = torch.autograd.grad(got * 0.5, (x, w))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.item() == pytest.approx(want.item(), rel=loss_tolerance(dtype))
    for g, ref in ((got_gx, want_gx), (got_gw, want_gw)):
        assert g.dtype == torch.float32 and (g - ref).abs().max() <= tol * ref.abs().max()


def test_a_second_backward_through_the_same_loss_is_refused_clearly():
    """The gradients are made in the forward and handed to one backward (kept by nothing else, so
    autograd adopts the weight's in place as .grad): a second backward says so."""
    x, w, y = inputs()
    got = softcapped_cross_entropy(x, w, y, CAP)
    got.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagate it once"):
        got.backward()


def test_chunks_cover_every_row_and_the_per_position_form_matches(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # chunks as on one thread, on any machine
    x, w, y = inputs(n=1000, v=700)  # 700 columns: 187 rows a chunk, a short last chunk
    with torch.no_grad():
        got = softcapped_cross_entropy(x, w, y, CAP, reduction="none")
        want = plain(x, w, y, reduction="none")
    assert got.shape == (1000,) and torch.allclose(got, want, atol=1e-5)
    assert (got[::7] == 0).all()  # ignored positions


def test_all_ignored_gives_zero_loss_and_gradient():
    x, w, y = inputs(n=8)
    y[:] = IGNORE_INDEX
    loss = softcapped_cross_entropy(x, w, y, CAP)
    gx, gw = torch.autograd.grad(loss, (x, w))
    assert loss.item() == 0.0 and not gx.any() and not gw.any()


def test_per_position_losses_with_gradients_are_refused():
    x, w, y = inputs(n=8)
    with pytest.raises(ValueError, match="reduction='none'"):
        softcapped_cross_entropy(x, w, y, CAP, reduction="none")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_head_rows_never_score_and_get_zero_gradient(dtype):
    x, w, y = inputs(v=300)
    padded = torch.cat([w.detach(), torch.randn(20, w.size(1))]).requires_grad_()  # 20 padding rows
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        want = plain(x, w, y)
        got = softcapped_cross_entropy(x, padded, y, CAP, vocab=300)
    want_gw, = torch.autograd.grad(want, (w,))
    junk = torch.full_like(padded, float("nan"))  # freed just before: the gradient's likely memory
    del junk
    got_gw, = torch.autograd.grad(got, (padded,))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.item() == pytest.approx(want.item(), rel=loss_tolerance(dtype))
    assert got_gw.shape == padded.shape and (got_gw[300:] == 0).all()
    assert (got_gw[:300] - want_gw).abs().max() <= tol * want_gw.abs().max()


def exact_inputs(n: int, d: int = 48, v: int = 5000, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """x and w of small integers times powers of two, with a cap whose 2 / cap is one too: every
    product and sum of the logits' GEMM is exact in fp32 (and every input in bf16), so the logits
    have the same bits whatever kernel and order the GEMM takes."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (n, d), generator=gen).float()
    w = torch.randint(-2, 3, (v, d), generator=gen).float() * 0.0625
    y = torch.randint(0, v, (n,), generator=gen)
    y[::7] = IGNORE_INDEX
    return x, w, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_loss_does_not_depend_on_how_the_batch_is_split(dtype):
    """Ranks and blocks cut a batch anywhere: each row's loss is the same to the bit wherever the cut
    falls, given the same logits (an elementwise op with a scalar tail at a thread's range end would
    change its last bit). The logits are made exact: the GEMM itself gives a row other bits in a
    one-row slice (a matrix-vector kernel) or in another tile, with the AVX-512 kernels of a
    Sapphire Rapids Xeon (cuts 1 and 999 of random inputs), which is no business of the loss's."""
    x, w, y = exact_inputs(n=1000)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        whole = softcapped_cross_entropy(x, w, y, 16.0, reduction="none")
        for cut in (1, 97, 500, 999):
            halves = (slice(0, cut), slice(cut, None))
            assert torch.equal(torch.cat([x[rows] * 0.125 @ w.t() for rows in halves]), x * 0.125 @ w.t())  # exact
            parts = [softcapped_cross_entropy(x[rows], w, y[rows], 16.0, reduction="none") for rows in halves]
            assert torch.equal(torch.cat(parts), whole), cut
