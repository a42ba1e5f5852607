"""EDM2's network (Karras et al. 2024, "Analyzing and Improving the Training Dynamics of Diffusion
Models", config G, Fig. 21): a UNet whose every layer preserves the magnitude of its activations.

What makes it config G, each written here from the paper's equations (sec. 2 and appendix B):

- no biases, and every convolution or linear layer an :class:`MPConv` computing with weight rows
  normalised to unit norm and scaled by 1 / sqrt(fan_in) (eq. 47), its stored rows put back to unit
  RMS after every optimizer step (forced weight normalisation, eq. 66: :func:`renormalize_`);
- pixel normalisation (each position's channel vector to unit RMS) instead of GroupNorm;
- MP-SiLU ``silu(x) / 0.596`` (eq. 81), MP-sum ``lerp(a, b, t) / sqrt((1 - t)^2 + t^2)`` (eq. 88) with
  the residual and attention balances 0.3, and MP-cat (eq. 103) of the skips with balance 0.5;
- the noise level embedded by magnitude-preserving Fourier features of c_noise = ln(sigma) / 4 (eq. 75),
  the class label (one-hot times sqrt(classes)) MP-summed into it with balance 0.5;
- an extra constant input channel of ones, and cosine attention (queries, keys and values pixel-normalised
  per head before the softmax);
- a learned output gain starting at 0 (so the network starts at zero output), and learned gains starting at
  0 on the embedding's modulation of every block (``1 + emb_linear(emb) * emb_gain``);
- activations clipped to [-256, 256] after each block;
- the learned loss weighting (eq. 21) from its own Fourier features of c_noise and a weight-normalised
  linear layer (``logvar.*``), as EDM2's preconditioner holds it.

The network is conditioned on EDM's c_noise: it takes what ``diffusion/edm.py``'s ``EDMObjective.cond`` gives
any network and inverts it (``c_noise_of_cond``), so it serves ``diffusion.objective = "edm"`` only (config.py
refuses the others). Down- and upsampling are EDM2's [1, 1] filter: a 2x2 average and a nearest-neighbour
copy. One difference from EDM2's code: a block with attention has ``max(1, channels // 64)`` heads, where
EDM2 has ``channels // 64`` (none below 64 channels, which the CPU presets have).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from difftrain.diffusion.edm import c_noise_of_cond
from difftrain.models.layers import MP_EPS, mp_normalize

# E[silu(x)^2] ** 0.5 for x ~ N(0, 1): MP-SiLU's divisor (EDM2 eq. 81).
MP_SILU_GAIN = 0.596
RES_BALANCE = 0.3  # MP-sum of the main branch (0) and the residual branch (1)
ATTN_BALANCE = 0.3  # MP-sum of the main branch (0) and the self-attention (1)
CONCAT_BALANCE = 0.5  # MP-cat of the decoder's input (0) and the skip connection (1)
LABEL_BALANCE = 0.5  # MP-sum of the noise embedding (0) and the class embedding (1)
CHANNELS_PER_HEAD = 64
CLIP_ACT = 256.0  # activations clipped to [-CLIP_ACT, CLIP_ACT] after each block


def mp_silu(x: Tensor) -> Tensor:
    """SiLU scaled back to unit variance for unit-variance input (eq. 81); any shape."""
    return F.silu(x) / MP_SILU_GAIN


def mp_sum(a: Tensor, b: Tensor, t: float) -> Tensor:
    """(1 - t) a + t b scaled so two independent unit-variance inputs give unit variance (eq. 88)."""
    return torch.lerp(a, b, t) / math.sqrt((1 - t) ** 2 + t**2)


def mp_cat(a: Tensor, b: Tensor, t: float, dim: int = 1) -> Tensor:
    """``a`` and ``b`` concatenated along ``dim``, weighted (1 - t) : t per tensor, not per channel, and
    scaled so unit-variance inputs give a unit-variance result (eq. 103): (B, Na, ...) + (B, Nb, ...)."""
    na, nb = a.shape[dim], b.shape[dim]
    scale = math.sqrt((na + nb) / ((1 - t) ** 2 + t**2))
    return torch.cat([a * (scale * (1 - t) / math.sqrt(na)), b * (scale * t / math.sqrt(nb))], dim=dim)


def pixel_norm(x: Tensor, dim: int = 1, eps: float = MP_EPS) -> Tensor:
    """``x`` with each vector along ``dim`` scaled to unit RMS (EDM2's replacement of GroupNorm): x / (eps + rms)."""
    rms = torch.linalg.vector_norm(x, dim=dim, keepdim=True, dtype=torch.float32) / math.sqrt(x.shape[dim])
    return x / (eps + rms).to(x.dtype)


class MPFourier(nn.Module):
    """Magnitude-preserving Fourier features (eq. 75): (B,) -> (B, channels) ``sqrt(2) cos(2 pi (f x + phi))``,
    f ~ N(0, 1) and phi ~ U(0, 1) drawn from the global generator at build (buffers, so checkpointed)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("freqs", 2 * math.pi * torch.randn(channels))
        self.register_buffer("phases", 2 * math.pi * torch.rand(channels))

    def forward(self, x: Tensor) -> Tensor:
        y = torch.outer(x.float(), self.freqs.float()) + self.phases.float()
        return (y.cos() * math.sqrt(2.0)).to(x.dtype)


class MPConv(nn.Module):
    """A bias-free convolution (kernel (k, k)) or linear layer (kernel ()) with magnitude-preserving weights
    (eq. 47): it computes with ``gain * normalize(weight) / sqrt(fan_in)``, so unit-variance input gives
    unit-variance output whatever the stored scale. Stored rows start at unit RMS; :meth:`renormalize_` puts
    them back there (forced weight normalisation, eq. 66). (B, C_in, H, W) -> (B, C_out, H, W) (same padding)
    or (..., C_in) -> (..., C_out)."""

    def __init__(self, in_channels: int, out_channels: int, kernel: Sequence[int]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_channels, in_channels, *kernel))
        self.renormalize_()

    def effective_weight(self, gain: Tensor | float = 1.0) -> Tensor:
        """The weight it computes with: unit-norm rows times ``gain`` (a scalar)."""
        return mp_normalize(self.weight) * (gain / math.sqrt(self.weight[0].numel()))

    def forward(self, x: Tensor, gain: Tensor | float = 1.0) -> Tensor:
        w = self.effective_weight(gain).to(x.dtype)
        if w.ndim == 2:
            return F.linear(x, w)
        return F.conv2d(x, w, padding=w.shape[-1] // 2)

    @torch.no_grad()
    def renormalize_(self) -> None:
        self.weight.copy_(mp_normalize(self.weight))


def renormalize_(model: nn.Module) -> None:
    """EDM2's forced weight normalisation of every :class:`MPConv` of ``model`` (after each optimizer step)."""
    for module in model.modules():
        if isinstance(module, MPConv):
            module.renormalize_()


class Block(nn.Module):
    """EDM2's encoder ("enc") or decoder ("dec") block (Fig. 21), optionally resampling first and with
    cosine self-attention after: (B, C_in, H, W), emb (B, D) -> (B, C_out, H', W').

    Encoder: resample, 1x1 ``conv_skip`` (when the channels change), pixel norm, then the residual branch.
    Decoder: resample, residual branch on the input, ``conv_skip`` on the main branch. The residual branch
    is MP-SiLU -> 3x3 conv -> times (1 + emb_linear(emb) emb_gain) -> MP-SiLU -> dropout -> 3x3 conv.
    """

    def __init__(self, in_channels: int, out_channels: int, emb_channels: int, flavor: str = "enc",
                 resample: str = "keep", attention: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.flavor, self.resample, self.dropout = flavor, resample, dropout
        self.num_heads = max(1, out_channels // CHANNELS_PER_HEAD) if attention else 0
        self.emb_gain = nn.Parameter(torch.zeros(()))
        self.conv_res0 = MPConv(out_channels if flavor == "enc" else in_channels, out_channels, (3, 3))
        self.emb_linear = MPConv(emb_channels, out_channels, ())
        self.conv_res1 = MPConv(out_channels, out_channels, (3, 3))
        self.conv_skip = MPConv(in_channels, out_channels, (1, 1)) if in_channels != out_channels else None
        self.attn_qkv = MPConv(out_channels, 3 * out_channels, (1, 1)) if attention else None
        self.attn_proj = MPConv(out_channels, out_channels, (1, 1)) if attention else None
        self.gradient_checkpointing = False  # set by EDM2UNet

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:
        if self.gradient_checkpointing and self.training:
            return checkpoint(self._forward, x, emb, use_reentrant=False)
        return self._forward(x, emb)

    def _forward(self, x: Tensor, emb: Tensor) -> Tensor:
        # Main branch.
        if self.resample == "down":
            x = F.avg_pool2d(x, 2)  # EDM2's [1, 1] filter, stride 2
        elif self.resample == "up":
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")  # its transposed twin
        if self.flavor == "enc":
            if self.conv_skip is not None:
                x = self.conv_skip(x)
            x = pixel_norm(x)
        # Residual branch, modulated by the embedding.
        y = self.conv_res0(mp_silu(x))
        scale = self.emb_linear(emb, gain=self.emb_gain) + 1  # (B, C_out)
        y = mp_silu(y * scale[:, :, None, None].to(y.dtype))
        if self.training and self.dropout:
            y = F.dropout(y, p=self.dropout)
        y = self.conv_res1(y)
        if self.flavor == "dec" and self.conv_skip is not None:
            x = self.conv_skip(x)
        x = mp_sum(x, y, RES_BALANCE)
        # Cosine self-attention.
        if self.attn_qkv is not None:
            B, C, H, W = x.shape
            qkv = self.attn_qkv(x).reshape(B, 3, self.num_heads, C // self.num_heads, H * W)
            q, k, v = pixel_norm(qkv, dim=3).transpose(3, 4).unbind(1)  # (B, heads, H*W, C/heads) each
            y = F.scaled_dot_product_attention(q, k, v)  # softmax(q k^T / sqrt(C/heads)) v
            y = self.attn_proj(y.transpose(2, 3).reshape(B, C, H, W))
            x = mp_sum(x, y, ATTN_BALANCE)
        return x.clamp(-CLIP_ACT, CLIP_ACT)


class UncertaintyHead(nn.Module):
    """EDM2's learned loss weighting as its preconditioner holds it (eq. 21): u = MPConv(MPFourier(c_noise)),
    (B,) c_noise -> (B,) float32."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.fourier = MPFourier(channels)
        self.linear = MPConv(channels, 1, ())

    def forward(self, c_noise: Tensor) -> Tensor:
        return self.linear(self.fourier(c_noise)).float().reshape(-1)


class EDM2UNet(nn.Module):
    """EDM2's UNet (config G) predicting EDM's F (B, out_channels, H, W) from c_in x and the EDM
    conditioning ``t`` (``EDMObjective.cond``), with class labels or none.

    Module layout:
        emb_fourier, emb_noise   MPFourier(C_0) of c_noise, then MPConv(C_0 -> D), D = max channels
        emb_label                MPConv(num_classes -> D), only if num_classes > 0
        enc                      ModuleDict in forward order: "{res}_conv" (the input conv on the image and a
                                 channel of ones), "{res}_down", "{res}_block{j}"
        dec                      ModuleDict in forward order: "{res}_in0" (attention), "{res}_in1" at the
                                 lowest resolution, "{res}_up" elsewhere, "{res}_block{j}" on MP-cat skips
        out_conv, out_gain       MPConv(C_0 -> out_channels) with the learned gain (starts at 0)
        logvar                   the learned loss weighting, only if logvar_channels > 0

    Args (keyword-only; the names of difftrain's UNet where they mean the same):
        resolution: image size; divisible by 2 ** (len(channel_mult) - 1).
        in_channels, out_channels: image channels (out: default in_channels).
        base_channels, channel_mult: per-level channels base_channels * channel_mult[l].
        num_res_blocks: encoder blocks per level (the decoder has one more).
        attention_resolutions: resolutions whose blocks end with self-attention (the lowest level's
            first decoder block always does, as in EDM2).
        dropout: in the residual branches.
        num_classes: class conditioning (label num_classes is the null label: a zero vector); 0 = none.
        context_dim: must be 0 (no text conditioning).
        gradient_checkpointing: recompute each block's activations in backward while training.
        logvar_channels: > 0 adds the learned loss weighting head.
    """

    def __init__(self, *, resolution: int, in_channels: int = 3, out_channels: int | None = None,
                 base_channels: int = 32, channel_mult: Sequence[int] = (1, 1, 2), num_res_blocks: int = 1,
                 attention_resolutions: Sequence[int] = (8,), dropout: float = 0.0, num_classes: int = 0,
                 context_dim: int = 0, gradient_checkpointing: bool = False, logvar_channels: int = 0) -> None:
        super().__init__()
        channel_mult, attention_resolutions = tuple(channel_mult), tuple(attention_resolutions)
        out_channels = in_channels if out_channels is None else out_channels
        if context_dim:
            raise ValueError("EDM2's network has no text conditioning (context_dim must be 0)")
        levels = len(channel_mult)
        if resolution % 2 ** (levels - 1):
            raise ValueError(f"resolution {resolution} must be divisible by 2 ** (levels - 1) = {2 ** (levels - 1)}")
        # The resolved constructor arguments: EDM2UNet(**model.config) rebuilds the architecture.
        self.config = dict(resolution=resolution, in_channels=in_channels, out_channels=out_channels,
                           base_channels=base_channels, channel_mult=channel_mult, num_res_blocks=num_res_blocks,
                           attention_resolutions=attention_resolutions, dropout=dropout, num_classes=num_classes,
                           context_dim=0, gradient_checkpointing=gradient_checkpointing,
                           logvar_channels=logvar_channels)
        self.num_classes = num_classes
        channels = [base_channels * m for m in channel_mult]
        emb_channels = max(channels)

        # Embedding.
        self.emb_fourier = MPFourier(channels[0])
        self.emb_noise = MPConv(channels[0], emb_channels, ())
        self.emb_label = MPConv(num_classes, emb_channels, ()) if num_classes > 0 else None

        # Encoder.
        self.enc = nn.ModuleDict()
        c_out = in_channels + 1
        for level, c in enumerate(channels):
            res = resolution >> level
            if level == 0:
                self.enc[f"{res}_conv"] = MPConv(c_out, c, (3, 3))
                c_out = c
            else:
                self.enc[f"{res}_down"] = Block(c_out, c_out, emb_channels, "enc", "down", dropout=dropout)
            for j in range(num_res_blocks):
                self.enc[f"{res}_block{j}"] = Block(c_out, c, emb_channels, "enc",
                                                    attention=res in attention_resolutions, dropout=dropout)
                c_out = c
        skips = [_out_channels(block) for block in self.enc.values()]

        # Decoder.
        self.dec = nn.ModuleDict()
        for level in reversed(range(levels)):
            res, c = resolution >> level, channels[level]
            if level == levels - 1:
                self.dec[f"{res}_in0"] = Block(c_out, c_out, emb_channels, "dec", attention=True, dropout=dropout)
                self.dec[f"{res}_in1"] = Block(c_out, c_out, emb_channels, "dec", dropout=dropout)
            else:
                self.dec[f"{res}_up"] = Block(c_out, c_out, emb_channels, "dec", "up", dropout=dropout)
            for j in range(num_res_blocks + 1):
                self.dec[f"{res}_block{j}"] = Block(c_out + skips.pop(), c, emb_channels, "dec",
                                                    attention=res in attention_resolutions, dropout=dropout)
                c_out = c
        self.out_conv = MPConv(c_out, out_channels, (3, 3))
        self.out_gain = nn.Parameter(torch.zeros(()))
        self.logvar = UncertaintyHead(logvar_channels) if logvar_channels else None
        self.set_gradient_checkpointing(gradient_checkpointing)

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Turn activation checkpointing of every block on or off (it acts only in training)."""
        self.config["gradient_checkpointing"] = bool(enabled)
        for module in self.modules():
            if isinstance(module, Block):
                module.gradient_checkpointing = bool(enabled)

    def forward(self, x: Tensor, t: Tensor, cond: Tensor | None = None, return_logvar: bool = False):
        """x: (B, in_channels, H, W) c_in-scaled noisy images; t: (B,) (or 0-d) EDM conditioning
        (``EDMObjective.cond``); cond: (B,) long labels in [0, num_classes] (num_classes: the null label; None:
        all null) or None for an unconditional model. Returns (B, out_channels, H, W); with ``return_logvar``,
        (that, u (B,) float32)."""
        c_noise = c_noise_of_cond(t.expand(x.shape[0])).to(x.dtype)
        emb = self.emb_noise(self.emb_fourier(c_noise))  # (B, D)
        if self.emb_label is not None:
            if cond is None:
                cond = torch.full((x.shape[0],), self.num_classes, dtype=torch.long, device=x.device)
            one_hot = F.one_hot(cond, self.num_classes + 1)[:, :-1].to(x.dtype)  # the null label: zeros
            emb = mp_sum(emb, self.emb_label(one_hot * math.sqrt(self.num_classes)), LABEL_BALANCE)
        elif cond is not None:
            raise ValueError("cond was given but the model was built with num_classes=0 (an unconditional model)")
        emb = mp_silu(emb)

        h = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)  # the constant input channel
        skips = []
        for block in self.enc.values():
            h = block(h) if isinstance(block, MPConv) else block(h, emb)
            skips.append(h)
        for name, block in self.dec.items():
            if "_block" in name:
                h = mp_cat(h, skips.pop(), CONCAT_BALANCE)
            h = block(h, emb)
        out = self.out_conv(h, gain=self.out_gain)
        if return_logvar:
            if self.logvar is None:
                raise ValueError("return_logvar needs a network built with logvar_channels > 0 "
                                 "(diffusion.uncertainty_weighting = true)")
            return out, self.logvar(c_noise)
        return out


def _out_channels(block: nn.Module) -> int:
    """The channels an encoder entry pushes as a skip connection."""
    return block.weight.shape[0] if isinstance(block, MPConv) else block.conv_res1.weight.shape[0]
