"""The confetti share: how many samples are saturated high-frequency noise.

A sample that has collapsed into "confetti" (pixels that flip between extremes from one pixel to
the next) has far more local contrast than any real image of the same data. The figure is the
mean absolute 4-neighbour Laplacian of each image (on [0, 1] pixel values, edges replicated),
compared with the same figure's 99th percentile over real images: a sample above it is counted.
On real images the share is 1% by construction; a healthy sampler stays near it.
"""

from __future__ import annotations

import numpy as np
import torch

# The percentile of the real images' Laplacian energy that a sample must pass to count.
REFERENCE_PERCENTILE = 99.0


def laplacian_energy(images: torch.Tensor | np.ndarray) -> np.ndarray:
    """Mean |4-neighbour Laplacian| of each image, (N,) float64.

    images: (N, C, H, W) float in [-1, 1] (a sampler's output), (N, C, H, W) uint8 tensor (what
    Inception is fed) or (N, H, W, C) uint8 array (image files). Pixels are scaled to [0, 1]; the
    border is replicated, so a flat image scores 0.
    """
    if isinstance(images, torch.Tensor) and images.dtype == torch.uint8:
        images = images.permute(0, 2, 3, 1).cpu().numpy()
    if isinstance(images, np.ndarray):
        if images.dtype != np.uint8 or images.ndim != 4:
            raise ValueError(f"expected (N, H, W, C) uint8 images, got {images.dtype} {images.shape}")
        x = torch.from_numpy(images).permute(0, 3, 1, 2).double() / 255.0
    else:
        if images.ndim != 4:
            raise ValueError(f"expected (N, C, H, W) images, got {tuple(images.shape)}")
        x = (images.detach().double().cpu().clamp(-1, 1) + 1) / 2
    p = torch.nn.functional.pad(x, (1, 1, 1, 1), mode="replicate")
    lap = 4 * x - p[..., :-2, 1:-1] - p[..., 2:, 1:-1] - p[..., 1:-1, :-2] - p[..., 1:-1, 2:]
    return lap.abs().mean(dim=(1, 2, 3)).numpy()


def confetti_threshold(reference: torch.Tensor | np.ndarray, percentile: float = REFERENCE_PERCENTILE) -> float:
    """The ``percentile`` of the reference (real) images' Laplacian energy."""
    return float(np.percentile(laplacian_energy(reference), percentile))


def confetti_share(samples: torch.Tensor | np.ndarray, threshold: float) -> float:
    """The fraction of ``samples`` whose Laplacian energy is above ``threshold``, in [0, 1]."""
    energy = laplacian_energy(samples)
    return float((energy > threshold).mean()) if energy.size else float("nan")


# The key of FeatureStats.metadata that holds the reference images' threshold.
THRESHOLD_KEY = "laplacian_energy_p99"


def share_against(energies: torch.Tensor | np.ndarray, metadata: dict) -> float | None:
    """The share of samples with Laplacian ``energies`` (N,) above the reference statistics'
    threshold (``metadata[THRESHOLD_KEY]``), or None for statistics made before it was recorded."""
    threshold = metadata.get(THRESHOLD_KEY)
    energies = np.asarray(energies, dtype=np.float64)
    if threshold is None or energies.size == 0:
        return None
    return float((energies > threshold).mean())
