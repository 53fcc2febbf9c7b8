"""ReLU² in place gives the plain form's values and gradients, and keeps less for the backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanochat_cpu.model import MLP, ModelConfig
from nanochat_cpu.relu_squared import relu_squared


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of fn()."""
    storages = {}

    def pack(t: torch.Tensor):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relu_squared_matches_the_plain_form(dtype):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(4, 6, 16, generator=gen, dtype=dtype, requires_grad=True)
    g = torch.randn(4, 6, 16, generator=gen, dtype=dtype)
    want, = torch.autograd.grad(F.relu(h).square(), h, g)
    out = relu_squared(h.clone())
    got, = torch.autograd.grad(out, h, g)
    assert torch.equal(out, F.relu(h).square())
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert (got - want).abs().max() <= tol * want.abs().max()
    assert (got[h <= 0] == 0).all()


def test_tiny_and_zero_inputs_give_finite_gradients():
    """The backward's root is out * rsqrt(max(out, smallest normal)): squares that underflow to
    zero or to subnormals give a gradient between 0 and 2h, never inf or NaN."""
    h = torch.tensor([0.0, -1.0, 1e-20, 1e-25, 3e-19, 2.0], requires_grad=True)
    out = relu_squared(h.clone())
    got, = torch.autograd.grad(out, h, torch.ones(6))
    assert torch.isfinite(got).all()
    assert got[0] == 0 and got[1] == 0 and got[-1] == 4.0
    assert (got[2:5] >= 0).all() and (got[2:5] <= 2 * h[2:5]).all()


def test_half_precision_takes_the_square_root_itself():
    """fp16's smallest normal (6e-5) is the square of 0.008: clamping to it would shrink every
    gradient of h below that, so fp16 keeps sqrt."""
    h = torch.tensor([0.0, 5e-3, 0.02, 0.5], dtype=torch.float16, requires_grad=True)
    got, = torch.autograd.grad(relu_squared(h.clone()), h, torch.ones(4, dtype=torch.float16))
    want, = torch.autograd.grad(F.relu(h).square(), h, torch.ones(4, dtype=torch.float16))
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=0)


def test_the_mlp_keeps_its_input_and_the_squares_only():
    """Not relu's output besides: 4 x width floats a token fewer than the plain form keeps."""
    cfg = ModelConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, seq_len=8)
    x = torch.randn(2, 8, 32, requires_grad=True)
    tokens, width = 2 * 8, 32
    mlp = MLP(cfg)
    weights = sum(p.numel() for p in mlp.parameters()) * 4
    plain = lambda: F.linear(F.relu(F.linear(x, mlp.c_fc.weight)).square(), mlp.c_proj.weight)  # noqa: E731
    assert saved_bytes(lambda: mlp(x)) - weights == tokens * (width + 4 * width) * 4
    assert saved_bytes(plain) - weights == tokens * (width + 2 * 4 * width) * 4
