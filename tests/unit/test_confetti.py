"""The confetti share: its energy figure, the reference threshold, and the samplers' clipping."""

import numpy as np
import pytest
import torch

from difftrain.diffusion.samplers import _dpmpp_multistep, ddim_sample, make_x0_denoiser, sampling_timesteps
from difftrain.diffusion.schedules import alpha_bar_schedule
from difftrain.evaluation.confetti import THRESHOLD_KEY, confetti_threshold, laplacian_energy, share_against
from difftrain.evaluation.fid import statistics_from_images


def _smooth_and_noisy(n: int = 50):
    """(n, 3, 16, 16) float images: smooth gradients, and the same with saturated pixel noise."""
    g = torch.Generator().manual_seed(0)
    ramp = torch.linspace(-0.8, 0.8, 16)
    smooth = (ramp[None, None, :, None] * torch.rand(n, 3, 1, 1, generator=g)).expand(n, 3, 16, 16).clone()
    noisy = torch.sign(torch.randn(n, 3, 16, 16, generator=g))
    return smooth, noisy


def test_laplacian_energy_is_zero_for_flat_images_and_the_same_in_every_input_form():
    assert laplacian_energy(torch.zeros(2, 3, 8, 8)).tolist() == [0.0, 0.0]
    smooth, noisy = _smooth_and_noisy(4)
    pixels = ((noisy + 1) * 127.5).round().to(torch.uint8)
    as_tensor = laplacian_energy(pixels)
    np.testing.assert_allclose(as_tensor, laplacian_energy(pixels.permute(0, 2, 3, 1).numpy()))
    np.testing.assert_allclose(as_tensor, laplacian_energy(noisy), rtol=1e-6)
    assert laplacian_energy(smooth).max() < 0.05 < 1.0 < laplacian_energy(noisy).min()


def test_share_counts_samples_above_the_reference_percentile():
    smooth, noisy = _smooth_and_noisy()
    threshold = confetti_threshold(smooth, percentile=100.0)  # the smoothest-image bar: no smooth image above it
    samples = torch.cat([smooth[:40], noisy[:10]])
    assert share_against(laplacian_energy(samples), {THRESHOLD_KEY: threshold}) == pytest.approx(0.2)
    assert share_against(laplacian_energy(samples), {}) is None  # statistics made before the threshold


def test_reference_statistics_record_the_threshold_of_their_images():
    class Features(torch.nn.Module):
        metadata = {"network": "stand-in"}
        feature_dim = 4

        def forward(self, images):
            return images.float().flatten(1)[:, :4]

    smooth, _ = _smooth_and_noisy()
    pixels = ((smooth + 1) * 127.5).round().to(torch.uint8)
    stats = statistics_from_images([pixels[:25], pixels[25:]], Features())
    assert stats.metadata[THRESHOLD_KEY] == pytest.approx(confetti_threshold(pixels.permute(0, 2, 3, 1).numpy()))


def test_first_order_dpm_solver_with_clipping_is_ddim_with_clipping():
    """One clipping convention for both forms: first-order DPM-Solver++ (data prediction) is DDIM,
    with the denoiser's x0 clamped alike."""
    alpha_bar = alpha_bar_schedule("linear", 1000)

    def eps_model(x, t):  # a poor epsilon network: x0 = (x - sqrt(1 - ab) eps) / sqrt(ab) leaves [-1, 1]
        return 0.9 * torch.tanh(x) + 0.05 * torch.sin(3 * x)

    clipped = make_x0_denoiser(eps_model, alpha_bar, "epsilon", clip=True)
    x_T = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    timesteps = sampling_timesteps(1000, 20)
    ddim = ddim_sample(clipped, x_T, timesteps, alpha_bar)
    dpm1 = _dpmpp_multistep(clipped, x_T, timesteps, alpha_bar, 1, False)
    torch.testing.assert_close(dpm1, ddim, rtol=1e-4, atol=1e-4)
    unclipped = make_x0_denoiser(eps_model, alpha_bar, "epsilon", clip=False)
    assert not torch.allclose(ddim, ddim_sample(unclipped, x_T, timesteps, alpha_bar), atol=1e-2)
