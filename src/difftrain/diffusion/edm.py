"""EDM (Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based Generative Models"):
preconditioning, lognormal noise levels, loss weight, and sampling on the EDM sigma grid.

x = x0 + sigma n with n ~ N(0, I), and the denoiser is (Table 1, "Ours")

    D(x, sigma) = c_skip(sigma) x + c_out(sigma) F(c_in(sigma) x, c_noise(sigma))
    c_skip = sd^2 / (sigma^2 + sd^2)      c_out = sigma sd / sqrt(sigma^2 + sd^2)
    c_in   = 1 / sqrt(sigma^2 + sd^2)     c_noise = ln(sigma) / 4

with sd = sigma_data. The loss lambda(sigma) ||D(x, sigma) - x0||^2 with
lambda = (sigma^2 + sd^2) / (sigma sd)^2 (eq. 8 and Table 1) equals
lambda c_out^2 ||F - (x0 - c_skip x) / c_out||^2, and lambda c_out^2 = 1: the network regresses
the "effective target" (x0 - c_skip x) / c_out with weight 1 (sec. 5, eq. 8). Training noise
levels are lognormal: ln(sigma) ~ N(P_mean, P_std^2).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from difftrain.diffusion.interface import Network, Noised
from difftrain.diffusion.ode_samplers import ODE_SOLVERS, karras_sigmas

# The UNet embeds its conditioning with DDPM's sinusoids (models/layers.py), whose frequencies
# run from 1 down to 1e-4 rad per unit: made for integer timesteps in [0, 1000). Table 1's
# c_noise = ln(sigma) / 4 spans only [-1.55, 1.10] over sigma in [0.002, 80], where all but the
# fastest few sinusoids are nearly constant. So the network gets c_noise mapped affinely onto
# [0, 1000] over EDM's default sigma range (fixed constants, so the conditioning of a trained
# network never depends on the sampling keys); an affine map of c_noise is still Table 1's
# c_noise up to the network's first layer.
_LOG_SIGMA_LO, _LOG_SIGMA_HI = math.log(0.002), math.log(80.0)
COND_SCALE = 1000.0 / (_LOG_SIGMA_HI - _LOG_SIGMA_LO)  # per unit of ln(sigma); = 250 / (c_noise span)


def c_noise_of_cond(cond: Tensor) -> Tensor:
    """Table 1's c_noise = ln(sigma) / 4 from what :meth:`EDMObjective.cond` gives the network (its
    inverse): (B,) -> (B,) float32. For a network that embeds c_noise itself (EDM2's, models/edm2.py)."""
    return ((cond.double() / COND_SCALE + _LOG_SIGMA_LO) / 4.0).float()


def _view(v: Tensor, like: Tensor) -> Tensor:
    """(B,) -> (B, 1, ..., 1) in like's dtype and device."""
    return v.reshape(-1, *([1] * (like.ndim - 1))).to(device=like.device, dtype=like.dtype)


class EDMObjective:
    """EDM training and sampling (Karras et al. 2022). Levels are sigmas, (B,) float32 > 0.

    Args:
        sigma_data: sd of the preconditioning (0.5 for images in [-1, 1]).
        p_mean, p_std: the lognormal training distribution of sigma.
        sigma_min, sigma_max, rho: the sampling grid (eq. 5).
    """

    family = "edm"
    samplers = {"euler": ODE_SOLVERS["euler"], "heun": ODE_SOLVERS["heun"]}
    # Network evaluations per sampler for N steps (reported with FID); Heun's last step is Euler.
    sampler_nfe = {"euler": lambda n: n, "heun": lambda n: 2 * n - 1}

    def __init__(self, sigma_data: float = 0.5, p_mean: float = -1.2, p_std: float = 1.2,
                 sigma_min: float = 0.002, sigma_max: float = 80.0, rho: float = 7.0):
        self.sigma_data, self.p_mean, self.p_std = sigma_data, p_mean, p_std
        self.sigma_min, self.sigma_max, self.rho = sigma_min, sigma_max, rho

    def to(self, device: torch.device) -> EDMObjective:
        """Nothing lives on a device; returns self."""
        return self

    # Table 1. sigma: (B,) any float dtype; each returns (B,) in sigma's dtype.
    def c_skip(self, sigma: Tensor) -> Tensor:
        return self.sigma_data**2 / (sigma**2 + self.sigma_data**2)

    def c_out(self, sigma: Tensor) -> Tensor:
        return sigma * self.sigma_data / (sigma**2 + self.sigma_data**2).sqrt()

    def c_in(self, sigma: Tensor) -> Tensor:
        return 1.0 / (sigma**2 + self.sigma_data**2).sqrt()

    def c_noise(self, sigma: Tensor) -> Tensor:
        """Table 1's c_noise = ln(sigma) / 4."""
        return sigma.log() / 4.0

    def cond(self, sigma: Tensor) -> Tensor:
        """What the network is conditioned on: c_noise mapped onto [0, 1000] over sigma in
        [0.002, 80] (see COND_SCALE), (B,) float32."""
        return ((sigma.double().log() - _LOG_SIGMA_LO) * COND_SCALE).float()

    def loss_lambda(self, sigma: Tensor) -> Tensor:
        """lambda(sigma) = (sigma^2 + sd^2) / (sigma sd)^2, the weight of ||D - x0||^2 (Table 1)."""
        return (sigma**2 + self.sigma_data**2) / (sigma * self.sigma_data) ** 2

    def quantile(self, u: Tensor) -> Tensor:
        """The sigma at probability u in (0, 1) of the training distribution: exp(P_mean + P_std Phi^-1(u))."""
        return (self.p_mean + self.p_std * torch.special.ndtri(u.double())).exp().float()

    def draw_levels(self, n: int, generator: torch.Generator, device: torch.device) -> Tensor:
        """(n,) float32 sigmas, ln(sigma) ~ N(P_mean, P_std^2) (sec. 5, "Training")."""
        return (torch.randn(n, device=device, generator=generator) * self.p_std + self.p_mean).exp()

    def stratified_levels(self, n: int, generator: torch.Generator) -> Tensor:
        """(n,) float32 sigmas on the CPU, one inside each of n slices of equal probability, ascending."""
        u = (torch.arange(n, dtype=torch.float64) + torch.rand(n, generator=generator, dtype=torch.float64)) / n
        return self.quantile(u.clamp(1e-12, 1 - 1e-12))

    def bucket(self, levels: Tensor, num_buckets: int) -> Tensor:
        """(n,) long: bucket i holds the sigmas with CDF in [i / k, (i + 1) / k); 0 = least noise."""
        u = torch.special.ndtr((levels.double().log() - self.p_mean) / self.p_std)
        return (u * num_buckets).floor().long().clamp_(0, num_buckets - 1)

    def noised(self, x0: Tensor, levels: Tensor, noise: Tensor) -> Noised:
        """Network input c_in x with x = x0 + sigma n, cond, target (x0 - c_skip x) / c_out, weight
        lambda c_out^2 = 1 (eq. 8). x0, noise: (B, C, H, W); levels: (B,) sigmas."""
        sigma = levels.to(torch.float64)
        x = x0 + _view(sigma, x0) * noise.to(x0.dtype)
        target = (x0 - _view(self.c_skip(sigma), x0) * x) / _view(self.c_out(sigma), x0)
        weight = (self.loss_lambda(sigma) * self.c_out(sigma) ** 2).float()  # = 1 up to rounding
        return Noised(_view(self.c_in(sigma), x0) * x, self.cond(sigma), target, weight)

    def x0_hat(self, b: Noised, out: Tensor, levels: Tensor) -> Tensor:
        """D(x, sigma) = c_skip x + c_out F from the network output on ``b.input`` = c_in x."""
        sigma = levels.to(torch.float64)
        x = b.input / _view(self.c_in(sigma), b.input)
        return _view(self.c_skip(sigma), x) * x + _view(self.c_out(sigma), x) * out.to(x.dtype)

    def denoiser(self, network: Network) -> Callable[[Tensor, float], Tensor]:
        """``D(x (B, C, H, W), sigma: float) -> x0_hat (B, C, H, W)`` float32 from the raw network."""

        def denoise(x: Tensor, sigma: float) -> Tensor:
            s = torch.full((x.shape[0],), sigma, dtype=torch.float64, device=x.device)
            out = network(_view(self.c_in(s), x) * x, self.cond(s)).float()
            return _view(self.c_skip(s), x) * x + _view(self.c_out(s), x) * out

        return denoise

    def sample(self, network: Network, x_T: Tensor, sampler: str, steps: int, generator, clip: bool = True,
               **options) -> Tensor:
        """x_0 (B, C, H, W) float32 by ``sampler`` over ``steps`` steps of EDM's sigma grid
        (rho, sigma_min, sigma_max, then 0). ``x_T`` is unit Gaussian noise: it is scaled by
        sigma_max here (alg. 1, line 2). The ODE is dx/dsigma = (x - D(x, sigma)) / sigma (eq. 3)."""
        if sampler not in self.samplers:
            raise ValueError(f"sampler must be one of {', '.join(self.samplers)} for edm models, got {sampler!r}")
        sigmas = karras_sigmas(steps, self.sigma_min, self.sigma_max, self.rho)
        denoise = self.denoiser(network)

        def derivative(x: Tensor, sigma: float) -> Tensor:
            return (x - denoise(x, sigma)) / sigma

        x0 = self.samplers[sampler](derivative, x_T.float() * self.sigma_max, sigmas, generator, **options)
        return x0.clamp(-1.0, 1.0) if clip else x0
