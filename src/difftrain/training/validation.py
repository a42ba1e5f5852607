"""Validation extras beside the EMA grid: a grid from the raw weights, from the same noise."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from difftrain.config import Config
from difftrain.sampling import generate, make_grid, save_png, to_uint8


def save_raw_grid(
    model: nn.Module,
    cfg: Config,
    noise: torch.Tensor,
    labels: torch.Tensor | None,
    num_classes: int,
    alpha_bar: torch.Tensor,
    run_dir: Path,
    step: int,
    trackers,
) -> None:
    """Sample the validation grid with the raw (non-EMA) weights from the EMA grid's fixed
    noise ``(N, C, H, W)``; write ``samples/raw/step_N.png`` and log it as ``samples/raw``."""
    v = cfg.validation
    images = generate(
        model,
        alpha_bar=alpha_bar,
        prediction=cfg.diffusion.prediction,
        noise=noise,
        sampler=v.sampler,
        steps=v.steps,
        seed=v.seed,
        class_labels=labels,
        null_label=num_classes,
    )
    grid = make_grid(to_uint8(images))
    (run_dir / "samples" / "raw").mkdir(parents=True, exist_ok=True)
    save_png(grid, run_dir / "samples" / "raw" / f"step_{step:08d}.png")
    trackers.log_image(step, "samples/raw", grid)
