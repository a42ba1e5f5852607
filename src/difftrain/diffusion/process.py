"""The forward (noising) process q(x_t | x_0) and the epsilon / v / x0 parameterizations.

Notation (DDPM, Ho et al. 2020): x_t = sqrt(alpha_bar_t) x_0 + sqrt(1 - alpha_bar_t) eps.
Coefficients are formed from alpha_bar in its own precision (float64 from the schedules) and
only then cast, so that 1 - alpha_bar_t keeps its digits when alpha_bar_t is close to 1.
"""

from __future__ import annotations

import torch
from torch import Tensor

# What the network is trained to output: the noise (DDPM), the velocity (Salimans & Ho 2022)
# or the clean image.
PREDICTIONS = ("epsilon", "v", "x0")


def check_prediction(prediction: str) -> None:
    """Raise a ValueError naming the choices if ``prediction`` is not in PREDICTIONS."""
    if prediction not in PREDICTIONS:
        raise ValueError(f"unknown prediction {prediction!r}; choose one of {list(PREDICTIONS)}")


def gather(values: Tensor, t: Tensor, ndim: int) -> Tensor:
    """values[t] reshaped to (B, 1, ..., 1) with ``ndim`` dimensions, for broadcasting.

    values: (T,), any dtype (kept). t: (B,) long. The result lives on t's device; keep
    ``values`` there already (move alpha_bar once) to avoid a copy per call.
    """
    if t.ndim != 1:
        raise ValueError(f"timesteps must have shape (B,), got {tuple(t.shape)}")
    return values.to(t.device)[t].reshape(-1, *([1] * (ndim - 1)))


def _sqrt_coefficients(alpha_bar_t: Tensor, like: Tensor) -> tuple[Tensor, Tensor]:
    """(sqrt(alpha_bar_t), sqrt(1 - alpha_bar_t)), each (B, 1, ..., 1), formed in alpha_bar_t's
    precision (at least float32), then cast to ``like``'s dtype and device."""
    if alpha_bar_t.shape != like.shape[:1]:
        raise ValueError(f"alpha_bar_t must have shape ({like.shape[0]},), got {tuple(alpha_bar_t.shape)}")
    alpha_bar_t = alpha_bar_t.to(torch.promote_types(alpha_bar_t.dtype, torch.float32))
    shape = (-1, *([1] * (like.ndim - 1)))
    signal = alpha_bar_t.sqrt().reshape(shape).to(device=like.device, dtype=like.dtype)
    noise = (1.0 - alpha_bar_t).sqrt().reshape(shape).to(device=like.device, dtype=like.dtype)
    return signal, noise


def q_sample(x0: Tensor, t: Tensor, noise: Tensor, alpha_bar: Tensor) -> Tensor:
    """Sample x_t ~ q(x_t | x_0) = N(sqrt(alpha_bar_t) x_0, (1 - alpha_bar_t) I) (DDPM eq. 4).

    x0, noise: (B, C, H, W); t: (B,) long in [0, T); alpha_bar: (T,).
    Returns x_t, (B, C, H, W), in x0's dtype.
    """
    if noise.shape != x0.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} differs from x0 shape {tuple(x0.shape)}")
    signal, sigma = _sqrt_coefficients(gather(alpha_bar, t, 1), x0)
    return mix(x0, noise, signal, sigma)


def coefficient_table(alpha_bar: Tensor, dtype: torch.dtype) -> Tensor:
    """(2, T): sqrt(alpha_bar) and sqrt(1 - alpha_bar) for every timestep, formed as
    ``_sqrt_coefficients`` forms them (in alpha_bar's precision, then cast to ``dtype``), so that
    indexing the table at t gives the same bits as forming them per batch: one gather per step
    instead of float64 arithmetic and two casts."""
    alpha_bar = alpha_bar.to(torch.promote_types(alpha_bar.dtype, torch.float32))
    return torch.stack([alpha_bar.sqrt(), (1.0 - alpha_bar).sqrt()]).to(dtype)


