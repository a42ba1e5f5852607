"""Samplers: plain functions sharing one signature, and the timestep grids they walk.

Every sampler is

    sampler(denoiser, x_T, timesteps, alpha_bar, generator=None, **options) -> x_0

with denoiser(x_t: (B, C, H, W), t: (B,) long) -> x0_hat: (B, C, H, W), the predicted clean
image; x_T: (B, C, H, W) noise at timesteps[0]; timesteps: (N,) long, strictly descending in
[0, T); alpha_bar: (T,) float64. The state is kept in float32 whatever precision the denoiser
runs in, coefficients are formed in float64 and the last step returns the denoiser's x0_hat
(no noise is added after timesteps[-1], i.e. alpha_bar before the first step is taken as 1).
Noise comes from torch.randn(..., generator=generator, device=x.device) (so the generator must
live on x_T's device) and a seeded generator reproduces a sample exactly. Call samplers under
torch.no_grad() unless gradients are wanted.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from difftrain.diffusion.process import check_prediction, to_x0_and_eps

# denoiser(x_t (B, C, H, W), t (B,) long) -> x0_hat (B, C, H, W).
Denoiser = Callable[[Tensor, Tensor], Tensor]

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


def _noise_like(x: Tensor, generator: torch.Generator | None) -> Tensor:
    """Standard normal noise shaped like x (float32), drawn from ``generator``."""
    return torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)


def ddpm_sample(
    denoiser: Denoiser,
    x_T: Tensor,
    timesteps: Tensor,
    alpha_bar: Tensor,
    generator: torch.Generator | None = None,
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
    generator: torch.Generator | None = None,
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


# name -> sampler with the shared signature; feeds config choices and the CLI.
SAMPLERS: dict[str, Callable[..., Tensor]] = {
    "ddpm": ddpm_sample,
    "ddim": ddim_sample,
}
