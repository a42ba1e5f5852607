"""Invariants of the loss weightings and the per-sample loss."""

import pytest
import torch

from difftrain.diffusion.losses import LOSS_WEIGHTINGS, diffusion_loss, loss_weight
from difftrain.diffusion.process import PREDICTIONS, prediction_target, q_sample, to_x0_and_eps
from difftrain.diffusion.schedules import alpha_bar_schedule, snr

ALPHA_BAR = alpha_bar_schedule("cosine", 1000)


@pytest.mark.parametrize("prediction", PREDICTIONS)
def test_uniform_weight_is_one(prediction):
    weight = loss_weight("uniform", ALPHA_BAR, prediction)
    assert weight.shape == ALPHA_BAR.shape and weight.dtype == torch.float32
    assert torch.all(weight == 1)


def test_inv_one_minus_alpha_bar_is_snr_plus_one():
    weight = loss_weight("inv_one_minus_alpha_bar", ALPHA_BAR, "x0")
    torch.testing.assert_close(weight, (snr(ALPHA_BAR) + 1).float())


@pytest.mark.parametrize("gamma", [1.0, 5.0, 20.0])
def test_min_snr_matches_closed_forms(gamma):
    ratio = snr(ALPHA_BAR)
    clipped = torch.minimum(ratio, torch.tensor(gamma, dtype=torch.float64))
    expected = {"epsilon": clipped / ratio, "v": clipped / (ratio + 1), "x0": clipped}
    for prediction, closed_form in expected.items():
        weight = loss_weight("min_snr", ALPHA_BAR, prediction, min_snr_gamma=gamma)
        torch.testing.assert_close(weight, closed_form.float())
    # Where SNR <= gamma the epsilon weight is exactly one: min-SNR only damps the easy steps.
    eps_weight = loss_weight("min_snr", ALPHA_BAR, "epsilon", min_snr_gamma=gamma)
    assert torch.all(eps_weight[ratio <= gamma] == 1)
    assert torch.all(eps_weight[ratio > gamma] < 1)


def test_min_snr_epsilon_weight_is_finite_at_zero_snr():
    weight = loss_weight("min_snr", torch.tensor([0.0, 1e-12]), "epsilon")
    assert torch.all(weight == 1)


def test_min_snr_weights_the_same_x0_error_identically_in_every_parameterization():
    # A fixed error in x0 at fixed x_t shows up as SNR times (epsilon) or SNR + 1 times (v) the
    # squared x0 error; min-SNR weights must cancel that, giving min(SNR, gamma) * ||x0 error||^2.
    generator = torch.Generator().manual_seed(0)
    # Below SNR ~ 0.02 the epsilon error is too small to survive the float32 loss; stop at t = 900.
    t = torch.randint(0, 900, (256,), generator=generator)
    ab = ALPHA_BAR[t]
    x0 = torch.randn(256, 3, 4, 4, generator=generator, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=generator, dtype=torch.float64)
    x_t = q_sample(x0, t, noise, ALPHA_BAR)
    x0_hat = x0 + 0.1 * torch.randn(x0.shape, generator=generator, dtype=torch.float64)
    losses = []
    for prediction in PREDICTIONS:
        # The model output that, at this x_t, corresponds to x0_hat.
        _, eps_hat = to_x0_and_eps("x0", x0_hat, x_t, ab)
        model_out = prediction_target(prediction, x0_hat, eps_hat, ab)
        target = prediction_target(prediction, x0, noise, ab)
        losses.append(diffusion_loss(model_out, target, loss_weight("min_snr", ab, prediction)))
    torch.testing.assert_close(losses[0], losses[2], rtol=1e-4, atol=0)
    torch.testing.assert_close(losses[1], losses[2], rtol=1e-4, atol=0)
    x0_error = (x0_hat - x0).square().mean(dim=(1, 2, 3))
    torch.testing.assert_close(losses[2].double(), snr(ab).clamp(max=5.0) * x0_error, rtol=1e-5, atol=0)


def test_loss_is_per_sample_and_zero_at_the_target():
    out = torch.randn(5, 3, 8, 8)
    weight = torch.rand(5)
    loss = diffusion_loss(out, out.clone(), weight)
    assert loss.shape == (5,) and loss.dtype == torch.float32
    assert torch.all(loss == 0)


def test_loss_is_weighted_mean_squared_error():
    out, target = torch.randn(4, 2, 3, 3), torch.randn(4, 2, 3, 3)
    weight = torch.tensor([0.0, 1.0, 2.0, 0.5])
    expected = weight * ((out - target) ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(diffusion_loss(out, target, weight), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loss_is_computed_in_float32_for_low_precision_inputs(dtype):
    generator = torch.Generator().manual_seed(1)
    out = torch.randn(3, 4, 16, 16, generator=generator).to(dtype)
    target = torch.randn(3, 4, 16, 16, generator=generator).to(dtype)
    weight = torch.tensor([1.0, 0.5, 3.0]).to(dtype)
    loss = diffusion_loss(out, target, weight)
    assert loss.dtype == torch.float32
    # A float64 reference: float32 arithmetic agrees to ~1e-6, low-precision arithmetic would not.
    expected = weight.double() * (out.double() - target.double()).square().mean(dim=(1, 2, 3))
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=0)


def test_loss_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="shape"):
        diffusion_loss(torch.zeros(2, 1, 2, 2), torch.zeros(2, 1, 2, 3), torch.ones(2))
    with pytest.raises(ValueError, match="weight"):
        diffusion_loss(torch.zeros(2, 1, 2, 2), torch.zeros(2, 1, 2, 2), torch.ones(3))


def test_unknown_names_list_the_choices():
    with pytest.raises(ValueError) as error:
        loss_weight("snr_squared", ALPHA_BAR, "epsilon")
    assert all(name in str(error.value) for name in LOSS_WEIGHTINGS)
    with pytest.raises(ValueError) as error:
        loss_weight("uniform", ALPHA_BAR, "score")
    assert all(name in str(error.value) for name in PREDICTIONS)
    with pytest.raises(ValueError, match="min_snr_gamma"):
        loss_weight("min_snr", ALPHA_BAR, "epsilon", min_snr_gamma=0.0)
