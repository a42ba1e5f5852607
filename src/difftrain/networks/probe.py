"""Whether a network's output is finite: one forward on a small fixed input, drawn from a generator of
its own, so that no random number of the caller's is used.

    output_is_finite(model, objective, conditioning, "cpu")   # -> False for weights that overflow

``lora_import.check_adapted_output`` refuses an adapter file with it (finite weights, a kohya ``alpha``
of 1e30, whose outputs overflow). An edit family's denoiser (``Family.references``) edits a reference image and
refuses a condition without one (Qwen-Image-Edit encodes even the empty prompt with it): the probe adds the
family's reference condition of zero latents (``Conditioning.reference_condition``, the empty prompt).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from difftrain.diffusion.objective import Objective
from difftrain.runtime.seeding import derive_seed

PROBE_SEED = 0  # the fixed input of output_is_finite


@torch.no_grad()
def output_is_finite(model: nn.Module, objective: Objective, conditioning, device: torch.device | str,
                     autocast: contextlib.AbstractContextManager | None = None) -> bool:
    """Whether one forward of ``model`` on a small fixed input is finite: x_t (1, C, H, W) at the
    network's shape (``conditioning.network_shape()``), noised from zeros by fixed noise to the median
    training level of ``objective``, with the null condition (``conditioning.null``; None unconditional); an edit
    family's (``conditioning.family.references``) with its references' condition of zero latents (1, C, h, w) at
    the network's shape under the empty prompt (:func:`probe_condition`).
    The model runs in eval mode (restored after), under ``autocast`` where given; no random number
    of the caller's is drawn. Every rank of a sharded (FSDP) model must call it together."""
    channels, resolution = conditioning.network_shape()
    gen = torch.Generator().manual_seed(derive_seed(PROBE_SEED, "output-probe"))
    noise = torch.randn((1, channels, resolution, resolution), generator=gen).to(device)
    levels = objective.quantile(torch.tensor([0.5])).to(device)
    b = objective.noised(torch.zeros_like(noise), levels, noise)
    was_training = model.training
    model.eval()
    try:
        with autocast or contextlib.nullcontext():
            out = model(b.input, b.cond, probe_condition(conditioning, channels, resolution, device))
    finally:
        model.train(was_training)
    return bool(torch.isfinite(out).all())


def probe_condition(conditioning, channels: int, resolution: int, device: torch.device | str):
    """The probe's condition of one row: ``conditioning.null(1)``; an edit family's (``family.references`` > 0)
    over its reference condition (``Conditioning.reference_condition``) of that many zero latents (1, ``channels``,
    ``resolution``, ``resolution``) under the empty prompt, so that the null's keys select the empty prompt's."""
    null = conditioning.null(1, device)
    count = getattr(conditioning.family, "references", 0)
    if not count or conditioning.text is None:
        return null
    zeros = torch.zeros((1, channels, resolution, resolution), device=device)
    refs = conditioning.reference_condition([zeros] * count, [""], device=device)
    return refs | null if isinstance(null, dict) else refs
