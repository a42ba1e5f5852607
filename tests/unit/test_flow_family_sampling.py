"""The flow objective's family timestep sampling and sampling grids against diffusers' own
functions: compute_density_for_timestep_sampling (same draws -> same t), the
FlowMatchEulerDiscreteScheduler's sigmas (SD3's static shift, Flux's dynamic mu), calculate_shift."""

from __future__ import annotations

import math

import pytest
import torch

from difftrain.config import ConfigError, load_config
from difftrain.diffusion.flow import FlowObjective, mode_times
from difftrain.diffusion.objective import build_objective
from difftrain.diffusion.ode_samplers import flow_times, image_seq_shift

training_utils = pytest.importorskip("diffusers.training_utils")


@pytest.mark.parametrize("scheme", ["logit_normal", "mode", "uniform"])
def test_draws_equal_diffusers_density(scheme):
    """Same generator state -> the same t as compute_density_for_timestep_sampling."""
    kw = dict(logit_mean=0.3, logit_std=1.2, mode_scale=1.29)
    ours = FlowObjective(kw["logit_mean"], kw["logit_std"], t_sampling=scheme, mode_scale=kw["mode_scale"])
    t = ours.draw_levels(257, torch.Generator().manual_seed(5), torch.device("cpu"))
    name = {"uniform": "none"}.get(scheme, scheme)
    u = training_utils.compute_density_for_timestep_sampling(name, 257, generator=torch.Generator().manual_seed(5), **kw)
    torch.testing.assert_close(t, u, rtol=0, atol=1e-6)


def test_default_is_todays_logit_normal_bit_for_bit():
    flow = FlowObjective()
    g = torch.Generator().manual_seed(3)
    expected = torch.sigmoid(torch.randn(64, generator=torch.Generator().manual_seed(3)))
    assert torch.equal(flow.draw_levels(64, g, torch.device("cpu")), expected)
    assert torch.equal(flow_times(7), torch.linspace(1.0, 0.0, 8, dtype=torch.float64))


@pytest.mark.parametrize("scheme,shift", [("logit_normal", 1.0), ("mode", 1.0), ("uniform", 3.0), ("mode", 3.0),
                                          ("logit_normal", 3.0)])
def test_quantile_cdf_and_buckets_agree_with_draws(scheme, shift):
    flow = FlowObjective(0.0, 1.0, t_sampling=scheme, mode_scale=1.29, train_shift=shift)
    u = torch.linspace(0.01, 0.99, 99, dtype=torch.float64)
    torch.testing.assert_close(flow.cdf(flow.quantile(u)), u, rtol=0, atol=1e-5)
    t = flow.draw_levels(40000, torch.Generator().manual_seed(0), torch.device("cpu"))
    counts = torch.bincount(flow.bucket(t, 10), minlength=10).double() / t.numel()
    assert (counts - 0.1).abs().max() < 0.01, counts
    s = flow.stratified_levels(10, torch.Generator().manual_seed(1))
    assert torch.equal(flow.bucket(s, 10), torch.arange(10))


def test_mode_times_is_decreasing_and_symmetric():
    u = torch.linspace(0, 1, 1001, dtype=torch.float64)
    t = mode_times(u, 1.29)
    assert (t[1:] < t[:-1]).all()
    torch.testing.assert_close(1 - t, mode_times(1 - u, 1.29))  # so diffusers' sigma = 1 - t has the same law


def test_train_shift_matches_sd3_scheduler_sigmas():
    """The SD3 script indexes FlowMatchEulerDiscreteScheduler(shift=3).sigmas at floor(1000 u):
    sigma = shift(1 - floor(1000 u) / 1000), already shifted; ours shifts t the same way."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    flow = FlowObjective(t_sampling="uniform", train_shift=3.0)
    idx = torch.arange(1000)
    unshifted = 1.0 - idx.double() / 1000
    torch.testing.assert_close(flow._shifted(unshifted).float(), sched.sigmas[idx], rtol=0, atol=1e-6)
    # Flux's scheduler (use_dynamic_shifting) leaves its training sigmas unshifted:
    flux = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    torch.testing.assert_close(flux.sigmas[idx], unshifted.float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("steps", [1, 4, 28])
def test_sd3_grid_is_the_schedulers(steps):
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    end = sched.sigma_min  # shift(1 / 1000): what the family's training_defaults set as diffusion.flow_grid_end
    sched.set_timesteps(steps)
    flow = FlowObjective(shift=3.0, grid_end=end)
    torch.testing.assert_close(flow.grid(steps, (4, 4)).float(), sched.sigmas, rtol=0, atol=1e-6)


@pytest.mark.parametrize("steps,hw", [(1, (4, 4)), (4, (8, 6)), (28, (128, 128))])
def test_flux_grid_is_the_schedulers_with_mu(steps, hw):
    """FluxPipeline: sigmas linspace(1, 1/N, N), mu = calculate_shift(tokens, ...), set_timesteps."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    cfg = dict(base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, **cfg)
    tokens = (hw[0] // 2) * (hw[1] // 2)
    mu = calculate_shift(tokens, 256, 4096, 0.5, 1.15)
    assert math.isclose(image_seq_shift(tokens, 0.5, 1.15, 256, 4096), mu, rel_tol=1e-12)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    flow = FlowObjective(shift=1.0, dynamic_shift=True)
    torch.testing.assert_close(flow.grid(steps, hw).float(), sched.sigmas, rtol=0, atol=1e-6)


def test_config_keys_build_the_objective_and_bad_values_are_refused():
    cfg = load_config(overrides=["diffusion.objective=flow", "diffusion.flow_t_sampling=mode",
                                 "diffusion.flow_train_shift=3", "diffusion.flow_grid_end=0.003",
                                 "diffusion.flow_dynamic_shift=true"])
    obj = build_objective(cfg.diffusion)
    assert (obj.t_sampling, obj.train_shift, obj.grid_end, obj.dynamic_shift) == ("mode", 3.0, 0.003, True)
    for bad in ("diffusion.flow_mode_scale=2", "diffusion.flow_grid_end=1.5", "diffusion.flow_train_shift=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(overrides=["diffusion.objective=flow", bad])
