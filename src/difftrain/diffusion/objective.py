"""Training objectives: what a network learns, bound into one object per family.

An objective holds the noise process, the prediction target and the loss weighting of one
family (like EDM's loss classes), and says how to sample from a network trained with it. The
training step, the held-out loss, ``diagnose``, ``lr-find``, ``estimate`` and the benchmarks all
compute a batch's loss through :func:`per_sample_loss`, so there is one copy of it.

Four families, switched by ``diffusion.objective``: "ddpm" (below), "edm" (:mod:`.edm`),
"flow" (:mod:`.flow`) and "meanflow" (:mod:`.meanflow`: few-step sampling, levels (t, r) of shape (B, 2)). A noise *level* is what an objective draws per sample (DDPM: the integer
timestep t; EDM: sigma; flow: t in (0, 1)); its ``cond`` is what the network is conditioned on. Levels fall into ``num_buckets`` buckets of
equal probability under the training distribution, for the loss per bucket.

Every objective has the same methods:

    draw_levels(n, generator, device) -> (n,)          training levels
    stratified_levels(n, generator) -> (n,)             equal counts per bucket (held-out loss)
    bucket(levels, num_buckets) -> (n,) long            the bucket of each level
    quantile(u) -> (n,)                                 the level at probability u (u: (n,) in (0, 1))
    noised(x0, levels, noise) -> Noised                 network input, cond, target, weight
                                                        (DDPM's also takes input_noise: input perturbation)
    x0_hat(noised, out, levels) -> (B, C, H, W)         the denoised image from the network output
    sample(network, x_T, sampler, steps, generator)     x_0 from the network, with ``samplers``

An objective whose target needs the network itself (MeanFlow's, through a JVP) also has

    network_loss(net, noised, levels, condition, autocast, pixel_weight) -> (B,)

which :func:`per_sample_loss` then calls in place of the regression onto ``noised.target``.

``x_T`` is unit Gaussian noise for every family; an objective whose prior is wider (EDM: sigma_max)
scales it in ``sample``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor

from difftrain.diffusion.edm import EDMObjective
from difftrain.diffusion.flow import FlowObjective
from difftrain.diffusion.interface import Network, Noised, Objective
from difftrain.diffusion.losses import diffusion_loss, loss_weight
from difftrain.diffusion.meanflow import MeanFlowObjective
from difftrain.diffusion.process import check_prediction, coefficient_table, mix, target_from, to_x0_and_eps
from difftrain.diffusion.samplers import SAMPLER_NFE, SAMPLERS, karras_timesteps, sampling_timesteps
from difftrain.diffusion.schedules import alpha_bar_schedule, rescale_zero_terminal_snr

__all__ = ["OBJECTIVES", "OBJECTIVE_SAMPLERS", "DDPMObjective", "EDMObjective", "FlowObjective", "MeanFlowObjective", "Network", "Noised", "Objective",
           "build_objective", "per_sample_loss", "sampler_names", "DEFAULT_SAMPLERS"]


class DDPMObjective:
    """The DDPM family (Ho et al. 2020): x_t = sqrt(alpha_bar_t) x0 + sqrt(1 - alpha_bar_t) eps
    at integer t uniform in [0, T), an epsilon, v or x0 target, and a per-timestep weighting
    (uniform, 1 / (1 - alpha_bar), min-SNR).

    Args:
        schedule: a key of ``SCHEDULES``; ``num_timesteps``: T.
        prediction: "epsilon", "v" or "x0"; ``loss_weighting``: a key of ``LOSS_WEIGHTINGS``.
        sigma_min, sigma_max, rho: the sigma grid "heun" walks (see ``karras_timesteps``).
        zero_terminal_snr: rescale alpha_bar so that alpha_bar[T-1] = 0 (Lin et al. 2024; see
            ``rescale_zero_terminal_snr``); refused with "epsilon", which has no x0 at SNR 0.
    """

    family = "ddpm"
    samplers = SAMPLERS
    sampler_nfe = SAMPLER_NFE  # network evaluations per sampler for N steps

    def __init__(self, schedule: str, num_timesteps: int, prediction: str, loss_weighting: str,
                 min_snr_gamma: float = 5.0, sigma_min: float = 0.002, sigma_max: float = 80.0,
                 rho: float = 7.0, zero_terminal_snr: bool = False):
        check_prediction(prediction)
        if zero_terminal_snr and prediction == "epsilon":
            raise ValueError("zero terminal SNR needs v or x0 prediction: at alpha_bar = 0 the noise is the input "
                             "and x0 cannot be recovered from it")
        self.alpha_bar = alpha_bar_schedule(schedule, num_timesteps)  # (T,) float64
        if zero_terminal_snr:
            self.alpha_bar = rescale_zero_terminal_snr(self.alpha_bar)
        self.num_timesteps = num_timesteps
        self.prediction = prediction
        self.loss_weighting = loss_weighting
        self.min_snr_gamma = min_snr_gamma
        self.sigma_min, self.sigma_max, self.rho = sigma_min, sigma_max, rho
        # Per-timestep rows (sqrt(alpha_bar), sqrt(1 - alpha_bar), loss weight) by x0's dtype and
        # device, made on first use from the float64 alpha_bar: a step gathers its rows instead
        # of forming them in float64 and casting (the same bits; see ``coefficient_table``).
        self._tables: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def to(self, device: torch.device) -> DDPMObjective:
        """Keep alpha_bar on ``device`` (once, not a copy per step); returns self."""
        self.alpha_bar = self.alpha_bar.to(device)
        return self

    def _table(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """(3, T) in ``dtype`` on ``device``: sqrt(alpha_bar), sqrt(1 - alpha_bar) and the loss
        weight (float32 from ``loss_weight``, exactly representable in any wider dtype)."""
        key = (dtype, device)
        if key not in self._tables:
            alpha_bar = self.alpha_bar.to(device)
            weight = loss_weight(self.loss_weighting, alpha_bar, self.prediction, self.min_snr_gamma)
            self._tables[key] = torch.cat([coefficient_table(alpha_bar, dtype), weight.to(dtype)[None]])
        return self._tables[key]

    def draw_levels(self, n: int, generator: torch.Generator, device: torch.device) -> Tensor:
        """(n,) long timesteps uniform in [0, T)."""
        return torch.randint(0, self.num_timesteps, (n,), device=device, generator=generator)

    def quantile(self, u: Tensor) -> Tensor:
        """(n,) long: the timestep at probability u in [0, 1) of the uniform draw, floor(u T)."""
        return (u.double() * self.num_timesteps).floor().long().clamp_(0, self.num_timesteps - 1)

    def stratified_levels(self, n: int, generator: torch.Generator) -> Tensor:
        """(n,) long timesteps, one uniform inside each of n equal slices of [0, T) (CPU)."""
        u = torch.rand(n, generator=generator, dtype=torch.float64)
        t = ((torch.arange(n, dtype=torch.float64) + u) * self.num_timesteps / n).floor().long()
        return t.clamp_(0, self.num_timesteps - 1)

    def bucket(self, levels: Tensor, num_buckets: int) -> Tensor:
        """(n,) long: bucket i holds t with (t * k) // T == i."""
        return (levels * num_buckets) // self.num_timesteps

    def noised(self, x0: Tensor, levels: Tensor, noise: Tensor, input_noise: Tensor | None = None) -> Noised:
        """x_t (DDPM eq. 4), the prediction target and the weighting at timesteps ``levels``:
        ``q_sample``, ``prediction_target`` and ``loss_weight`` bit for bit, from one gather of
        the per-timestep table. ``input_noise`` (B, C, H, W), if given, makes x_t in place of
        ``noise``, which still makes the target: input perturbation (Ning et al. 2023)."""
        if noise.shape != x0.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} differs from x0 shape {tuple(x0.shape)}")
        if input_noise is not None and input_noise.shape != x0.shape:
            raise ValueError(f"input_noise shape {tuple(input_noise.shape)} differs from x0 shape {tuple(x0.shape)}")
        rows = self._table(x0.dtype, levels.device).index_select(1, levels)  # (3, B)
        signal, sigma = rows[:2].reshape(2, -1, *([1] * (x0.ndim - 1)))  # (B, 1, ..., 1) each
        x_t = mix(x0, noise if input_noise is None else input_noise, signal, sigma)
        target = target_from(self.prediction, x0, noise, signal, sigma)
        return Noised(x_t, levels, target, rows[2].float())

    def x0_hat(self, b: Noised, out: Tensor, levels: Tensor) -> Tensor:
        """x0 from the network output on ``b.input`` = x_t (``to_x0_and_eps``), unclipped, float32."""
        return to_x0_and_eps(self.prediction, out.float(), b.input, self.alpha_bar[levels])[0]

    def denoiser(self, network: Network, alpha_bar: Tensor, clip: bool = True) -> Callable[[Tensor, Tensor], Tensor]:
        """``denoiser(x_t, t) -> x0_hat`` (float32, clipped to [-1, 1]) from the raw network;
        ``alpha_bar`` (T,) on the network's device."""

        def denoise(x_t: Tensor, t: Tensor) -> Tensor:
            x0, _ = to_x0_and_eps(self.prediction, network(x_t, t).float(), x_t, alpha_bar[t])
            return x0.clamp(-1.0, 1.0) if clip else x0

        return denoise

    def sample(self, network: Network, x_T: Tensor, sampler: str, steps: int, generator, clip: bool = True,
               **options) -> Tensor:
        """x_0 (B, C, H, W) float32 from x_T by ``sampler`` over ``steps`` timesteps: trailing ones
        (Lin et al. 2024), except for "heun", which walks the timesteps nearest EDM's sigma grid
        capped at sigma_max (the trailing grid starts at sigma ~ 2e4 on the cosine schedule).
        ``clip``: clamp each x0 estimate to [-1, 1] (pixels; latents are not bounded so)."""
        if sampler not in self.samplers:
            raise ValueError(f"sampler must be one of {', '.join(self.samplers)} for ddpm models, got {sampler!r}")
        if sampler == "heun":
            timesteps = karras_timesteps(self.alpha_bar, steps, self.sigma_min, self.sigma_max, self.rho)
        else:
            timesteps = sampling_timesteps(self.num_timesteps, steps)
        timesteps = timesteps.to(x_T.device)
        alpha_bar = self.alpha_bar.to(x_T.device)
        return self.samplers[sampler](self.denoiser(network, alpha_bar, clip), x_T, timesteps, alpha_bar, generator, **options)


