"""Noise schedules: functions from the number of timesteps T to alpha_bar, shape (T,), float64.

Discrete time throughout: timesteps are integers t in [0, T), and

    alpha_bar[t] = prod_{s <= t} (1 - beta_s)        (DDPM, Ho et al. 2020, below eq. 4)

so alpha_bar[0] = 1 - beta_0 < 1 and alpha_bar is strictly decreasing in (0, 1). Every schedule
returns a CPU float64 tensor; callers cast (or move) once, where they use it.
``rescale_zero_terminal_snr`` reshapes any of them so that alpha_bar[T-1] = 0 exactly.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

# Largest beta a schedule defined through a continuous alpha_bar(t) may produce; the last step
# of such schedules would otherwise have beta = 1 (alpha_bar = 0). Improved DDPM, Nichol &
# Dhariwal 2021, below eq. 17.
MAX_BETA = 0.999


def _check_num_timesteps(num_timesteps: int) -> None:
    """Fail early on a T that is not a positive integer."""
    if isinstance(num_timesteps, bool) or not isinstance(num_timesteps, int) or num_timesteps < 1:
        raise ValueError(f"num_timesteps must be an integer >= 1, got {num_timesteps!r}")


def _alpha_bar_from_betas(betas: Tensor) -> Tensor:
    """alpha_bar[t] = prod_{s<=t} (1 - beta_s) (DDPM below eq. 4), betas clipped to (0, MAX_BETA]."""
    return torch.cumprod(1.0 - betas.clamp(max=MAX_BETA), dim=0)


def _alpha_bar_from_continuous(alpha_bar_fn: Callable[[Tensor], Tensor], num_timesteps: int) -> Tensor:
    """Discretize a continuous alpha_bar(tau), tau in [0, 1], as improved DDPM does (eq. 17).

    beta_t = min(1 - alpha_bar((t+1)/T) / alpha_bar(t/T), MAX_BETA); the result is the cumulative
    product of (1 - beta_t), normalized so that alpha_bar(0) = 1 before the first step.
    """
    tau = torch.arange(num_timesteps + 1, dtype=torch.float64) / num_timesteps
    continuous = alpha_bar_fn(tau)
    continuous = continuous / continuous[0]
    betas = 1.0 - continuous[1:] / continuous[:-1]
    return _alpha_bar_from_betas(betas)


def linear_schedule(num_timesteps: int) -> Tensor:
    """DDPM linear betas (Ho et al. 2020, sec. 4): beta from 1e-4 to 0.02 at T = 1000.

    Both ends are scaled by 1000 / T as in improved DDPM (Nichol & Dhariwal 2021), so that the
    total amount of noise is roughly independent of T. For T < 50 the scaled betas would pass 1;
    they are clipped at MAX_BETA.

    Returns alpha_bar, shape (T,), float64.
    """
    _check_num_timesteps(num_timesteps)
    scale = 1000.0 / num_timesteps
    betas = torch.linspace(scale * 1e-4, scale * 0.02, num_timesteps, dtype=torch.float64)
    return _alpha_bar_from_betas(betas)


def scaled_linear_schedule(num_timesteps: int) -> Tensor:
    """Latent diffusion's "scaled linear" schedule (Rombach et al. 2022): sqrt(beta) linear.

    sqrt(beta) runs linearly from sqrt(0.00085) to sqrt(0.012) at T = 1000; betas are scaled by
    1000 / T like ``linear_schedule`` (so T = 1000 matches Stable Diffusion exactly).

    Returns alpha_bar, shape (T,), float64.
    """
    _check_num_timesteps(num_timesteps)
    scale = 1000.0 / num_timesteps
    sqrt_betas = torch.linspace(math.sqrt(0.00085), math.sqrt(0.012), num_timesteps, dtype=torch.float64)
    return _alpha_bar_from_betas(scale * sqrt_betas**2)


def cosine_schedule(num_timesteps: int, s: float = 0.008) -> Tensor:
    """Improved DDPM cosine schedule (Nichol & Dhariwal 2021, eq. 17).

    f(tau) = cos((tau + s) / (1 + s) * pi / 2)^2, alpha_bar(tau) = f(tau) / f(0), discretized
    through betas clipped at MAX_BETA = 0.999.

    Returns alpha_bar, shape (T,), float64.
    """
    _check_num_timesteps(num_timesteps)
    return _alpha_bar_from_continuous(
        lambda tau: torch.cos((tau + s) / (1 + s) * (math.pi / 2)) ** 2, num_timesteps
    )


def sigmoid_schedule(num_timesteps: int, start: float = -3.0, end: float = 3.0, tau: float = 1.0) -> Tensor:
    """Sigmoid schedule (Jabri et al. 2022; Chen 2023, "On the importance of noise scheduling", alg. 1).

    gamma(u) = (sigmoid(end / tau) - sigmoid((u (end - start) + start) / tau))
               / (sigmoid(end / tau) - sigmoid(start / tau)),   u in [0, 1],
    used as the continuous alpha_bar, discretized through betas clipped at MAX_BETA.

    Returns alpha_bar, shape (T,), float64.
    """
    _check_num_timesteps(num_timesteps)
    if not end > start or not tau > 0:
        raise ValueError(f"sigmoid schedule needs end > start and tau > 0, got {start=}, {end=}, {tau=}")
    v_start = torch.sigmoid(torch.tensor(start / tau, dtype=torch.float64))
    v_end = torch.sigmoid(torch.tensor(end / tau, dtype=torch.float64))

    def gamma(u: Tensor) -> Tensor:
        return (v_end - torch.sigmoid((u * (end - start) + start) / tau)) / (v_end - v_start)

    return _alpha_bar_from_continuous(gamma, num_timesteps)


# name -> (num_timesteps -> alpha_bar (T,) float64). Feeds config choices and the CLI.
SCHEDULES: dict[str, Callable[[int], Tensor]] = {
    "linear": linear_schedule,
    "cosine": cosine_schedule,
    "scaled_linear": scaled_linear_schedule,
    "sigmoid": sigmoid_schedule,
}


def alpha_bar_schedule(name: str, num_timesteps: int) -> Tensor:
    """alpha_bar for the registered schedule ``name``: shape (T,), float64, strictly decreasing in (0, 1)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown noise schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[name](num_timesteps)


