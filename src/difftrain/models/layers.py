"""Building blocks of the DDPM UNet: timestep embedding, residual block, attention (self and
cross), resampling.

Ho, Jain & Abbeel, "Denoising Diffusion Probabilistic Models", NeurIPS 2020 (arXiv:2006.11239),
Appendix B, and its reference implementation (diffusion_tf/models/unet.py). Module and parameter
names here are the ones `diffusers_export` maps onto diffusers' `UNet2DModel`.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

# GroupNorm epsilon of the DDPM reference code (the TensorFlow group_norm default).
NORM_EPS = 1e-6


def group_norm(channels: int, groups: int) -> nn.GroupNorm:
    """GroupNorm with the DDPM epsilon; `groups` must divide `channels`."""
    return nn.GroupNorm(groups, channels, eps=NORM_EPS)


def sinusoidal_embedding(t: Tensor, dim: int) -> Tensor:
    """Sinusoidal timestep embedding of DDPM (Transformer positions, Vaswani et al. 2017).

    Frequencies are 10000 ** (-i / (dim/2 - 1)) for i in [0, dim/2); the output is the sines
    followed by the cosines, as in the DDPM reference code.

    Args:
        t: (B,) integer or float timesteps.
        dim: embedding width, even and >= 4.

    Returns:
        (B, dim) float32 embedding.
    """
    angles = t[:, None].float() * _frequencies(dim // 2, t.device)[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


_FREQUENCIES: dict[tuple[int, torch.device], Tensor] = {}


def _frequencies(half: int, device: torch.device) -> Tensor:
    """(half,) float32 10000 ** (-i / (half - 1)), made once per width and device in eager mode
    rather than by four kernels per step (a compiled graph computes them in itself)."""
    if torch.compiler.is_compiling():
        return _make_frequencies(half, device)
    if (half, device) not in _FREQUENCIES:
        with torch.inference_mode(False):  # a normal tensor, usable in training after sampling
            _FREQUENCIES[half, device] = _make_frequencies(half, device)
    return _FREQUENCIES[half, device]


def _make_frequencies(half: int, device: torch.device) -> Tensor:
    exponent = -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=device)
    return torch.exp(exponent / (half - 1))


class TimestepEmbedding(nn.Module):
    """Sinusoidal embedding of t followed by a 2-layer MLP: (B,) -> (B, out_dim)."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.in_dim = in_dim
        self.linear_1 = nn.Linear(in_dim, out_dim)
        self.linear_2 = nn.Linear(out_dim, out_dim)

    def forward(self, t: Tensor) -> Tensor:
        """t: (B,) timesteps -> (B, out_dim)."""
        emb = sinusoidal_embedding(t, self.in_dim).to(self.linear_1.weight.dtype)
        return self.linear_2(F.silu(self.linear_1(emb)))


