"""Invariants of the samplers and their timestep grids, and a cross-check against diffusers."""

import math

import pytest
import torch

from difftrain.diffusion.objective import DDPMObjective
from difftrain.diffusion.process import PREDICTIONS, prediction_target, q_sample
from difftrain.diffusion.samplers import (
    SAMPLER_NFE,
    SAMPLERS,
    SPACINGS,
    ddim_sample,
    ddpm_sample,
    make_x0_denoiser,
    sampling_timesteps,
)
from difftrain.diffusion.schedules import alpha_bar_schedule
from difftrain.generation.sampling import generate

NUM_TIMESTEPS = 100
ALPHA_BAR = alpha_bar_schedule("linear", NUM_TIMESTEPS)
SHAPE = (2, 3, 8, 8)


def toy_model(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A fixed, smooth, nonlinear "network" of x_t and t: (B, C, H, W), (B,) -> (B, C, H, W)."""
    phase = torch.sin(t.to(x.dtype) / 97.0).view(-1, 1, 1, 1)
    return 0.9 * torch.tanh(0.8 * x + 0.5 * phase) + 0.05 * x.flip(-1)


def oracle(x0: torch.Tensor):
    """A denoiser that knows the data: it always returns x0."""
    return lambda x_t, t: x0.clone()


class Recorder:
    """Wraps a denoiser and keeps the (x_t, t) it was called with."""

    def __init__(self, denoiser):
        self.denoiser, self.calls = denoiser, []

    def __call__(self, x_t, t):
        self.calls.append((x_t.clone(), t.clone()))
        return self.denoiser(x_t, t)


def _data(seed: int = 0, shape=SHAPE) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x0 = torch.rand(shape, generator=generator) * 2 - 1
    return x0, torch.randn(shape, generator=generator)


def _x_T(x0, noise, timesteps, alpha_bar=ALPHA_BAR):
    return q_sample(x0, timesteps[:1].expand(len(x0)), noise, alpha_bar)


# --- Timestep grids -----------------------------------------------------------------------------


def _valid_steps(num_timesteps):
    candidates = (1, 2, 3, 7, num_timesteps // 3, num_timesteps - 1, num_timesteps)
    return sorted({s for s in candidates if 1 <= s <= num_timesteps})


@pytest.mark.parametrize("spacing", SPACINGS)
@pytest.mark.parametrize("num_timesteps", [1, 2, 7, 10, 100, 1000])
def test_sampling_timesteps_are_strictly_descending_inside_range(spacing, num_timesteps):
    for steps in _valid_steps(num_timesteps):
        timesteps = sampling_timesteps(num_timesteps, steps, spacing)
        assert timesteps.shape == (steps,) and timesteps.dtype == torch.long
        assert torch.all(timesteps[1:] < timesteps[:-1])
        assert timesteps[-1] >= 0 and timesteps[0] <= num_timesteps - 1
        if spacing in ("trailing", "linspace"):
            assert timesteps[0] == num_timesteps - 1
        if spacing == "trailing":
            # Ends within one stride of t = 0.
            assert timesteps[-1] <= math.ceil(num_timesteps / steps) - 1
        if spacing == "leading" or (spacing == "linspace" and steps > 1):
            assert timesteps[-1] == 0
        if spacing == "leading":
            stride = num_timesteps // steps
            assert torch.all(timesteps[:-1] - timesteps[1:] == stride)
        if steps == num_timesteps:
            assert torch.equal(timesteps, torch.arange(num_timesteps - 1, -1, -1))


def test_sampling_timesteps_validate_their_arguments():
    for steps in (0, 101, 2.0):
        with pytest.raises(ValueError, match=r"\[1, 100\]"):
            sampling_timesteps(100, steps)
    with pytest.raises(ValueError) as error:
        sampling_timesteps(100, 10, "uniform")
    assert all(spacing in str(error.value) for spacing in SPACINGS)


# --- Samplers -----------------------------------------------------------------------------------


def test_registry_maps_names_to_samplers():
    assert SAMPLERS["ddpm"] is ddpm_sample and SAMPLERS["ddim"] is ddim_sample


def test_ddim_with_eta_zero_is_deterministic():
    denoiser = make_x0_denoiser(toy_model, ALPHA_BAR, "epsilon", clip=True)
    timesteps = sampling_timesteps(NUM_TIMESTEPS, 10)
    x_T = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    first = ddim_sample(denoiser, x_T, timesteps, ALPHA_BAR, None, eta=0.0)
    torch.randn(3)  # disturb the global RNG: eta = 0 must not draw noise
    second = ddim_sample(denoiser, x_T, timesteps, ALPHA_BAR, None, eta=0.0)
    assert torch.equal(first, second)


@pytest.mark.parametrize("spacing", SPACINGS)
@pytest.mark.parametrize("steps", [1, 5, NUM_TIMESTEPS])
def test_ddim_with_oracle_follows_the_forward_trajectory_and_returns_the_data(spacing, steps):
    # With eta = 0 and a perfect denoiser, eps_hat is the noise in x_T at every step, so each x_t
    # is exactly q_sample(x0, t, that noise) (DDIM eq. 12 with sigma = 0).
    x0, noise = _data(1)
    timesteps = sampling_timesteps(NUM_TIMESTEPS, steps, spacing)
    recorder = Recorder(oracle(x0))
    out = ddim_sample(recorder, _x_T(x0, noise, timesteps), timesteps, ALPHA_BAR, None, eta=0.0)
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-5)
    assert [int(t[0]) for _, t in recorder.calls] == timesteps.tolist()
    for x_t, t in recorder.calls:
        torch.testing.assert_close(x_t, q_sample(x0, t, noise, ALPHA_BAR), rtol=0, atol=1e-5)


@pytest.mark.parametrize("spacing", SPACINGS)
@pytest.mark.parametrize("steps", [1, 5, NUM_TIMESTEPS])
def test_ddpm_with_oracle_returns_the_data(spacing, steps):
    x0, noise = _data(2)
    timesteps = sampling_timesteps(NUM_TIMESTEPS, steps, spacing)
    recorder = Recorder(oracle(x0))
    generator = torch.Generator().manual_seed(0)
    out = ddpm_sample(recorder, _x_T(x0, noise, timesteps), timesteps, ALPHA_BAR, generator)
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-5)
    assert len(recorder.calls) == steps


@pytest.mark.parametrize(
    "sampler, options",
    [(ddpm_sample, {}), (ddim_sample, {"eta": 1.0}), (ddim_sample, {"eta": 0.5})],
    ids=["ddpm", "ddim-eta1", "ddim-eta0.5"],
)
def test_stochastic_samplers_keep_the_forward_marginals_on_a_respaced_grid(sampler, options):
    # For data concentrated at one point the reverse steps are exact posteriors (DDPM eq. 7,
    # DDIM eq. 7), so every visited x_t must be distributed as q(x_t | x0) = N(sqrt(ab) x0, 1 - ab).
    x0 = torch.full((8000, 1, 4, 4), 0.6)
    n = x0.numel()
    timesteps = sampling_timesteps(NUM_TIMESTEPS, 7, "trailing")
    generator = torch.Generator().manual_seed(3)
    x_T = _x_T(x0, torch.randn(x0.shape, generator=generator), timesteps)
    recorder = Recorder(oracle(x0))
    sampler(recorder, x_T, timesteps, ALPHA_BAR, generator, **options)
    assert len(recorder.calls) == 7
    for x_t, t in recorder.calls[1:]:
        ab = ALPHA_BAR[t[0]].item()
        # Standard scores of the sample mean and variance; 5 sigma leaves no room for flakiness
        # (the seed is fixed anyway) but catches a wrong beta or variance by a wide margin.
        mean_score = (x_t.mean().item() - math.sqrt(ab) * 0.6) / math.sqrt((1 - ab) / n)
        variance_score = (x_t.var().item() / (1 - ab) - 1) / math.sqrt(2 / n)
        assert abs(mean_score) < 5 and abs(variance_score) < 5, (int(t[0]), mean_score, variance_score)


def test_ddim_with_eta_one_is_ddpm():
    denoiser = make_x0_denoiser(toy_model, ALPHA_BAR, "v", clip=True)
    timesteps = sampling_timesteps(NUM_TIMESTEPS, 12, "linspace")
    x_T = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    ddpm = ddpm_sample(denoiser, x_T, timesteps, ALPHA_BAR, torch.Generator().manual_seed(7))
    ddim = ddim_sample(denoiser, x_T, timesteps, ALPHA_BAR, torch.Generator().manual_seed(7), eta=1.0)
    torch.testing.assert_close(ddim, ddpm, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "sampler, options", [(ddpm_sample, {}), (ddim_sample, {"eta": 0.7})], ids=["ddpm", "ddim"]
)
def test_same_seed_same_sample_different_seed_different_sample(sampler, options):
    denoiser = make_x0_denoiser(toy_model, ALPHA_BAR, "epsilon", clip=True)
    timesteps = sampling_timesteps(NUM_TIMESTEPS, 10)
    x_T = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))

    def sample(seed):
        return sampler(denoiser, x_T, timesteps, ALPHA_BAR, torch.Generator().manual_seed(seed), **options)

    assert torch.equal(sample(11), sample(11))
    assert not torch.allclose(sample(11), sample(12))


@pytest.mark.parametrize(
    "sampler, options", [(ddpm_sample, {}), (ddim_sample, {"eta": 0.7})], ids=["ddpm", "ddim"]
)
def test_one_generator_per_row_makes_a_sample_independent_of_its_batch(sampler, options):
    # How a grid split across processes stays the grid of one process: row i draws from its own
    # generator, so sampling rows 0-1 and 2-3 apart equals sampling all four together.
    denoiser = make_x0_denoiser(toy_model, ALPHA_BAR, "epsilon", clip=True)
    timesteps = sampling_timesteps(NUM_TIMESTEPS, 10)
    x_T = torch.randn((4, 3, 8, 8), generator=torch.Generator().manual_seed(0))

    def rows(ids):
        gens = [torch.Generator().manual_seed(100 + i) for i in ids]
        return sampler(denoiser, x_T[ids], timesteps, ALPHA_BAR, gens, **options)

    whole = rows([0, 1, 2, 3])
    torch.testing.assert_close(torch.cat([rows([0, 1]), rows([2, 3])]), whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(rows([2]), whole[2:3], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="3 generators for a batch of 4"):
        sampler(denoiser, x_T, timesteps, ALPHA_BAR, [torch.Generator()] * 3, **options)


class _ToyNet(torch.nn.Module):
    """toy_model as a network with the UNet's call signature (and one parameter for its device)."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x, t, labels=None):
        return toy_model(x, t) + self.anchor


def test_generate_with_sample_ids_is_the_same_however_the_rows_are_split():
    net, noise = _ToyNet(), torch.randn((5, 3, 8, 8), generator=torch.Generator().manual_seed(0))
    objective = DDPMObjective("linear", NUM_TIMESTEPS, "epsilon", "uniform")
    common = {"objective": objective, "sampler": "ddpm", "steps": 6, "seed": 9}
    whole = generate(net, noise=noise, sample_ids=range(5), **common)
    parts = [generate(net, noise=noise[s], sample_ids=range(5)[s], batch_size=2, **common)
             for s in (slice(0, 3), slice(3, 5))]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=1e-6)
    # Without ids the noise follows the batches, as before: then the split changes the samples.
    assert not torch.allclose(generate(net, noise=noise[3:], **common), whole[3:])
    # A share of no rows (more processes than images) is an empty batch, not an error.
    assert generate(net, noise=noise[5:], sample_ids=range(5, 5), **common).shape == (0, 3, 8, 8)


