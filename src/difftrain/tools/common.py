"""What the tools share: the run's objects from a config, and the diffusion loss of one batch."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.utils.data import Dataset

from difftrain.config import Config
from difftrain.data import build_dataset
from difftrain.data.loader import collate
from difftrain.diffusion.losses import diffusion_loss, loss_weight
from difftrain.diffusion.process import prediction_target, q_sample
from difftrain.diffusion.schedules import alpha_bar_schedule
from difftrain.training.builders import build_model, resolve_device
from difftrain.training.heldout import split_heldout
from difftrain.training.precision import autocast
from difftrain.training.seeding import derive_seed


@dataclasses.dataclass
class Setup:
    cfg: Config
    device: torch.device
    dataset: Dataset  # the training split
    num_classes: int
    model: nn.Module  # freshly initialised from the run's seed, on ``device``, training mode
    alpha_bar: torch.Tensor  # (T,) float64 on ``device``


class RandomImages(Dataset):
    """Stand-in data of the configured shape (uniform in [-1, 1]) where only shapes matter."""

    num_classes = 0

    def __init__(self, cfg: Config, num_items: int = 4096):
        self.shape = (cfg.data.channels, cfg.data.resolution, cfg.data.resolution)
        self.num_items = num_items

    def __len__(self) -> int:
        return self.num_items

    def __getitem__(self, key):
        index = key[0] if isinstance(key, tuple) else key
        g = torch.Generator().manual_seed(int(index))
        return torch.rand(self.shape, generator=g) * 2 - 1, 0


def build_setup(cfg: Config, need_data: bool = True) -> Setup:
    """The training split, a fresh model and the schedule, as ``train`` builds them. Without
    ``need_data``, a missing ``data.path`` falls back to :class:`RandomImages`."""
    d = cfg.data
    device = resolve_device(cfg.train.device)
    try:
        dataset = build_dataset(d.path, d.resolution, d.channels, d.random_flip, d.color_jitter, d.class_conditional)
    except ValueError:
        if need_data:
            raise
        dataset = RandomImages(cfg)
    dataset, _ = split_heldout(dataset, cfg, lambda p: None)
    num_classes = getattr(dataset, "num_classes", 0) if d.class_conditional else 0
    torch.manual_seed(derive_seed(cfg.train.seed, "init"))
    model = build_model(cfg, num_classes).to(device).train()
    alpha_bar = alpha_bar_schedule(cfg.diffusion.schedule, cfg.diffusion.num_timesteps).to(device)
    return Setup(cfg, device, dataset, num_classes, model, alpha_bar)


def fetch_batch(setup: Setup, batch_size: int, seed: int, augment: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A batch of ``batch_size`` training images chosen by ``seed``: (x0 (B, C, H, W), labels (B,) or None)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(setup.dataset), (batch_size,), generator=g).tolist()
    keys = [(i, derive_seed(seed, "aug", i)) if augment else i for i in idx]
    x0, labels = collate([setup.dataset[k] for k in keys])
    return x0.to(setup.device), (labels.to(setup.device) if setup.num_classes else None)


def batch_loss(setup: Setup, x0: torch.Tensor, labels: torch.Tensor | None, gen: torch.Generator) -> torch.Tensor:
    """The per-sample training loss (B,) of ``x0`` at timesteps and noise drawn from ``gen``,
    with the config's prediction target, weighting and precision (as in the training loop)."""
    cfg = setup.cfg
    T = cfg.diffusion.num_timesteps
    t = torch.randint(0, T, (x0.shape[0],), device=setup.device, generator=gen)
    noise = torch.randn(x0.shape, device=setup.device, generator=gen)
    ab_t = setup.alpha_bar[t]
    x_t = q_sample(x0, t, noise, setup.alpha_bar)
    target = prediction_target(cfg.diffusion.prediction, x0, noise, ab_t)
    weight = loss_weight(cfg.diffusion.loss_weighting, ab_t, cfg.diffusion.prediction, cfg.diffusion.min_snr_gamma)
    with autocast(cfg.train.precision, setup.device):
        out = setup.model(x_t, t, labels)
    return diffusion_loss(out, target, weight)
