"""Pure diffusion math: noise schedules, the forward process and its parameterizations, losses, samplers."""

from difftrain.diffusion.losses import LOSS_WEIGHTINGS, diffusion_loss, loss_weight
from difftrain.diffusion.process import (
    PREDICTIONS,
    check_prediction,
    gather,
    prediction_target,
    q_sample,
    to_x0_and_eps,
)
from difftrain.diffusion.samplers import (
    SAMPLERS,
    SPACINGS,
    Denoiser,
    ddim_sample,
    ddpm_sample,
    make_x0_denoiser,
    sampling_timesteps,
)
from difftrain.diffusion.schedules import SCHEDULES, alpha_bar_schedule, betas_from_alpha_bar, snr

__all__ = [
    "LOSS_WEIGHTINGS",
    "PREDICTIONS",
    "SAMPLERS",
    "SCHEDULES",
    "SPACINGS",
    "Denoiser",
    "alpha_bar_schedule",
    "betas_from_alpha_bar",
    "check_prediction",
    "ddim_sample",
    "ddpm_sample",
    "diffusion_loss",
    "gather",
    "loss_weight",
    "make_x0_denoiser",
    "prediction_target",
    "q_sample",
    "sampling_timesteps",
    "snr",
    "to_x0_and_eps",
]
