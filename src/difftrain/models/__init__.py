"""The denoising networks: the DDPM UNet and a registry of its presets."""

import inspect

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
}


def build_unet(preset: str, *, resolution: int, in_channels: int, num_classes: int = 0, **overrides) -> UNet:
    """Build the UNet of a preset in MODEL_PRESETS, with keyword `overrides` of its arguments.

    Example: build_unet("tiny", resolution=32, in_channels=3, dropout=0.1).
    """
    if preset not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choices: {', '.join(MODEL_PRESETS)}")
    allowed = set(inspect.signature(UNet).parameters) - {"resolution", "in_channels", "num_classes"}
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise ValueError(f"unknown UNet override(s) {unknown}; choices: {', '.join(sorted(allowed))}")
    kwargs = {**MODEL_PRESETS[preset], **overrides}
    return UNet(resolution=resolution, in_channels=in_channels, num_classes=num_classes, **kwargs)


def build_model(cfg, num_classes: int = 0) -> UNet:
    """The UNet of a config's ``model.preset`` (a ``difftrain.config.Config``) with its non-None
    ``model.*`` overrides, at ``data.resolution`` and ``data.channels``."""
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


__all__ = ["MODEL_PRESETS", "UNet", "build_model", "build_unet"]
