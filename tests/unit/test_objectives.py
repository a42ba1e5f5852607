"""EDM and flow matching against their papers' equations, every objective's samplers against the
analytic Gaussian oracle, and DDPM's heun on the sigma grid."""

from __future__ import annotations

import math

import pytest
import torch

from difftrain.diffusion import edm as edm_module
from difftrain.diffusion.edm import EDMObjective
from difftrain.diffusion.flow import FlowObjective
from difftrain.diffusion.meanflow import COND_SCALE as MEANFLOW_COND_SCALE
from difftrain.diffusion.meanflow import MeanFlowObjective
from difftrain.diffusion.objective import OBJECTIVE_SAMPLERS, DDPMObjective, per_sample_loss
from difftrain.diffusion.ode_samplers import flow_times, karras_sigmas
from difftrain.diffusion.samplers import SAMPLER_NFE, karras_timesteps, sampling_timesteps
from difftrain.diffusion.schedules import alpha_bar_schedule

# ---------------------------------------------------------------------------------------------
# The Gaussian oracle: data x0 ~ N(mu, S) in 4 dimensions shaped (B, 1, 2, 2). For x = a x0 + b eps
# the optimal denoiser is E[x0 | x] = mu + a S (a^2 S + b^2 I)^-1 (x - a mu), computed in float64
# through S = Q diag(l) Q^T. Narrow enough that clipping to [-1, 1] never matters.

MU = torch.tensor([0.2, -0.15, 0.1, 0.0], dtype=torch.float64)
_L = 0.6 * torch.tensor([[0.30, 0.0, 0.0, 0.0], [0.12, 0.22, 0.0, 0.0], [-0.05, 0.08, 0.25, 0.0], [0.0, 0.1, -0.1, 0.2]],
                        dtype=torch.float64)  # std 0.12 - 0.18: clipping to [-1, 1] never bites
COV = _L @ _L.T
_EIG, _Q = torch.linalg.eigh(COV)
N = 4000


