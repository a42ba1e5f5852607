"""Build the run's objects from a config: device, model, optimizer."""

from __future__ import annotations

import torch
from torch import nn

from difftrain.config import Config
from difftrain.models import build_unet
from difftrain.models.unet import UNet


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device is {name!r} but CUDA is not available on this machine")
    return device


def build_model(cfg: Config, num_classes: int = 0) -> UNet:
    """The UNet of ``cfg.model.preset`` with the config's non-None overrides."""
    m = cfg.model
    overrides = {
        key: getattr(m, key)
        for key in ("base_channels", "channel_mult", "num_res_blocks", "attention_resolutions", "dropout")
        if getattr(m, key) is not None
    }
    return build_unet(
        m.preset,
        resolution=cfg.data.resolution,
        in_channels=cfg.data.channels,
        num_classes=num_classes,
        gradient_checkpointing=m.gradient_checkpointing,
        **overrides,
    )


def effective_batch(cfg: Config, world_size: int = 1) -> int:
    """Images per optimizer step: per-device batch x accumulation x world size."""
    return cfg.train.batch_size * cfg.train.grad_accum_steps * world_size


def peak_lr(cfg: Config, world_size: int = 1) -> float:
    """``optim.lr``, scaled by the linear rule (Goyal et al. 2017) when ``optim.scale_lr``."""
    if not cfg.optim.scale_lr:
        return cfg.optim.lr
    return cfg.optim.lr * effective_batch(cfg, world_size) / cfg.optim.base_batch


def build_optimizer(cfg: Config, model: nn.Module, device: torch.device) -> torch.optim.AdamW:
    """AdamW; the fused kernel where it exists (CPU and CUDA), so that a skipped step is
    decided on the device without a host synchronisation (see ``found_inf`` in the loop)."""
    o = cfg.optim
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, fused=fused
    )
