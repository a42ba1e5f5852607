"""ODE solvers on a continuous noise grid (EDM's sigma, flow matching's t), and the grids.

Every solver is

    solver(derivative, x_start, grid, generator=None) -> x_end

with derivative(x (B, C, H, W) float32, level: float) -> dx/dlevel (B, C, H, W); x_start:
(B, C, H, W) at grid[0]; grid: (N + 1,) float64, strictly descending, ending at 0. The state is
kept in float32; step sizes are formed in float64. The derivative is never evaluated at level 0
unless the solver is told it is defined there (EDM's dx/dsigma = (x - D(x, sigma)) / sigma is not):
Heun's step whose end is 0 is then a plain Euler step, as in EDM (Karras et al. 2022, alg. 1,
lines 8-11). All solvers are
deterministic (``generator`` is unused; it keeps the samplers' shared signature). Call them under
torch.no_grad() unless gradients are wanted.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

# derivative(x (B, C, H, W), level) -> dx/dlevel (B, C, H, W).
Derivative = Callable[[Tensor, float], Tensor]


def karras_sigmas(steps: int, sigma_min: float, sigma_max: float, rho: float = 7.0) -> Tensor:
    """EDM's sigma grid (Karras et al. 2022, eq. 5), (steps + 1,) float64, descending, last 0:

        sigma_i = (sigma_max^(1/rho) + i / (N - 1) (sigma_min^(1/rho) - sigma_max^(1/rho)))^rho,  i < N
        sigma_N = 0

    ``steps`` = 1 gives [sigma_max, 0].
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"sampling steps must be an integer >= 1, got {steps!r}")
    if not 0 < sigma_min < sigma_max:
        raise ValueError(f"need 0 < sigma_min < sigma_max, got {sigma_min}, {sigma_max}")
    if not rho > 0:
        raise ValueError(f"rho must be > 0, got {rho}")
    i = torch.arange(steps, dtype=torch.float64)
    frac = i / max(steps - 1, 1)
    lo, hi = sigma_min ** (1.0 / rho), sigma_max ** (1.0 / rho)
    sigmas = (hi + frac * (lo - hi)) ** rho
    return torch.cat([sigmas, torch.zeros(1, dtype=torch.float64)])


def flow_times(steps: int, shift: float = 1.0, end: float | None = None, mu: float | None = None) -> Tensor:
    """A flow-matching time grid from t = 1 (noise) to t = 0 (data), (steps + 1,) float64:
    uniform, then shifted by t' = shift t / (1 + (shift - 1) t) (SD3, Esser et al. 2024, eq. 23;
    shift > 1 spends more of the steps at high noise).

    ``end`` (SD3's FlowMatchEulerDiscreteScheduler.set_timesteps): the ``steps`` levels are
    linspace(1, end, steps) before the shift, then 0; None = linspace(1, 0, steps + 1) (the
    same as linspace(1, 1 / steps, steps) then 0: FluxPipeline's sigmas).
    ``mu`` (Flux's resolution-dependent shift, the scheduler's use_dynamic_shifting):
    t' = e^mu / (e^mu + 1 / t - 1) instead of ``shift``; t = 0 stays 0."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"sampling steps must be an integer >= 1, got {steps!r}")
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    if end is None:
        t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    else:
        if not 0 < end < 1:
            raise ValueError(f"the grid's end must be in (0, 1), got {end}")
        t = torch.cat([torch.linspace(1.0, end, steps, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)])
    if mu is not None:
        return dynamic_shift(t, mu)
    return shift * t / (1.0 + (shift - 1.0) * t)


def dynamic_shift(t: Tensor, mu: float) -> Tensor:
    """Flux's time shift t' = e^mu / (e^mu + (1 / t - 1)) (FlowMatchEulerDiscreteScheduler.time_shift,
    exponential, sigma 1) of t (any shape) in [0, 1]; t = 0 maps to 0. The same as the shift
    s t / (1 + (s - 1) t) with s = e^mu."""
    return shift_times(t, math.exp(mu))


def shift_times(t: Tensor, shift: float) -> Tensor:
    """t' = shift t / (1 + (shift - 1) t) of t (any shape) in [0, 1] (SD3 eq. 23)."""
    return shift * t / (1.0 + (shift - 1.0) * t)


