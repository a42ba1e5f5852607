"""The frozen autoencoder of latent diffusion: a diffusers AutoencoderKL between images and latents.

Latent diffusion (Rombach et al. 2022) trains the denoiser on ``z * scaling_factor`` where
``z`` is drawn from the encoder's Gaussian ``N(mean, std^2)``; Stable Diffusion 3 / FLUX
VAEs also subtract a ``shift_factor`` first. ``LatentCodec`` keeps the moments unscaled (what
the latent cache stores) and converts to and from the model's space with ``to_model`` and
``decode``. diffusers is imported only when a codec is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from difftrain.runtime.optional import require
from difftrain.runtime.tensor_source import check_weight_indexes

from .text import check_loading_info, first_line, quiet_loading, weights_digest

WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin",
                "diffusion_pytorch_model.safetensors.index.json")
VAE_CLASSES = ("AutoencoderKL",)


def vae_folder(path: str, classes: tuple[str, ...] = VAE_CLASSES) -> Path:
    """The VAE folder of ``path``: the folder itself or a Stable Diffusion folder's ``vae/``, its config
    naming one of ``classes`` (a family's: ``Family.vae_classes``). Raises ValueError naming the folder and
    what is missing."""
    root = Path(path).expanduser()
    if not str(path).strip():
        raise ValueError("vae: the path is empty")
    if not root.is_dir():
        raise ValueError(f"vae {path}: no such folder")
    folder = root / "vae" if (root / "vae").is_dir() or (root / "model_index.json").is_file() else root
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"vae {path}: no config.json in {folder}")
    try:
        cls = json.loads(config.read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"vae {path}: unreadable {config}: {e}") from e
    if cls not in classes:
        raise ValueError(f"vae {path}: {config} describes a {cls!r}, not an {' or '.join(classes)}")
    if not any((folder / f).is_file() for f in WEIGHT_FILES):
        raise ValueError(f"vae {path}: no weights in {folder} (looked for {', '.join(WEIGHT_FILES)})")
    return folder


def vae_factor(path: str, classes: tuple[str, ...] = VAE_CLASSES) -> int:
    """The spatial downsampling of the VAE (one of ``classes``) at ``path`` from its config alone (no weights
    loaded): ``2 ** (len(block_out_channels) - 1)``, as :class:`LatentCodec` computes it."""
    folder = vae_folder(path, classes)
    try:
        return 2 ** (len(json.loads((folder / "config.json").read_text())["block_out_channels"]) - 1)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"vae {path}: {folder / 'config.json'} has no list block_out_channels ({e})") from None


class LatentCodec(nn.Module):
    """A frozen AutoencoderKL: images (B, 3, H, W) in [-1, 1] <-> latents (B, c, H/f, W/f).

    Attributes: ``latent_channels`` (c), ``factor`` (f, the spatial downsampling: 8 for Stable
    Diffusion), ``scaling_factor`` and ``shift_factor`` (0 when the config has none; model
    space is ``(z - shift) * scaling``), ``digest`` (SHA-256 of the weights), ``source``.
    Everything runs under no_grad; it stays in eval mode.
    """

    def __init__(self, vae: nn.Module, source: str):
        super().__init__()
        self.vae = vae.eval().requires_grad_(False)
        config = vae.config
        self.source = source
        self.in_channels = int(config.in_channels)
        self.latent_channels = int(config.latent_channels)
        self.factor = 2 ** (len(config.block_out_channels) - 1)
        scaling = getattr(config, "scaling_factor", None)  # None or absent (a VAE normalising otherwise): 1
        self.scaling_factor = float(scaling if scaling is not None else 1.0)
        self.shift_factor = float(getattr(config, "shift_factor", None) or 0.0)
        self.digest = weights_digest(vae)

    @classmethod
    def from_path(cls, path: str) -> LatentCodec:
        """Load on the CPU, float32, from an AutoencoderKL folder (config.json and
        diffusion_pytorch_model.safetensors) or a Stable Diffusion folder with ``vae/``."""
        folder = vae_folder(path)
        require("diffusers", "text", f"model.vae={path}")
        from diffusers import AutoencoderKL  # inside: diffusers is optional (the text extra), required above
        from diffusers.utils import logging

        check_weight_indexes(folder)  # from_pretrained reads the files a sharded VAE's index names, unchecked
        try:
            with quiet_loading(logging):
                vae, info = AutoencoderKL.from_pretrained(str(folder), torch_dtype=torch.float32,
                                                          low_cpu_mem_usage=False, output_loading_info=True)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise ValueError(f"vae {path}: cannot load {folder}: {first_line(e)}") from e
        check_loading_info(info, f"vae {path}", folder)
        return cls(vae, path)

    def train(self, mode: bool = True) -> LatentCodec:
        """Frozen: stays in eval mode whatever a parent module asks."""
        return super().train(False)

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the VAE is held in: float32 as loaded; a LoRA run's training copy may hold it in
        bf16/fp16 (``networks/frozen_dtype.py``), and images and latents are cast to it."""
        return next(self.vae.parameters()).dtype

    @torch.no_grad()
    def encode_moments(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) of the encoder's Gaussian, each (B, c, H/f, W/f) float32, unscaled, of
        images (B, 3, H, W) in [-1, 1] (H and W multiples of ``factor``)."""
        if images.ndim != 4 or images.shape[1] != self.in_channels:
            raise ValueError(
                f"vae {self.source}: encodes (B, {self.in_channels}, H, W) images, got {tuple(images.shape)}")
        if images.shape[2] % self.factor or images.shape[3] % self.factor:
            raise ValueError(
                f"vae {self.source}: image sides must be multiples of {self.factor}, got {tuple(images.shape[2:])}")
        dist = self.vae.encode(images.to(self.device, self.dtype)).latent_dist  # float32 unless held in bf16
        return dist.mean.float(), dist.std.float()

    def to_model(self, z: torch.Tensor) -> torch.Tensor:
        """Latents (unscaled) -> the diffusion model's space: ``(z - shift) * scaling``."""
        return (z - self.shift_factor) * self.scaling_factor

    def from_model(self, latents: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`to_model`: ``latents / scaling + shift``."""
        return latents / self.scaling_factor + self.shift_factor

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) float32 clamped to [-1, 1] of latents (B, c, h, w) in model space."""
        z = self.from_model(latents.to(self.device, torch.float32))
        return self.vae.decode(z.to(self.dtype)).sample.float().clamp_(-1.0, 1.0)