def build_objective(diffusion) -> Objective:
    """The objective of a ``DiffusionConfig`` (``cfg.diffusion``), on the CPU."""
    return OBJECTIVES[diffusion.objective](diffusion)


# name -> builder from cfg.diffusion; feeds the config's choices. Each family reads its own keys.
OBJECTIVES: dict[str, Callable[..., Objective]] = {
    "ddpm": lambda d: DDPMObjective(d.schedule, d.num_timesteps, d.prediction, d.loss_weighting, d.min_snr_gamma,
                                    d.sigma_min, d.sigma_max, d.rho, d.zero_terminal_snr),
    "edm": lambda d: EDMObjective(d.edm_sigma_data, d.edm_p_mean, d.edm_p_std, d.sigma_min, d.sigma_max, d.rho),
    "flow": lambda d: FlowObjective(d.flow_logit_mean, d.flow_logit_std, d.flow_shift, d.flow_t_sampling,
                                    d.flow_mode_scale, d.flow_train_shift, d.flow_grid_end, d.flow_dynamic_shift,
                                    d.flow_base_shift, d.flow_max_shift, d.flow_base_seq_len, d.flow_max_seq_len,
                                    d.flow_loss, d.flow_shift_rule),
    "meanflow": lambda d: MeanFlowObjective(d.meanflow_t_mean, d.meanflow_t_std, d.meanflow_r_mean, d.meanflow_r_std,
                                            d.meanflow_ratio, d.meanflow_adaptive_p, d.meanflow_adaptive_eps),
}

