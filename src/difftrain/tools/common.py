"""What the tools share: the run's objects from a config, and batches chosen by a seed."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.utils.data import Dataset

from difftrain.networks.conditioning import Conditioning
from difftrain.config import Config, DataConfig
from difftrain.data.latents import with_latent_cache
from difftrain.data.loader import collate
from difftrain.data.prepare import dataset_from_config
from difftrain.data.split import split_heldout
from difftrain.diffusion.objective import Objective, build_objective
from difftrain.runtime.device import resolve_device
from difftrain.runtime.seeding import derive_seed
from difftrain.training.state import RunState


@dataclasses.dataclass
class Setup:
    cfg: Config
    device: torch.device
    dataset: Dataset  # the training split
    num_classes: int
    state: RunState  # fresh weights from the run's seed, on ``device``, training mode
    objective: Objective  # on ``device``

    @property
    def model(self) -> nn.Module:
        return self.state.model


class RandomImages(Dataset):
    """Stand-in data of the configured shape (uniform in [-1, 1]) where only shapes matter; with
    ``data.captions``, every caption is empty."""

    num_classes = 0

    def __init__(self, data: DataConfig, num_items: int = 4096):
        self.shape = (data.channels, data.resolution, data.resolution)
        self.num_items = num_items
        self.captions = data.captions
        self.masks = data.masks
        # an edit family's pairs: a reference per folder of data.references (a list: several), else one
        self.references = (len(data.references) if data.references and not isinstance(data.references, str)
                           else int(bool(data.references or data.reference_column)))

    def __len__(self) -> int:
        return self.num_items

    def __getitem__(self, key):
        index = key[0] if isinstance(key, tuple) else key
        g = torch.Generator().manual_seed(int(index))
        x = torch.rand(self.shape, generator=g) * 2 - 1
        if self.references:  # the reference images' channels after the target's, in order (data/folder.py)
            x = torch.cat([x, *(torch.rand(self.shape, generator=g) * 2 - 1 for _ in range(self.references))])
        if self.masks:  # data.masks: every pixel trains
            x = torch.cat([x, torch.ones((1, *self.shape[1:]))])
        return x, "" if self.captions else 0


def build_setup(cfg: Config, need_data: bool = True, network: dict | None = None) -> Setup:
    """The training split, a fresh run state and the objective, as ``train`` builds them.
    Without ``need_data``, a missing ``data.path`` falls back to :class:`RandomImages`;
    ``network``: a checkpoint's network record (a fine-tuned diffusers UNet is rebuilt from it)."""
    device = resolve_device(cfg.train.device)
    try:
        dataset = dataset_from_config(cfg.data)
    except ValueError:
        if need_data:
            raise
        dataset = RandomImages(cfg.data)
    dataset, _ = split_heldout(dataset, cfg.data, cfg.train.seed, lambda p: None)
    num_classes = getattr(dataset, "num_classes", 0) if cfg.data.class_conditional else 0
    conditioning = Conditioning.from_config(cfg, num_classes, device)
    if conditioning.codec is not None:  # the tools see latents, as training does
        dataset = with_latent_cache(dataset, random_flip=cfg.data.random_flip, codec=conditioning.codec,
                                    cache_dir=cfg.data.cache_dir or None, batch_size=64, device=device)
    state = RunState.build(cfg, num_classes, device, conditioning=conditioning, network=network,
                           init_weights=network is None)
    state.model.train()
    return Setup(cfg, device, dataset, num_classes, state, build_objective(cfg.diffusion).to(device))


def fetch_batch(setup: Setup, batch_size: int, seed: int, augment: bool = True):
    """A batch of ``batch_size`` training images chosen by ``seed``: (x0 (B, C, H, W) (latent
    runs: cached moments (B, 2c, h, w)), labels (B,) on the device / captions (B strings) / None)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(setup.dataset), (batch_size,), generator=g).tolist()
    keys = [(i, derive_seed(seed, "aug", i)) if augment else i for i in idx]
    x0, second, *_ = collate([setup.dataset[k] for k in keys])
    if isinstance(second, torch.Tensor):
        second = second.to(setup.device) if setup.num_classes else None
    return x0.to(setup.device), second


def network_condition(setup: Setup, second, repeat: int = 1) -> torch.Tensor | None:
    """The network's condition of a fetched batch (labels, or the captions' embeddings), each row
    repeated ``repeat`` times in turn (as ``Tensor.repeat``)."""
    c = setup.state.conditioning.condition(second, None, setup.device)
    return None if c is None else c.repeat(repeat, *([1] * (c.dim() - 1)))