@pytest.mark.parametrize("name", sorted(SAMPLERS))
@pytest.mark.parametrize("steps", [1, NUM_TIMESTEPS])
def test_samplers_run_with_one_step_and_with_every_step(name, steps):
    denoiser = Recorder(make_x0_denoiser(toy_model, ALPHA_BAR, "epsilon", clip=True))
    timesteps = sampling_timesteps(NUM_TIMESTEPS, steps)
    x_T = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    out = SAMPLERS[name](denoiser, x_T, timesteps, ALPHA_BAR, torch.Generator().manual_seed(1))
    assert out.shape == SHAPE and out.dtype == torch.float32
    assert torch.isfinite(out).all() and out.abs().max() <= 1  # the final x0 is clipped
    assert len(denoiser.calls) == SAMPLER_NFE[name](steps)
    assert denoiser.calls[0][1].tolist() == [NUM_TIMESTEPS - 1] * SHAPE[0]


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_state_stays_float32_with_a_low_precision_denoiser(name):
    dtypes = []

    def bf16_denoiser(x_t, t):
        dtypes.append(x_t.dtype)
        return make_x0_denoiser(toy_model, ALPHA_BAR, "epsilon", clip=True)(x_t.bfloat16(), t).bfloat16()

    timesteps = sampling_timesteps(NUM_TIMESTEPS, 5)
    x_T = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).bfloat16()
    out = SAMPLERS[name](bf16_denoiser, x_T, timesteps, ALPHA_BAR, torch.Generator().manual_seed(1))
    assert out.dtype == torch.float32 and set(dtypes) == {torch.float32}


