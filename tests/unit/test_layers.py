"""The CPU fast paths of GroupNorm and Dropout compute what nn.GroupNorm and nn.Dropout do."""

import pytest
import torch
from torch import nn

from difftrain.models.layers import Dropout, GroupNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_norm_on_channels_last_matches_nn_group_norm(dtype):
    gen = torch.Generator().manual_seed(0)
    ours, ref = GroupNorm(4, 16, eps=1e-6), nn.GroupNorm(4, 16, eps=1e-6)
    with torch.no_grad():
        for p in (ours.weight, ours.bias):
            p.copy_(torch.randn(p.shape, generator=gen))
    ref.load_state_dict(ours.state_dict())  # the same keys
    x = torch.randn(2, 16, 5, 7, generator=gen, dtype=dtype)
    x_cl = x.to(memory_format=torch.channels_last).requires_grad_()
    x_ref = x.clone().requires_grad_()
    grad = torch.randn(x.shape, generator=gen, dtype=dtype)
    y, y_ref = ours.to(dtype)(x_cl), ref.to(dtype)(x_ref)
    assert y.is_contiguous(memory_format=torch.channels_last)  # the layout the next conv wants
    (y * grad).sum().backward()
    (y_ref * grad).sum().backward()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(x_cl.grad, x_ref.grad, **tol)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, **tol)
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad, **tol)


def test_dropout_drops_at_rate_p_and_scales_the_rest():
    torch.manual_seed(0)
    drop = Dropout(0.1).train()
    x = torch.randn(64, 32, 16, 16).requires_grad_()
    y = drop(x)
    kept = y != 0
    assert abs(1 - kept.float().mean().item() - 0.1) < 0.003  # 524,288 draws: 3 sigma is 0.0012
    torch.testing.assert_close(y[kept], x[kept] / 0.9)
    y.sum().backward()
    torch.testing.assert_close(x.grad, kept.float() / 0.9)  # the gradient goes through the kept units only


def test_dropout_masks_are_independent_per_element_and_seeded():
    torch.manual_seed(1)
    a = Dropout(0.5).train()(torch.ones(4096)) != 0
    b = Dropout(0.5).train()(torch.ones(4096)) != 0
    torch.manual_seed(1)
    a_again = Dropout(0.5).train()(torch.ones(4096)) != 0
    assert torch.equal(a, a_again)  # the global generator decides, so a seeded run is reproducible
    assert not torch.equal(a, b)
    # neighbours (which share one 64-bit draw) are uncorrelated: P(both kept) ~ 1/4
    both = (a[0::2] & a[1::2]).float().mean().item()
    assert abs(both - 0.25) < 0.04


def test_dropout_is_identity_in_eval_mode_and_with_p_zero():
    x = torch.randn(3, 5)
    assert torch.equal(Dropout(0.3).eval()(x), x)
    assert torch.equal(Dropout(0.0).train()(x), x)
