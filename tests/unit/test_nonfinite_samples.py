"""Samples and first outputs that overflow (issue 39), on toy networks: ``generate`` checks each batch's
final images once and names the rows; ``naming_samples`` puts what was sampled in front; the output probe
of an adapter's network runs one forward on a fixed input, in eval mode, drawing none of the caller's
random numbers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from difftrain.networks.conditioning import Conditioning
from difftrain.diffusion.objective import DDPMObjective
from difftrain.generation.sampling import NonFiniteSamples, generate, naming_samples
from difftrain.networks.probe import output_is_finite


class Toy(nn.Module):
    """``net(x (B, C, H, W), t (B,), cond) -> (B, C, H, W)``: ``x * weight``, NaN on the rows given."""

    def __init__(self, weight: float = 0.5, nan_rows: tuple[int, ...] = ()):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(weight))
        self.nan_rows, self.calls, self.modes = nan_rows, 0, []

    def forward(self, x, t, cond=None):
        self.calls += 1
        self.modes.append(self.training)
        out = x * self.weight
        if self.nan_rows:
            out = out.clone()
            out[list(self.nan_rows)] = float("nan")
        return out


OBJECTIVE = DDPMObjective("linear", 100, "epsilon", "uniform")


def _generate(model, num: int = 4, batch_size: int = 2, **options):
    return generate(model, objective=OBJECTIVE, noise=torch.randn(num, 3, 4, 4), steps=3, batch_size=batch_size,
                    **options)


def test_a_batch_whose_samples_are_not_finite_raises_naming_its_rows():
    assert torch.isfinite(_generate(Toy())).all()
    with pytest.raises(NonFiniteSamples, match=r"^samples 0-1 came out not finite \(NaN or inf\)"):
        _generate(Toy(nan_rows=(1,)))
    # A finite weight whose outputs overflow, unclipped (latents are not clipped to [-1, 1]; pixels' clipped x0
    # estimates hide an infinite output, not a NaN one).
    overflowing = Toy(weight=1e30)
    with pytest.raises(NonFiniteSamples, match=r"^run/x.pt \(step 3\): samples 0-1 came out .*; do this$") as info:
        with naming_samples("run/x.pt (step 3)", then="do this"):
            _generate(overflowing, clip=False)
    assert "\n" not in str(info.value)


def test_the_check_is_once_per_batch_on_the_final_images_never_inside_the_sampler():
    """3 sampler steps, 2 batches of 2: the first batch's NaN is found once its sampler has run to its end
    (3 network calls, none checked), and the second batch is never sampled."""
    model = Toy(nan_rows=(0,))
    with pytest.raises(NonFiniteSamples):
        _generate(model, num=4, batch_size=2)
    assert model.calls == 3  # the first batch's sampler ran to its end, then the check stopped it


def test_the_output_probe_runs_one_forward_in_eval_mode_and_draws_no_random_number_of_the_caller():
    conditioning = Conditioning(channels=3, resolution=8)
    model = Toy().train()
    torch.manual_seed(5)
    before = torch.get_rng_state()
    assert output_is_finite(model, OBJECTIVE, conditioning, "cpu")
    assert torch.equal(torch.get_rng_state(), before)
    assert model.calls == 1 and model.modes == [False] and model.training  # eval for the forward, restored
    assert not output_is_finite(Toy(weight=float("inf")), OBJECTIVE, conditioning, "cpu")
    assert not output_is_finite(Toy(nan_rows=(0,)), OBJECTIVE, conditioning, "cpu")
