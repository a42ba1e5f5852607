"""diffusers folders for EDM and flow-matching models: ``unet/`` (a UNet2DModel), ``scheduler/``
(diffusers' own EDMEulerScheduler or FlowMatchEulerDiscreteScheduler) and a README.md with the
sampling loop that reproduces difftrain's Euler sampler.

EDM: EDMEulerScheduler carries Table 1's preconditioning (``scale_model_input`` multiplies by
c_in = 1 / sqrt(sigma^2 + sd^2); ``step`` forms D = c_skip x + c_out F with ``sigma_data``, and
``prediction_type="epsilon"`` is EDM's c_out sign), the sigma grid (``sigma_min``, ``sigma_max``,
``rho``, last sigma 0) and the Euler step of dx/dsigma = (x - D) / sigma. Its timesteps are
Table 1's c_noise = ln(sigma) / 4, while difftrain's UNet is conditioned on ln(sigma) mapped
affinely onto [0, 1000] (diffusion/edm.py, ``EDMObjective.cond``): no UNet2DModel setting
scales the sinusoids' frequencies, so the loop maps the timestep, ``unet_t = A c_noise + B``
(A and B written into the README), and scales the initial noise by ``sigma_max`` (the scheduler's
``init_noise_sigma`` is sqrt(sigma_max^2 + 1), EDM's is sigma_max). No stock pipeline calls
``scale_model_input`` with a UNet2DModel, so the folder has no ``model_index.json``.

Flow: FlowMatchEulerDiscreteScheduler's timesteps are 1000 t, which is difftrain's conditioning
(diffusion/flow.py), its ``shift`` is SD3's eq. 23 as ``diffusion.flow_shift``, and its step
x + (t_next - t) v is difftrain's Euler step. ``DDPMPipeline`` loads the folder and samples it on
diffusers' default grid (1000 t from 1000 to 1); the README's loop passes difftrain's grid
(t = 1, 1 - 1/N, ..., 1/N, shifted by the scheduler) and gives difftrain's images.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

# diffusion.objective -> the diffusers scheduler class that exports it.
ODE_SCHEDULERS = {"edm": "EDMEulerScheduler", "flow": "FlowMatchEulerDiscreteScheduler"}

_LOAD = '''\
import torch
from diffusers import {scheduler}, UNet2DModel

folder = "{folder}"
unet = UNet2DModel.from_pretrained(folder, subfolder="unet").eval()
scheduler = {scheduler}.from_pretrained(folder, subfolder="scheduler")
steps = 32
{labels}size = unet.config.sample_size
generator = torch.Generator().manual_seed(0)
x = torch.randn({n}, unet.config.in_channels, size, size, generator=generator)
'''

_EDM_LOOP = '''\
scheduler.set_timesteps(steps)  # EDM's sigma grid (rho, sigma_min, sigma_max), then 0
x = x * scheduler.sigmas[0]  # EDM scales unit noise by sigma_max


def unet_timestep(c_noise):
    """difftrain's conditioning: ln(sigma) mapped onto [0, 1000] over sigma in [0.002, 80]."""
    return {scale!r} * c_noise.double() + {offset!r}


with torch.no_grad():
    for t in scheduler.timesteps:  # t = c_noise = ln(sigma) / 4
        out = unet(scheduler.scale_model_input(x, t), unet_timestep(t){cond}).sample
        x = scheduler.step(out, t, x).prev_sample
images = (x / 2 + 0.5).clamp(0, 1)  # (N, C, H, W) in [0, 1]
'''

_FLOW_LOOP = '''\
# difftrain's grid t = 1, 1 - 1/N, ..., 1/N (then 0); the scheduler applies its shift to it.
scheduler.set_timesteps(sigmas=torch.linspace(1.0, 0.0, steps + 1)[:-1].tolist())
with torch.no_grad():
    for t in scheduler.timesteps:  # t = 1000 t_flow, difftrain's conditioning
        out = unet(x, t{cond}).sample  # the velocity eps - x0
        x = scheduler.step(out, t, x).prev_sample