@pytest.mark.parametrize("prediction", PREDICTIONS)
def test_make_x0_denoiser_inverts_each_parameterization(prediction):
    # A model returning the exact target for (x0, noise) at x_t denoises to x0.
    x0, noise = _data(4)
    t = torch.tensor([3, 80])

    def exact_model(x_t, t_in):
        assert torch.equal(t_in, t)
        return prediction_target(prediction, x0, noise, ALPHA_BAR[t_in])

    x_t = q_sample(x0, t, noise, ALPHA_BAR)
    x0_hat = make_x0_denoiser(exact_model, ALPHA_BAR, prediction, clip=False)(x_t, t)
    torch.testing.assert_close(x0_hat, x0, rtol=0, atol=1e-4)


def test_make_x0_denoiser_clips_to_the_data_range():
    def loud_model(x_t, t):
        return torch.full_like(x_t, 3.0)

    t = torch.tensor([10, 10])
    x_t = torch.zeros(SHAPE)
    assert make_x0_denoiser(loud_model, ALPHA_BAR, "x0", clip=True)(x_t, t).abs().max() == 1
    assert make_x0_denoiser(loud_model, ALPHA_BAR, "x0", clip=False)(x_t, t).max() == 3
    with pytest.raises(ValueError, match="epsilon"):
        make_x0_denoiser(loud_model, ALPHA_BAR, "eps")