def mix(x0: Tensor, noise: Tensor, signal: Tensor, sigma: Tensor) -> Tensor:
    """x_t = signal * x0 + sigma * noise (DDPM eq. 4) with coefficients (B, 1, ..., 1) in x0's dtype."""
    return signal * x0 + sigma * noise.to(x0.dtype)


def target_from(prediction: str, x0: Tensor, noise: Tensor, signal: Tensor | None, sigma: Tensor | None) -> Tensor:
    """The regression target of ``prediction`` from the coefficients sqrt(alpha_bar_t) and
    sqrt(1 - alpha_bar_t), (B, 1, ..., 1) in x0's dtype (read only for "v"); see
    :func:`prediction_target`."""
    if prediction == "epsilon":
        return noise.to(x0.dtype)
    if prediction == "x0":
        return x0
    return signal * noise.to(x0.dtype) - sigma * x0


def prediction_target(prediction: str, x0: Tensor, noise: Tensor, alpha_bar_t: Tensor) -> Tensor:
    """The regression target for the given parameterization.

    "epsilon": eps (DDPM eq. 14); "v": v = sqrt(alpha_bar_t) eps - sqrt(1 - alpha_bar_t) x0
    (Salimans & Ho 2022, sec. 4); "x0": x0.
    x0, noise: (B, C, H, W); alpha_bar_t: (B,). Returns (B, C, H, W) in x0's dtype.
    """
    check_prediction(prediction)
    signal, sigma = _sqrt_coefficients(alpha_bar_t, x0) if prediction == "v" else (None, None)
    return target_from(prediction, x0, noise, signal, sigma)


def to_x0_and_eps(
    prediction: str, model_out: Tensor, x_t: Tensor, alpha_bar_t: Tensor
) -> tuple[Tensor, Tensor]:
    """Invert any parameterization: (x0_hat, eps_hat) from the model output at x_t.

    "epsilon": eps_hat = out, x0_hat = (x_t - sqrt(1 - ab) eps_hat) / sqrt(ab)   (DDPM eq. 15)
    "x0":      x0_hat = out,  eps_hat = (x_t - sqrt(ab) x0_hat) / sqrt(1 - ab)
    "v":       x0_hat = sqrt(ab) x_t - sqrt(1 - ab) v,
               eps_hat = sqrt(1 - ab) x_t + sqrt(ab) v                          (Salimans & Ho 2022)

    The predicted quantity passes through unchanged; the other one is derived with float64
    coefficients. Deriving x0 from eps is ill-conditioned as alpha_bar -> 0 (error grows like
    1 / sqrt(ab)), and eps from x0 as alpha_bar -> 1 (like 1 / sqrt(1 - ab)); that is inherent to
    the parameterization, and v is well conditioned at both ends.

    model_out, x_t: (B, C, H, W); alpha_bar_t: (B,) in [0, 1). "v" and "x0" are finite at
    alpha_bar_t = 0 (zero terminal SNR); "epsilon" is not (x0 is not recoverable from the noise
    alone there), which is why ``DDPMObjective`` refuses that combination.
    Returns two (B, C, H, W) tensors in float32, or float64 if either input is float64.
    """
    check_prediction(prediction)
    dtype = torch.promote_types(torch.promote_types(model_out.dtype, x_t.dtype), torch.float32)
    model_out, x_t = model_out.to(dtype), x_t.to(dtype)
    signal, sigma = _sqrt_coefficients(alpha_bar_t, x_t)
    if prediction == "epsilon":
        eps = model_out
        x0 = (x_t - sigma * eps) / signal
    elif prediction == "x0":
        x0 = model_out
        eps = (x_t - signal * x0) / sigma
    else:
        x0 = signal * x_t - sigma * model_out
        eps = sigma * x_t + signal * model_out
    return x0, eps