def posterior_mean(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """E[x0 | x] for x: (B, 1, 2, 2), a, b: (B,) or scalars; returns (B, 1, 2, 2) float64."""
    z = x.double().reshape(x.shape[0], 4)
    a = torch.as_tensor(a, dtype=torch.float64).reshape(-1, 1)
    b = torch.as_tensor(b, dtype=torch.float64).reshape(-1, 1)
    r = (z - a * MU) @ _Q  # (B, 4) in the eigenbasis
    gain = a * _EIG / (a**2 * _EIG + b**2)
    return (MU + (gain * r) @ _Q.T).reshape(x.shape)


def posterior_noise(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """E[eps | x] = b (a^2 S + b^2 I)^-1 (x - a mu), finite at b = 0 (float64)."""
    z = x.double().reshape(x.shape[0], 4)
    a = torch.as_tensor(a, dtype=torch.float64).reshape(-1, 1)
    b = torch.as_tensor(b, dtype=torch.float64).reshape(-1, 1)
    r = (z - a * MU) @ _Q
    return ((b / (a**2 * _EIG + b**2) * r) @ _Q.T).reshape(x.shape)


def ddpm_oracle(alpha_bar):
    """The epsilon-prediction network of the optimal denoiser: net(x_t, t long)."""

    def net(x, t):
        ab = alpha_bar[t]
        a, b = ab.sqrt(), (1 - ab).sqrt()
        d = posterior_mean(x, a, b)
        return ((x.double() - a.view(-1, 1, 1, 1) * d) / b.view(-1, 1, 1, 1)).float()

    return net


def edm_oracle(obj: EDMObjective):
    """F of the optimal denoiser, undoing the preconditioning: net(c_in x, cond)."""

    def net(inp, cond):
        sigma = (cond.double() / edm_module.COND_SCALE + edm_module._LOG_SIGMA_LO).exp()
        v = lambda c: c.view(-1, 1, 1, 1)  # noqa: E731
        x = inp.double() / v(obj.c_in(sigma))
        d = posterior_mean(x, torch.ones_like(sigma), sigma)
        return ((d - v(obj.c_skip(sigma)) * x) / v(obj.c_out(sigma))).float()

    return net


def flow_oracle(net_in, cond):
    """The optimal velocity E[eps - x0 | x_t] at t = cond / 1000."""
    t = cond.double() / 1000.0
    return (posterior_noise(net_in, 1 - t, t) - posterior_mean(net_in, 1 - t, t)).float()


def meanflow_oracle(net_in, cond):
    """The exact average velocity u(z, r, t) = (z - z_r) / (t - r) of the straight path's flow (t = cond[:, 0] /
    COND_SCALE, r = t - cond[:, 1] / COND_SCALE: MeanFlow's), the flow velocity at r = t. Every marginal is Gaussian
    with covariance (1 - s)^2 S + s^2 I, diagonal in S's eigenbasis, so the flow map is z_r = m_r + (sd_r / sd_t)
    (z_t - m_t) coordinate by coordinate there."""
    t, r = (cond[:, 0].double() / MEANFLOW_COND_SCALE, (cond[:, 0] - cond[:, 1]).double() / MEANFLOW_COND_SCALE)
    gap = (t - r).view(-1, 1)
    if bool((gap == 0).all()):
        return flow_oracle(net_in, t * 1000.0)  # the flow family's conditioning: 1000 t
    z = net_in.double().reshape(net_in.shape[0], 4)
    sd = lambda s: ((1 - s).view(-1, 1) ** 2 * _EIG + s.view(-1, 1) ** 2).sqrt()  # noqa: E731
    m = lambda s: (1 - s).view(-1, 1) * MU  # noqa: E731
    z_r = m(r) + (((z - m(t)) @ _Q) * sd(r) / sd(t)) @ _Q.T
    return ((z - z_r) / gap).reshape(net_in.shape).float()


def moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = x.double().reshape(x.shape[0], -1)
    return z.mean(0), torch.cov(z.T)


def data_sample(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (MU + torch.randn(n, 4, generator=g, dtype=torch.float64) @ _L.T).reshape(n, 1, 2, 2).float()


def x_T(seed: int = 0) -> torch.Tensor:
    """(N, 1, 2, 2) unit noise whitened to mean exactly 0 and covariance exactly I: the exact ODE
    map of a Gaussian is affine, so a deterministic sampler's moment errors are then its own."""
    z = torch.randn((N, 4), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    z = z - z.mean(0)
    z = z @ torch.linalg.inv(torch.linalg.cholesky(torch.cov(z.T))).T
    return z.reshape(N, 1, 2, 2).float()


# x_T is whitened, so a deterministic sampler's errors are its own: its mean is off by ~3e-4
# (the prior at sigma_max ignores the data mean) and its covariance by its discretization. The
# stochastic "ddpm" sampler adds Monte Carlo error, ~ 0.18 / sqrt(N) = 0.003 on the mean. Covariance
# errors are relative to the largest data variance (0.032).
MEAN_TOL, COV_REL_TOL = 0.01, 0.04


def assert_matches_data(samples: torch.Tensor) -> tuple[float, float]:
    mean, cov = moments(samples)
    mean_err = float((mean - MU).abs().max())
    cov_err = float((cov - COV).abs().max()) / float(COV.diagonal().max())
    assert mean_err < MEAN_TOL and cov_err < COV_REL_TOL, (mean_err, cov_err)
    return mean_err, cov_err


def test_the_oracle_itself_matches_monte_carlo():
    # E[x0 | x] from the formula against a regression on simulated pairs, and E[x0] recovered.
    x0 = data_sample(20000, 1).double()
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x = 0.8 * x0 + 0.6 * noise
    d = posterior_mean(x, 0.8, 0.6)
    assert float((d.mean(0) - x0.mean(0)).abs().max()) < 5e-3
    resid = (x0 - d).reshape(-1, 4)
    # the residual of the optimal estimator is uncorrelated with the observation
    assert float((resid.T @ x.reshape(-1, 4) / x.shape[0]).abs().max()) < 5e-3


# ---------------------------------------------------------------------------------------------
# EDM against Karras et al. 2022.


def test_edm_preconditioning_is_table_1():
    obj = EDMObjective()
    s = torch.tensor([0.002, 0.1, 0.5, 1.0, 7.0, 80.0], dtype=torch.float64)
    sd = 0.5
    torch.testing.assert_close(obj.c_skip(s), sd**2 / (s**2 + sd**2))
    torch.testing.assert_close(obj.c_out(s), s * sd / torch.sqrt(s**2 + sd**2))
    torch.testing.assert_close(obj.c_in(s), 1 / torch.sqrt(s**2 + sd**2))
    torch.testing.assert_close(obj.c_noise(s), torch.log(s) / 4)
    # lambda c_out^2 = 1: the weight of the effective target (eq. 8)
    torch.testing.assert_close(obj.loss_lambda(s) * obj.c_out(s) ** 2, torch.ones_like(s))
    # the conditioning is affine in c_noise and spans [0, 1000] over [0.002, 80]
    cond = obj.cond(s).double()
    assert cond[0] == pytest.approx(0, abs=1e-3) and cond[-1] == pytest.approx(1000, abs=1e-3)
    slope = (cond[1:] - cond[:-1]) / (obj.c_noise(s)[1:] - obj.c_noise(s)[:-1])
    torch.testing.assert_close(slope, torch.full_like(slope, slope[0].item()), rtol=1e-5, atol=0)


def test_edm_loss_is_lambda_times_the_denoiser_error():
    # per_sample_loss = lambda(sigma) mean ||D(x; sigma) - x0||^2 for any network (eq. 2, Table 1).
    obj = EDMObjective()
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.rand(6, 3, 4, 4, generator=g) * 2 - 1, torch.randn(6, 3, 4, 4, generator=g)
    sigma = torch.tensor([0.01, 0.1, 0.5, 1.0, 5.0, 50.0])

    def net(inp, cond, labels=None):
        return torch.tanh(inp) * 0.7 + 0.001 * cond.view(-1, 1, 1, 1)

    loss = per_sample_loss(obj, net, x0, None, sigma, noise)
    b = obj.noised(x0, sigma, noise)
    d = obj.x0_hat(b, net(b.input, b.cond), sigma)
    expected = obj.loss_lambda(sigma.double()) * (d.double() - x0.double()).square().mean((1, 2, 3))
    torch.testing.assert_close(loss.double(), expected, rtol=1e-4, atol=0)
    torch.testing.assert_close(b.weight, torch.ones(6))
    # the target is what F must output for D to return x0 exactly
    torch.testing.assert_close(obj.x0_hat(b, b.target, sigma), x0, rtol=0, atol=1e-5)


def test_edm_levels_are_lognormal_and_buckets_equal_probability():
    obj = EDMObjective()
    s = obj.draw_levels(200_000, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert s.log().mean().item() == pytest.approx(-1.2, abs=0.01)
    assert s.log().std().item() == pytest.approx(1.2, abs=0.01)
    counts = torch.bincount(obj.bucket(s, 10), minlength=10).double() / s.numel()
    torch.testing.assert_close(counts, torch.full((10,), 0.1, dtype=torch.float64), atol=3e-3, rtol=0)
    strat = obj.stratified_levels(40, torch.Generator().manual_seed(1))
    assert torch.bincount(obj.bucket(strat, 10), minlength=10).tolist() == [4] * 10
    assert bool((strat[1:] > strat[:-1]).all())


def test_karras_grid_is_eq_5():
    s = karras_sigmas(18, 0.002, 80.0, 7.0)
    assert s.shape == (19,) and s[0] == pytest.approx(80.0) and s[-2] == pytest.approx(0.002) and s[-1] == 0
    i = 5
    expected = (80 ** (1 / 7) + i / 17 * (0.002 ** (1 / 7) - 80 ** (1 / 7))) ** 7
    assert s[i].item() == pytest.approx(expected, rel=1e-12)
    assert bool((s[1:] < s[:-1]).all())


# ---------------------------------------------------------------------------------------------
# Flow matching against Lipman et al. 2023 / Liu et al. 2023 / Esser et al. 2024.


def test_flow_path_velocity_and_logit_normal_levels():
    obj = FlowObjective()
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.rand(5, 3, 4, 4, generator=g) * 2 - 1, torch.randn(5, 3, 4, 4, generator=g)
    t = torch.tensor([0.01, 0.2, 0.5, 0.8, 0.99])
    b = obj.noised(x0, t, noise)
    tv = t.view(-1, 1, 1, 1)
    torch.testing.assert_close(b.input, (1 - tv) * x0 + tv * noise)
    torch.testing.assert_close(b.target, noise - x0)
    torch.testing.assert_close(b.cond, 1000 * t)
    torch.testing.assert_close(b.weight, torch.ones(5))
    # the velocity is the time derivative of the path, and x0 = x_t - t v
    h = 1e-3
    d = (obj.noised(x0, t + h, noise).input - obj.noised(x0, t - h, noise).input) / (2 * h)
    torch.testing.assert_close(d, b.target, rtol=0, atol=2e-3)
    torch.testing.assert_close(obj.x0_hat(b, b.target, t), x0, rtol=0, atol=1e-5)
    draws = obj.draw_levels(200_000, torch.Generator().manual_seed(1), torch.device("cpu"))
    assert torch.logit(draws.double()).mean().item() == pytest.approx(0.0, abs=0.01)
    assert torch.logit(draws.double()).std().item() == pytest.approx(1.0, abs=0.01)
    counts = torch.bincount(obj.bucket(draws, 10), minlength=10).double() / draws.numel()
    torch.testing.assert_close(counts, torch.full((10,), 0.1, dtype=torch.float64), atol=3e-3, rtol=0)
    strat = obj.stratified_levels(30, torch.Generator().manual_seed(2))
    assert torch.bincount(obj.bucket(strat, 10), minlength=10).tolist() == [3] * 10


def test_flow_x0_loss_is_sigma_squared_times_the_velocity_loss_and_the_x0_error():
    """``diffusion.flow_loss = "x0"`` (diffusers' SD3 script's --precondition_outputs 1: the output made
    x0_hat = x_t - sigma v_hat, the loss ||x0_hat - x0||^2) is sigma^2 times the velocity loss and equals
    the x0 error computed directly; the default "velocity" is the plain velocity error, unchanged."""
    from difftrain.config import load_config
    from difftrain.diffusion.objective import build_objective

    g = torch.Generator().manual_seed(0)
    x0, noise = torch.rand(6, 3, 4, 4, generator=g) * 2 - 1, torch.randn(6, 3, 4, 4, generator=g)
    t = torch.tensor([0.02, 0.2, 0.45, 0.6, 0.85, 0.99])
    head = torch.nn.Conv2d(3, 3, 1)
    torch.nn.init.normal_(head.weight, generator=g)  # some network, far from the target

    def net(x, cond, condition):
        return head(x) * (cond.view(-1, 1, 1, 1) / 1000)

    velocity = build_objective(load_config(None, ["diffusion.objective=flow"]).diffusion)
    x0_cfg = load_config(None, ["diffusion.objective=flow", "diffusion.flow_loss=x0"])
    x0_loss = build_objective(x0_cfg.diffusion)
    assert velocity.loss == "velocity" and x0_loss.loss == "x0"
    with torch.no_grad():
        plain = per_sample_loss(velocity, net, x0, None, t, noise)
        weighted = per_sample_loss(x0_loss, net, x0, None, t, noise)
        b = velocity.noised(x0, t, noise)
        out = net(b.input, b.cond, None)
    tv = t.view(-1, 1, 1, 1)
    torch.testing.assert_close(plain, (out - (noise - x0)).square().mean((1, 2, 3)))  # off: unchanged
    torch.testing.assert_close(weighted, t.square() * plain)
    x0_hat = b.input - tv * out  # the script's model_pred * (-sigmas) + noisy_model_input
    torch.testing.assert_close(weighted, (x0_hat - x0).square().mean((1, 2, 3)), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="loss must be one of"):
        FlowObjective(loss="eps")


def test_flow_grid_uniform_and_shifted():
    torch.testing.assert_close(flow_times(4), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=torch.float64))
    shifted = flow_times(4, shift=3.0)
    assert shifted[0] == 1.0 and shifted[-1] == 0.0
    assert shifted[2].item() == pytest.approx(3 * 0.5 / (1 + 2 * 0.5))
    assert bool((shifted[1:-1] > flow_times(4)[1:-1]).all())  # more time at high noise


# ---------------------------------------------------------------------------------------------
# Every sampler of every objective on the Gaussian oracle.

# Steps where each sampler's bias is a few percent of the data variance on this narrow Gaussian
# (DDPM's trailing grid returns x0_hat at t = T / steps - 1, which shrinks the variance at few steps).
ORACLE_CASES = [
    ("ddpm", "ddpm", 1000), ("ddpm", "ddim", 250), ("ddpm", "dpmpp_2m", 100), ("ddpm", "dpmpp_3m", 100),
    ("ddpm", "heun", 40),
    ("edm", "euler", 200), ("edm", "heun", 40),
    ("flow", "euler", 200), ("flow", "heun", 20), ("flow", "midpoint", 20),
    ("flow_shifted", "heun", 40),
    # MeanFlow's average velocity is the flow map's secant: its sampler is exact at any step count
    ("meanflow", "meanflow", 1), ("meanflow", "meanflow", 2),
]


def _sample(family: str, sampler: str, steps: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        if family == "ddpm":
            obj = DDPMObjective("cosine", 1000, "epsilon", "uniform")
            return obj.sample(ddpm_oracle(obj.alpha_bar), x_T(), sampler, steps, gen)
        if family == "edm":
            obj = EDMObjective()
            return obj.sample(edm_oracle(obj), x_T(), sampler, steps, gen, clip=False)
        if family == "meanflow":
            return MeanFlowObjective().sample(meanflow_oracle, x_T(), sampler, steps, gen, clip=False)
        obj = FlowObjective(shift=3.0 if family == "flow_shifted" else 1.0)
        return obj.sample(flow_oracle, x_T(), sampler, steps, gen, clip=False)


def test_every_sampler_is_in_the_oracle_test():
    covered = {(f.replace("_shifted", ""), s) for f, s, _ in ORACLE_CASES}
    assert covered == {(f, s) for f, names in OBJECTIVE_SAMPLERS.items() for s in names}


@pytest.mark.parametrize("family, sampler, steps", ORACLE_CASES)
def test_oracle_samples_have_the_data_mean_and_covariance(family, sampler, steps):
    assert_matches_data(_sample(family, sampler, steps))


def test_ode_samplers_converge_on_the_oracle():
    # At few steps the error of the exact-noise map shrinks faster for the second-order solvers.
    # Reference: the same x_T through a fine Heun solve.
    ref = {f: _sample(f, "heun", 200) for f in ("edm", "flow")}
    for family, sampler in (("edm", "euler"), ("edm", "heun"), ("flow", "euler"), ("flow", "heun"), ("flow", "midpoint")):
        coarse, fine = (float((_sample(family, sampler, n) - ref[family]).abs().max()) for n in (8, 16))
        order = math.log2(coarse / fine)
        assert order > (0.8 if sampler == "euler" else 1.6), (family, sampler, coarse, fine)


# ---------------------------------------------------------------------------------------------
# DDPM's heun walks EDM's sigma grid.


def test_ddpm_heun_on_the_cosine_schedule_starts_at_sigma_max_not_2e4():
    alpha_bar = alpha_bar_schedule("cosine", 1000)
    sigma = ((1 - alpha_bar) / alpha_bar).sqrt()
    assert sigma[sampling_timesteps(1000, 20)[0]] > 1e4  # what heun walked before
    t = karras_timesteps(alpha_bar, 20)
    assert t.shape == (20,) and bool((t[1:] < t[:-1]).all())
    assert 70 < sigma[t[0]] < 90 and sigma[t[-1]] < 0.02
    # the sampler is called at exactly these timesteps
    obj = DDPMObjective("cosine", 1000, "epsilon", "uniform")
    seen = []
    net = ddpm_oracle(obj.alpha_bar)

    def spy(x, tt):
        seen.append(int(tt[0]))
        return net(x, tt)

    with torch.no_grad():
        obj.sample(spy, x_T()[:8], "heun", 20, None)
    assert seen[0] == int(t[0]) and set(seen) == set(t.tolist()) and len(seen) == SAMPLER_NFE["heun"](20)


@pytest.mark.parametrize("schedule, T, steps", [("linear", 1000, 50), ("cosine", 100, 100), ("scaled_linear", 50, 7)])
def test_karras_timesteps_are_distinct_and_in_range(schedule, T, steps):
    t = karras_timesteps(alpha_bar_schedule(schedule, T), steps)
    assert t.shape == (steps,) and bool((t[1:] < t[:-1]).all()) and 0 <= int(t[-1]) and int(t[0]) < T


@pytest.mark.parametrize("family", ["edm", "flow"])
def test_network_evaluations_match_sampler_nfe_and_edm_starts_at_sigma_max(family):
    obj = EDMObjective() if family == "edm" else FlowObjective()
    for sampler in obj.samplers:
        conds = []

        def net(x, cond):
            conds.append(float(cond[0]))
            return torch.zeros_like(x)

        with torch.no_grad():
            obj.sample(net, x_T()[:4], sampler, 5, None)
        assert len(conds) == obj.sampler_nfe[sampler](5), sampler
        assert conds[0] == pytest.approx(1000.0, abs=1e-3)  # sigma_max = 80 / t = 1
    if family == "edm":  # x_T is scaled by sigma_max: c_in x at sigma_max has unit-ish scale
        seen = []
        obj.sample(lambda x, c: seen.append(x.std().item()) or torch.zeros_like(x), x_T(), "euler", 2, None)
        assert seen[0] == pytest.approx(80 / math.sqrt(80**2 + 0.25), rel=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("prediction", ["epsilon", "v", "x0"])
@pytest.mark.parametrize("weighting", ["uniform", "inv_one_minus_alpha_bar", "min_snr"])
def test_ddpm_noised_from_its_table_is_the_per_batch_formula_bit_for_bit(dtype, prediction, weighting):
    """The per-timestep table gathered each step gives exactly what forming the coefficients
    and the weight from the float64 alpha_bar per batch gives (the pinned weights rely on it)."""
    from difftrain.diffusion.losses import loss_weight
    from difftrain.diffusion.process import prediction_target, q_sample

    obj = DDPMObjective("cosine", 1000, prediction, weighting, min_snr_gamma=5.0)
    g = torch.Generator().manual_seed(0)
    levels = torch.cat([torch.tensor([0, 1, 999]), torch.randint(0, 1000, (61,), generator=g)])
    x0 = torch.randn(64, 3, 4, 4, generator=g, dtype=dtype)
    noise = torch.randn(64, 3, 4, 4, generator=g, dtype=dtype)
    b = obj.noised(x0, levels, noise)
    ab_t = obj.alpha_bar[levels]
    assert torch.equal(b.input, q_sample(x0, levels, noise, obj.alpha_bar)) and b.input.dtype == dtype
    assert torch.equal(b.target, prediction_target(prediction, x0, noise, ab_t))
    weight = loss_weight(weighting, ab_t, prediction, 5.0)
    assert torch.equal(b.weight, weight) and b.weight.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Zero terminal SNR (Lin et al. 2024): alpha_bar[T-1] = 0, where sampling starts.


def ddpm_v_oracle(alpha_bar):
    """The v-prediction network of the optimal denoiser, v = a E[eps | x] - b E[x0 | x]: finite at
    a = 0 (there E[x0 | x] = mu and v = -mu)."""

    def net(x, t):
        ab = alpha_bar[t]
        a, b = ab.sqrt(), (1 - ab).sqrt()
        v = lambda c: c.view(-1, 1, 1, 1)  # noqa: E731
        return (v(a) * posterior_noise(x, a, b) - v(b) * posterior_mean(x, a, b)).float()

    return net


# heun at every timestep: its grid (EDM's, capped at sigma_max) reaches T - 1 only when it must.
ZERO_SNR_CASES = [(s, n) for f, s, n in ORACLE_CASES if f == "ddpm" and s != "heun"] + [("heun", 1000)]


@pytest.mark.parametrize("sampler, steps", ZERO_SNR_CASES)
def test_every_ddpm_sampler_starts_at_snr_zero_and_samples_the_data(sampler, steps):
    # cosine as in ORACLE_CASES: at t = 0 scaled_linear's noise (sigma 0.03) shrinks this narrow Gaussian
    obj = DDPMObjective("cosine", 1000, "v", "uniform", zero_terminal_snr=True)
    assert obj.alpha_bar[-1].item() == 0.0
    net, seen = ddpm_v_oracle(obj.alpha_bar), []

    def spy(x, t):
        seen.append(int(t[0]))
        return net(x, t)

    with torch.no_grad():
        samples = obj.sample(spy, x_T(), sampler, steps, torch.Generator().manual_seed(3))
    assert seen[0] == 999  # trailing grid (and heun's at steps = T): x_T is pure noise, as trained
    assert bool(samples.isfinite().all())
    assert_matches_data(samples)


def test_zero_terminal_snr_refuses_epsilon_prediction():
    with pytest.raises(ValueError, match="v or x0"):
        DDPMObjective("scaled_linear", 1000, "epsilon", "uniform", zero_terminal_snr=True)
    for prediction in ("v", "x0"):  # and the loss weights stay finite at SNR 0
        for weighting in ("uniform", "inv_one_minus_alpha_bar", "min_snr"):
            obj = DDPMObjective("scaled_linear", 100, prediction, weighting, zero_terminal_snr=True)
            b = obj.noised(torch.ones(2, 1, 2, 2), torch.tensor([99, 0]), torch.zeros(2, 1, 2, 2))
            assert bool(b.weight.isfinite().all()) and bool(b.target.isfinite().all())
            assert torch.equal(b.input[0], torch.zeros(1, 2, 2))  # at T - 1 the input is the noise alone
