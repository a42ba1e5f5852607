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


# ---------------------------------------------------------------------------------------------
# EDM2's magnitude-preserving learned layers (Karras et al. 2024, "Analyzing and improving the
# training dynamics of diffusion models", sec. 2.3-2.4, configs D and E of its Table 1).

MP_EPS = 1e-4  # EDM2's epsilon of the weight normalisation


def mp_normalize(w: Tensor, eps: float = MP_EPS) -> Tensor:
    """``w`` (C_out, ...) with each output row scaled to unit RMS over its fan-in: w_i / (eps + rms(w_i))."""
    dims = tuple(range(1, w.ndim))
    rms = torch.linalg.vector_norm(w, dim=dims, keepdim=True, dtype=torch.float32) / math.sqrt(w[0].numel())
    return w / (eps + rms).to(w.dtype)


class _MagnitudePreserving:
    """Weight normalisation on use: the layer computes with ``gain * normalize(weight) / sqrt(fan_in)``,
    unit-norm rows, so unit-variance inputs give unit-variance outputs whatever the stored weights'
    scale (EDM2 config D). ``gain`` is a learned scalar only where the DDPM UNet zero-initialises a
    layer (the last layer of each residual branch, ``conv_out``): it starts at 0 there, so the
    network still starts with zero residual branches; elsewhere it is 1. ``renormalize_()`` is
    EDM2's forced weight normalisation (config E): the stored rows are put back to unit RMS after
    every optimizer step (``difftrain.training.optimizers``), so the effective learning rate does
    not decay as the weights grow. The bias is kept (zero-initialised)."""

    gain: nn.Parameter | None

    def effective_weight(self) -> Tensor:
        w = mp_normalize(self.weight) / math.sqrt(self.weight[0].numel())
        return w if self.gain is None else w * self.gain

    @torch.no_grad()
    def renormalize_(self) -> None:
        self.weight.copy_(mp_normalize(self.weight))


class MPConv2d(_MagnitudePreserving, nn.Conv2d):
    """nn.Conv2d with magnitude-preserving weights: (B, C_in, H, W) -> (B, C_out, H', W')."""

    def forward(self, x: Tensor) -> Tensor:
        return self._conv_forward(x, self.effective_weight(), self.bias)


class MPLinear(_MagnitudePreserving, nn.Linear):
    """nn.Linear with magnitude-preserving weights: (..., in) -> (..., out)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.effective_weight(), self.bias)


def _mp_copy(layer: nn.Module) -> nn.Module:
    """The magnitude-preserving twin of an nn.Conv2d or nn.Linear, holding a unit-RMS random weight
    (seeded from the global RNG, as the layer's own init) and the layer's bias."""
    if isinstance(layer, nn.Conv2d):
        mp = MPConv2d(layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride,
                      padding=layer.padding, dilation=layer.dilation, groups=layer.groups,
                      bias=layer.bias is not None, padding_mode=layer.padding_mode)
    else:
        mp = MPLinear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    zero_init = not bool(layer.weight.detach().any())
    with torch.no_grad():
        mp.weight.normal_()
        mp.renormalize_()
        if mp.bias is not None:
            mp.bias.copy_(layer.bias)
    mp.gain = nn.Parameter(torch.zeros(())) if zero_init else None
    return mp


def make_magnitude_preserving(model: nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Replace every plain nn.Conv2d and nn.Linear of ``model`` by its magnitude-preserving twin,
    except under the submodules named in ``skip``; returns how many. Call after the model's own
    init: a layer it zero-initialised gets a zero learned gain."""
    replaced = 0
    for name, parent in list(model.named_modules()):
        if any(name == s or name.startswith(s + ".") for s in skip):
            continue
        for child_name, child in list(parent.named_children()):
            qualified = f"{name}.{child_name}" if name else child_name
            if type(child) in (nn.Conv2d, nn.Linear) and qualified not in skip:
                setattr(parent, child_name, _mp_copy(child))
                replaced += 1
    return replaced


def renormalize_magnitude_preserving_(model: nn.Module) -> None:
    """EDM2's forced weight normalisation of every magnitude-preserving layer of ``model``."""
    for module in model.modules():
        if isinstance(module, _MagnitudePreserving):
            module.renormalize_()


def bake_magnitude_preserving(state_dict: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """``state_dict`` with each magnitude-preserving layer's weight replaced by the weight it computes
    with (gain included) and its ``gain`` entry dropped: the plain layers' state dict of the same
    function (what an export to diffusers' classes writes)."""
    out = dict(state_dict)
    for name, module in model.named_modules():
        if isinstance(module, _MagnitudePreserving):
            prefix = f"{name}." if name else ""
            with torch.no_grad():
                out[prefix + "weight"] = module.effective_weight().detach().clone()
            out.pop(prefix + "gain", None)
    return out
