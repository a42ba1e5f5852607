"""Training objectives: what a network learns, bound into one object per family.

An objective holds the noise process, the prediction target and the loss weighting of one
family (like EDM's loss classes), and says how to sample from a network trained with it. The
training step, the held-out loss, ``diagnose``, ``lr-find``, ``estimate`` and the benchmarks all
compute a batch's loss through :func:`per_sample_loss`, so there is one copy of it.

A noise *level* is what an objective draws per sample (DDPM: the integer timestep t); its
``cond`` is what the network is conditioned on. Levels fall into ``num_buckets`` buckets of
equal probability under the training distribution, for the loss per bucket.

Every objective has the same methods:

    draw_levels(n, generator, device) -> (n,)          training levels
    stratified_levels(n, generator) -> (n,)             equal counts per bucket (held-out loss)
    bucket(levels, num_buckets) -> (n,) long            the bucket of each level
    noised(x0, levels, noise) -> Noised                 network input, cond, target, weight
    sample(network, x_T, sampler, steps, generator)     x_0 from the network, with ``samplers``
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from difftrain.diffusion.losses import diffusion_loss, loss_weight
from difftrain.diffusion.process import check_prediction, prediction_target, q_sample, to_x0_and_eps
from difftrain.diffusion.samplers import SAMPLERS, sampling_timesteps
from difftrain.diffusion.schedules import alpha_bar_schedule

# network(x (B, C, H, W), cond (B,)) -> raw output (B, C, H, W): labels and guidance bound in.
Network = Callable[[Tensor, Tensor], Tensor]


@dataclasses.dataclass(frozen=True)
class Noised:
    """One batch prepared for the network: ``net(input, cond)`` is regressed onto ``target``
    with per-sample ``weight``."""

    input: Tensor  # (B, C, H, W) what the network sees
    cond: Tensor  # (B,) the noise conditioning the network gets
    target: Tensor  # (B, C, H, W)
    weight: Tensor  # (B,) float32


class Objective(Protocol):
    family: str
    samplers: dict[str, Callable[..., Tensor]]

    def to(self, device: torch.device) -> Objective: ...
    def draw_levels(self, n: int, generator: torch.Generator, device: torch.device) -> Tensor: ...
    def stratified_levels(self, n: int, generator: torch.Generator) -> Tensor: ...
    def bucket(self, levels: Tensor, num_buckets: int) -> Tensor: ...
    def noised(self, x0: Tensor, levels: Tensor, noise: Tensor) -> Noised: ...
    def sample(self, network: Network, x_T: Tensor, sampler: str, steps: int, generator, **options) -> Tensor: ...


class DDPMObjective:
    """The DDPM family (Ho et al. 2020): x_t = sqrt(alpha_bar_t) x0 + sqrt(1 - alpha_bar_t) eps
    at integer t uniform in [0, T), an epsilon, v or x0 target, and a per-timestep weighting
    (uniform, 1 / (1 - alpha_bar), min-SNR).

    Args:
        schedule: a key of ``SCHEDULES``; ``num_timesteps``: T.
        prediction: "epsilon", "v" or "x0"; ``loss_weighting``: a key of ``LOSS_WEIGHTINGS``.
    """

    family = "ddpm"
    samplers = SAMPLERS

    def __init__(self, schedule: str, num_timesteps: int, prediction: str, loss_weighting: str,
                 min_snr_gamma: float = 5.0):
        check_prediction(prediction)
        self.alpha_bar = alpha_bar_schedule(schedule, num_timesteps)  # (T,) float64
        self.num_timesteps = num_timesteps
        self.prediction = prediction
        self.loss_weighting = loss_weighting
        self.min_snr_gamma = min_snr_gamma

    def to(self, device: torch.device) -> DDPMObjective:
        """Keep alpha_bar on ``device`` (once, not a copy per step); returns self."""
        self.alpha_bar = self.alpha_bar.to(device)
        return self

    def draw_levels(self, n: int, generator: torch.Generator, device: torch.device) -> Tensor:
        """(n,) long timesteps uniform in [0, T)."""
        return torch.randint(0, self.num_timesteps, (n,), device=device, generator=generator)

    def stratified_levels(self, n: int, generator: torch.Generator) -> Tensor:
        """(n,) long timesteps, one uniform inside each of n equal slices of [0, T) (CPU)."""
        u = torch.rand(n, generator=generator, dtype=torch.float64)
        t = ((torch.arange(n, dtype=torch.float64) + u) * self.num_timesteps / n).floor().long()
        return t.clamp_(0, self.num_timesteps - 1)

    def bucket(self, levels: Tensor, num_buckets: int) -> Tensor:
        """(n,) long: bucket i holds t with (t * k) // T == i."""
        return (levels * num_buckets) // self.num_timesteps

    def noised(self, x0: Tensor, levels: Tensor, noise: Tensor) -> Noised:
        """x_t (DDPM eq. 4), the prediction target and the weighting at timesteps ``levels``."""
        ab_t = self.alpha_bar[levels]
        x_t = q_sample(x0, levels, noise, self.alpha_bar)
        target = prediction_target(self.prediction, x0, noise, ab_t)
        weight = loss_weight(self.loss_weighting, ab_t, self.prediction, self.min_snr_gamma)
        return Noised(x_t, levels, target, weight)

    def denoiser(self, network: Network, alpha_bar: Tensor, clip: bool = True) -> Callable[[Tensor, Tensor], Tensor]:
        """``denoiser(x_t, t) -> x0_hat`` (float32, clipped to [-1, 1]) from the raw network;
        ``alpha_bar`` (T,) on the network's device."""

        def denoise(x_t: Tensor, t: Tensor) -> Tensor:
            x0, _ = to_x0_and_eps(self.prediction, network(x_t, t).float(), x_t, alpha_bar[t])
            return x0.clamp(-1.0, 1.0) if clip else x0

        return denoise

    def sample(self, network: Network, x_T: Tensor, sampler: str, steps: int, generator, **options) -> Tensor:
        """x_0 (B, C, H, W) float32 from x_T by ``sampler`` over ``steps`` trailing timesteps."""
        if sampler not in self.samplers:
            raise ValueError(f"sampler must be one of {', '.join(self.samplers)} for ddpm models, got {sampler!r}")
        timesteps = sampling_timesteps(self.num_timesteps, steps).to(x_T.device)
        alpha_bar = self.alpha_bar.to(x_T.device)
        return self.samplers[sampler](self.denoiser(network, alpha_bar), x_T, timesteps, alpha_bar, generator, **options)


def build_objective(diffusion) -> DDPMObjective:
    """The objective of a ``DiffusionConfig`` (``cfg.diffusion``), on the CPU."""
    return OBJECTIVES[diffusion.objective](diffusion)


# name -> builder from cfg.diffusion; feeds the config's choices.
OBJECTIVES: dict[str, Callable[..., Objective]] = {
    "ddpm": lambda d: DDPMObjective(d.schedule, d.num_timesteps, d.prediction, d.loss_weighting, d.min_snr_gamma),
}


def per_sample_loss(
    objective: Objective,
    net: Callable[..., Tensor],
    x0: Tensor,
    labels: Tensor | None,
    levels: Tensor,
    noise: Tensor,
    autocast: contextlib.AbstractContextManager | None = None,
) -> Tensor:
    """The training loss of each sample, (B,) float32: ``net(input, cond, labels)`` (under
    ``autocast``, when given) regressed onto the objective's target with its weight.

    x0, noise: (B, C, H, W); labels: (B,) long or None; levels: (B,) from ``draw_levels``.
    """
    b = objective.noised(x0, levels, noise)
    with autocast or contextlib.nullcontext():
        out = net(b.input, b.cond, labels)
    return diffusion_loss(out, b.target, b.weight)
