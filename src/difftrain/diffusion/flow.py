"""Flow matching / rectified flow with a velocity target (Lipman et al. 2023, "Flow Matching for
Generative Modeling"; Liu et al. 2023, "Flow Straight and Fast"), logit-normal t as in SD3
(Esser et al. 2024, "Scaling Rectified Flow Transformers", sec. 3.1).

The straight path from data (t = 0) to noise (t = 1) and its velocity (SD3 eq. 2 with
a_t = 1 - t, b_t = t; Liu et al. eq. 1):

    x_t = (1 - t) x0 + t eps,     v = dx_t/dt = eps - x0

The network regresses v with weight 1 (the conditional flow matching loss, Lipman et al. eq. 9).
Training t is logit-normal: logit(t) ~ N(m, s^2) (SD3 eq. 19). Sampling integrates
dx/dt = v(x, t) from t = 1 (x_T ~ N(0, I)) to t = 0 on a uniform grid, optionally shifted
(SD3 eq. 23). The denoised image is x0_hat = x_t - t v.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from difftrain.diffusion.interface import Network, Noised
from difftrain.diffusion.ode_samplers import ODE_SOLVERS, flow_times

# The UNet embeds its conditioning with DDPM's sinusoids, made for timesteps in [0, 1000)
# (models/layers.py); t in (0, 1) would leave all but the fastest few nearly constant. The
# network gets 1000 t, as SD3's reference code does.
COND_SCALE = 1000.0


def _view(v: Tensor, like: Tensor) -> Tensor:
    """(B,) -> (B, 1, ..., 1) in like's dtype and device."""
    return v.reshape(-1, *([1] * (like.ndim - 1))).to(device=like.device, dtype=like.dtype)


class FlowObjective:
    """Rectified flow with a velocity target. Levels are t, (B,) float32 in (0, 1).

    Args:
        logit_mean, logit_std: logit(t) ~ N(logit_mean, logit_std^2) in training.
        shift: sampling grid shift (1 = uniform in t; > 1 more steps at high noise).
    """

    family = "flow"
    # The velocity is defined at t = 0, so Heun's last step is second order too (2N evaluations).
    samplers = {"euler": ODE_SOLVERS["euler"], "heun": functools.partial(ODE_SOLVERS["heun"], defined_at_zero=True),
                "midpoint": ODE_SOLVERS["midpoint"]}
    # Network evaluations per sampler for N steps (reported with FID).
    sampler_nfe = {"euler": lambda n: n, "heun": lambda n: 2 * n, "midpoint": lambda n: 2 * n}

    def __init__(self, logit_mean: float = 0.0, logit_std: float = 1.0, shift: float = 1.0):
        self.logit_mean, self.logit_std, self.shift = logit_mean, logit_std, shift

    def to(self, device: torch.device) -> FlowObjective:
        """Nothing lives on a device; returns self."""
        return self

    def cond(self, t: Tensor) -> Tensor:
        """What the network is conditioned on: 1000 t, (B,) float32."""
        return (t * COND_SCALE).float()

    def quantile(self, u: Tensor) -> Tensor:
        """The t at probability u in (0, 1) of the training distribution: sigmoid(m + s Phi^-1(u))."""
        return torch.sigmoid(self.logit_mean + self.logit_std * torch.special.ndtri(u.double())).float()

    def draw_levels(self, n: int, generator: torch.Generator, device: torch.device) -> Tensor:
        """(n,) float32 t, logit-normal (SD3 eq. 19)."""
        return torch.sigmoid(torch.randn(n, device=device, generator=generator) * self.logit_std + self.logit_mean)

    def stratified_levels(self, n: int, generator: torch.Generator) -> Tensor:
        """(n,) float32 t on the CPU, one inside each of n slices of equal probability, ascending."""
        u = (torch.arange(n, dtype=torch.float64) + torch.rand(n, generator=generator, dtype=torch.float64)) / n
        return self.quantile(u.clamp(1e-12, 1 - 1e-12))

    def bucket(self, levels: Tensor, num_buckets: int) -> Tensor:
        """(n,) long: bucket i holds the t with CDF in [i / k, (i + 1) / k); 0 = least noise."""
        logit = torch.logit(levels.double())
        u = torch.special.ndtr((logit - self.logit_mean) / self.logit_std)
        return (u * num_buckets).floor().long().clamp_(0, num_buckets - 1)

    def noised(self, x0: Tensor, levels: Tensor, noise: Tensor) -> Noised:
        """x_t = (1 - t) x0 + t eps, cond 1000 t, target v = eps - x0, weight 1.
        x0, noise: (B, C, H, W); levels: (B,) t."""
        t = _view(levels, x0)
        noise = noise.to(x0.dtype)
        x_t = (1.0 - t) * x0 + t * noise
        return Noised(x_t, self.cond(levels), noise - x0, torch.ones_like(levels, dtype=torch.float32))

    def x0_hat(self, b: Noised, out: Tensor, levels: Tensor) -> Tensor:
        """x0_hat = x_t - t v_hat from the network output on ``b.input`` = x_t."""
        return b.input - _view(levels, b.input) * out.to(b.input.dtype)

    def velocity(self, network: Network) -> Callable[[Tensor, float], Tensor]:
        """``v(x (B, C, H, W), t: float) -> (B, C, H, W)`` float32 from the raw network."""

        def v(x: Tensor, t: float) -> Tensor:
            return network(x, self.cond(torch.full((x.shape[0],), t, dtype=torch.float64, device=x.device))).float()

        return v

    def sample(self, network: Network, x_T: Tensor, sampler: str, steps: int, generator, clip: bool = True,
               **options) -> Tensor:
        """x_0 (B, C, H, W) float32: integrate dx/dt = v from t = 1 (x_T, unit noise) to t = 0 with
        ``sampler`` over ``steps`` steps of the (shifted) uniform grid."""
        if sampler not in self.samplers:
            raise ValueError(f"sampler must be one of {', '.join(self.samplers)} for flow models, got {sampler!r}")
        x0 = self.samplers[sampler](self.velocity(network), x_T, flow_times(steps, self.shift), generator, **options)
        return x0.clamp(-1.0, 1.0) if clip else x0
