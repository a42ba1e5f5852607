"""difftrain's diffusion settings and diffusers' DDPM-family scheduler configs, both ways.

    scheduler_config(cfg.diffusion)   -> DDPMScheduler keyword arguments that sample as difftrain does
    diffusers_training(scheduler)      -> the diffusion.* values a base's scheduler config describes

A lower layer (it knows the schedules, not models, files or families): ``interop`` writes pipeline
folders with it and the base families (``families/sd.py``) read their bases' schedulers with it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from difftrain.diffusion.schedules import MAX_BETA, alpha_bar_schedule, betas_from_alpha_bar

# difftrain prediction -> diffusers prediction_type.
DIFFUSERS_PREDICTION = {"epsilon": "epsilon", "v": "v_prediction", "x0": "sample"}


def _named_betas(name: str, num_timesteps: int) -> tuple[dict, Tensor] | None:
    """diffusers' keyword arguments naming difftrain's schedule ``name``, and the float64 betas
    diffusers builds from them; None when diffusers has no equal schedule."""
    scale = 1000.0 / num_timesteps  # difftrain scales both ends by 1000 / T (improved DDPM)
    if name == "linear":
        kw = dict(beta_schedule="linear", beta_start=scale * 1e-4, beta_end=scale * 0.02)
        return kw, torch.linspace(kw["beta_start"], kw["beta_end"], num_timesteps, dtype=torch.float64)
    if name == "scaled_linear":
        kw = dict(beta_schedule="scaled_linear", beta_start=scale * 0.00085, beta_end=scale * 0.012)
        lin = torch.linspace(kw["beta_start"] ** 0.5, kw["beta_end"] ** 0.5, num_timesteps, dtype=torch.float64)
        return kw, lin**2
    if name == "cosine":  # improved DDPM eq. 17, betas capped at 0.999: the same construction
        return dict(beta_schedule="squaredcos_cap_v2"), betas_from_alpha_bar(alpha_bar_schedule("cosine", num_timesteps))
    return None  # sigmoid: diffusers' "sigmoid" is a different curve


def scheduler_config(diffusion) -> dict:
    """Keyword arguments of diffusers' ``DDPMScheduler`` (``DDIMScheduler`` accepts them too)
    that reproduce difftrain's sampling for ``cfg.diffusion``: the same alpha_bar (a named
    schedule when diffusers has an equal one, else ``trained_betas``; rescaled to zero terminal
    SNR by diffusers when ``diffusion.zero_terminal_snr``), prediction, x0 clipped to [-1, 1], the
    trailing timestep grid, and the posterior variance of ``ddpm_sample``.

    DDIM matches difftrain's DDIM when the step count divides T (diffusers steps by T // steps)
    and the pipeline is called with ``use_clipped_model_output=True`` (difftrain derives the
    noise estimate from the clipped x0).
    """
    if diffusion.objective != "ddpm":
        raise ValueError(f"export to diffusers supports ddpm-family models (diffusion.objective = 'ddpm'); "
                         f"this model's objective is {diffusion.objective!r}")
    T = diffusion.num_timesteps
    ours = betas_from_alpha_bar(alpha_bar_schedule(diffusion.schedule, T))
    named = _named_betas(diffusion.schedule, T)
    if named is not None and torch.allclose(named[1].clamp(max=MAX_BETA), ours, rtol=1e-9, atol=1e-12) \
            and bool((named[1] <= MAX_BETA).all()):
        betas = named[0]
    else:  # no equal named schedule (sigmoid), or betas clipped at 0.999 (linear at small T)
        betas = dict(beta_schedule="linear", trained_betas=ours.tolist())
    return dict(
        num_train_timesteps=T,
        **betas,
        prediction_type=DIFFUSERS_PREDICTION[diffusion.prediction],
        variance_type="fixed_small",  # beta-tilde, as ddpm_sample
        clip_sample=True,
        clip_sample_range=1.0,
        thresholding=False,
        timestep_spacing="trailing",  # difftrain's grid (Lin et al. 2024)
        steps_offset=0,
        rescale_betas_zero_snr=diffusion.zero_terminal_snr,  # diffusers rescales the betas above as difftrain does
    )


_FROM_DIFFUSERS_PREDICTION = {v: k for k, v in DIFFUSERS_PREDICTION.items()}


def diffusers_training(scheduler: dict) -> dict:
    """The diffusion.* values a diffusers scheduler config describes (diffusers' defaults where it
    is silent: SD 1.x's has no prediction_type, meaning epsilon); a schedule only when difftrain
    has the same one; a FlowMatchEulerDiscreteScheduler (SD3, Flux) says flow."""
    if scheduler.get("_class_name") == "FlowMatchEulerDiscreteScheduler":  # SD3, Flux: rectified flow
        return {"objective": "flow"}
    out = {"objective": "ddpm", "zero_terminal_snr": bool(scheduler.get("rescale_betas_zero_snr", False))}
    if scheduler.get("prediction_type", "epsilon") in _FROM_DIFFUSERS_PREDICTION:
        out["prediction"] = _FROM_DIFFUSERS_PREDICTION[scheduler.get("prediction_type", "epsilon")]
    T = scheduler.get("num_train_timesteps", 1000)
    if isinstance(T, int) and T >= 2:
        out["num_timesteps"] = T
        for name in ("linear", "scaled_linear", "cosine"):
            if scheduler.get("trained_betas") is None and all(
                    _same(scheduler.get(k), v) for k, v in _named_betas(name, T)[0].items()):
                out["schedule"] = name
    return out


def _same(theirs, ours) -> bool:
    """A scheduler config value equals ours (floats to 1e-9 relative: JSON round trips)."""
    if isinstance(ours, float) and isinstance(theirs, (int, float)) and not isinstance(theirs, bool):
        return abs(theirs - ours) <= 1e-9 * abs(ours)
    return theirs == ours