def test_samplers_reject_bad_arguments():
    denoiser = oracle(torch.zeros(SHAPE))
    x_T = torch.zeros(SHAPE)
    bad_grids = ([5, 7, 1], [5, 5], [NUM_TIMESTEPS, 3], [3, -1], [])
    for timesteps in (torch.tensor(grid, dtype=torch.long) for grid in bad_grids):
        for sampler in SAMPLERS.values():
            with pytest.raises(ValueError, match="timesteps"):
                sampler(denoiser, x_T, timesteps, ALPHA_BAR, None)
    with pytest.raises(ValueError, match="eta"):
        ddim_sample(denoiser, x_T, torch.tensor([5, 0]), ALPHA_BAR, None, eta=1.5)
    with pytest.raises(TypeError):
        ddpm_sample(denoiser, x_T, torch.tensor([5, 0]), ALPHA_BAR, None, eta=0.5)


# --- Cross-check against diffusers ----------------------------------------------------------------

DIFFUSERS_PREDICTION = {"epsilon": "epsilon", "v": "v_prediction", "x0": "sample"}


@pytest.mark.parametrize("spacing", SPACINGS)
def test_timesteps_match_diffusers(spacing):
    diffusers = pytest.importorskip("diffusers")
    scheduler = diffusers.DDIMScheduler(num_train_timesteps=1000, timestep_spacing=spacing, steps_offset=0)
    # diffusers' "linspace" with one step starts at t = 0; ours starts at T - 1.
    for steps in [2, 3, 7, 10, 16, 50, 100, 333, 1000] + ([1] if spacing != "linspace" else []):
        scheduler.set_timesteps(steps)
        assert torch.equal(scheduler.timesteps, sampling_timesteps(1000, steps, spacing)), steps


