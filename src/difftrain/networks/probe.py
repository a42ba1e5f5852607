"""Whether a network's output is finite: one forward on a small fixed input, drawn from a generator of
its own, so that no random number of the caller's is used.

    output_is_finite(model, objective, conditioning, "cpu")   # -> False for weights that overflow

``lora_import.check_adapted_output`` refuses an adapter file with it (finite weights, a kohya ``alpha``
of 1e30, whose outputs overflow).
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
    training level of ``objective``, with the null condition (``conditioning.null``; None unconditional).
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
            out = model(b.input, b.cond, conditioning.null(1, device))
    finally:
        model.train(was_training)
    return bool(torch.isfinite(out).all())