class ResBlock(nn.Module):
    """DDPM residual block with an additive timestep-embedding projection.

    norm1 -> SiLU -> conv1 -> (+ time_proj(SiLU(emb))) -> norm2 -> SiLU -> dropout -> conv2,
    added to the input (through a 1x1 conv `skip` when the channel count changes).
    """

    def __init__(
        self, in_channels: int, out_channels: int, emb_dim: int, dropout: float, norm_groups: int
    ) -> None:
        super().__init__()
        self.norm1 = group_norm(in_channels, norm_groups)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.time_proj = nn.Linear(emb_dim, out_channels)
        self.norm2 = group_norm(out_channels, norm_groups)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.skip = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else nn.Identity()
        # Recompute activations in backward instead of storing them (set by UNet).
        self.gradient_checkpointing = False

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:
        """x: (B, C_in, H, W), emb: (B, emb_dim) -> (B, C_out, H, W)."""
        if self.gradient_checkpointing and self.training:
            return checkpoint(self._forward, x, emb, use_reentrant=False)
        return self._forward(x, emb)

    def _forward(self, x: Tensor, emb: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time_proj(F.silu(emb))[:, :, None, None]
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        return self.skip(x) + h


class CrossAttention(nn.Module):
    """Pre-norm single-head cross-attention from image positions to text tokens, with a residual.

    GroupNorm of x, queries from its H*W positions, keys and values from the context tokens
    (Rombach et al. 2022, "High-Resolution Image Synthesis with Latent Diffusion Models", Sec. 3.3).
    """

    def __init__(self, channels: int, context_dim: int, norm_groups: int) -> None:
        super().__init__()
        self.norm = group_norm(channels, norm_groups)
        self.q = nn.Linear(channels, channels)
        self.k = nn.Linear(context_dim, channels)
        self.v = nn.Linear(context_dim, channels)
        self.proj_out = nn.Linear(channels, channels)

    def forward(self, x: Tensor, context: Tensor) -> Tensor:
        """x: (B, C, H, W), context: (B, L, context_dim) -> (B, C, H, W)."""
        B, C, H, W = x.shape
        h = self.norm(x).flatten(2).transpose(1, 2)  # (B, H*W, C)
        q = self.q(h).unsqueeze(1)  # (B, 1, H*W, C)
        context = context.to(q.dtype)
        k, v = self.k(context).unsqueeze(1), self.v(context).unsqueeze(1)  # (B, 1, L, C)
        h = F.scaled_dot_product_attention(q, k, v).squeeze(1)  # (B, H*W, C)
        h = self.proj_out(h).transpose(1, 2).reshape(B, C, H, W)
        return x + h


class AttentionBlock(nn.Module):
    """Single-head self-attention over the H*W positions, with a residual connection (DDPM);
    with `context_dim > 0`, followed by a `CrossAttention` (`cross`) to text tokens.

    Uses `F.scaled_dot_product_attention`, so fused kernels are picked where the device has them.
    """

    def __init__(self, channels: int, norm_groups: int, context_dim: int = 0) -> None:
        super().__init__()
        self.norm = group_norm(channels, norm_groups)
        self.q = nn.Linear(channels, channels)
        self.k = nn.Linear(channels, channels)
        self.v = nn.Linear(channels, channels)
        self.proj_out = nn.Linear(channels, channels)
        # Created after the self-attention, and only for a text model: models without context
        # keep their parameter names and initialisation order.
        self.cross = CrossAttention(channels, context_dim, norm_groups) if context_dim > 0 else None
        # Recompute activations in backward instead of storing them (set by UNet, text models only).
        self.gradient_checkpointing = False

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        """x: (B, C, H, W), context: (B, L, context_dim) or None -> (B, C, H, W)."""
        if self.cross is None:
            return self._self_attention(x)
        if self.gradient_checkpointing and self.training:
            return checkpoint(self._forward_with_context, x, context, use_reentrant=False)
        return self._forward_with_context(x, context)

    def _forward_with_context(self, x: Tensor, context: Tensor) -> Tensor:
        return self.cross(self._self_attention(x), context)

    def _self_attention(self, x: Tensor) -> Tensor:
        B, C, H, W = x.shape
        h = self.norm(x).flatten(2).transpose(1, 2)  # (B, H*W, C); a view under channels_last
        q, k, v = (proj(h).unsqueeze(1) for proj in (self.q, self.k, self.v))  # (B, 1, H*W, C)
        h = F.scaled_dot_product_attention(q, k, v).squeeze(1)  # softmax(q k^T / sqrt(C)) v
        h = self.proj_out(h).transpose(1, 2).reshape(B, C, H, W)
        return x + h


class NoAttention(nn.Identity):
    """The identity in the place of an attention block, taking (and ignoring) the context."""

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        return x


class Downsample(nn.Module):
    """Stride-2 3x3 conv halving the resolution: (B, C, H, W) -> (B, C, H/2, W/2).

    Padded by one row and column at the bottom and right only, as TensorFlow's 'SAME' padding in
    the DDPM reference code, so released DDPM weights compute the same function here.
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    """Nearest-neighbour 2x upsampling then a 3x3 conv: (B, C, H, W) -> (B, C, 2H, 2W)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class UncertaintyHead(nn.Module):
    """EDM2's learned loss weighting (Karras et al. 2024, "Analyzing and improving the training
    dynamics of diffusion models", eq. 21): u(t) = linear(fourier(t)), the log-variance of the
    loss at noise conditioning t, (B,) -> (B,) float32. Random Fourier features cos(2 pi (x f +
    phi)) sqrt(2) with f ~ N(0, 1), phi ~ U(0, 1) (fixed buffers, seeded: the same in every
    build) of x = t / 250 (t in [0, 1000]: a span of 4, as EDM2's c_noise spans 2.7), and a
    zero-initialised linear layer, so u = 0 (the plain loss) at the start."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.register_buffer("freqs", torch.randn(channels, generator=gen))
        self.register_buffer("phases", torch.rand(channels, generator=gen))
        self.linear = nn.Linear(channels, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, t: Tensor) -> Tensor:
        x = t.float()[:, None] / 250.0
        features = torch.cos(2 * math.pi * (x * self.freqs + self.phases)) * math.sqrt(2.0)
        return self.linear(features).float().reshape(-1)