def image_seq_shift(tokens: int, base_shift: float = 0.5, max_shift: float = 1.15, base_seq_len: int = 256,
                    max_seq_len: int = 4096) -> float:
    """Flux's mu for an image of ``tokens`` latent patches: linear in the token count through
    (base_seq_len, base_shift) and (max_seq_len, max_shift) (diffusers' calculate_shift)."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return tokens * slope + base_shift - slope * base_seq_len


def empirical_shift(tokens: int, steps: int) -> float:
    """FLUX.2's mu for an image of ``tokens`` latent patches sampled in ``steps`` steps: Black Forest Labs'
    empirical fit (diffusers' compute_empirical_mu, from BFL's flux2 sampling code): linear in the token count
    at 10 and at 200 steps, linear in the step count between (and beyond) them; past 4300 tokens the 200-step
    line alone."""
    a10, b10, a200, b200 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    at200 = a200 * tokens + b200
    if tokens > 4300:
        return float(at200)
    slope = (at200 - (a10 * tokens + b10)) / 190.0
    return float(slope * steps + at200 - 200.0 * slope)


SHIFT_RULES = ("linear", "empirical")  # mu of the dynamic shift: image_seq_shift, empirical_shift


def _levels(x: Tensor, grid: Tensor) -> tuple[Tensor, list[float]]:
    """Validate the shared arguments; return float32 x and the grid as floats."""
    if x.ndim < 2:
        raise ValueError(f"x must have shape (B, C, H, W), got {tuple(x.shape)}")
    levels = [float(v) for v in grid.reshape(-1).tolist()] if grid.ndim == 1 else []
    if len(levels) < 2:
        raise ValueError(f"grid must have shape (N + 1,) with N >= 1, got {tuple(grid.shape)}")
    if any(a <= b for a, b in zip(levels, levels[1:])) or levels[-1] < 0:
        raise ValueError(f"grid must be strictly descending and >= 0, got {levels}")
    return x.to(torch.float32), levels


def _slope(derivative: Derivative, x: Tensor, level: float) -> Tensor:
    d = derivative(x, level)
    if d.shape != x.shape:
        raise ValueError(f"derivative returned shape {tuple(d.shape)} for input {tuple(x.shape)}")
    return d.to(torch.float32)


def euler_solve(derivative: Derivative, x_start: Tensor, grid: Tensor, generator=None) -> Tensor:
    """Euler's method: x_{i+1} = x_i + (l_{i+1} - l_i) f(x_i, l_i). N evaluations."""
    x, levels = _levels(x_start, grid)
    for cur, nxt in zip(levels, levels[1:]):
        x = x + (nxt - cur) * _slope(derivative, x, cur)
    return x


def heun_solve(derivative: Derivative, x_start: Tensor, grid: Tensor, generator=None, *,
               defined_at_zero: bool = False) -> Tensor:
    """Heun's second-order method (EDM alg. 1, deterministic: S_churn = 0): an Euler step to
    x'_{i+1}, then x_{i+1} = x_i + h (f(x_i, l_i) + f(x'_{i+1}, l_{i+1})) / 2, h = l_{i+1} - l_i.
    Unless ``defined_at_zero``, the step to level 0 stays Euler: 2N - 1 evaluations (else 2N)."""
    x, levels = _levels(x_start, grid)
    for cur, nxt in zip(levels, levels[1:]):
        d = _slope(derivative, x, cur)
        x_euler = x + (nxt - cur) * d
        if nxt == 0.0 and not defined_at_zero:
            x = x_euler
        else:
            x = x + (0.5 * (nxt - cur)) * (d + _slope(derivative, x_euler, nxt))
    return x


def midpoint_solve(derivative: Derivative, x_start: Tensor, grid: Tensor, generator=None) -> Tensor:
    """The explicit midpoint method: x_{i+1} = x_i + h f(x_i + h/2 f(x_i, l_i), l_i + h/2).
    The midpoint level is > 0 even on the last step, so every step is second order: 2N evaluations."""
    x, levels = _levels(x_start, grid)
    for cur, nxt in zip(levels, levels[1:]):
        h = nxt - cur
        x_mid = x + (0.5 * h) * _slope(derivative, x, cur)
        x = x + h * _slope(derivative, x_mid, cur + 0.5 * h)
    return x


# name -> solver with the shared signature.
ODE_SOLVERS: dict[str, Callable[..., Tensor]] = {
    "euler": euler_solve,
    "heun": heun_solve,
    "midpoint": midpoint_solve,
}