# name -> the samplers of that family (config validation; the CLI offers their union).
OBJECTIVE_SAMPLERS: dict[str, tuple[str, ...]] = {
    "ddpm": tuple(DDPMObjective.samplers), "edm": tuple(EDMObjective.samplers), "flow": tuple(FlowObjective.samplers),
    "meanflow": tuple(MeanFlowObjective.samplers),
}
# name -> the sampler that validation.sampler and evaluation.fid_sampler take when no preset or
# --set names them: DDIM for DDPM, Heun for EDM (Karras et al. 2022, Alg. 1) and flow, MeanFlow's own (eq. 12).
DEFAULT_SAMPLERS: dict[str, str] = {"ddpm": "ddim", "edm": "heun", "flow": "heun", "meanflow": "meanflow"}


def sampler_names() -> list[str]:
    """Every sampler name of every objective, each once, in registry order."""
    return list(dict.fromkeys(n for names in OBJECTIVE_SAMPLERS.values() for n in names))


def per_sample_loss(
    objective: Objective,
    net: Callable[..., Tensor],
    x0: Tensor,
    condition: Tensor | None,
    levels: Tensor,
    noise: Tensor,
    autocast: contextlib.AbstractContextManager | None = None,
    input_noise: Tensor | None = None,
    uncertainty: bool = False,
    pixel_weight: Tensor | None = None,
) -> Tensor:
    """The training loss of each sample, (B,) float32: ``net(input, cond, condition)`` (under
    ``autocast``, when given) regressed onto the objective's target with its weight.

    x0, noise: (B, C, H, W); condition: class labels (B,) long, text embeddings (B, L, D) or None;
    levels: (B,) from ``draw_levels``; input_noise: (B, C, H, W) with input perturbation (DDPM
    only: the input is noised with it, the target made from ``noise``), else None.
    uncertainty: EDM2's learned weighting (Karras et al. 2024, eq. 21): the network also returns
    the log-variance u (B,) of its noise level, and the loss is loss / e^u + u.
    pixel_weight: (B, 1, H, W) loss mask (``data.masks``) or None.
    """
    b = objective.noised(x0, levels, noise) if input_noise is None else objective.noised(x0, levels, noise, input_noise)
    network_loss = getattr(objective, "network_loss", None)  # a target made with the network (MeanFlow's JVP)
    if network_loss is not None:
        return network_loss(net, b, levels, condition, autocast, pixel_weight)
    with autocast or contextlib.nullcontext():
        out = net(b.input, b.cond, condition, return_logvar=True) if uncertainty else net(b.input, b.cond, condition)
    if not uncertainty:
        return diffusion_loss(out, b.target, b.weight, pixel_weight)
    out, logvar = out
    return diffusion_loss(out, b.target, b.weight, pixel_weight) / logvar.float().exp() + logvar.float()
