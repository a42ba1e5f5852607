"""MeanFlow (Geng, Deng, Bai, Kolter & He 2025, "Mean Flows for One-step Generative Modeling",
arXiv:2505.13447): a network trained from scratch to sample in one to a few steps.

Why MeanFlow among the few-step objectives trained from scratch (issue 43, item 3): at small
scale it has the strongest one-step result of the candidates with no teacher and no
pre-training (unconditional CIFAR-10, 1 network evaluation, FID 2.92, with the U-Net of EDM);
Inductive Moment Matching reaches 1.98 on CIFAR-10 but at 2 steps and with a batch of particles
per group and a kernel loss over them; continuous-time consistency models (sCM) need the
TrigFlow parameterisation, tangent normalisation and warm-up from a diffusion model to be stable;
shortcut models report their small-scale results on CelebA-HQ and ImageNet-256 latents, not
CIFAR-10. MeanFlow is the plain flow-matching path with one second time input and one JVP per
step, so it reuses the flow family's noise path and difftrain's UNet (with its optional second
time embedding, ``UNet(interval_embedding=True)``).

The path and the average velocity (MeanFlow eqs. 1-3; t = 1 is noise, as in :mod:`.flow`):

    z_t = (1 - t) x0 + t eps,     v = eps - x0,
    u(z_t, r, t) = 1 / (t - r) int_r^t v(z_s, s) ds                     (r <= t)

The MeanFlow identity (eq. 6) gives the regression target without the integral:

    u(z_t, r, t) = v(z_t, t) - (t - r) d/dt u(z_t, r, t),
    d/dt u = v d_z u + d_t u                                            (eq. 8)

where d/dt u is one Jacobian-vector product of the network along the tangent (dz, dr, dt) =
(v, 0, 1) (``torch.func.jvp``), and the target u_tgt = v - (t - r) d/dt u is held fixed
(stop-gradient, eq. 10). The loss of a sample is its adaptive weight times the squared error
(sec. 4.3): with d = ||u_theta - u_tgt||^2 summed over the pixels, loss = d / sg(d + c)^p.

The network sees t and t - r (the "(t, t - r)" conditioning the paper found best, Table 1c), as
(B, 2) columns of ``cond`` (see :data:`COND_SCALE`). The training times, facts from the authors' CIFAR-10
script (``py-meanflow``, ``scripts/cifar10_v1.sh`` with its ``time_sampler.py`` "v1"): t and r
are drawn independently, logit(t) ~ N(-0.6, 1.6^2) and logit(r) ~ N(-4.0, 1.6^2); then with
probability 1 - ratio (ratio = 0.75) r = t (plain flow matching for that sample, whose JVP term
is zero), and finally r = min(t, r). Their adaptive weight there: p = 0.75, c = 1e-3.

Sampling (eq. 12): z_r = z_t - (t - r) u(z_t, r, t) over a grid from t = 1 to 0; one step is
z_0 = eps - u(eps, 0, 1). N steps cost N network evaluations.

The JVP needs forward-mode AD through every layer: the CPU's fused attention kernel
(``_scaled_dot_product_flash_attention_for_cpu``, torch 2.13) has none, so the JVP runs with the
math SDPA kernel (:func:`math_attention`); activation checkpointing does not survive it either
(config.py refuses ``model.gradient_checkpointing`` with this objective).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from difftrain.diffusion.interface import Network, Noised

# The network sees t and t - r themselves (scale 1), as the authors' CIFAR-10 U-Net does (its positional
# embedding of t in [0, 1], frequencies up to 1 rad per unit), not 1000 t as the flow family: the JVP's
# target holds d/dt of the network, and the UNet's fastest sinusoid at 1000 t turns 1000 rad per unit of t,
# which made that target, and the loss, grow through training (measured: the loss rose from 10.8 to 19.8
# over the first 300 steps of the CPU protocol at 1000; sCM, Lu & Song 2024, likewise keeps its time
# input's scale small for the stability of its JVP).
COND_SCALE = 1.0


def _view(v: Tensor, like: Tensor) -> Tensor:
    """(B,) -> (B, 1, ..., 1) in like's dtype and device."""
    return v.reshape(-1, *([1] * (like.ndim - 1))).to(device=like.device, dtype=like.dtype)


