"""The denoising networks: the DDPM UNet (unconditional, class- or text-conditional) and a registry
of its presets; a base family's denoiser (a wrapped diffusers UNet2DConditionModel...) lives in `difftrain.families`."""

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


def build_unet(
    preset: str, *, resolution: int, in_channels: int, num_classes: int = 0, context_dim: int = 0, **overrides
) -> UNet:
    """Build the UNet of a preset in MODEL_PRESETS, with keyword `overrides` of its arguments.

    Example: build_unet("tiny", resolution=32, in_channels=3, dropout=0.1); a text model
    cross-attending to (B, L, 512) embeddings: build_unet("tiny", ..., context_dim=512).
    """
    if preset not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choices: {', '.join(MODEL_PRESETS)}")
    allowed = set(inspect.signature(UNet).parameters) - {"resolution", "in_channels", "num_classes", "context_dim"}
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise ValueError(f"unknown UNet override(s) {unknown}; choices: {', '.join(sorted(allowed))}")
    kwargs = {**MODEL_PRESETS[preset], **overrides}
    return UNet(resolution=resolution, in_channels=in_channels, num_classes=num_classes, context_dim=context_dim,
                **kwargs)


# Fourier features of the learned loss weighting's MLP (EDM2's logvar_channels).
LOGVAR_CHANNELS = 128


def build_model(
    cfg, num_classes: int = 0, *, context_dim: int = 0, in_channels: int | None = None, resolution: int | None = None
) -> UNet:
    """The UNet of a config's ``model.preset`` (a ``difftrain.config.Config``) with its non-None
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
    return build_unet(
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


__all__ = ["MODEL_PRESETS", "UNet", "build_model", "build_unet"]