def rescale_zero_terminal_snr(alpha_bar: Tensor) -> Tensor:
    """Zero terminal SNR (Lin et al. 2024, "Common diffusion noise schedules and sample steps are
    flawed", alg. 1): shift sqrt(alpha_bar) so that its last value is 0 and scale it so that its
    first is kept, i.e. sqrt(alpha_bar'[t]) = (sqrt(alpha_bar[t]) - sqrt(alpha_bar[T-1]))
    * sqrt(alpha_bar[0]) / (sqrt(alpha_bar[0]) - sqrt(alpha_bar[T-1])).

    alpha_bar: (T,), strictly decreasing, T >= 2. Returns (T,) in its dtype, strictly decreasing,
    with alpha_bar'[T-1] = 0 exactly (SNR 0: x_{T-1} is pure noise, which sampling starts from).
    An epsilon-prediction network cannot give x0 there (x0 = (x_t - eps) / 0): train v or x0.
    """
    if alpha_bar.ndim != 1 or alpha_bar.shape[0] < 2:
        raise ValueError(f"alpha_bar must have shape (T,) with T >= 2, got {tuple(alpha_bar.shape)}")
    root = alpha_bar.sqrt()
    first, last = root[0].clone(), root[-1].clone()
    return ((root - last) * (first / (first - last))).square()


def betas_from_alpha_bar(alpha_bar: Tensor) -> Tensor:
    """Per-step betas, (T,): beta_0 = 1 - alpha_bar[0], beta_t = 1 - alpha_bar[t] / alpha_bar[t-1].

    Also gives respaced betas (improved DDPM, sec. 4) when passed alpha_bar at kept timesteps.
    """
    previous = torch.cat([alpha_bar.new_ones(1), alpha_bar[:-1]])
    return 1.0 - alpha_bar / previous


def snr(alpha_bar: Tensor) -> Tensor:
    """Signal-to-noise ratio alpha_bar / (1 - alpha_bar) (Kingma et al. 2021, VDM); shape of alpha_bar."""
    return alpha_bar / (1.0 - alpha_bar)
