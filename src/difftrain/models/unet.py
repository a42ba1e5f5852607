"""The UNet of DDPM (Ho, Jain & Abbeel 2020, arXiv:2006.11239, Appendix B), optionally class- or
text-conditional.

A PixelCNN++-style UNet: per resolution level a stack of residual blocks with additive timestep
embeddings, single-head self-attention at chosen resolutions, a middle block (ResBlock, attention,
ResBlock), and an up path that concatenates the down path's activations. Its modules map one to
one onto diffusers' `UNet2DModel` (see `difftrain.models.diffusers_export`). A text model
(`context_dim > 0`) adds cross-attention to the text tokens in every attention block, as the
latent diffusion UNet does (Rombach et al. 2022); it has no UNet2DModel equivalent.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from difftrain.models.layers import (
    AttentionBlock,
    Downsample,
    NoAttention,
    ResBlock,
    TimestepEmbedding,
    UncertaintyHead,
    Upsample,
    group_norm,
    make_magnitude_preserving,
)


class DownLevel(nn.Module):
    """One level of the down path: `res[j]` then `attn[j]` (or identity), then `downsample`."""

    def __init__(self, res: list[ResBlock], attn: list[nn.Module], downsample: Downsample | None) -> None:
        super().__init__()
        self.res = nn.ModuleList(res)
        self.attn = nn.ModuleList(attn)
        self.downsample = downsample

    def forward(self, h: Tensor, emb: Tensor, skips: list[Tensor], context: Tensor | None = None) -> Tensor:
        """h: (B, C_in, H, W), emb: (B, D), context: (B, L, D_ctx) or None -> (B, C, H/2, W/2);
        appends each output to `skips`."""
        for res, attn in zip(self.res, self.attn):
            h = attn(res(h, emb), context)
            skips.append(h)
        if self.downsample is not None:
            h = self.downsample(h)
            skips.append(h)
        return h


class MidBlock(nn.Module):
    """Middle of the UNet at the lowest resolution: ResBlock, attention, ResBlock."""

    def __init__(self, channels: int, emb_dim: int, dropout: float, norm_groups: int, context_dim: int = 0) -> None:
        super().__init__()
        self.res_1 = ResBlock(channels, channels, emb_dim, dropout, norm_groups)
        self.attn = AttentionBlock(channels, norm_groups, context_dim)
        self.res_2 = ResBlock(channels, channels, emb_dim, dropout, norm_groups)

    def forward(self, h: Tensor, emb: Tensor, context: Tensor | None = None) -> Tensor:
        """h: (B, C, H, W), emb: (B, D), context: (B, L, D_ctx) or None -> (B, C, H, W)."""
        return self.res_2(self.attn(self.res_1(h, emb), context), emb)


class UpLevel(nn.Module):
    """One level of the up path: `res[j]` on [h, skip] concatenated, then `attn[j]`, then `upsample`."""

    def __init__(self, res: list[ResBlock], attn: list[nn.Module], upsample: Upsample | None) -> None:
        super().__init__()
        self.res = nn.ModuleList(res)
        self.attn = nn.ModuleList(attn)
        self.upsample = upsample

    def forward(self, h: Tensor, emb: Tensor, skips: list[Tensor], context: Tensor | None = None) -> Tensor:
        """h: (B, C_in, H, W), emb: (B, D), context: (B, L, D_ctx) or None -> (B, C, 2H, 2W);
        pops one skip per ResBlock."""
        for res, attn in zip(self.res, self.attn):
            h = attn(res(torch.cat([h, skips.pop()], dim=1), emb), context)
        if self.upsample is not None:
            h = self.upsample(h)
        return h


class UNet(nn.Module):
    """DDPM UNet predicting a (B, out_channels, H, W) tensor (eps, v or x0) from x_t, t and an
    optional condition (class labels or text embeddings).

    Module layout (the names `diffusers_export` maps):
        time_embed          sinusoidal(t) -> linear_1 -> SiLU -> linear_2, width 4 * base_channels
        class_embed         nn.Embedding(num_classes + 1, 4 * base_channels), only if num_classes > 0;
                            label `num_classes` is the null label of classifier-free guidance
        interval_embed      a second TimestepEmbedding, of t's second column, only if
                            interval_embedding (MeanFlow's t - r)
        conv_in
        down[l]             DownLevel for level l = 0 .. L-1 (resolution / 2**l)
        mid                 MidBlock
        *.attn*.cross       CrossAttention to the text tokens, only if context_dim > 0
        up[i]               UpLevel for level L-1-i, in execution order (deepest first)
        norm_out, conv_out

    Args (keyword-only):
        resolution: training image size; must be divisible by 2**(len(channel_mult) - 1).
        in_channels: image channels.
        out_channels: output channels (default: in_channels).
        base_channels: channels at the first level.
        channel_mult: per-level multiplier of base_channels; one level per entry.
        num_res_blocks: ResBlocks per level on the down path (the up path has one more).
        attention_resolutions: resolutions at which each ResBlock is followed by self-attention.
        dropout: dropout probability inside ResBlocks.
        num_classes: number of classes for class conditioning; 0 for an unconditional model.
        norm_groups: GroupNorm groups; must divide every level's channel count.
        gradient_checkpointing: recompute ResBlock (and, in a text model, attention block)
            activations in backward while training.
        context_dim: width D_ctx of the text embeddings (B, L, D_ctx) cross-attended in every
            attention block (those of attention_resolutions and the middle block); 0 for none.
            Exclusive with num_classes.
        logvar_channels: > 0 adds EDM2's learned loss weighting head (``logvar``).
        magnitude_preserving: every convolution and linear layer computes with EDM2's
            weight-normalised weights (``layers.MPConv2d`` / ``MPLinear``; the zero-initialised
            ones get a learned gain starting at 0); the state dict gains those ``gain`` entries.
        interval_embedding: the network takes two times, ``t`` of shape (B, 2): column 0 is
            embedded by ``time_embed``, column 1 by a second sinusoidal embedding and MLP
            (``interval_embed``), and the two are summed (MeanFlow's (t, t - r) conditioning,
            diffusion/meanflow.py; diffusers' ``class_embed_type="timestep"`` computes the same).
            Off by default: every other network, its state dict and its initial weights are unchanged.
    """

    def __init__(
        self,
        *,
        resolution: int,
        in_channels: int = 3,
        out_channels: int | None = None,
        base_channels: int = 128,
        channel_mult: Sequence[int] = (1, 2, 2, 2),
        num_res_blocks: int = 2,
        attention_resolutions: Sequence[int] = (16,),
        dropout: float = 0.1,
        num_classes: int = 0,
        norm_groups: int = 32,
        gradient_checkpointing: bool = False,
        context_dim: int = 0,
        logvar_channels: int = 0,
        magnitude_preserving: bool = False,
        interval_embedding: bool = False,
    ) -> None:
        super().__init__()
        channel_mult = tuple(channel_mult)
        attention_resolutions = tuple(attention_resolutions)
        out_channels = in_channels if out_channels is None else out_channels
        _check_args(
            resolution=resolution,
            in_channels=in_channels,
            out_channels=out_channels,
            base_channels=base_channels,
            channel_mult=channel_mult,
            num_res_blocks=num_res_blocks,
            attention_resolutions=attention_resolutions,
            dropout=dropout,
            num_classes=num_classes,
            norm_groups=norm_groups,
            context_dim=context_dim,
        )
        # The resolved constructor arguments: UNet(**model.config) rebuilds the architecture.
        self.config = dict(
            resolution=resolution,
            in_channels=in_channels,
            out_channels=out_channels,
            base_channels=base_channels,
            channel_mult=channel_mult,
            num_res_blocks=num_res_blocks,
            attention_resolutions=attention_resolutions,
            dropout=dropout,
            num_classes=num_classes,
            norm_groups=norm_groups,
            gradient_checkpointing=gradient_checkpointing,
            context_dim=context_dim,
            # EDM2's learned loss weighting (diffusion.uncertainty_weighting); only when on, so
            # the configs of other runs are unchanged
            **({"logvar_channels": logvar_channels} if logvar_channels else {}),
            **({"magnitude_preserving": True} if magnitude_preserving else {}),  # EDM2's MP layers, likewise
            **({"interval_embedding": True} if interval_embedding else {}),  # MeanFlow's second time, likewise
        )
        self.num_classes = num_classes
        self.context_dim = context_dim
        emb_dim = 4 * base_channels
        channels = [base_channels * m for m in channel_mult]
        num_levels = len(channels)

        def res_block(c_in: int, c_out: int) -> ResBlock:
            return ResBlock(c_in, c_out, emb_dim, dropout, norm_groups)

        def attn_or_identity(c: int, level: int) -> nn.Module:
            use_attn = resolution // 2**level in attention_resolutions
            return AttentionBlock(c, norm_groups, context_dim) if use_attn else NoAttention()

        # Embeddings of t and of the class label, summed.
        self.time_embed = TimestepEmbedding(base_channels, emb_dim)
        self.class_embed = nn.Embedding(num_classes + 1, emb_dim) if num_classes > 0 else None

        # Down path; skip_channels records what each level pushes for the up path.
        self.conv_in = nn.Conv2d(in_channels, base_channels, 3, padding=1)
        skip_channels = [base_channels]
        self.down = nn.ModuleList()
        c_in = base_channels
        for level, c in enumerate(channels):
            res, attn = [], []
            for _ in range(num_res_blocks):
                res.append(res_block(c_in, c))
                attn.append(attn_or_identity(c, level))
                skip_channels.append(c)
                c_in = c
            downsample = None
            if level < num_levels - 1:
                downsample = Downsample(c)
                skip_channels.append(c)
            self.down.append(DownLevel(res, attn, downsample))

        self.mid = MidBlock(c_in, emb_dim, dropout, norm_groups, context_dim)

        # Up path, deepest level first; each ResBlock consumes one skip connection.
        self.up = nn.ModuleList()
        for level in reversed(range(num_levels)):
            c = channels[level]
            res, attn = [], []
            for _ in range(num_res_blocks + 1):
                res.append(res_block(c_in + skip_channels.pop(), c))
                attn.append(attn_or_identity(c, level))
                c_in = c
            upsample = Upsample(c) if level > 0 else None
            self.up.append(UpLevel(res, attn, upsample))

        self.norm_out = group_norm(c_in, norm_groups)
        self.conv_out = nn.Conv2d(c_in, out_channels, 3, padding=1)

        self._init_weights()
        if magnitude_preserving:
            make_magnitude_preserving(self)
        # Built after the init (zeros of its own), so the other layers' initial weights do not depend on it.
        self.logvar = UncertaintyHead(logvar_channels) if logvar_channels else None
        # Likewise built last, so that the random draws of every other layer are those of a network without it.
        self.interval_embed = None
        if interval_embedding:
            self.interval_embed = TimestepEmbedding(base_channels, emb_dim)
            for layer in (self.interval_embed.linear_1, self.interval_embed.linear_2):
                nn.init.xavier_uniform_(layer.weight)
                nn.init.zeros_(layer.bias)
            if magnitude_preserving:
                make_magnitude_preserving(self.interval_embed)
        self.set_gradient_checkpointing(gradient_checkpointing)

    def _init_weights(self) -> None:
        """DDPM initialisation: Xavier-uniform weights, zero biases, and zeros for the last layer
        of every residual branch (ResBlock.conv2, AttentionBlock.proj_out, CrossAttention.proj_out)
        and for conv_out, so the network starts as an identity-like map with zero output."""
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        for module in self.modules():
            if isinstance(module, ResBlock):
                nn.init.zeros_(module.conv2.weight)
            elif isinstance(module, AttentionBlock):
                nn.init.zeros_(module.proj_out.weight)
                if module.cross is not None:
                    nn.init.zeros_(module.cross.proj_out.weight)
        nn.init.zeros_(self.conv_out.weight)

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Turn activation checkpointing of every ResBlock, and of every attention block with
        cross-attention, on or off (it acts only in training)."""
        self.config["gradient_checkpointing"] = bool(enabled)
        for module in self.modules():
            if isinstance(module, (ResBlock, AttentionBlock)):
                module.gradient_checkpointing = bool(enabled)

    def forward(self, x: Tensor, t: Tensor, cond: Tensor | None = None, return_logvar: bool = False):
        """Predict the network target for noisy images.

        Args:
            x: (B, in_channels, H, W) float noisy images; H and W divisible by 2**(L-1).
            t: (B,) integer or float timesteps in [0, T) (a 0-d tensor is broadcast); with
                ``interval_embedding``, (B, 2) float: the two times, each embedded on its own.
            cond: the condition, by the kind of model:
                num_classes > 0: (B,) long labels in [0, num_classes], `num_classes` being the
                    null label; None means the null label.
                context_dim > 0: (B, L, context_dim) float text embeddings; required.
                otherwise: None.

            return_logvar: also the learned loss log-variance u(t), (B,) (``logvar_channels`` > 0).

        Returns:
            (B, out_channels, H, W); with ``return_logvar``, (that, (B,) float32).
        """
        t_first = t
        if self.interval_embed is not None:
            if t.ndim != 2 or t.shape[1] != 2:
                raise ValueError(f"this UNet (interval_embedding) takes two times, t of shape (B, 2); got {tuple(t.shape)}")
            t_first = t[:, 0]
            emb = self.time_embed(t_first) + self.interval_embed(t[:, 1])  # (B, 4 * base_channels)
        else:
            emb = self.time_embed(t.expand(x.shape[0]))  # (B, 4 * base_channels)
        context = None
        if self.class_embed is not None:
            if cond is None:
                cond = torch.full((x.shape[0],), self.num_classes, dtype=torch.long, device=x.device)
            emb = emb + self.class_embed(cond)
        elif self.context_dim > 0:
            context = _check_context(cond, x.shape[0], self.context_dim)
        elif cond is not None:
            raise ValueError("cond was given but the model was built with num_classes=0 and context_dim=0 "
                             "(an unconditional model)")

        h = self.conv_in(x)
        skips = [h]
        for level in self.down:
            h = level(h, emb, skips, context)
        h = self.mid(h, emb, context)
        for level in self.up:
            h = level(h, emb, skips, context)
        out = self.conv_out(F.silu(self.norm_out(h)))
        if return_logvar:
            if self.logvar is None:
                raise ValueError("return_logvar needs a UNet built with logvar_channels > 0 "
                                 "(diffusion.uncertainty_weighting = true)")
            return out, self.logvar(t_first.expand(x.shape[0]))
        return out


def _check_context(cond: Tensor | None, batch: int, context_dim: int) -> Tensor:
    """`cond` if it is a (batch, L, context_dim) floating tensor, else a ValueError saying why."""
    if cond is None:
        raise ValueError(f"this text model (context_dim={context_dim}) needs cond: text embeddings "
                         f"(B, L, {context_dim}); got None")
    if cond.ndim != 3 or cond.shape[0] != batch or cond.shape[2] != context_dim or not cond.is_floating_point():
        raise ValueError(f"cond of this text model must be float text embeddings ({batch}, L, {context_dim}); "
                         f"got {cond.dtype} of shape {tuple(cond.shape)}")
    return cond


def _check_args(
    *,
    resolution: int,
    in_channels: int,
    out_channels: int,
    base_channels: int,
    channel_mult: tuple[int, ...],
    num_res_blocks: int,
    attention_resolutions: tuple[int, ...],
    dropout: float,
    num_classes: int,
    norm_groups: int,
    context_dim: int = 0,
) -> None:
    """Raise a ValueError naming the first invalid constructor argument."""
    for name, value in [
        ("resolution", resolution),
        ("in_channels", in_channels),
        ("out_channels", out_channels),
        ("base_channels", base_channels),
        ("num_res_blocks", num_res_blocks),
        ("norm_groups", norm_groups),
    ]:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if base_channels % 2 != 0 or base_channels < 4:
        raise ValueError(f"base_channels must be even and >= 4 (sinusoidal embedding width), got {base_channels}")
    if not channel_mult or not all(isinstance(m, int) and m >= 1 for m in channel_mult):
        raise ValueError(f"channel_mult must be a non-empty tuple of positive integers, got {channel_mult!r}")
    factor = 2 ** (len(channel_mult) - 1)
    if resolution % factor != 0:
        raise ValueError(
            f"resolution must be divisible by 2**(len(channel_mult)-1) = {factor} "
            f"for channel_mult={channel_mult}, got {resolution}"
        )
    for m in channel_mult:
        if (base_channels * m) % norm_groups != 0:
            raise ValueError(
                f"norm_groups={norm_groups} must divide every level's channels base_channels*mult, "
                f"got base_channels={base_channels} * {m} = {base_channels * m}"
            )
    level_resolutions = tuple(resolution // 2**level for level in range(len(channel_mult)))
    for r in attention_resolutions:
        if r not in level_resolutions:
            raise ValueError(
                f"attention_resolutions entry {r!r} matches no level; level resolutions are "
                f"{level_resolutions} for resolution={resolution}, channel_mult={channel_mult}"
            )
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    if not isinstance(num_classes, int) or num_classes < 0:
        raise ValueError(f"num_classes must be an integer >= 0, got {num_classes!r}")
    if not isinstance(context_dim, int) or context_dim < 0:
        raise ValueError(f"context_dim must be an integer >= 0, got {context_dim!r}")
    if context_dim > 0 and num_classes > 0:
        raise ValueError(f"a UNet is conditioned on classes or on text, not both: num_classes={num_classes}, "
                         f"context_dim={context_dim}")
