"""Validation grids: the EMA (and raw) weights sampled from fixed noise, spread across ranks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from difftrain.config import Config
from difftrain.sampling import generate, make_grid, save_png, to_uint8
from difftrain.runtime import distributed


def sample_grid(
    model: nn.Module,
    cfg: Config,
    noise: torch.Tensor,
    labels: torch.Tensor | None,
    num_classes: int,
    objective,
    ctx: distributed.DistContext,
) -> np.ndarray | None:
    """The grid of ``model``'s samples from the fixed noise ``(N, C, H, W)``: an (H', W', C)
    uint8 image on rank 0, None on the others.

    Rank r samples the rows ``shard(N, ctx)``, and the sampler noise of row i is seeded by
    (validation.seed, i), so the grid is the same on any number of processes.
    """
    v = cfg.validation
    mine = distributed.shard(noise.shape[0], ctx)
    images = generate(
        model,
        objective=objective,
        noise=noise[mine],
        sampler=v.sampler,
        steps=v.steps,
        seed=v.seed,
        class_labels=None if labels is None else labels[mine],
        null_label=num_classes,
        sample_ids=range(noise.shape[0])[mine],
    )
    images = distributed.gather_cat(images, ctx)  # (N, C, H, W) on rank 0, None elsewhere
    return None if images is None else make_grid(to_uint8(images))


def validation_grids(
    model: nn.Module,
    ema_model: nn.Module,
    cfg: Config,
    noise: torch.Tensor,
    labels: torch.Tensor | None,
    num_classes: int,
    objective,
    ctx: distributed.DistContext,
) -> dict[str, np.ndarray]:
    """``{"samples/ema": grid}``, plus ``"samples/raw"`` (the raw weights from the same noise)
    with ``validation.raw_grid``, on rank 0; ``{}`` on the others. Every rank must call it."""
    grids = {"samples/ema": sample_grid(ema_model, cfg, noise, labels, num_classes, objective, ctx)}
    if cfg.validation.raw_grid:
        grids["samples/raw"] = sample_grid(model, cfg, noise, labels, num_classes, objective, ctx)
    return {name: grid for name, grid in grids.items() if grid is not None}


def save_grids(grids: dict[str, np.ndarray], run_dir: Path, step: int, trackers) -> None:
    """Write ``samples/step_N.png`` (EMA) and ``samples/raw/step_N.png``; log each by name."""
    folders = {"samples/ema": run_dir / "samples", "samples/raw": run_dir / "samples" / "raw"}
    for name, grid in grids.items():
        folders[name].mkdir(parents=True, exist_ok=True)
        save_png(grid, folders[name] / f"step_{step:08d}.png")
        trackers.log_image(step, name, grid)
