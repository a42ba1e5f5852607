"""Per-sample diffusion losses and their timestep weightings; the caller reduces over the batch."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from difftrain.diffusion.process import check_prediction


def _uniform(alpha_bar_t: Tensor, prediction: str, min_snr_gamma: float) -> Tensor:
    """Weight 1: the "simple" loss of DDPM (eq. 14) in whichever parameterization is trained."""
    return torch.ones_like(alpha_bar_t)


def _inv_one_minus_alpha_bar(alpha_bar_t: Tensor, prediction: str, min_snr_gamma: float) -> Tensor:
    """Weight 1 / (1 - alpha_bar_t) = SNR + 1; with x0 prediction this equals the v-prediction loss."""
    return 1.0 / (1.0 - alpha_bar_t)


def _min_snr(alpha_bar_t: Tensor, prediction: str, min_snr_gamma: float) -> Tensor:
    """Min-SNR-gamma (Hang et al. 2023, "Efficient Diffusion Training via Min-SNR Weighting").

    In x0 space the weight is min(SNR, gamma). At fixed x_t, ||eps - eps_hat||^2 =
    SNR ||x0 - x0_hat||^2 and ||v - v_hat||^2 = (SNR + 1) ||x0 - x0_hat||^2, so the same
    weighting reads min(SNR, gamma) / SNR for epsilon and min(SNR, gamma) / (SNR + 1) for v.
    """
    snr = alpha_bar_t / (1.0 - alpha_bar_t)
    clipped = snr.clamp(max=min_snr_gamma)
    if prediction == "epsilon":
        # min(SNR, gamma) / SNR written as min(1, gamma / SNR): finite at SNR = 0.
        return (min_snr_gamma / snr).clamp(max=1.0)
    if prediction == "v":
        return clipped / (snr + 1.0)
    return clipped


# name -> (alpha_bar_t (B,), prediction, min_snr_gamma) -> weight (B,).
LOSS_WEIGHTINGS: dict[str, Callable[[Tensor, str, float], Tensor]] = {
    "uniform": _uniform,
    "inv_one_minus_alpha_bar": _inv_one_minus_alpha_bar,
    "min_snr": _min_snr,
}


def loss_weight(weighting: str, alpha_bar_t: Tensor, prediction: str, min_snr_gamma: float = 5.0) -> Tensor:
    """Per-sample loss weight, (B,) float32, for timesteps with alpha_bar_t: (B,) in [0, 1); finite
    at alpha_bar_t = 0 (zero terminal SNR), where min-SNR gives v and x0 the weight 0.

    ``prediction`` is the trained target (one of PREDICTIONS); only "min_snr" depends on it.
    """
    if weighting not in LOSS_WEIGHTINGS:
        raise ValueError(f"unknown loss weighting {weighting!r}; choose one of {sorted(LOSS_WEIGHTINGS)}")
    check_prediction(prediction)
    if not min_snr_gamma > 0:
        raise ValueError(f"min_snr_gamma must be > 0, got {min_snr_gamma}")
    # Form the weight in float64 (1 - alpha_bar_t loses digits in float32 near t = 0).
    alpha_bar_t = alpha_bar_t.to(torch.float64)
    return LOSS_WEIGHTINGS[weighting](alpha_bar_t, prediction, min_snr_gamma).to(torch.float32)


def diffusion_loss(model_out: Tensor, target: Tensor, weight: Tensor, pixel_weight: Tensor | None = None) -> Tensor:
    """Weighted mean squared error per sample: weight * mean_{C,H,W} pixel_weight * (model_out - target)^2.

    model_out, target: (B, C, H, W), any float dtype; weight: (B,); pixel_weight: (B, 1, H, W) (a loss
    mask in [0, 1], as kohya's masked loss: a masked pixel adds 0, the mean is over every pixel) or None.
    Returns (B,) float32: the difference is taken in float32 even for bf16 / fp16 inputs.
    """
    if model_out.shape != target.shape:
        raise ValueError(
            f"model output shape {tuple(model_out.shape)} differs from target {tuple(target.shape)}"
        )
    if model_out.ndim < 2:
        raise ValueError(f"model output must have shape (B, ...), got {tuple(model_out.shape)}")
    if weight.shape != model_out.shape[:1]:
        raise ValueError(f"weight must have shape ({model_out.shape[0]},), got {tuple(weight.shape)}")
    squared_error = (model_out.float() - target.float()).square()
    if pixel_weight is not None:
        squared_error = squared_error * pixel_weight.float()
    return squared_error.mean(dim=tuple(range(1, model_out.ndim))) * weight.float()