def math_attention() -> contextlib.AbstractContextManager:
    """Attention by the math SDPA kernel only: the one with forward-mode AD on the CPU (the fused CPU
    kernel has none) and on CUDA (flash / memory-efficient attention have none for the JVP either)."""
    return sdpa_kernel(SDPBackend.MATH)


def mean_flow_steps(u: Callable[[Tensor, float, float], Tensor], x: Tensor, times: Tensor) -> Tensor:
    """MeanFlow's sampler (eq. 12): z_r = z_t - (t - r) u(z_t, r, t) for consecutive (t, r) of
    ``times`` (N + 1,) descending from 1 to 0; x: (B, C, H, W) unit noise -> (B, C, H, W) float32.
    ``u(x, r, t)``: the average velocity. N network evaluations."""
    x = x.float()
    for t, r in zip(times[:-1].tolist(), times[1:].tolist()):
        x = x - (t - r) * u(x, r, t)
    return x


class MeanFlowObjective:
    """MeanFlow training and sampling. Levels are (t, r) pairs, (B, 2) float32 with 0 < r <= t < 1.

    Args:
        t_mean, t_std: logit(t) ~ N(t_mean, t_std^2).
        r_mean, r_std: logit(r) ~ N(r_mean, r_std^2), before r = min(t, r).
        ratio: the share of samples with r drawn apart from t (the rest train r = t).
        adaptive_p, adaptive_eps: the adaptive loss weight 1 / sg(d + eps)^p of the squared error d.
    """

    family = "meanflow"
    samplers = {"meanflow": mean_flow_steps}
    sampler_nfe = {"meanflow": lambda n: n}  # one network evaluation per step
    # No guidance at sampling time: a blend of two average velocities is not the guided field's average
    # velocity (MeanFlow trains its classifier-free guidance in, sec. 4.2); sampling.py and autoguidance.py refuse it.
    guidable = False

    def __init__(self, t_mean: float = -0.6, t_std: float = 1.6, r_mean: float = -4.0, r_std: float = 1.6,
                 ratio: float = 0.75, adaptive_p: float = 0.75, adaptive_eps: float = 1e-3):
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {ratio}")
        self.t_mean, self.t_std, self.r_mean, self.r_std = t_mean, t_std, r_mean, r_std
        self.ratio, self.adaptive_p, self.adaptive_eps = ratio, adaptive_p, adaptive_eps

    def to(self, device: torch.device) -> MeanFlowObjective:
        """Nothing lives on a device; returns self."""
        return self

    def cond(self, levels: Tensor) -> Tensor:
        """What the network is conditioned on: (B, 2) float32 columns t and t - r (times COND_SCALE)."""
        t, r = levels[:, 0], levels[:, 1]
        return torch.stack([t, t - r], dim=1).float() * COND_SCALE

    def _pair(self, t: Tensor, r: Tensor, apart: Tensor) -> Tensor:
        """(B, 2): r = t where not ``apart``, then r = min(t, r) (the authors' "v1" order)."""
        r = torch.minimum(t, torch.where(apart, r, t))
        return torch.stack([t, r], dim=1).float()

    def draw_levels(self, n: int, generator: torch.Generator, device: torch.device) -> Tensor:
        """(n, 2) float32 (t, r) from the training distribution."""
        t = torch.sigmoid(torch.randn(n, device=device, generator=generator) * self.t_std + self.t_mean)
        r = torch.sigmoid(torch.randn(n, device=device, generator=generator) * self.r_std + self.r_mean)
        apart = torch.rand(n, device=device, generator=generator) < self.ratio
        return self._pair(t, r, apart)

    def quantile(self, u: Tensor) -> Tensor:
        """(n, 2): t at probability u in (0, 1) of its distribution, with r = t (the flow-matching case)."""
        t = torch.sigmoid(self.t_mean + self.t_std * torch.special.ndtri(u.double())).float()
        return torch.stack([t, t], dim=1)

    def stratified_levels(self, n: int, generator: torch.Generator) -> Tensor:
        """(n, 2) on the CPU: t one inside each of n slices of equal probability, ascending; r drawn
        from its distribution (and the ratio) with the same generator."""
        u = (torch.arange(n, dtype=torch.float64) + torch.rand(n, generator=generator, dtype=torch.float64)) / n
        t = self.quantile(u.clamp(1e-12, 1 - 1e-12))[:, 0]
        r = torch.sigmoid(torch.randn(n, generator=generator) * self.r_std + self.r_mean)
        apart = torch.rand(n, generator=generator) < self.ratio
        return self._pair(t, r, apart)

    def bucket(self, levels: Tensor, num_buckets: int) -> Tensor:
        """(n,) long: by t alone, bucket i holds the t with CDF in [i / k, (i + 1) / k)."""
        u = torch.special.ndtr((torch.logit(levels[:, 0].double()) - self.t_mean) / self.t_std)
        return (u * num_buckets).floor().long().clamp_(0, num_buckets - 1)

    def noised(self, x0: Tensor, levels: Tensor, noise: Tensor) -> Noised:
        """z_t = (1 - t) x0 + t eps, cond (B, 2), target the instantaneous velocity v = eps - x0 (the
        training target u_tgt also needs the network: :meth:`network_loss`), weight 1.
        x0, noise: (B, C, H, W); levels: (B, 2) (t, r)."""
        t = _view(levels[:, 0], x0)
        noise = noise.to(x0.dtype)
        return Noised((1.0 - t) * x0 + t * noise, self.cond(levels), noise - x0,
                      torch.ones(x0.shape[0], dtype=torch.float32, device=x0.device))

    def network_loss(self, net: Callable[..., Tensor], b: Noised, levels: Tensor, condition,
                     autocast: contextlib.AbstractContextManager | None = None,
                     pixel_weight: Tensor | None = None) -> Tensor:
        """(B,) float32: the MeanFlow loss of each sample (eqs. 8-10, adaptive weight of sec. 4.3).

        One JVP of ``net(z, cond, condition)`` along (dz, dcond) = (v, (1, 1) COND_SCALE) (the
        derivative of cond in t at fixed r) gives u_theta and du/dt; u_tgt = v - (t - r) du/dt,
        without gradient. pixel_weight: (B, 1, H, W) loss mask or None."""
        tangent = torch.full_like(b.cond, COND_SCALE)

        def u(z: Tensor, cond: Tensor) -> Tensor:
            return net(z, cond, condition)

        with autocast or contextlib.nullcontext(), math_attention():
            u_pred, du_dt = torch.func.jvp(u, (b.input, b.cond), (b.target, tangent))
        gap = _view(levels[:, 0] - levels[:, 1], b.input).float()
        u_tgt = (b.target.float() - gap * du_dt.float()).detach()
        squared = (u_pred.float() - u_tgt).square()
        if pixel_weight is not None:
            squared = squared * pixel_weight.float()
        d = squared.sum(dim=tuple(range(1, squared.ndim)))  # (B,) ||u_theta - u_tgt||^2
        return d / (d.detach() + self.adaptive_eps) ** self.adaptive_p

    def x0_hat(self, b: Noised, out: Tensor, levels: Tensor) -> Tensor:
        """The one-step estimate z_t - t u from the network output on ``b.input``: x0 itself when the
        network was conditioned on r = 0 (the average velocity over [0, t])."""
        return b.input - _view(levels[:, 0], b.input) * out.to(b.input.dtype)

    def average_velocity(self, network: Network) -> Callable[[Tensor, float, float], Tensor]:
        """``u(x (B, C, H, W), r, t) -> (B, C, H, W)`` float32 from the raw network."""

        def u(x: Tensor, r: float, t: float) -> Tensor:
            cond = torch.tensor([[t, t - r]], dtype=torch.float64, device=x.device) * COND_SCALE
            return network(x, cond.float().expand(x.shape[0], 2)).float()

        return u

    def grid(self, steps: int) -> Tensor:
        """(steps + 1,) float64 times, uniform from 1 to 0."""
        return torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)

    def sample(self, network: Network, x_T: Tensor, sampler: str, steps: int, generator, clip: bool = True,
               **options) -> Tensor:
        """x_0 (B, C, H, W) float32 from unit noise x_T in ``steps`` MeanFlow steps (eq. 12): ``steps``
        network evaluations; ``generator`` is unused (the sampler is deterministic)."""
        if sampler not in self.samplers:
            raise ValueError(f"sampler must be one of {', '.join(self.samplers)} for meanflow models, got {sampler!r}")
        if options:
            raise ValueError(f"the meanflow sampler takes no options, got {', '.join(options)}")
        x0 = self.samplers[sampler](self.average_velocity(network), x_T, self.grid(steps))
        return x0.clamp(-1.0, 1.0) if clip else x0

