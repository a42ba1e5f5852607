"""Autoguidance (Karras et al. 2024): D_guide + w (D_main - D_guide) on the network outputs, by
another checkpoint or an earlier step of the same run, in `sample`, the API and validation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from difftrain import cli
from difftrain.generation.autoguidance import AutoGuided, ValidationGuide, guide_checkpoint
from difftrain.config import load_config


class Affine(nn.Module):
    """A tiny stand-in network: net(x, t, cond) = a x + b t (+ cond)."""

    def __init__(self, a: float, b: float):
        super().__init__()
        self.a, self.b = nn.Parameter(torch.tensor(a)), nn.Parameter(torch.tensor(b))

    def forward(self, x, t, cond=None):
        out = self.a * x + self.b * t.view(-1, 1, 1, 1)
        return out if cond is None else out + cond.view(-1, 1, 1, 1)


def test_guided_output_is_the_formula_and_its_ends_are_the_two_networks():
    gen = torch.Generator().manual_seed(0)
    x, t, cond = torch.randn(3, 2, 4, 4, generator=gen), torch.rand(3, generator=gen), torch.randn(3, generator=gen)
    main, guide = Affine(0.7, 0.3), Affine(-0.2, 1.1)
    for c in (None, cond):
        d_main, d_guide = main(x, t, c), guide(x, t, c)
        assert torch.equal(AutoGuided(main, guide, 1.0)(x, t, c), d_main)
        assert torch.equal(AutoGuided(main, guide, 0.0)(x, t, c), d_guide)
        torch.testing.assert_close(AutoGuided(main, guide, 2.5)(x, t, c), d_guide + 2.5 * (d_main - d_guide))
    with pytest.raises(ValueError, match="weight must be >= 0"):
        AutoGuided(main, guide, -1.0)


def test_autoguidance_composes_with_classifier_free_guidance():
    from difftrain.generation.sampling import guided_network

    gen = torch.Generator().manual_seed(1)
    x, t = torch.randn(2, 1, 2, 2, generator=gen), torch.rand(2, generator=gen)
    labels, null = torch.tensor([0.5, -1.0]), torch.tensor(0.0)
    main, guide = Affine(0.7, 0.3), Affine(-0.2, 1.1)

    def auto(c):  # D_guide + w (D_main - D_guide), w = 2
        return guide(x, t, c) + 2.0 * (main(x, t, c) - guide(x, t, c))

    want = auto(null.expand(2)) + 3.0 * (auto(labels) - auto(null.expand(2)))  # CFG scale 3 on top
    torch.testing.assert_close(guided_network(AutoGuided(main, guide, 2.0), labels, null, 3.0)(x, t), want)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny EDM run with checkpoints at steps 2, 4 and 6."""
    from conftest import TINY_OVERRIDES
    from difftrain.training.loop import train

    run = tmp_path_factory.mktemp("autoguidance") / "run"
    cfg = load_config(None, TINY_OVERRIDES + ["diffusion.objective=edm", "checkpoint.keep_last=3",
                                              "validation.every_steps=0", "model.base_channels=8",
                                              "model.channel_mult=[1, 2]"])
    train(cfg, run)
    return run


def test_weight_one_is_the_model_and_weight_zero_the_guide_when_sampling(run):
    from difftrain.api import generate, load

    options = dict(sampler="euler", steps=3, seed=1)
    main, early = generate(load(run), 2, **options), generate(load(run / "checkpoints" / "step_00000002.pt"), 2, **options)
    assert torch.equal(generate(load(run, guide_step=2, guide_weight=1.0), 2, **options), main)
    assert torch.equal(generate(load(run, guide_step=2, guide_weight=0.0), 2, **options), early)
    guided = load(run, guide=run / "checkpoints" / "step_00000004.pt", guide_weight=2.0)
    assert guided.guide.endswith("step_00000004.pt") and guided.guide_step == 4 and guided.guide_weight == 2.0
    assert not torch.equal(generate(guided, 2, **options), main)


def test_guide_step_must_exist_and_a_guide_must_share_the_parameterization(run, tmp_path):
    from conftest import TINY_OVERRIDES
    from difftrain.api import load
    from difftrain.training.loop import train

    with pytest.raises(ValueError, match=r"--guide-step 3: .* has no checkpoint of that step \(it has steps \[2, 4, 6\]\)"):
        guide_checkpoint(run, guide_step=3)
    flow = tmp_path / "flow"
    train(load_config(None, TINY_OVERRIDES + ["diffusion.objective=flow", "train.total_steps=2",
                                              "validation.every_steps=0"]), flow)
    with pytest.raises(ValueError, match=r"diffusion\.objective='flow'.*with 'edm'"):
        load(run, guide=flow)


def test_sample_cli_with_a_guide_step(run, tmp_path, capsys):
    out = tmp_path / "samples"
    assert cli.main(["sample", "--checkpoint", str(run), "--guide-step", "2", "--guide-weight", "2.5", "--num", "2",
                     "--steps", "2", "--sampler", "euler", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "autoguided by" in said and "(step 2), weight 2.5" in said and (out / "000001.png").is_file()
    assert cli.main(["sample", "--checkpoint", str(run), "--guide-step", "3", "--num", "2", "--out", str(out)]) == 2
    assert "--guide-step 3: " in capsys.readouterr().err


def test_training_validates_with_a_guide(run, tmp_path):
    from conftest import TINY_OVERRIDES
    from difftrain.training.loop import train

    guide = run / "checkpoints" / "step_00000002.pt"  # a smaller network than this run's: any architecture guides
    cfg = load_config(None, TINY_OVERRIDES + ["diffusion.objective=edm", "train.total_steps=3",
                                              f"validation.guide={guide}", "validation.sampler=euler"])
    train(cfg, tmp_path / "main")
    assert (tmp_path / "main" / "samples" / "step_00000003.png").is_file()


def test_validation_guide_wraps_the_grid_and_fid_model(run):
    from difftrain.networks.conditioning import Conditioning

    cfg = load_config(None, ["diffusion.objective=edm", f"validation.guide={run / 'checkpoints' / 'step_00000002.pt'}",
                             "validation.guide_weight=3", "data.resolution=16"])
    model = Affine(1.0, 0.0)
    none = ValidationGuide(load_config(None, []).validation, load_config(None, []).diffusion, Conditioning(channels=3, resolution=16))
    assert none.wrap(model) is model
    wrapped = ValidationGuide(cfg.validation, cfg.diffusion, Conditioning(channels=3, resolution=16)).wrap(model)
    assert isinstance(wrapped, AutoGuided) and wrapped.weight == 3.0 and wrapped.main is model
    bad = load_config(None, [f"validation.guide={run / 'missing'}"])
    with pytest.raises(ValueError, match="validation.guide .*missing"):
        ValidationGuide(bad.validation, bad.diffusion, Conditioning(channels=3, resolution=16)).wrap(model)
