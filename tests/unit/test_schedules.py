"""Invariants of the noise schedules: shape, range, monotonicity, and consistency with betas."""

import math

import pytest
import torch

from difftrain.diffusion.schedules import (
    MAX_BETA,
    SCHEDULES,
    alpha_bar_schedule,
    betas_from_alpha_bar,
    cosine_schedule,
    linear_schedule,
    rescale_zero_terminal_snr,
    scaled_linear_schedule,
    snr,
)

NUM_TIMESTEPS = [1, 2, 7, 10, 50, 100, 1000, 4000]


def test_registry_has_the_required_schedules():
    assert {"linear", "cosine", "scaled_linear"} <= set(SCHEDULES)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("num_timesteps", NUM_TIMESTEPS)
def test_alpha_bar_is_strictly_decreasing_inside_unit_interval(name, num_timesteps):
    alpha_bar = alpha_bar_schedule(name, num_timesteps)
    assert alpha_bar.shape == (num_timesteps,)
    assert alpha_bar.dtype == torch.float64
    assert torch.all(alpha_bar > 0) and torch.all(alpha_bar < 1)
    assert torch.all(alpha_bar[1:] < alpha_bar[:-1])


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_betas_round_trip_and_stay_in_range(name):
    alpha_bar = alpha_bar_schedule(name, 1000)
    betas = betas_from_alpha_bar(alpha_bar)
    assert torch.all(betas > 0) and torch.all(betas <= MAX_BETA + 1e-12)
    torch.testing.assert_close(torch.cumprod(1 - betas, 0), alpha_bar, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_destroys_the_signal_at_t_minus_one(name):
    # At T = 1000 every schedule starts nearly noise-free and ends with low SNR.
    alpha_bar = alpha_bar_schedule(name, 1000)
    assert alpha_bar[0] > 0.99
    assert alpha_bar[-1] < 5e-3


def test_linear_matches_ddpm_betas_at_1000_steps():
    betas = betas_from_alpha_bar(linear_schedule(1000))
    torch.testing.assert_close(betas[0], torch.tensor(1e-4, dtype=torch.float64))
    torch.testing.assert_close(betas[-1], torch.tensor(0.02, dtype=torch.float64))
    steps = betas[1:] - betas[:-1]
    torch.testing.assert_close(steps, torch.full_like(steps, (0.02 - 1e-4) / 999), rtol=1e-9, atol=0)


def test_linear_rescaling_keeps_total_noise_roughly_constant():
    # sum of betas is invariant under the 1000 / T scaling, so alpha_bar at the end stays close.
    end_1000 = linear_schedule(1000)[-1].log()
    end_250 = linear_schedule(250)[-1].log()
    assert abs(end_1000 - end_250) / abs(end_1000) < 0.05


def test_scaled_linear_has_linear_square_root_betas():
    sqrt_betas = betas_from_alpha_bar(scaled_linear_schedule(1000)).sqrt()
    torch.testing.assert_close(sqrt_betas[0], torch.tensor(math.sqrt(0.00085), dtype=torch.float64))
    torch.testing.assert_close(sqrt_betas[-1], torch.tensor(math.sqrt(0.012), dtype=torch.float64))
    steps = sqrt_betas[1:] - sqrt_betas[:-1]
    torch.testing.assert_close(steps, torch.full_like(steps, steps.mean().item()), rtol=1e-6, atol=0)


def test_cosine_follows_closed_form_until_clipping():
    num_timesteps, s = 1000, 0.008
    alpha_bar = cosine_schedule(num_timesteps)
    tau = torch.arange(1, num_timesteps + 1, dtype=torch.float64) / num_timesteps
    f = torch.cos((tau + s) / (1 + s) * math.pi / 2) ** 2
    closed_form = f / math.cos(s / (1 + s) * math.pi / 2) ** 2
    # Only the last beta hits the 0.999 clip (f(1) = 0).
    torch.testing.assert_close(alpha_bar[:-1], closed_form[:-1], rtol=1e-10, atol=0)


def test_unknown_schedule_names_the_choices():
    with pytest.raises(ValueError) as error:
        alpha_bar_schedule("quadratic", 1000)
    message = str(error.value)
    assert "quadratic" in message
    for name in SCHEDULES:
        assert name in message


@pytest.mark.parametrize("num_timesteps", [0, -3, 2.5])
def test_invalid_num_timesteps_is_rejected(num_timesteps):
    with pytest.raises(ValueError, match="num_timesteps"):
        alpha_bar_schedule("linear", num_timesteps)


def test_snr_closed_form_and_monotone():
    alpha_bar = alpha_bar_schedule("cosine", 1000)
    ratio = snr(alpha_bar)
    torch.testing.assert_close(ratio * (1 - alpha_bar), alpha_bar)
    assert torch.all(ratio[1:] < ratio[:-1])
    assert snr(torch.tensor(0.5)).item() == 1.0


@pytest.mark.parametrize(
    "name, diffusers_name, beta_start, beta_end",
    [
        ("linear", "linear", 1e-4, 0.02),
        ("scaled_linear", "scaled_linear", 0.00085, 0.012),
        ("cosine", "squaredcos_cap_v2", None, None),
    ],
)
def test_schedules_match_diffusers_at_1000_steps(name, diffusers_name, beta_start, beta_end):
    # diffusers builds alpha_bar in float32; agreement is to float32 accumulation error.
    diffusers = pytest.importorskip("diffusers")
    limits = {} if beta_start is None else {"beta_start": beta_start, "beta_end": beta_end}
    scheduler = diffusers.DDPMScheduler(num_train_timesteps=1000, beta_schedule=diffusers_name, **limits)
    theirs = scheduler.alphas_cumprod.double()
    torch.testing.assert_close(theirs, alpha_bar_schedule(name, 1000), rtol=5e-5, atol=0)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("num_timesteps", [2, 10, 1000])
def test_zero_terminal_snr_is_an_affine_map_of_sqrt_alpha_bar_ending_at_zero(name, num_timesteps):
    # Lin et al. 2024, alg. 1: sqrt(alpha_bar) shifted to end at exactly 0, scaled to keep its start.
    alpha_bar = alpha_bar_schedule(name, num_timesteps)
    rescaled = rescale_zero_terminal_snr(alpha_bar)
    assert rescaled.shape == alpha_bar.shape and rescaled.dtype == torch.float64
    assert rescaled[-1].item() == 0.0 and snr(rescaled)[-1].item() == 0.0
    torch.testing.assert_close(rescaled[0], alpha_bar[0], rtol=1e-14, atol=0)
    assert torch.all(rescaled[1:] < rescaled[:-1]) and torch.all(rescaled[:-1] > 0)
    old, new = alpha_bar.sqrt(), rescaled.sqrt()
    slope = (new[0] - new[-1]) / (old[0] - old[-1])
    torch.testing.assert_close(new, slope * (old - old[-1]), rtol=0, atol=1e-14)
    betas = betas_from_alpha_bar(rescaled)
    assert betas[-1].item() == 1.0 and torch.all(betas[:-1] < 1)


def test_zero_terminal_snr_matches_diffusers_rescale_betas_zero_snr():
    # diffusers rescales its float32 betas the same way (what an exported scheduler config asks for).
    diffusers = pytest.importorskip("diffusers")
    scheduler = diffusers.DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085,
                                        beta_end=0.012, rescale_betas_zero_snr=True)
    ours = rescale_zero_terminal_snr(alpha_bar_schedule("scaled_linear", 1000))
    assert scheduler.alphas_cumprod[-1].item() == 0.0
    torch.testing.assert_close(scheduler.alphas_cumprod.double(), ours, rtol=1e-4, atol=1e-7)


def test_zero_terminal_snr_refuses_a_single_timestep():
    with pytest.raises(ValueError, match="T >= 2"):
        rescale_zero_terminal_snr(alpha_bar_schedule("cosine", 1))