@pytest.mark.parametrize("spacing", ["leading", "trailing"])
@pytest.mark.parametrize("prediction", PREDICTIONS)
@pytest.mark.parametrize("eta", [0.0, 1.0])
@pytest.mark.parametrize("clip", [False, True])
def test_ddim_matches_diffusers(spacing, prediction, eta, clip):
    # Conventions that make the two agree: set_alpha_to_one=True is our "last step returns x0_hat";
    # diffusers steps from t to t - T // steps, which is the next grid point only for "leading"
    # and for "trailing" with steps dividing T, so "linspace" is not compared here. With clip, the
    # toy model's x0 leaves [-1, 1] at high noise; both clamp it and form the noise from the
    # clamped x0 (diffusers: use_clipped_model_output=True).
    diffusers = pytest.importorskip("diffusers")
    num_timesteps, steps = 1000, 50
    scheduler = diffusers.DDIMScheduler(
        num_train_timesteps=num_timesteps,
        beta_start=1e-4,
        beta_end=0.02,
        beta_schedule="linear",
        clip_sample=clip,
        set_alpha_to_one=True,
        steps_offset=0,
        timestep_spacing=spacing,
        prediction_type=DIFFUSERS_PREDICTION[prediction],
    )
    scheduler.set_timesteps(steps)
    alpha_bar = alpha_bar_schedule("linear", num_timesteps)
    timesteps = sampling_timesteps(num_timesteps, steps, spacing)
    assert torch.equal(scheduler.timesteps, timesteps)
    x_T = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))

    # Theirs: the same noise, drawn in the same order (one draw per step but the last).
    generator = torch.Generator().manual_seed(5)
    x = x_T.clone()
    for i, t in enumerate(scheduler.timesteps):
        variance_noise = None
        if eta > 0:
            last = i == steps - 1
            variance_noise = torch.zeros(SHAPE) if last else torch.randn(SHAPE, generator=generator)
        model_out = toy_model(x, t.expand(SHAPE[0]))
        x = scheduler.step(model_out, t, x, eta=eta, variance_noise=variance_noise,
                           use_clipped_model_output=clip).prev_sample

    denoiser = make_x0_denoiser(toy_model, alpha_bar, prediction, clip=clip)
    ours = ddim_sample(denoiser, x_T, timesteps, alpha_bar, torch.Generator().manual_seed(5), eta=eta)
    torch.testing.assert_close(ours, x, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spacing", SPACINGS)
def test_respaced_ddpm_matches_diffusers(spacing):
    # DDPMScheduler with set_timesteps steps to the next grid point and recomputes beta from
    # alpha_bar there, as ddpm_sample does; it draws noise at every t > 0 from the generator.
    diffusers = pytest.importorskip("diffusers")
    num_timesteps, steps = 1000, 20
    scheduler = diffusers.DDPMScheduler(
        num_train_timesteps=num_timesteps,
        beta_schedule="linear",
        clip_sample=False,
        variance_type="fixed_small",
        steps_offset=0,
        timestep_spacing=spacing,
        prediction_type="epsilon",
    )
    scheduler.set_timesteps(steps)
    alpha_bar = alpha_bar_schedule("linear", num_timesteps)
    timesteps = sampling_timesteps(num_timesteps, steps, spacing)
    assert torch.equal(scheduler.timesteps, timesteps)
    x_T = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))

    generator = torch.Generator().manual_seed(9)
    x = x_T.clone()
    for t in scheduler.timesteps:
        x = scheduler.step(toy_model(x, t.expand(SHAPE[0])), t, x, generator=generator).prev_sample

    denoiser = make_x0_denoiser(toy_model, alpha_bar, "epsilon", clip=False)
    ours = ddpm_sample(denoiser, x_T, timesteps, alpha_bar, torch.Generator().manual_seed(9))
    torch.testing.assert_close(ours, x, rtol=1e-4, atol=1e-4)
