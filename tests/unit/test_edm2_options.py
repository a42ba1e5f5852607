"""EDM2's training options (Karras et al. 2024, "Analyzing and improving the training dynamics of
diffusion models"): the learned loss weighting, the inverse square root LR decay, Adam's betas."""

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
    from difftrain.training import checkpoint as ckpt
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
    assert build_optimizer(cfg, build_model(cfg), torch.device("cpu")).param_groups[0]["betas"] == (0.9, 0.99)
