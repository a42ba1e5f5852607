"""From a trained network to images: the denoiser wrapper, batched generation, PNG grids.

The samplers themselves are pure functions in :mod:`difftrain.diffusion.samplers`; this module
connects them to a model, fixed seeds and files. Sampling always runs in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from difftrain.diffusion.objective import Objective
from difftrain.runtime.seeding import derive_seed


def guided_network(
    model: nn.Module,
    class_labels: torch.Tensor | None = None,
    null_label: int | None = None,
    guidance_scale: float = 1.0,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Bind labels and guidance into ``network(x (B,C,H,W), cond (B,)) -> output (B,C,H,W)`` float32.

    With class labels and ``guidance_scale != 1`` the output is classifier-free guided (Ho &
    Salimans 2022): ``out_uncond + s * (out_cond - out_uncond)``; every parameterization is
    linear in the output, so guiding it guides the x0 prediction alike.
    """

    def network(x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        labels = None if class_labels is None else class_labels[: x.shape[0]]
        out = model(x, cond, labels).float()
        if labels is not None and guidance_scale != 1.0:
            uncond = model(x, cond, torch.full_like(labels, null_label)).float()
            out = uncond + guidance_scale * (out - uncond)
        return out

    return network


def initial_noise(num: int, shape: tuple[int, int, int], seed: int) -> torch.Tensor:
    """x_T of shape (num, C, H, W), drawn on the CPU so a seed gives the same noise anywhere."""
    gen = torch.Generator().manual_seed(derive_seed(seed, "initial-noise"))
    return torch.randn((num, *shape), generator=gen)


@torch.no_grad()
def generate(
    model: nn.Module,
    *,
    objective: Objective,
    noise: torch.Tensor,
    sampler: str = "ddim",
    steps: int = 50,
    seed: int = 0,
    class_labels: torch.Tensor | None = None,
    null_label: int | None = None,
    guidance_scale: float = 1.0,
    batch_size: int = 256,
    sample_ids: Sequence[int] | None = None,
    progress=None,
    **sampler_options,
) -> torch.Tensor:
    """Sample images from fixed initial noise.

    Args:
        model: the network, in float32; put in eval mode for the call.
        objective: what the network was trained with; it holds the samplers.
        noise: (N, C, H, W) x_T on the CPU (see :func:`initial_noise`).
        class_labels: (N,) long, or None for an unconditional model.
        sample_ids: (N,) ints naming the samples. Given, row k's sampler noise (DDPM, DDIM with
            eta > 0) comes from its own generator seeded by (seed, sample_ids[k]), so a sample
            is the same whichever batch or process draws it. Without them each batch of
            ``batch_size`` draws from one generator seeded by (seed, batch number).
        progress: an object with ``advance(n)`` told of each finished batch (a progress line).
    Returns:
        (N, C, H, W) float32 images in [-1, 1], on the CPU.
    """
    if sample_ids is not None and len(sample_ids) != noise.shape[0]:
        raise ValueError(f"got {len(sample_ids)} sample_ids for {noise.shape[0]} noise rows")
    if sampler not in objective.samplers:
        raise ValueError(f"sampler must be one of {', '.join(objective.samplers)} for {objective.family} models, "
                         f"got {sampler!r}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = []
    try:
        for i, start in enumerate(range(0, noise.shape[0], batch_size)):
            x_T = noise[start : start + batch_size].to(device)
            labels = None if class_labels is None else class_labels[start : start + batch_size].to(device)
            network = guided_network(model, labels, null_label, guidance_scale)
            if sample_ids is None:
                gen = torch.Generator(device=device).manual_seed(derive_seed(seed, "sampler", i))
            else:
                ids = sample_ids[start : start + batch_size]
                gen = [torch.Generator(device=device).manual_seed(derive_seed(seed, "sample", int(k))) for k in ids]
            out.append(objective.sample(network, x_T, sampler, steps, gen, **sampler_options).cpu())
            if progress is not None:
                progress.advance(x_T.shape[0])
    finally:
        model.train(was_training)
    return torch.cat(out) if out else torch.zeros(noise.shape)  # no rows: a rank with no share


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(N, C, H, W) in [-1, 1] -> (N, H, W, C) uint8."""
    x = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).numpy()


def grid_columns(num_images: int) -> int:
    """Columns of a near-square grid of ``num_images``."""
    return max(1, math.ceil(math.sqrt(num_images)))


def grid_class_labels(num_images: int, num_classes: int) -> torch.Tensor | None:
    """(num_images,) long labels with one class per grid row (None when unconditional)."""
    if num_classes == 0:
        return None
    return (torch.arange(num_images) // grid_columns(num_images)) % num_classes


def make_grid(images: np.ndarray, ncols: int | None = None, pad: int = 2) -> np.ndarray:
    """(N, H, W, C) uint8 -> one (H', W', C) uint8 grid, ``ncols`` images per row."""
    n, h, w, c = images.shape
    ncols = ncols or grid_columns(n)
    nrows = math.ceil(n / ncols)
    grid = np.full((nrows * (h + pad) + pad, ncols * (w + pad) + pad, c), 255, dtype=np.uint8)
    for i in range(n):
        r, q = divmod(i, ncols)
        grid[pad + r * (h + pad) : pad + r * (h + pad) + h, pad + q * (w + pad) : pad + q * (w + pad) + w] = images[i]
    return grid


def save_png(image: np.ndarray, path: Path) -> None:
    """Save an (H, W, C) uint8 array (C = 1 or 3) as PNG."""
    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(path)
