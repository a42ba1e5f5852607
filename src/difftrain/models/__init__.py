"""The denoising networks: the DDPM UNet (unconditional, class- or text-conditional), EDM2's network
(``models/edm2.py``) and a registry of their presets; a base family's denoiser (a wrapped diffusers
UNet2DConditionModel...) lives in `difftrain.families`."""

import inspect
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from difftrain.models import edm2
from difftrain.models.edm2 import EDM2UNet
from difftrain.models.layers import MPConv2d, MPLinear
from difftrain.models.unet import UNet

# UNet keyword arguments per preset; resolution, in_channels and num_classes come from the data.
MODEL_PRESETS: dict[str, dict] = {
    # For CPU runs and tests: 0.81M parameters; at 32x32, a training step at batch 32 takes a
    # fraction of a second on 2 CPU cores.
    "tiny": dict(
        base_channels=32,
        channel_mult=(1, 1, 2),
        num_res_blocks=1,
        attention_resolutions=(8,),
        dropout=0.0,
        norm_groups=8,
    ),
    # The DDPM CIFAR-10 model (Ho et al. 2020, Appendix B): 35.7M parameters at 32x32.
    "ddpm-cifar10": dict(
        base_channels=128,
        channel_mult=(1, 2, 2, 2),
        num_res_blocks=2,
        attention_resolutions=(16,),
        dropout=0.1,
        norm_groups=32,
    ),
    # A 64x64 model with the channel widths of Nichol & Dhariwal's (2021) ImageNet-64 UNet.
    "ddpm-64": dict(
        base_channels=128,
        channel_mult=(1, 2, 3, 4),
        num_res_blocks=2,
        attention_resolutions=(16, 8),
        dropout=0.1,
        norm_groups=32,
    ),
    # EDM2's network (config G, models/edm2.py) at the CPU protocol's size: the tiny UNet's levels, blocks and
    # attention; 0.81M parameters at 16 px (0.77M for "tiny"), a training step about 1.45x tiny's on one CPU thread.
    "edm2-tiny": dict(
        base_channels=32,
        channel_mult=(1, 1, 2),
        num_res_blocks=1,
        attention_resolutions=(8,),
        dropout=0.0,
    ),
}


@dataclass(frozen=True)
class Network:
    """A network class of the presets: how it is built and what it needs beside its weights."""

    cls: type[nn.Module]  # called with resolution, in_channels, num_classes, context_dim and the preset's kwargs
    # why ``export --format diffusers`` cannot write it ("": it maps onto diffusers' UNet2DModel)
    no_diffusers: str = ""


NETWORKS: dict[str, Network] = {
    "unet": Network(UNet),
    "edm2": Network(EDM2UNet, no_diffusers=(
        "EDM2's network (no biases, pixel norm, MP-SiLU, MP-sum and MP-cat, cosine attention) has no diffusers "
        "class that computes the same; export --format safetensors writes difftrain's weights file, which "
        "difftrain sample reads")),
}
# The network each preset builds (a key of NETWORKS); the same keys as MODEL_PRESETS.
PRESET_NETWORKS: dict[str, str] = {"tiny": "unet", "ddpm-cifar10": "unet", "ddpm-64": "unet", "edm2-tiny": "edm2"}


def network_of_preset(preset: str) -> Network:
    """The :class:`Network` that ``model.preset`` builds."""
    if preset not in PRESET_NETWORKS:
        raise ValueError(f"unknown model preset {preset!r}; choices: {', '.join(MODEL_PRESETS)}")
    return NETWORKS[PRESET_NETWORKS[preset]]


def weight_normalised_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of ``model`` whose stored weights EDM2's forced weight normalisation puts back to unit-RMS
    rows after every optimizer step (each has ``renormalize_()``): the UNet's ``model.magnitude_preserving``
    layers and every layer of EDM2's network; [] for any other network."""
    return [m for m in model.modules() if isinstance(m, (MPConv2d, MPLinear, edm2.MPConv))]


def build_preset(
    preset: str, *, resolution: int, in_channels: int, num_classes: int = 0, context_dim: int = 0, **overrides
) -> nn.Module:
    """Build the network of a preset in MODEL_PRESETS (its class: PRESET_NETWORKS), with keyword
    `overrides` of its arguments.

    Example: build_preset("tiny", resolution=32, in_channels=3, dropout=0.1); a text model
    cross-attending to (B, L, 512) embeddings: build_preset("tiny", ..., context_dim=512).
    """
    cls = network_of_preset(preset).cls
    allowed = set(inspect.signature(cls).parameters) - {"resolution", "in_channels", "num_classes", "context_dim"}
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} override(s) {unknown}; choices: {', '.join(sorted(allowed))}")
    kwargs = {**MODEL_PRESETS[preset], **overrides}
    return cls(resolution=resolution, in_channels=in_channels, num_classes=num_classes, context_dim=context_dim,
               **kwargs)


# The name of build_preset from when every preset was a UNet.
build_unet: Callable[..., nn.Module] = build_preset


# Fourier features of the learned loss weighting's MLP (EDM2's logvar_channels).
LOGVAR_CHANNELS = 128


def build_model(
    cfg, num_classes: int = 0, *, context_dim: int = 0, in_channels: int | None = None, resolution: int | None = None
) -> nn.Module:
    """The network of a config's ``model.preset`` (a ``difftrain.config.Config``) with its non-None
    ``model.*`` overrides.

    ``in_channels`` and ``resolution`` default to ``data.channels`` and ``data.resolution``; a
    latent model passes its codec's latent channels and resolution / factor. ``context_dim`` > 0
    builds a text model cross-attending to (B, L, context_dim) embeddings. A ``model.init_from``
    naming a UNet2DConditionModel folder is not built here: see ``difftrain.families``.
    """
    m = cfg.model
    overrides = {
        key: getattr(m, key)
        for key in ("base_channels", "channel_mult", "num_res_blocks", "attention_resolutions", "dropout")
        if getattr(m, key) is not None
    }
    return build_preset(
        m.preset,
        resolution=cfg.data.resolution if resolution is None else resolution,
        in_channels=cfg.data.channels if in_channels is None else in_channels,
        num_classes=num_classes,
        context_dim=context_dim,
        gradient_checkpointing=m.gradient_checkpointing,
        **({"logvar_channels": LOGVAR_CHANNELS} if cfg.diffusion.uncertainty_weighting else {}),
        **({"magnitude_preserving": True} if m.magnitude_preserving else {}),
        # MeanFlow conditions on two times, (t, t - r) (diffusion/meanflow.py): the UNet's second time embedding
        **({"interval_embedding": True} if cfg.diffusion.objective == "meanflow" else {}),
        **overrides,
    )


__all__ = ["MODEL_PRESETS", "NETWORKS", "PRESET_NETWORKS", "EDM2UNet", "UNet", "build_model", "build_preset",
           "build_unet", "network_of_preset", "weight_normalised_layers"]
