"""Weight gradients written into the optimizer's buffer (grad_target.py): same values as autograd's,
in the buffer's memory, and accumulated there by later micro-steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanochat_cpu.grad_target import linear, release_grad_target, set_grad_target
from nanochat_cpu.loss import softcapped_cross_entropy
from nanochat_cpu.optim import MuonAdamW
from nanochat_cpu.sync_strategy import Group


def test_linear_writes_its_weight_gradient_into_the_target_and_accumulates_there():
    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 4, generator=gen))
    reference = torch.nn.Parameter(weight.detach().clone())
    buffer = torch.full((40,), float("nan"))  # stale contents must be overwritten, not added to
    set_grad_target(weight, buffer[8:32].view(6, 4))
    x = torch.randn(2, 3, 4, generator=gen, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    for micro_step in range(2):
        linear(x, weight).square().sum().backward()
        F.linear(x_ref, reference).square().sum().backward()
        assert weight.grad.data_ptr() == buffer[8:].data_ptr(), f"micro-step {micro_step}: gradient not in the buffer"
        torch.testing.assert_close(weight.grad, reference.grad)
        torch.testing.assert_close(x.grad, x_ref.grad)
    assert buffer[:8].isnan().all() and buffer[32:].isnan().all(), "wrote outside the target"


def test_loss_writes_the_heads_gradient_into_the_target_with_zero_padding_rows():
    gen = torch.Generator().manual_seed(1)
    vocab, padded, width = 10, 16, 8
    head = torch.nn.Parameter(torch.randn(padded, width, generator=gen))
    reference = torch.nn.Parameter(head.detach().clone())
    target = torch.full((padded, width), 7.0)  # last step's values: padding rows must come back zero
    set_grad_target(head, target)
    x = torch.randn(12, width, generator=gen)
    y = torch.randint(0, vocab, (12,), generator=gen)
    softcapped_cross_entropy(x, head, y, 15.0, vocab=vocab).backward()
    F.cross_entropy(15.0 * torch.tanh(x @ reference[:vocab].t() / 15.0), y).backward()
    assert head.grad.data_ptr() == target.data_ptr()
    torch.testing.assert_close(head.grad, reference.grad)
    assert (target[vocab:] == 0).all()


def test_a_weight_used_twice_in_one_backward_gets_the_sum_of_both_gradients():
    """The second use must not write over the first one's gradient in the target."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.nn.Parameter(torch.randn(5, 4, generator=gen))
    reference = torch.nn.Parameter(weight.detach().clone())
    set_grad_target(weight, torch.zeros(5, 4))
    a, b = torch.randn(3, 4, generator=gen), torch.randn(2, 4, generator=gen)
    (linear(a, weight).sum() + linear(b, weight).square().sum()).backward()
    (F.linear(a, reference).sum() + F.linear(b, reference).square().sum()).backward()
    torch.testing.assert_close(weight.grad, reference.grad)


def test_a_weight_used_inside_and_outside_a_reentrant_checkpoint_gets_the_sum():
    """The checkpoint's nested backward is another pass while the outer one still holds the target."""
    gen = torch.Generator().manual_seed(4)
    weight = torch.nn.Parameter(torch.randn(4, 4, generator=gen))
    reference = torch.nn.Parameter(weight.detach().clone())
    set_grad_target(weight, torch.zeros(4, 4))
    x = torch.randn(3, 4, generator=gen, requires_grad=True)

    def model(w, use):
        inner = torch.utils.checkpoint.checkpoint(lambda h: use(h, w).tanh(), use(x, w), use_reentrant=True)
        return use(inner, w).square().sum()

    model(weight, linear).backward()
    model(reference, F.linear).backward()
    torch.testing.assert_close(weight.grad, reference.grad)


def test_the_target_is_written_again_only_after_the_optimizer_releases_it():
    weight = torch.nn.Parameter(torch.randn(3, 4))
    target = torch.zeros(3, 4)
    set_grad_target(weight, target)
    x = torch.randn(2, 4)
    linear(x, weight).sum().backward()
    assert weight.grad.data_ptr() == target.data_ptr()
    weight.grad = None  # not released: this step's target is taken, the gradient goes elsewhere
    linear(x, weight).sum().backward()
    assert weight.grad.data_ptr() != target.data_ptr()
    weight.grad = None
    release_grad_target(weight)
    linear(x, weight).sum().backward()
    assert weight.grad.data_ptr() == target.data_ptr()


def test_strided_inputs_without_gradient_and_autocast_give_autograds_gradients():
    gen = torch.Generator().manual_seed(3)
    weight = torch.nn.Parameter(torch.randn(3, 4, generator=gen))
    reference = torch.nn.Parameter(weight.detach().clone())
    target = torch.zeros(3, 4)
    set_grad_target(weight, target)
    x = torch.randn(5, 2, 4, generator=gen).transpose(0, 1)  # (2, 5, 4) that no view flattens
    linear(x, weight).square().sum().backward()
    F.linear(x, reference).square().sum().backward()
    assert weight.grad.data_ptr() == target.data_ptr()
    torch.testing.assert_close(weight.grad, reference.grad)
    weight.grad = reference.grad = None
    release_grad_target(weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # F.linear's own path: autocast casts it
        linear(x, weight).float().square().sum().backward()
        F.linear(x, reference).float().square().sum().backward()
    torch.testing.assert_close(weight.grad, reference.grad)


def test_an_optimizer_takes_away_targets_it_did_not_set():
    """A target left by an earlier optimizer (its shared buffer) must not receive gradients."""
    weight = torch.nn.Parameter(torch.randn(3, 4))
    stale = torch.zeros(3, 4)
    set_grad_target(weight, stale)
    MuonAdamW([Group("adamw", "w", [weight], lr=0.1)])
    linear(torch.randn(2, 4), weight).sum().backward()
    assert weight.grad.data_ptr() != stale.data_ptr() and (stale == 0).all()


@pytest.mark.parametrize(("target", "why"), [(torch.zeros(3, 4), r"\(3, 4\) torch.float32 on cpu"),
                                             (torch.zeros(4, 3, dtype=torch.float64), "float64"),
                                             (torch.zeros(3, 4).t(), r"contiguous: False"),
                                             (torch.zeros(4, 3, device="meta"), "on meta")])
def test_a_target_that_does_not_fit_the_parameter_is_refused(target, why):
    with pytest.raises(ValueError, match=why + r".*does not fit a parameter \(4, 3\) torch.float32 on cpu"):
        set_grad_target(torch.zeros(4, 3), target)
