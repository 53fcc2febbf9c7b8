"""RMSNorm and the rotary embedding, written for CPU, give the plain forms' values and gradients,
keep less for the backward, and give each row what it gets in any batch (so a rank's split of
the batch never changes a row's result)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanochat_cpu.rms_norm import rms_norm
from nanochat_cpu.rotary import apply_rotary, rotary_tables
from tests.test_relu_squared import saved_bytes


def plain_rotary(x, cos, sin):
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


def plain_rms_norm(x):
    return F.rms_norm(x, (x.size(-1),))


def queries(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, 10, 4, 16, generator=gen) * 3).to(dtype).requires_grad_()
    return x, torch.randn(x.shape, generator=gen).to(dtype)


def grads_against_float64(fn, plain, x, g):
    """fn's and plain's output and input gradient, each minus plain's in float64."""
    x64 = x.detach().double().requires_grad_()
    want = plain(x64)
    want_g, = torch.autograd.grad(want, x64, g.double())
    got = fn(x)
    got_g, = torch.autograd.grad(got, x, g)
    return (got.double() - want).abs().max(), (got_g.double() - want_g).abs().max(), want_g.abs().max()


def test_rms_norm_matches_the_plain_form_in_float32():
    x, g = queries()
    out_err, grad_err, scale = grads_against_float64(rms_norm, plain_rms_norm, x, g)
    plain_out_err, plain_grad_err, _ = grads_against_float64(plain_rms_norm, plain_rms_norm, x, g)
    assert out_err <= 4 * max(plain_out_err, 1e-7) and grad_err <= 4 * max(plain_grad_err, 1e-7 * scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_in_half_precision_is_the_plain_form(dtype):
    """bf16 and fp16 need F.rms_norm's float accumulation: they take it, bit for bit."""
    x, g = queries(dtype)
    got, want = rms_norm(x), plain_rms_norm(x)
    assert torch.equal(got, want)
    assert torch.equal(torch.autograd.grad(got, x, g)[0], torch.autograd.grad(want, x, g)[0])


def test_rms_norm_of_zeros_is_zero_and_finite():
    x = torch.zeros(2, 8, requires_grad=True)
    out = rms_norm(x)
    g, = torch.autograd.grad(out, x, torch.ones(2, 8))
    assert not out.any() and torch.isfinite(g).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_the_plain_form(dtype):
    x, g = queries(dtype)
    cos, sin = rotary_tables(10, 16)
    got, want = apply_rotary(x, cos, sin), plain_rotary(x, cos, sin)
    # the plain form's dtype too: bf16 queries times fp32 tables are fp32
    assert got.dtype == want.dtype == torch.float32
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()  # fp32 arithmetic both ways
    got_g, = torch.autograd.grad(got, x, g.float())
    want_g, = torch.autograd.grad(want, x, g.float())
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: both round the gradient to bf16
    assert got_g.dtype == dtype and (got_g.float() - want_g.float()).abs().max() <= tol * want_g.abs().max()


def test_rotary_keeps_the_norm_and_undoes_itself_backwards():
    """A rotation: each pair's length is kept, and the backward is the inverse rotation, so a
    gradient equal to the output comes back as the input."""
    x, _ = queries()
    cos, sin = rotary_tables(10, 16)
    out = apply_rotary(x, cos, sin)
    d = 8
    pair_lengths = lambda t: t[..., :d].square() + t[..., d:].square()  # noqa: E731
    torch.testing.assert_close(pair_lengths(out), pair_lengths(x), rtol=1e-5, atol=1e-5)
    back, = torch.autograd.grad(out, x, out.detach())
    torch.testing.assert_close(back, x.detach(), rtol=1e-5, atol=1e-5)


def test_the_attention_inputs_keep_less_than_the_plain_forms():
    """The queries' path (rotary, then norm, then attention, which keeps the normed queries)
    keeps nothing else of the queries' size; the plain forms keep the norm's input besides."""
    x, _ = queries()
    cos, sin = rotary_tables(10, 16)
    keys = torch.randn(x.shape, requires_grad=True)
    attend = lambda q: q * keys  # noqa: E731  (keeps q, as attention does)
    ours = saved_bytes(lambda: attend(rms_norm(apply_rotary(x, cos, sin))))
    plain = saved_bytes(lambda: attend(plain_rms_norm(plain_rotary(x, cos, sin))))
    tensor = x.numel() * 4
    assert ours < 2.5 * tensor and plain > 3 * tensor  # keys and q (and small tables), or a third


def test_each_row_gets_what_it_gets_in_any_batch():
    """Bit for bit: a rank that holds some of the batch's rows gets for them what one rank
    holding all of them gets, in the forward and the backward."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(12, 64, 6, 64, generator=gen, requires_grad=True)
    g = torch.randn(x.shape, generator=gen)
    cos, sin = rotary_tables(64, 64)
    fn = lambda t: rms_norm(apply_rotary(t, cos, sin))  # noqa: E731
    whole = fn(x)
    whole_g, = torch.autograd.grad(whole, x, g)
    for rows in (slice(0, 1), slice(1, 6), slice(5, 12)):
        part = x[rows].detach().clone().requires_grad_()
        got = fn(part)
        got_g, = torch.autograd.grad(got, part, g[rows])
        assert torch.equal(got, whole[rows]) and torch.equal(got_g, whole_g[rows])
