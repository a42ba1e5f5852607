"""Invariants of the forward process and of the epsilon / v / x0 parameterizations."""

import pytest
import torch

from difftrain.diffusion.process import PREDICTIONS, gather, prediction_target, q_sample, to_x0_and_eps
from difftrain.diffusion.schedules import SCHEDULES, alpha_bar_schedule

NUM_TIMESTEPS = 1000


def _all_timesteps(num_timesteps: int = NUM_TIMESTEPS) -> torch.Tensor:
    return torch.arange(num_timesteps)


def test_gather_broadcasts_per_sample_values():
    values = torch.arange(10, dtype=torch.float64)
    t = torch.tensor([3, 0, 9])
    out = gather(values, t, 4)
    assert out.shape == (3, 1, 1, 1) and out.dtype == torch.float64
    assert out.flatten().tolist() == [3.0, 0.0, 9.0]


def test_q_sample_of_zero_image_is_scaled_noise_with_variance_one_minus_alpha_bar():
    alpha_bar = alpha_bar_schedule("linear", NUM_TIMESTEPS)
    generator = torch.Generator().manual_seed(0)
    t = torch.tensor([0, 10, 250, 500, 999])
    noise = torch.randn(len(t), 4, 64, 64, generator=generator)
    x_t = q_sample(torch.zeros_like(noise), t, noise, alpha_bar)
    expected_std = (1 - alpha_bar[t]).sqrt().float()
    torch.testing.assert_close(x_t, expected_std.view(-1, 1, 1, 1) * noise)
    # Empirical statistics over 16k values per sample.
    variance = x_t.flatten(1).var(dim=1)
    torch.testing.assert_close(variance, expected_std**2, rtol=0.05, atol=1e-6)
    assert x_t.flatten(1).mean(dim=1).abs().max() < 0.05


def test_q_sample_mean_and_variance_for_a_fixed_image():
    alpha_bar = alpha_bar_schedule("cosine", NUM_TIMESTEPS)
    generator = torch.Generator().manual_seed(1)
    x0 = torch.full((1, 1, 1, 1), 0.7).expand(20000, 1, 1, 1)
    t = torch.full((20000,), 400)
    x_t = q_sample(x0, t, torch.randn(x0.shape, generator=generator), alpha_bar)
    ab = alpha_bar[400].item()
    assert abs(x_t.mean().item() - 0.7 * ab**0.5) < 0.03
    assert abs(x_t.var().item() - (1 - ab)) < 0.03


def test_q_sample_without_noise_scales_the_signal_and_keeps_dtype():
    alpha_bar = alpha_bar_schedule("linear", NUM_TIMESTEPS)
    x0 = torch.randn(3, 3, 4, 4, dtype=torch.bfloat16)
    t = torch.tensor([1, 2, 3])
    x_t = q_sample(x0, t, torch.zeros_like(x0), alpha_bar)
    assert x_t.dtype == torch.bfloat16
    torch.testing.assert_close(x_t, (alpha_bar[t].sqrt().view(-1, 1, 1, 1) * x0.double()).bfloat16())


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("prediction", PREDICTIONS)
def test_target_then_inverse_recovers_x0_and_eps_in_float64(schedule, prediction):
    alpha_bar = alpha_bar_schedule(schedule, NUM_TIMESTEPS)
    generator = torch.Generator().manual_seed(2)
    t = _all_timesteps()
    x0 = torch.rand(len(t), 3, 4, 4, generator=generator, dtype=torch.float64) * 2 - 1
    noise = torch.randn(x0.shape, generator=generator, dtype=torch.float64)
    x_t = q_sample(x0, t, noise, alpha_bar)
    target = prediction_target(prediction, x0, noise, alpha_bar[t])
    x0_hat, eps_hat = to_x0_and_eps(prediction, target, x_t, alpha_bar[t])
    assert x0_hat.dtype == eps_hat.dtype == torch.float64
    # Condition numbers: x0 from eps grows as 1/sqrt(ab), eps from x0 as 1/sqrt(1 - ab).
    torch.testing.assert_close(x0_hat, x0, rtol=0, atol=1e-9)
    torch.testing.assert_close(eps_hat, noise, rtol=0, atol=1e-9)


@pytest.mark.parametrize("prediction", PREDICTIONS)
def test_float32_round_trip_is_accurate_up_to_the_parameterization_conditioning(prediction):
    alpha_bar = alpha_bar_schedule("cosine", NUM_TIMESTEPS)
    generator = torch.Generator().manual_seed(3)
    t = _all_timesteps()
    x0 = torch.rand(len(t), 3, 8, 8, generator=generator) * 2 - 1
    noise = torch.randn(x0.shape, generator=generator)
    ab = alpha_bar[t]
    x_t = q_sample(x0, t, noise, alpha_bar)
    target = prediction_target(prediction, x0, noise, ab)
    x0_hat, eps_hat = to_x0_and_eps(prediction, target, x_t, ab)
    assert x0_hat.dtype == eps_hat.dtype == torch.float32
    # The predicted quantity passes through unchanged.
    if prediction == "epsilon":
        assert torch.equal(eps_hat, noise)
    if prediction == "x0":
        assert torch.equal(x0_hat, x0)
    # The derived quantity is off by at most a few float32 ulps times its condition number.
    if prediction == "epsilon":
        bound = (1e-6 / ab.sqrt()).float().view(-1, 1, 1, 1) * 8
    elif prediction == "x0":
        bound = (1e-6 / (1 - ab).sqrt()).float().view(-1, 1, 1, 1) * 8
    else:
        bound = torch.full((len(t), 1, 1, 1), 1e-5)
    assert torch.all((x0_hat - x0).abs() <= bound)
    assert torch.all((eps_hat - noise).abs() <= bound)


def test_v_target_is_a_rotation_of_x0_and_eps():
    # (x_t, v) is (x0, eps) rotated by the angle phi with cos(phi) = sqrt(ab): norms are kept.
    alpha_bar = alpha_bar_schedule("linear", NUM_TIMESTEPS)
    generator = torch.Generator().manual_seed(4)
    t = torch.randint(0, NUM_TIMESTEPS, (64,), generator=generator)
    x0 = torch.randn(64, 2, 1, 1, generator=generator, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=generator, dtype=torch.float64)
    x_t = q_sample(x0, t, noise, alpha_bar)
    v = prediction_target("v", x0, noise, alpha_bar[t])
    torch.testing.assert_close(x_t**2 + v**2, x0**2 + noise**2)


def test_epsilon_and_x0_targets_are_the_inputs():
    x0, noise = torch.randn(2, 1, 2, 2), torch.randn(2, 1, 2, 2)
    ab = torch.tensor([0.3, 0.6], dtype=torch.float64)
    assert torch.equal(prediction_target("epsilon", x0, noise, ab), noise)
    assert torch.equal(prediction_target("x0", x0, noise, ab), x0)


def test_unknown_prediction_names_the_choices():
    x = torch.zeros(1, 1, 1, 1)
    ab = torch.tensor([0.5])
    for call in (
        lambda: prediction_target("score", x, x, ab),
        lambda: to_x0_and_eps("score", x, x, ab),
    ):
        with pytest.raises(ValueError) as error:
            call()
        assert "score" in str(error.value)
        assert all(name in str(error.value) for name in PREDICTIONS)
