"""Samplers: plain functions sharing one signature, and the timestep grids they walk.

Every sampler is

    sampler(denoiser, x_T, timesteps, alpha_bar, generator=None, **options) -> x_0

with denoiser(x_t: (B, C, H, W), t: (B,) long) -> x0_hat: (B, C, H, W), the predicted clean
image; x_T: (B, C, H, W) noise at timesteps[0]; timesteps: (N,) long, strictly descending in
[0, T); alpha_bar: (T,) float64 in [0, 1) (0 at T - 1 under zero terminal SNR, which every
sampler handles). The state is kept in float32 whatever precision the denoiser runs in,
coefficients are formed in float64 and the last step returns the denoiser's x0_hat
(no noise is added after timesteps[-1], i.e. alpha_bar before the first step is taken as 1).
Noise comes from torch.randn(..., generator=generator, device=x.device) (so the generator must
live on x_T's device) and a seeded generator reproduces a sample exactly. ``generator`` may also
be a sequence of B generators, one per row: row i's noise then comes from generator[i] alone, so
a sample does not depend on which other samples share its batch. Call samplers under
torch.no_grad() unless gradients are wanted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Callable

import torch
from torch import Tensor

from difftrain.diffusion.process import check_prediction, to_x0_and_eps

# denoiser(x_t (B, C, H, W), t (B,) long) -> x0_hat (B, C, H, W).
Denoiser = Callable[[Tensor, Tensor], Tensor]
# One generator for the batch, one per row of the batch, or None (the global generator).
Generators = torch.Generator | Sequence[torch.Generator] | None

# How sampling_timesteps spreads `steps` timesteps over [0, T) (Lin et al. 2024, sec. 3.3).
SPACINGS = ("trailing", "leading", "linspace")


def sampling_timesteps(num_timesteps: int, steps: int, spacing: str = "trailing") -> Tensor:
    """The timesteps a sampler visits, (steps,) long, strictly descending in [0, T).

    "trailing": round(T - i T / steps) - 1 for i = 0 .. steps-1; starts at T - 1 and ends at
        round(T / steps) - 1 (Lin et al. 2024, "Common diffusion noise schedules and sample
        steps are flawed", sec. 3.3).
    "leading": i * (T // steps), i = steps-1 .. 0, as in DDIM; ends at 0, starts at or below T - 1.
    "linspace": round(linspace(T - 1, 0, steps)); both ends included (steps = 1 gives [T - 1]).

    Rounding is half to even (matching numpy, hence diffusers' grids). steps = T gives every
    timestep for all three spacings. The last timestep is the one whose x0 prediction is returned.
    """
    if isinstance(num_timesteps, bool) or not isinstance(num_timesteps, int) or num_timesteps < 1:
        raise ValueError(f"num_timesteps must be an integer >= 1, got {num_timesteps!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= num_timesteps:
        raise ValueError(f"sampling steps must be an integer in [1, {num_timesteps}], got {steps!r}")
    if spacing not in SPACINGS:
        raise ValueError(f"unknown timestep spacing {spacing!r}; choose one of {list(SPACINGS)}")
    i = torch.arange(steps, dtype=torch.float64)
    if spacing == "trailing":
        timesteps = torch.round((steps - i) * num_timesteps / steps) - 1
    elif spacing == "leading":
        timesteps = (steps - 1 - i) * (num_timesteps // steps)
    elif steps == 1:
        timesteps = torch.full((1,), num_timesteps - 1, dtype=torch.float64)
    else:
        timesteps = torch.round((steps - 1 - i) * (num_timesteps - 1) / (steps - 1))
    return timesteps.to(torch.long)


def karras_timesteps(alpha_bar: Tensor, steps: int, sigma_min: float = 0.002, sigma_max: float = 80.0,
                     rho: float = 7.0) -> Tensor:
    """The timesteps nearest EDM's sigma grid (Karras et al. 2022, eq. 5), (steps,) long, strictly
    descending in [0, T): the grid runs from min(sigma_max, sigma_{T-1}) down to max(sigma_min,
    sigma_0), with sigma_t = sqrt((1 - alpha_bar_t) / alpha_bar_t), and each sigma goes to the
    timestep nearest it in log sigma. Where two land on one timestep the larger moves up, so
    there are always ``steps`` of them (steps <= T).

    The trailing grid starts at T - 1, which on the cosine schedule is sigma ~ 2e4: an ODE
    solver there spends its first steps far outside the range EDM found useful (sigma_max = 80).
    alpha_bar: (T,).
    """
    T = alpha_bar.shape[0]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= T:
        raise ValueError(f"sampling steps must be an integer in [1, {T}], got {steps!r}")
    ab = alpha_bar.detach().to("cpu", torch.float64)
    log_sigma = 0.5 * (torch.log1p(-ab) - torch.log(ab))  # (T,) ascending in t
    hi = min(math.log(sigma_max), float(log_sigma[-1]))
    lo = min(max(math.log(sigma_min), float(log_sigma[0])), hi)
    i = torch.arange(steps, dtype=torch.float64) / max(steps - 1, 1)
    sigmas = (math.exp(hi / rho) + i * (math.exp(lo / rho) - math.exp(hi / rho))) ** rho  # (steps,) descending
    t = (sigmas.log()[:, None] - log_sigma[None, :]).abs().argmin(dim=1).tolist()
    for k in range(steps - 2, -1, -1):  # strictly descending: a tie moves up one timestep
        t[k] = max(t[k], t[k + 1] + 1)
    return torch.tensor([min(v, T - 1 - k) for k, v in enumerate(t)], dtype=torch.long)


def make_x0_denoiser(
    model_fn: Callable[[Tensor, Tensor], Tensor], alpha_bar: Tensor, prediction: str, clip: bool = True
) -> Denoiser:
    """Wrap a raw network model_fn(x_t, t) -> epsilon / v / x0 into a denoiser returning x0_hat.

    x0_hat comes from ``to_x0_and_eps`` (float32); with ``clip`` it is clamped to the data range
    [-1, 1] (DDPM sec. 3.3 scales images to [-1, 1]). alpha_bar: (T,) float64.
    """
    check_prediction(prediction)
    alpha_bar = alpha_bar.detach().to("cpu", torch.float64)

    def denoiser(x_t: Tensor, t: Tensor) -> Tensor:
        x0_hat, _ = to_x0_and_eps(prediction, model_fn(x_t, t), x_t, alpha_bar[t.cpu()])
        return x0_hat.clamp(-1.0, 1.0) if clip else x0_hat

    return denoiser


def _prepare(x_T: Tensor, timesteps: Tensor, alpha_bar: Tensor) -> tuple[Tensor, list[int], list[float]]:
    """Validate the shared arguments; return float32 x, timesteps as ints, alpha_bar at them as floats."""
    if x_T.ndim < 2:
        raise ValueError(f"x_T must have shape (B, C, H, W), got {tuple(x_T.shape)}")
    if alpha_bar.ndim != 1:
        raise ValueError(f"alpha_bar must have shape (T,), got {tuple(alpha_bar.shape)}")
    steps = [int(t) for t in timesteps.reshape(-1).tolist()] if timesteps.ndim == 1 else None
    if not steps:
        raise ValueError(f"timesteps must have shape (N,) with N >= 1, got {tuple(timesteps.shape)}")
    if any(a <= b for a, b in zip(steps, steps[1:])):
        raise ValueError(f"timesteps must be strictly descending, got {steps}")
    if steps[-1] < 0 or steps[0] >= alpha_bar.shape[0]:
        raise ValueError(f"timesteps must lie in [0, {alpha_bar.shape[0]}), got {steps[0]} .. {steps[-1]}")
    alpha_bars = alpha_bar.detach().to("cpu", torch.float64)[steps].tolist()
    return x_T.to(torch.float32), steps, alpha_bars


def _predict_x0(denoiser: Denoiser, x: Tensor, t: int) -> Tensor:
    """x0_hat in float32 from the denoiser at integer timestep t for the whole batch."""
    t_batch = torch.full((x.shape[0],), t, dtype=torch.long, device=x.device)
    x0_hat = denoiser(x, t_batch)
    if x0_hat.shape != x.shape:
        raise ValueError(f"denoiser returned shape {tuple(x0_hat.shape)} for input {tuple(x.shape)}")
    return x0_hat.to(torch.float32)


def _noise_like(x: Tensor, generator: Generators) -> Tensor:
    """Standard normal noise shaped like x (B, ...) float32, drawn from ``generator``, or row i
    from ``generator[i]`` when it is a sequence of B generators."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    if len(generator) != x.shape[0]:
        raise ValueError(f"got {len(generator)} generators for a batch of {x.shape[0]}")
    return torch.stack(
        [torch.randn(x.shape[1:], generator=g, device=x.device, dtype=torch.float32) for g in generator]
    )


def ddpm_sample(
    denoiser: Denoiser,
    x_T: Tensor,
    timesteps: Tensor,
    alpha_bar: Tensor,
    generator: Generators = None,
) -> Tensor:
    """Ancestral sampling (DDPM, Ho et al. 2020, alg. 2) with the posterior variance beta-tilde.

    Each step from t to the next kept timestep s < t samples q(x_s | x_t, x0_hat) (DDPM eqs. 6-7):
        beta = 1 - alpha_bar_t / alpha_bar_s          (respacing, improved DDPM sec. 4)
        mean = sqrt(alpha_bar_s) beta / (1 - alpha_bar_t) x0_hat
               + sqrt(1 - beta) (1 - alpha_bar_s) / (1 - alpha_bar_t) x_t
        var  = beta (1 - alpha_bar_s) / (1 - alpha_bar_t)
    so any descending subsequence of [0, T) works. After the last timestep alpha_bar_s = 1, the
    mean is x0_hat and the variance 0: the last step returns x0_hat.

    Shapes as in the module docstring; returns x_0, (B, C, H, W) float32.
    """
    x, steps, alpha_bars = _prepare(x_T, timesteps, alpha_bar)
    for i, t in enumerate(steps):
        x0_hat = _predict_x0(denoiser, x, t)
        if i == len(steps) - 1:
            return x0_hat
        ab_t, ab_s = alpha_bars[i], alpha_bars[i + 1]
        beta = 1.0 - ab_t / ab_s
        coef_x0 = math.sqrt(ab_s) * beta / (1.0 - ab_t)
        coef_xt = math.sqrt(1.0 - beta) * (1.0 - ab_s) / (1.0 - ab_t)
        std = math.sqrt(beta * (1.0 - ab_s) / (1.0 - ab_t))
        x = coef_x0 * x0_hat + coef_xt * x + std * _noise_like(x, generator)
    raise AssertionError("unreachable: timesteps is non-empty")


def ddim_sample(
    denoiser: Denoiser,
    x_T: Tensor,
    timesteps: Tensor,
    alpha_bar: Tensor,
    generator: Generators = None,
    *,
    eta: float = 0.0,
) -> Tensor:
    """DDIM (Song et al. 2021, eq. 12): from t to the next kept timestep s < t,

        eps_hat = (x_t - sqrt(alpha_bar_t) x0_hat) / sqrt(1 - alpha_bar_t)
        sigma   = eta sqrt((1 - alpha_bar_s) / (1 - alpha_bar_t) (1 - alpha_bar_t / alpha_bar_s))  (eq. 16)
        x_s     = sqrt(alpha_bar_s) x0_hat + sqrt(1 - alpha_bar_s - sigma^2) eps_hat + sigma z

    eta = 0 is deterministic (no noise is drawn); eta = 1 is DDPM ancestral sampling. The last
    step returns x0_hat (alpha_bar_s = 1). Shapes as in the module docstring; returns x_0,
    (B, C, H, W) float32.

    eps_hat comes from the denoiser's x0_hat, clamped when the denoiser clamps (diffusers' DDIM with
    ``use_clipped_model_output=True``). Keeping the network's own noise instead (diffusers' default)
    was measured and not taken (docs/quality.md): it removed an epsilon model's "confetti" at 25-50
    steps but cost FID (88.2 -> 97.8) and guided prompt following (shape 65% -> 45%).
    """
    if not 0.0 <= eta <= 1.0:
        raise ValueError(f"ddim eta must be in [0, 1], got {eta}")
    x, steps, alpha_bars = _prepare(x_T, timesteps, alpha_bar)
    for i, t in enumerate(steps):
        x0_hat = _predict_x0(denoiser, x, t)
        if i == len(steps) - 1:
            return x0_hat
        ab_t, ab_s = alpha_bars[i], alpha_bars[i + 1]
        eps_hat = (x - math.sqrt(ab_t) * x0_hat) / math.sqrt(1.0 - ab_t)
        sigma = eta * math.sqrt((1.0 - ab_s) / (1.0 - ab_t) * (1.0 - ab_t / ab_s))
        # max(., 0) guards float64 rounding at eta = 1, where this is analytically >= 0.
        x = math.sqrt(ab_s) * x0_hat + math.sqrt(max(1.0 - ab_s - sigma**2, 0.0)) * eps_hat
        if eta > 0:
            x = x + sigma * _noise_like(x, generator)
    raise AssertionError("unreachable: timesteps is non-empty")


def _log_snr_half(ab: float) -> float:
    """lambda = log(alpha / sigma) = 0.5 log(alpha_bar / (1 - alpha_bar)) (DPM-Solver's lambda_t);
    -inf at alpha_bar = 0 (zero terminal SNR)."""
    return 0.5 * (math.log(ab) - math.log1p(-ab)) if ab > 0.0 else -math.inf


def _dpmpp_multistep(
    denoiser: Denoiser, x_T: Tensor, timesteps: Tensor, alpha_bar: Tensor, order: int, lower_order_final: bool
) -> Tensor:
    """DPM-Solver++ multistep of ``order`` 1, 2 or 3 in data prediction (Lu et al. 2022, "DPM-Solver++",
    alg. 2 and its third-order extension; the update formulas of the reference code).

    With alpha_t = sqrt(alpha_bar_t), sigma_t = sqrt(1 - alpha_bar_t), lambda_t = log(alpha_t / sigma_t),
    h = lambda_s - lambda_t from the current timestep t to the next s, and D0 the current x0_hat:
        1st order: x_s = sigma_s / sigma_t x_t - alpha_s (e^{-h} - 1) D0                 (= DDIM)
        2M:        ... - 0.5 alpha_s (e^{-h} - 1) D1,  D1 = (D0 - D_prev) / r0,  r0 = h_prev / h
        3M:        ... + alpha_s ((e^{-h} - 1) / h + 1) D1 - alpha_s ((e^{-h} - 1 + h) / h^2 - 0.5) D2
    The order ramps up over the first steps (one x0_hat of history per extra order), and again
    after a step from alpha_bar = 0 (zero terminal SNR, lambda = -inf), which is first order. With
    ``lower_order_final`` and fewer than 15 timesteps the second-to-last update drops to order 2
    (as DPM-Solver++ and diffusers do, for stability at few steps). The last timestep returns x0_hat.
    """
    x, steps, alpha_bars = _prepare(x_T, timesteps, alpha_bar)
    history: list[Tensor] = []  # x0_hat at the previous timesteps, newest last
    lambdas: list[float] = []
    for i, t in enumerate(steps):
        x0_hat = _predict_x0(denoiser, x, t)
        if i == len(steps) - 1:
            return x0_hat
        ab_t, ab_s = alpha_bars[i], alpha_bars[i + 1]
        lam_t, lam_s = _log_snr_half(ab_t), _log_snr_half(ab_s)
        history, lambdas = (history + [x0_hat])[-order:], (lambdas + [lam_t])[-order:]
        k = len(history)  # x0_hats available, so the highest usable order
        if lower_order_final and len(steps) < 15 and i == len(steps) - 2:
            k = min(k, 2)
        h = lam_s - lam_t
        alpha_s, sigma_s, sigma_t = math.sqrt(ab_s), math.sqrt(1.0 - ab_s), math.sqrt(1.0 - ab_t)
        phi1 = math.expm1(-h)  # e^{-h} - 1
        x = (sigma_s / sigma_t) * x - (alpha_s * phi1) * x0_hat
        if k >= 2:
            r0 = (lambdas[-1] - lambdas[-2]) / h
            d1_0 = (history[-1] - history[-2]) / r0
            if k == 2:
                x = x - (0.5 * alpha_s * phi1) * d1_0
            else:
                r1 = (lambdas[-2] - lambdas[-3]) / h
                d1_1 = (history[-2] - history[-3]) / r1
                d1 = d1_0 + (r0 / (r0 + r1)) * (d1_0 - d1_1)
                d2 = (d1_0 - d1_1) / (r0 + r1)
                x = x + (alpha_s * (phi1 / h + 1.0)) * d1 - (alpha_s * ((phi1 + h) / h**2 - 0.5)) * d2
        if lam_t == -math.inf:  # from SNR 0 (h = inf, e^{-h} = 0) the step above is DDIM's; that x0_hat
            history, lambdas = [], []  # lies infinitely far back in lambda: no higher-order difference uses it
    raise AssertionError("unreachable: timesteps is non-empty")


def dpmpp_2m_sample(
    denoiser: Denoiser,
    x_T: Tensor,
    timesteps: Tensor,
    alpha_bar: Tensor,
    generator: Generators = None,
    *,
    lower_order_final: bool = True,
) -> Tensor:
    """DPM-Solver++(2M) (Lu et al. 2022, alg. 2): a second-order multistep solver of the probability
    flow ODE in log-SNR time, one network evaluation per timestep. Deterministic (``generator`` is
    unused). See ``_dpmpp_multistep`` for the update; shapes as in the module docstring.
    """
    return _dpmpp_multistep(denoiser, x_T, timesteps, alpha_bar, 2, lower_order_final)


def dpmpp_3m_sample(
    denoiser: Denoiser,
    x_T: Tensor,
    timesteps: Tensor,
    alpha_bar: Tensor,
    generator: Generators = None,
    *,
    lower_order_final: bool = True,
) -> Tensor:
    """DPM-Solver++(3M): the third-order multistep variant (Lu et al. 2022), one network
    evaluation per timestep. Deterministic. See ``_dpmpp_multistep``; shapes as in the module docstring.
    """
    return _dpmpp_multistep(denoiser, x_T, timesteps, alpha_bar, 3, lower_order_final)


def heun_sample(
    denoiser: Denoiser,
    x_T: Tensor,
    timesteps: Tensor,
    alpha_bar: Tensor,
    generator: Generators = None,
) -> Tensor:
    """Heun's second-order method on the probability flow ODE as in EDM (Karras et al. 2022, alg. 1,
    deterministic, no churn), on the discrete schedule.

    In EDM's variables sigma_t = sqrt((1 - alpha_bar_t) / alpha_bar_t) and y = x_t / sqrt(alpha_bar_t),
    the ODE is dy/dsigma = (y - x0_hat(y)) / sigma. From t to the next timestep s: an Euler step
    to y'_s (which is the DDIM step), then the average of the slopes at t and at (y'_s, s).
    Written back in x with the scalars formed in float64 (sigma_t reaches 2e4 at the end of the
    cosine schedule, where y itself would lose float32 precision), with D_t, D_s the two x0_hats:

        x'_s = b_s / b_t x_t + sqrt(alpha_bar_s) (1 - sigma_s / sigma_t) D_t,     b = sqrt(1 - alpha_bar)
        x_s  = x'_s + sqrt(alpha_bar_s) (sigma_t - sigma_s) / (2 sigma_s) (D_s - D_t)

    (the slope difference d_s - d_t reduces to (D_t - D_s) / sigma_s).

    ``DDPMObjective`` walks it on ``karras_timesteps`` (EDM's sigma grid, capped at sigma_max),
    not on the trailing grid. Two network evaluations per step between timesteps, one at the last
    timestep, whose x0_hat is returned: 2N - 1 in all (2N - 2 when the grid starts at alpha_bar = 0,
    sigma = inf, whose step is the Euler one alone). Deterministic (``generator`` is unused); shapes as in the module
    docstring.
    """
    x, steps, alpha_bars = _prepare(x_T, timesteps, alpha_bar)
    x0_hat = _predict_x0(denoiser, x, steps[0])
    for i in range(len(steps) - 1):
        ab_t, ab_s = alpha_bars[i], alpha_bars[i + 1]
        sigma_t = math.sqrt((1.0 - ab_t) / ab_t) if ab_t > 0.0 else math.inf  # inf: zero terminal SNR
        sigma_s = math.sqrt((1.0 - ab_s) / ab_s)
        x_euler = math.sqrt((1.0 - ab_s) / (1.0 - ab_t)) * x + math.sqrt(ab_s) * (1.0 - sigma_s / sigma_t) * x0_hat
        x0_next = _predict_x0(denoiser, x_euler, steps[i + 1])
        if sigma_t == math.inf:  # from sigma = inf the Euler step is DDIM's and there is no trapezoid: keep it
            x, x0_hat = x_euler, x0_next
            continue
        correction = math.sqrt(ab_s) * (sigma_t - sigma_s) / (2.0 * sigma_s)
        x = x_euler + correction * (x0_next - x0_hat)
        x0_hat = _predict_x0(denoiser, x, steps[i + 1])
    return x0_hat


# name -> sampler with the shared signature; feeds config choices and the CLI.
SAMPLERS: dict[str, Callable[..., Tensor]] = {
    "ddpm": ddpm_sample,
    "ddim": ddim_sample,
    "dpmpp_2m": dpmpp_2m_sample,
    "dpmpp_3m": dpmpp_3m_sample,
    "heun": heun_sample,
}

# Network evaluations a sampler makes for N timesteps (for reporting cost next to quality).
SAMPLER_NFE: dict[str, Callable[[int], int]] = {
    "ddpm": lambda n: n,
    "ddim": lambda n: n,
    "dpmpp_2m": lambda n: n,
    "dpmpp_3m": lambda n: n,
    "heun": lambda n: 2 * n - 1,
}