images = (x / 2 + 0.5).clamp(0, 1)  # (N, C, H, W) in [0, 1]
'''


def ode_scheduler(objective):
    """The diffusers scheduler that samples ``objective`` (an ``EDMObjective`` or
    ``FlowObjective``) with difftrain's Euler steps; diffusers must be installed."""
    import diffusers  # inside: diffusers is optional (the text extra)

    if objective.family == "edm":
        return diffusers.EDMEulerScheduler(
            sigma_min=objective.sigma_min, sigma_max=objective.sigma_max, sigma_data=objective.sigma_data,
            sigma_schedule="karras", rho=objective.rho, prediction_type="epsilon", final_sigmas_type="zero")
    if objective.family == "flow":
        return diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=objective.shift)
    raise ValueError(f"no diffusers ODE scheduler for {objective.family!r} models (edm or flow)")


def edm_timestep_map(objective) -> tuple[float, float]:
    """(A, B) with ``objective.cond(sigma) = A c_noise + B`` for c_noise = ln(sigma) / 4, the
    timestep EDMEulerScheduler feeds the UNet."""
    one = torch.ones(1, dtype=torch.float64)
    offset = float(objective.cond(one).double())  # c_noise(1) = 0
    scale = float(objective.cond(one * math.e**4).double()) - offset  # c_noise(e^4) = 1
    return scale, offset


def sampling_snippet(objective, folder: Path, num_classes: int) -> str:
    """The README's Python loop that samples the exported folder as difftrain's Euler sampler."""
    labels = (f"labels = torch.arange(4) % {num_classes}  # classes in [0, {num_classes}); "
              f"{num_classes} = unconditional\n") if num_classes else ""
    n = "len(labels)" if num_classes else "4"
    cond = ", class_labels=labels" if num_classes else ""
    head = _LOAD.format(scheduler=ODE_SCHEDULERS[objective.family], folder=folder, labels=labels, n=n)
    if objective.family == "edm":
        scale, offset = edm_timestep_map(objective)
        return head + _EDM_LOOP.format(scale=scale, offset=offset, cond=cond)
    return head + _FLOW_LOOP.format(cond=cond)


def export_ode_diffusers(unet, objective, out: str | Path, num_classes: int) -> Path:
    """Write ``out/unet`` (``unet``, a diffusers UNet2DModel), ``out/scheduler``
    (:func:`ode_scheduler`) and ``out/README.md`` (:func:`sampling_snippet`); a flow model also
    gets ``model_index.json`` (``DDPMPipeline`` samples it, on diffusers' grid). Returns ``out``."""
    from diffusers import DDPMPipeline  # inside: diffusers is optional (the text extra)

    out = Path(out)
    scheduler = ode_scheduler(objective)
    if objective.family == "flow" and not num_classes:
        DDPMPipeline(unet=unet.eval(), scheduler=scheduler).save_pretrained(out, safe_serialization=True)
    else:
        unet.eval().save_pretrained(out / "unet", safe_serialization=True)
        scheduler.save_pretrained(out / "scheduler")
    name = {"edm": "an EDM", "flow": "a flow-matching"}[objective.family]
    why = ("No stock diffusers pipeline runs EDMEulerScheduler's preconditioning (`scale_model_input`) with a "
           "UNet2DModel, and difftrain conditions the UNet on ln(sigma) mapped onto [0, 1000] rather than on "
           "c_noise = ln(sigma) / 4; the loop below maps it." if objective.family == "edm" else
           ("This UNet needs class labels, which DDPMPipeline does not pass. " if num_classes else
            "`DDPMPipeline.from_pretrained` loads this folder and samples it on diffusers' default grid. ")
           + "The loop below uses difftrain's grid and gives the images of `difftrain sample --sampler euler`.")
    (out / "README.md").write_text(
        f"# {name[0].upper() + name[1:]} difftrain model"
        f"{f' ({num_classes} classes)' if num_classes else ''}\n\n{why}\n\n"
        f"```python\n{sampling_snippet(objective, out, num_classes)}```\n\n"
        "`difftrain sample --sampler euler --steps 32 --seed S` starts from "
        "`difftrain.interop.diffusers.pipeline_generator(S)`'s first draw; pass that generator for its images.\n")
    return out
