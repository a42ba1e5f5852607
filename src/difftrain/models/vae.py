"""The frozen autoencoder of latent diffusion: a diffusers AutoencoderKL (or AutoencoderDC) between images and latents.

Latent diffusion (Rombach et al. 2022) trains the denoiser on ``z * scaling_factor`` where
``z`` is drawn from the encoder's Gaussian ``N(mean, std^2)``; Stable Diffusion 3 / FLUX
VAEs also subtract a ``shift_factor`` first. ``LatentCodec`` keeps the moments unscaled (what
the latent cache stores) and converts to and from the model's space with ``to_model`` and
``decode``. diffusers is imported only when a codec is loaded.

An AutoencoderDC (deep compression, Sana's: 32 channels, factor 32) encodes deterministically: its
``encode(x).latent`` is the mean and its std is 0; its factor is ``2 ** (len(encoder_block_out_channels) - 1)``
(what SanaPipeline computes), its config's key for the widths of the encoder's levels.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from difftrain.runtime.optional import require
from difftrain.runtime.tensor_source import check_weight_indexes

from .text import check_loading_info, first_line, quiet_loading, weights_digest

WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin",
                "diffusion_pytorch_model.safetensors.index.json")
# The classes LatentCodec loads (its encode gives a distribution, or a latent: AutoencoderDC's, deterministic).
CODEC_CLASSES = ("AutoencoderKL", "AutoencoderDC")
# The config key of each level's width: the factor is 2 ** (levels - 1) (AutoencoderDC: its encoder's).
LEVEL_KEYS = ("block_out_channels", "encoder_block_out_channels")


def config_factor(config: dict) -> int:
    """The spatial downsampling ``2 ** (len(widths) - 1)`` of a VAE config (a dict): its ``block_out_channels``,
    else an AutoencoderDC's ``encoder_block_out_channels``; KeyError / TypeError when it has neither list."""
    widths = next((config[k] for k in LEVEL_KEYS if config.get(k) is not None), None)
    if widths is None:
        raise KeyError("block_out_channels")
    return 2 ** (len(widths) - 1)


# config.json _class_name -> the spatial downsampling its config gives: LatentCodec's classes here; a family whose
# VAE is another class registers it from its module (register_vae_class) and loads it with its Family.load_codec.
VAE_FACTORS: dict[str, Callable[[dict], int]] = dict.fromkeys(CODEC_CLASSES, config_factor)


def register_vae_class(name: str, factor: Callable[[dict], int]) -> None:
    """Let :func:`vae_folder` and :func:`vae_factor` take VAE folders of class ``name`` (a family's own VAE class),
    ``factor(config)`` their spatial downsampling."""
    VAE_FACTORS[name] = factor


def vae_folder(path: str, expect: str | None = None) -> Path:
    """The VAE folder of ``path``: the folder itself or a Stable Diffusion folder's ``vae/``, its config
    naming a class of :data:`VAE_FACTORS` (``expect``: that class alone, a family's own). Raises ValueError naming
    the folder and what is missing."""
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
    if expect is not None and cls != expect:
        raise ValueError(f"vae {path}: {config} describes a {cls!r}, not the {expect} this base decodes with")
    if cls not in VAE_FACTORS:
        raise ValueError(f"vae {path}: {config} describes a {cls!r}, not an AutoencoderKL (nor another VAE class a "
                         f"family takes: {', '.join(VAE_FACTORS)})")
    if not any((folder / f).is_file() for f in WEIGHT_FILES):
        raise ValueError(f"vae {path}: no weights in {folder} (looked for {', '.join(WEIGHT_FILES)})")
    return folder


def vae_factor(path: str) -> int:
    """The spatial downsampling of the VAE at ``path`` from its config alone (no weights loaded): an
    AutoencoderKL's ``2 ** (len(block_out_channels) - 1)``, as :class:`LatentCodec` computes it (another class's:
    :data:`VAE_FACTORS`)."""
    folder = vae_folder(path)
    try:
        config = json.loads((folder / "config.json").read_text())
        return int(VAE_FACTORS[config.get("_class_name")](config))
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
        self.factor = config_factor(dict(config))
        scaling = getattr(config, "scaling_factor", None)  # None or absent (a VAE normalising otherwise): 1
        self.scaling_factor = float(scaling if scaling is not None else 1.0)
        self.shift_factor = float(getattr(config, "shift_factor", None) or 0.0)
        self.digest = weights_digest(vae)

    @classmethod
    def from_path(cls, path: str) -> LatentCodec:
        """Load on the CPU, float32, from an AutoencoderKL folder (config.json and
        diffusion_pytorch_model.safetensors) or a Stable Diffusion folder with ``vae/``."""
        folder = vae_folder(path)
        found = json.loads((folder / "config.json").read_text()).get("_class_name")
        if found not in CODEC_CLASSES:  # a family's own VAE class (VAE_FACTORS): its Family.load_codec loads it
            raise ValueError(f"vae {path}: {folder} holds a {found}, which its base family loads, not an AutoencoderKL")
        require("diffusers", "text", f"model.vae={path}")
        import diffusers  # inside: diffusers is optional (the text extra), required above
        from diffusers.utils import logging

        vae_class = getattr(diffusers, found)  # one of CODEC_CLASSES

        check_weight_indexes(folder)  # from_pretrained reads the files a sharded VAE's index names, unchecked
        try:
            with quiet_loading(logging):
                vae, info = vae_class.from_pretrained(str(folder), torch_dtype=torch.float32,
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
        out = self.vae.encode(images.to(self.device, self.dtype))  # float32 unless held in bf16
        dist = getattr(out, "latent_dist", None)
        if dist is None:  # an AutoencoderDC: deterministic, its latent the mean, std 0
            return out.latent.float(), torch.zeros_like(out.latent, dtype=torch.float32)
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

