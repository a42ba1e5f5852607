"""DPM-Solver++ (2M, 3M) and Heun: oracle, agreement with diffusers, convergence on a Gaussian."""

import math

import pytest
import torch

from difftrain.diffusion.process import q_sample
from difftrain.diffusion.samplers import (
    SAMPLER_NFE,
    SAMPLERS,
    ddim_sample,
    dpmpp_2m_sample,
    dpmpp_3m_sample,
    make_x0_denoiser,
    sampling_timesteps,
)
from difftrain.diffusion.schedules import alpha_bar_schedule

NEW = ["dpmpp_2m", "dpmpp_3m", "heun"]
SHAPE = (2, 3, 8, 8)


def toy_model(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A fixed smooth nonlinear "network": (B, C, H, W), (B,) -> (B, C, H, W)."""
    phase = torch.sin(t.to(x.dtype) / 97.0).view(-1, 1, 1, 1)
    return 0.9 * torch.tanh(0.8 * x + 0.5 * phase) + 0.05 * x.flip(-1)


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("steps", [1, 2, 3, 6, 20])
def test_oracle_denoiser_returns_the_data_exactly(name, steps):
    # x0_hat = x0 at every call: the ODE is solved exactly by any of these solvers (all
    # higher-order terms are differences of x0_hat, hence 0), so x_t stays on q(x_t | x0, noise).
    alpha_bar = alpha_bar_schedule("cosine", 1000)
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.rand(SHAPE, generator=g) * 2 - 1, torch.randn(SHAPE, generator=g)
    timesteps = sampling_timesteps(1000, steps)
    calls = []

    def oracle(x_t, t):
        calls.append((x_t.clone(), t.clone()))
        return x0.clone()

    x_T = q_sample(x0, timesteps[:1].expand(SHAPE[0]), noise, alpha_bar)
    out = SAMPLERS[name](oracle, x_T, timesteps, alpha_bar, None)
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-5)
    assert len(calls) == SAMPLER_NFE[name](steps)
    for x_t, t in calls:
        torch.testing.assert_close(x_t, q_sample(x0, t, noise, alpha_bar), rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", NEW)
def test_new_samplers_are_deterministic_and_not_ddim(name):
    alpha_bar = alpha_bar_schedule("linear", 1000)
    denoiser = make_x0_denoiser(toy_model, alpha_bar, "epsilon", clip=False)
    timesteps = sampling_timesteps(1000, 10)
    x_T = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    first = SAMPLERS[name](denoiser, x_T, timesteps, alpha_bar, torch.Generator().manual_seed(1))
    second = SAMPLERS[name](denoiser, x_T, timesteps, alpha_bar, torch.Generator().manual_seed(2))
    assert torch.equal(first, second)
    ddim = ddim_sample(denoiser, x_T, timesteps, alpha_bar, None)
    assert (first - ddim).abs().max() > 1e-3  # the higher-order terms do something


@pytest.mark.parametrize("order, steps", [(2, 10), (2, 25), (3, 10), (3, 25)])
@pytest.mark.parametrize("spacing", ["trailing", "linspace"])
def test_dpmpp_matches_diffusers_multistep_scheduler(order, steps, spacing):
    # Lined-up conventions: trained_betas from our alpha_bar, prediction_type="sample" (the
    # network output is x0_hat), our timesteps passed as custom timesteps, final_sigmas_type="zero"
    # (its last step to sigma = 0 returns x0_hat, as ours does).
    diffusers = pytest.importorskip("diffusers")
    alpha_bar = alpha_bar_schedule("cosine", 1000)
    betas = 1 - alpha_bar / torch.cat([torch.ones(1, dtype=torch.float64), alpha_bar[:-1]])
    scheduler = diffusers.DPMSolverMultistepScheduler(
        num_train_timesteps=1000,
        trained_betas=betas.tolist(),
        solver_order=order,
        prediction_type="sample",
        algorithm_type="dpmsolver++",
        solver_type="midpoint",
        lower_order_final=True,
        final_sigmas_type="zero",
    )
    timesteps = sampling_timesteps(1000, steps, spacing)
    scheduler.set_timesteps(timesteps=timesteps.tolist())
    assert torch.equal(scheduler.timesteps, timesteps)
    denoiser = make_x0_denoiser(toy_model, alpha_bar, "epsilon", clip=False)
    x_T = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    x = x_T.clone()
    for t in scheduler.timesteps:
        x = scheduler.step(denoiser(x, t.expand(SHAPE[0])), t, x).prev_sample
    sampler = dpmpp_2m_sample if order == 2 else dpmpp_3m_sample
    ours = sampler(denoiser, x_T, timesteps, alpha_bar, None)
    torch.testing.assert_close(ours, x, rtol=5e-4, atol=5e-4)  # diffusers forms alpha_bar in float32


# --- Convergence on Gaussian data, where the exact probability-flow solution is known ----------

MU, S = 0.3, 0.5  # data x0 ~ N(MU, S^2) in every coordinate


def _gaussian_denoiser(alpha_bar: torch.Tensor):
    """E[x0 | x_t] for Gaussian data: MU + S^2 sqrt(ab) / v_t (x_t - sqrt(ab) MU), v_t = ab S^2 + 1 - ab."""

    def denoiser(x_t, t):
        ab = alpha_bar[t].view(-1, 1, 1, 1)
        v = ab * S**2 + 1 - ab
        return (MU + S**2 * ab.sqrt() / v * (x_t.double() - ab.sqrt() * MU)).float()

    return denoiser


def _exact(x_T: torch.Tensor, alpha_bar: torch.Tensor, t_first: int, t_last: int) -> torch.Tensor:
    """x0_hat at t_last on the exact probability-flow trajectory from x_T at t_first.

    The marginals are N(m_t, v_t) per coordinate with m_t = sqrt(ab_t) MU; the flow is linear and
    monotone, so it keeps the standard score (x_t - m_t) / sqrt(v_t) fixed.
    """
    ab_T, ab_0 = alpha_bar[t_first].item(), alpha_bar[t_last].item()
    v_T, v_0 = ab_T * S**2 + 1 - ab_T, ab_0 * S**2 + 1 - ab_0
    x_last = math.sqrt(ab_0) * MU + math.sqrt(v_0 / v_T) * (x_T.double() - math.sqrt(ab_T) * MU)
    return _gaussian_denoiser(alpha_bar)(x_last, torch.tensor([t_last] * len(x_T)))


def _errors(name: str, steps_list, spacing="linspace"):
    alpha_bar = alpha_bar_schedule("linear", 1000)
    x_T = torch.randn((4, 1, 8, 8), generator=torch.Generator().manual_seed(0))
    errors = []
    for steps in steps_list:
        timesteps = sampling_timesteps(1000, steps, spacing)
        out = SAMPLERS[name](_gaussian_denoiser(alpha_bar), x_T, timesteps, alpha_bar, None)
        exact = _exact(x_T, alpha_bar, int(timesteps[0]), int(timesteps[-1]))
        errors.append((out.double() - exact).abs().max().item())
    return errors


@pytest.mark.parametrize("name, min_order", [("ddim", 0.9), ("dpmpp_2m", 1.8), ("dpmpp_3m", 2.0), ("heun", 1.8)])
def test_error_shrinks_with_the_solver_order(name, min_order):
    # Doubling the steps divides the error by about 2^order: observed order log2(e_N / e_2N).
    # Few steps are pre-asymptotic on the linear schedule (the error of a multistep method even
    # changes sign there), so the orders are read from 40, 80 and 160 steps.
    errors = _errors(name, [40, 80, 160])
    orders = [math.log2(a / b) for a, b in zip(errors, errors[1:])]
    assert all(o > min_order for o in orders), (errors, orders)


def test_higher_order_samplers_beat_ddim_at_equal_steps():
    ddim, dpm2, dpm3 = (_errors(name, [160])[0] for name in ("ddim", "dpmpp_2m", "dpmpp_3m"))
    assert dpm3 < dpm2 < ddim / 3, (ddim, dpm2, dpm3)
