"""EDM2's training options (Karras et al. 2024, "Analyzing and improving the training dynamics of
diffusion models"): the learned loss weighting, the inverse square root LR decay, Adam's betas, the
magnitude-preserving layers with forced weight normalisation."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import TINY_OVERRIDES
from difftrain.config import ConfigError, load_config
from difftrain.diffusion.objective import build_objective, per_sample_loss
from difftrain.models import build_model
from difftrain.training.lr_schedule import lr_at
from difftrain.training.state import RunState, build_optimizer

SMALL = TINY_OVERRIDES + ["model.base_channels=8", "model.channel_mult=[1, 2]", "diffusion.objective=edm"]


def test_uncertainty_loss_is_loss_over_exp_u_plus_u_and_starts_as_the_plain_loss():
    cfg = load_config(None, SMALL + ["diffusion.uncertainty_weighting=true"])
    model, objective = build_model(cfg), build_objective(cfg.diffusion)
    gen = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(4, 3, 16, 16, generator=gen), torch.randn(4, 3, 16, 16, generator=gen)
    levels = objective.draw_levels(4, gen, torch.device("cpu"))
    plain = per_sample_loss(objective, model, x0, None, levels, noise)
    torch.testing.assert_close(per_sample_loss(objective, model, x0, None, levels, noise, uncertainty=True), plain)
    with torch.no_grad():  # a trained head: u depends on the noise level
        model.logvar.linear.weight.normal_(generator=gen)
    u = model.logvar(objective.cond(levels))
    assert u.shape == (4,) and u.std() > 0
    torch.testing.assert_close(per_sample_loss(objective, model, x0, None, levels, noise, uncertainty=True),
                               plain / u.exp() + u)


def test_uncertainty_head_trains_is_checkpointed_and_is_left_out_of_exports(tmp_path):
    from difftrain.models.diffusers_export import to_diffusers_state_dict
    from difftrain.checkpoints import checkpoint as ckpt
    from difftrain.training.loop import train

    cfg = load_config(None, SMALL + ["diffusion.uncertainty_weighting=true", "validation.every_steps=0"])
    train(cfg, tmp_path / "run")
    state = ckpt.load_checkpoint(tmp_path / "run")
    assert state["model"]["logvar.linear.weight"].abs().sum() > 0  # it moved from its zero start
    assert "logvar.freqs" in state["ema"]["model"]
    model = build_model(cfg)
    model.load_state_dict(state["ema"]["model"])
    assert not any(k.startswith("logvar") for k in to_diffusers_state_dict(model))
    assert "logvar_channels" not in build_model(load_config(None, SMALL)).config  # off: the config is unchanged
    with pytest.raises(ConfigError, match="uncertainty_weighting .*LoRA"):
        load_config(None, SMALL + ["diffusion.uncertainty_weighting=true", "lora.rank=4"])


def test_inverse_sqrt_lr_decay():
    kw = dict(peak_lr=1e-2, warmup_steps=10, total_steps=10_000, schedule="inverse_sqrt", ref_steps=100)
    assert lr_at(5, **kw) == pytest.approx(6e-3)  # warm-up first
    assert lr_at(50, **kw) == lr_at(100, **kw) == 1e-2  # constant up to t_ref
    assert lr_at(400, **kw) == pytest.approx(1e-2 / math.sqrt(4))
    assert lr_at(10_000, **kw) == pytest.approx(1e-3)
    cfg = load_config(None, ["optim.lr_schedule=inverse_sqrt", "optim.lr_ref_steps=300"])
    assert cfg.optim.lr_schedule == "inverse_sqrt" and cfg.optim.lr_ref_steps == 300
    with pytest.raises(ConfigError, match="optim.lr_ref_steps must be > 0"):
        load_config(None, ["optim.lr_ref_steps=0"])


def test_adam_beta2_is_configurable():
    cfg = load_config(None, SMALL + ["optim.betas=[0.9, 0.99]"])
    state = RunState.build(cfg, 0, torch.device("cpu"))
    assert state.optimizer.param_groups[0]["betas"] == (0.9, 0.99)
    assert build_optimizer(cfg.optim, build_model(cfg), torch.device("cpu")).param_groups[0]["betas"] == (0.9, 0.99)


def test_mp_layers_compute_the_same_whatever_the_weight_scale_and_preserve_magnitude():
    from difftrain.models.layers import MPConv2d, MPLinear, mp_normalize

    torch.manual_seed(0)
    conv, linear = MPConv2d(64, 32, 3, padding=1), MPLinear(256, 128)
    for layer in (conv, linear):
        layer.gain = None
        layer.renormalize_()  # stored at unit RMS, as MP layers keep them (EDM2's epsilon is then 1e-4 of it)
        torch.nn.init.zeros_(layer.bias)
    x_img, x_vec = torch.randn(8, 64, 16, 16), torch.randn(512, 256)
    with torch.no_grad():
        before = conv(x_img), linear(x_vec)
        for layer in (conv, linear):
            layer.weight.mul_(100.0)  # the stored scale does not reach the output
        after = conv(x_img), linear(x_vec)
    for b, a in zip(before, after):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4)
        assert 0.85 < b.std().item() < 1.15  # unit-variance in, unit-variance out
    rows = mp_normalize(conv.weight).flatten(1)
    torch.testing.assert_close(rows.pow(2).mean(1), torch.ones(32), rtol=1e-3, atol=1e-3)


def test_forced_weight_normalisation_puts_rows_back_to_unit_rms_after_every_step():
    from difftrain.models.layers import MPConv2d, MPLinear

    def rms_spread(model):
        rms = [m.weight.detach().flatten(1).pow(2).mean(1).sqrt() for m in model.modules()
               if isinstance(m, (MPConv2d, MPLinear))]
        return torch.cat(rms).sub(1).abs().max().item()

    cfg = load_config(None, SMALL + ["model.magnitude_preserving=true", "optim.lr=0.3", "optim.warmup_steps=0"])
    model = build_model(cfg)
    assert rms_spread(model) < 1e-3  # EDM2's eps (1e-4 of a unit row) leaves rows just under 1
    x, t = torch.randn(4, 3, 16, 16), torch.randint(0, 100, (4,))
    for hooked in (True, False):
        optimizer = build_optimizer(cfg.optim, model, torch.device("cpu"))
        if not hooked:  # the same step without the hook moves the rows off unit RMS: the hook acts
            optimizer._optimizer_step_post_hooks.clear()
        model(x, t).square().mean().backward()
        with torch.no_grad():  # a gradient for every weight (the zero gains block it at the start)
            for p in model.parameters():
                p.grad = torch.randn_like(p) if p.grad is None else p.grad + torch.randn_like(p)
        optimizer.step()
        optimizer.zero_grad()
        assert (rms_spread(model) < 1e-3) is hooked


def test_mp_model_trains_resumes_exactly_and_exports_the_weights_it_computes_with(tmp_path):
    from diffusers import UNet2DModel

    from difftrain.models.diffusers_export import diffusers_config, to_diffusers_state_dict
    from difftrain.checkpoints import checkpoint as ckpt
    from difftrain.training.loop import train

    cfg = load_config(None, SMALL + ["model.magnitude_preserving=true", "validation.every_steps=0",
                                     "optim.lr_schedule=inverse_sqrt", "optim.lr_ref_steps=2"])
    train(cfg, tmp_path / "straight")
    train(cfg, tmp_path / "resumed", stop_at_step=2)
    train(cfg, tmp_path / "resumed")
    digests = [ckpt.state_dict_sha256(ckpt.load_checkpoint(tmp_path / r)["model"]) for r in ("straight", "resumed")]
    assert digests[0] == digests[1]
    state = ckpt.load_checkpoint(tmp_path / "straight")
    assert state["model"]["conv_out.gain"].abs() > 0  # the zero-started gains train
    model = build_model(cfg).eval()
    model.load_state_dict(state["model"])
    hf = UNet2DModel(**diffusers_config(model)).eval()
    hf.load_state_dict(to_diffusers_state_dict(model), strict=True)
    x, t = torch.randn(2, 3, 16, 16), torch.tensor([10, 90])
    with torch.no_grad():
        torch.testing.assert_close(hf(x, t).sample, model(x, t), rtol=1e-4, atol=1e-5)
    assert "magnitude_preserving" not in build_model(load_config(None, SMALL)).config  # off: configs unchanged


@pytest.mark.parametrize("extra, match", [
    (["lora.rank=4"], "magnitude_preserving .*lora.rank"),
    (["optim.name=schedulefree", "optim.lr_schedule=constant"], "magnitude_preserving .*schedulefree"),
])
def test_mp_refuses_what_it_is_not_verified_with(extra, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, SMALL + ["model.magnitude_preserving=true", *extra])
