"""Flow matching / rectified flow with a velocity target (Lipman et al. 2023, "Flow Matching for
Generative Modeling"; Liu et al. 2023, "Flow Straight and Fast"), logit-normal t as in SD3
(Esser et al. 2024, "Scaling Rectified Flow Transformers", sec. 3.1).

The straight path from data (t = 0) to noise (t = 1) and its velocity (SD3 eq. 2 with
a_t = 1 - t, b_t = t; Liu et al. eq. 1):

    x_t = (1 - t) x0 + t eps,     v = dx_t/dt = eps - x0

The network regresses v with weight 1 (``loss`` "velocity": the conditional flow matching loss,
Lipman et al. eq. 9, and SD3's (sec. 2, the velocity loss its weightings w_t multiply);
diffusers' compute_loss_weighting_for_sd3 "none"/"logit_normal"/"mode": ones), or, with ``loss``
"x0", the error of the denoised image x0_hat = x_t - t v_hat (diffusers' SD3 script's default
``--precondition_outputs 1``: it turns the output into x0_hat and regresses x0). Since
x0_hat - x0 = x_t - t v_hat - x0 = t (v - v_hat), that is the velocity error weighted by t^2:
difftrain keeps the velocity target and gives it the weight t^2 (the same loss, the same
gradients). Training t is
drawn by one of (``t_sampling``; SD3 sec. 3.1, diffusers' compute_density_for_timestep_sampling
from the same draws):

    logit_normal  t = sigmoid(m + s z), z ~ N(0, 1)                            (SD3 eq. 19)
    mode          t = 1 - u - c (cos^2(pi u / 2) - 1 + u), u ~ U(0, 1)         (SD3 eq. 20)
    uniform       t = u

then optionally shifted, t' = k t / (1 + (k - 1) t) (``train_shift``; SD3 eq. 23): diffusers'
SD3 script indexes the scheduler's sigmas, which FlowMatchEulerDiscreteScheduler has already
shifted by its ``shift`` (3.0 for SD3); with ``use_dynamic_shifting`` (Flux) they are not, and
diffusers' Flux script trains on unshifted t. (The scripts take sigma = 1 - u on a 1000-level
grid: the same distribution for logit_normal with mean 0, for mode and for uniform, both being
symmetric about 1/2; a logit mean m there means -m here, where t = 1 is noise as in the paper.)

Sampling integrates dx/dt = v(x, t) from t = 1 (x_T ~ N(0, I)) to t = 0 on a uniform grid
(``grid_end`` None: linspace(1, 0, N + 1), FluxPipeline's sigmas; a value: linspace(1, end, N)
then 0, what FlowMatchEulerDiscreteScheduler.set_timesteps makes for SD3), shifted by ``shift``,
or, with ``dynamic_shift`` (Flux), by e^mu with mu from the image's token count (h / 2)(w / 2)
of its latents (diffusers' calculate_shift; ``shift_rule`` "empirical": FLUX.2's fit of the token and
step counts, diffusers' compute_empirical_mu). The denoised image is x0_hat = x_t - t v.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from difftrain.diffusion.interface import Network, Noised
from difftrain.diffusion.ode_samplers import (ODE_SOLVERS, SHIFT_RULES, empirical_shift, flow_times, image_seq_shift,
                                              shift_times)

# The UNet embeds its conditioning with DDPM's sinusoids, made for timesteps in [0, 1000)
# (models/layers.py); t in (0, 1) would leave all but the fastest few nearly constant. The
# network gets 1000 t, as SD3's reference code does.
COND_SCALE = 1000.0


def _view(v: Tensor, like: Tensor) -> Tensor:
    """(B,) -> (B, 1, ..., 1) in like's dtype and device."""
    return v.reshape(-1, *([1] * (like.ndim - 1))).to(device=like.device, dtype=like.dtype)


T_SAMPLINGS = ("logit_normal", "mode", "uniform")


def _velocity_weight(t: Tensor) -> Tensor:
    """Weight 1: the velocity error ||v - v_hat||^2 (Lipman et al. eq. 9; SD3 sec. 2)."""
    return torch.ones_like(t, dtype=torch.float32)


def _x0_weight(t: Tensor) -> Tensor:
    """Weight t^2: ||x0 - x0_hat||^2 = t^2 ||v - v_hat||^2 with x0_hat = x_t - t v_hat (diffusers' SD3
    script's --precondition_outputs 1, its default)."""
    return t.float().square()


# name (``diffusion.flow_loss``) -> t (B,) -> the per-sample weight (B,) float32 of the velocity error.
FLOW_LOSSES = {"velocity": _velocity_weight, "x0": _x0_weight}


def mode_times(u: Tensor, scale: float) -> Tensor:
    """SD3's mode sampling (eq. 20): t = 1 - u - scale (cos^2(pi u / 2) - 1 + u) of u in [0, 1]
    (any shape, float64 kept); decreasing in u for 0 <= scale < 1 / (pi / 2 - 1) ~ 1.75."""
    return 1.0 - u - scale * (torch.cos(math.pi * u / 2) ** 2 - 1.0 + u)


def _unshift(t: Tensor, shift: float) -> Tensor:
    """The inverse of t' = k t / (1 + (k - 1) t): t = t' / (k - (k - 1) t')."""
    return t / (shift - (shift - 1.0) * t)


class FlowObjective:
    """Rectified flow with a velocity target. Levels are t, (B,) float32 in (0, 1).

    Args:
        logit_mean, logit_std: logit(t) ~ N(logit_mean, logit_std^2) in training (logit_normal).
        shift: sampling grid shift (1 = uniform in t; > 1 more steps at high noise).
        t_sampling: training t distribution, "logit_normal", "mode" or "uniform".
        mode_scale: c of "mode" sampling, in [0, 1.75) (1.29 in SD3 and diffusers' scripts).
        train_shift: shift of the training t (1 = none; SD3: 3.0 as diffusers' scheduler).
        grid_end: None = the sampling grid linspace(1, 0, N + 1); else linspace(1, end, N) then 0.
        dynamic_shift: sample with Flux's resolution-dependent shift (ignores ``shift``) from
            the latents' token count (h / 2)(w / 2) through base/max shift at base/max seq len.
        loss: a key of :data:`FLOW_LOSSES`: "velocity" (weight 1) or "x0" (the denoised image's
            error, weight t^2: diffusers' SD3 script's default).
    """

    family = "flow"
    # The velocity is defined at t = 0, so Heun's last step is second order too (2N evaluations).
    samplers = {"euler": ODE_SOLVERS["euler"], "heun": functools.partial(ODE_SOLVERS["heun"], defined_at_zero=True),
                "midpoint": ODE_SOLVERS["midpoint"]}
    # Network evaluations per sampler for N steps (reported with FID).
    sampler_nfe = {"euler": lambda n: n, "heun": lambda n: 2 * n, "midpoint": lambda n: 2 * n}

    def __init__(self, logit_mean: float = 0.0, logit_std: float = 1.0, shift: float = 1.0,
                 t_sampling: str = "logit_normal", mode_scale: float = 1.29, train_shift: float = 1.0,
                 grid_end: float | None = None, dynamic_shift: bool = False, base_shift: float = 0.5,
                 max_shift: float = 1.15, base_seq_len: int = 256, max_seq_len: int = 4096, loss: str = "velocity",
                 shift_rule: str = "linear"):
        if t_sampling not in T_SAMPLINGS:
            raise ValueError(f"t_sampling must be one of {', '.join(T_SAMPLINGS)}, got {t_sampling!r}")
        if loss not in FLOW_LOSSES:
            raise ValueError(f"loss must be one of {', '.join(FLOW_LOSSES)}, got {loss!r}")
        if shift_rule not in SHIFT_RULES:
            raise ValueError(f"shift_rule must be one of {', '.join(SHIFT_RULES)}, got {shift_rule!r}")
        self.loss, self.shift_rule = loss, shift_rule
        self.logit_mean, self.logit_std, self.shift = logit_mean, logit_std, shift
        self.t_sampling, self.mode_scale, self.train_shift = t_sampling, mode_scale, train_shift
        self.grid_end, self.dynamic_shift = grid_end, dynamic_shift
        self.seq_shift = dict(base_shift=base_shift, max_shift=max_shift, base_seq_len=base_seq_len,
                              max_seq_len=max_seq_len)

    def to(self, device: torch.device) -> FlowObjective:
        """Nothing lives on a device; returns self."""
        return self

    def cond(self, t: Tensor) -> Tensor:
        """What the network is conditioned on: 1000 t, (B,) float32."""
        return (t * COND_SCALE).float()

    def _shifted(self, t: Tensor) -> Tensor:
        """The training shift of t (returned unchanged, bit for bit, when it is 1)."""
        return t if self.train_shift == 1.0 else shift_times(t, self.train_shift)

    def quantile(self, u: Tensor) -> Tensor:
        """The t at probability u in (0, 1) of the training distribution (logit_normal:
        sigmoid(m + s Phi^-1(u)); mode: mode_times(1 - u); uniform: u; then the training shift)."""
        u = u.double()
        if self.t_sampling == "logit_normal":
            t = torch.sigmoid(self.logit_mean + self.logit_std * torch.special.ndtri(u))
        elif self.t_sampling == "mode":
            t = mode_times(1.0 - u, self.mode_scale)
        else:
            t = u
        return self._shifted(t).float()

    def cdf(self, t: Tensor) -> Tensor:
        """P(T <= t) of the training distribution, float64, t (any shape) in (0, 1)."""
        t = t.double()
        if self.train_shift != 1.0:
            t = _unshift(t, self.train_shift)
        if self.t_sampling == "logit_normal":
            return torch.special.ndtr((torch.logit(t) - self.logit_mean) / self.logit_std)
        if self.t_sampling == "uniform":
            return t.clamp(0.0, 1.0)
        lo, hi = torch.zeros_like(t), torch.ones_like(t)  # mode: bisect u with mode_times(1 - u) = t
        for _ in range(60):
            mid = (lo + hi) / 2
            below = mode_times(1.0 - mid, self.mode_scale) < t
            lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
        return (lo + hi) / 2

    def draw_levels(self, n: int, generator: torch.Generator, device: torch.device) -> Tensor:
        """(n,) float32 t from the training distribution (t = 1 is noise). From the same generator
        state, the unshifted t equal diffusers' compute_density_for_timestep_sampling."""
        if self.t_sampling == "logit_normal":
            t = torch.sigmoid(torch.randn(n, device=device, generator=generator) * self.logit_std + self.logit_mean)
        else:
            u = torch.rand(n, device=device, generator=generator)
            t = mode_times(u, self.mode_scale) if self.t_sampling == "mode" else u
        return self._shifted(t)

    def stratified_levels(self, n: int, generator: torch.Generator) -> Tensor:
        """(n,) float32 t on the CPU, one inside each of n slices of equal probability, ascending."""
        u = (torch.arange(n, dtype=torch.float64) + torch.rand(n, generator=generator, dtype=torch.float64)) / n
        return self.quantile(u.clamp(1e-12, 1 - 1e-12))

    def bucket(self, levels: Tensor, num_buckets: int) -> Tensor:
        """(n,) long: bucket i holds the t with CDF in [i / k, (i + 1) / k); 0 = least noise."""
        return (self.cdf(levels) * num_buckets).floor().long().clamp_(0, num_buckets - 1)

    def grid(self, steps: int, latent_hw: tuple[int, int]) -> Tensor:
        """The sampling grid (steps + 1,) float64 from 1 to 0 for latents of ``latent_hw`` = (h, w):
        shifted by ``shift`` or, with ``dynamic_shift``, by the mu of (h / 2)(w / 2) tokens: Flux's, linear in
        them (``shift_rule`` "linear"), or FLUX.2's empirical fit of tokens and ``steps`` ("empirical")."""
        mu = None
        tokens = (latent_hw[0] // 2) * (latent_hw[1] // 2)
        if self.dynamic_shift:
            mu = image_seq_shift(tokens, **self.seq_shift) if self.shift_rule == "linear" else empirical_shift(tokens, steps)
        return flow_times(steps, self.shift, self.grid_end, mu)

    def noised(self, x0: Tensor, levels: Tensor, noise: Tensor) -> Noised:
        """x_t = (1 - t) x0 + t eps, cond 1000 t, target v = eps - x0, weight 1 (``loss`` "x0": t^2).
        x0, noise: (B, C, H, W); levels: (B,) t."""
        t = _view(levels, x0)
        noise = noise.to(x0.dtype)
        x_t = (1.0 - t) * x0 + t * noise
        return Noised(x_t, self.cond(levels), noise - x0, FLOW_LOSSES[self.loss](levels))

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
        ``sampler`` over ``steps`` steps of :meth:`grid`."""
        if sampler not in self.samplers:
            raise ValueError(f"sampler must be one of {', '.join(self.samplers)} for flow models, got {sampler!r}")
        grid = self.grid(steps, tuple(x_T.shape[-2:]))
        x0 = self.samplers[sampler](self.velocity(network), x_T, grid, generator, **options)
        return x0.clamp(-1.0, 1.0) if clip else x0
