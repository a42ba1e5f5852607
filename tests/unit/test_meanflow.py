"""MeanFlow (diffusion/meanflow.py): its (t, r) draw, its training target on an analytic case, the JVP
against a finite difference, the sampler's step count, the UNet's second time embedding, the export."""

from __future__ import annotations

import math

import pytest
import torch

from difftrain.config import ConfigError, load_config
from difftrain.diffusion.meanflow import COND_SCALE, MeanFlowObjective, math_attention
from difftrain.diffusion.objective import OBJECTIVES, build_objective, per_sample_loss
from difftrain.models import build_unet

CPU = torch.device("cpu")


def _unet(**kw):
    torch.manual_seed(0)
    net = build_unet("tiny", resolution=8, in_channels=3, channel_mult=(1, 2), attention_resolutions=(4,),
                     interval_embedding=True, **kw)
    with torch.no_grad():  # the zero-initialised last layers would make every output 0
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return net


def test_levels_are_pairs_with_r_at_most_t_and_the_ratio_apart():
    obj = MeanFlowObjective(t_mean=-0.6, t_std=1.6, r_mean=-4.0, r_std=1.6, ratio=0.75)
    levels = obj.draw_levels(20000, torch.Generator().manual_seed(0), CPU)
    t, r = levels[:, 0], levels[:, 1]
    assert levels.shape == (20000, 2) and levels.dtype == torch.float32
    assert bool((r <= t).all()) and bool(((t > 0) & (t < 1)).all())
    # r = t for the 25% not drawn apart, and where the drawn r came out above t (min(t, r)): P(r' >= t) is small
    equal = (r == t).float().mean().item()
    assert 0.25 <= equal <= 0.25 + 0.75 * 0.2
    logit_t = torch.logit(t.double())
    assert abs(logit_t.mean().item() + 0.6) < 0.05 and abs(logit_t.std().item() - 1.6) < 0.05
    buckets = obj.bucket(levels, 10)
    counts = torch.bincount(buckets, minlength=10).float() / 20000
    assert torch.allclose(counts, torch.full((10,), 0.1), atol=0.015)  # equal probability by t
    cond = obj.cond(levels)
    assert torch.allclose(cond, torch.stack([t, t - r], 1) * COND_SCALE)


def test_the_jvp_is_the_total_derivative_along_v_by_finite_differences():
    """The JVP network_loss takes, of the network along (dz, dcond) = (v, (1, 1) COND_SCALE), equals central
    differences in float64: tightly along z alone (tangent (v, 0)), and along t alone at fixed r to 1% (the
    UNet's sinusoids are computed in float32: a finite difference in t cannot be tighter); the JVP along
    (v, 1) is their sum."""
    net = _unet().double()
    obj = MeanFlowObjective()
    g = torch.Generator().manual_seed(1)
    x0 = torch.rand(3, 3, 8, 8, generator=g, dtype=torch.float64) * 2 - 1
    noise = torch.randn(3, 3, 8, 8, generator=g, dtype=torch.float64)
    levels = torch.tensor([[0.7, 0.2], [0.4, 0.4], [0.9, 0.05]], dtype=torch.float64)
    b = obj.noised(x0, levels, noise)
    cond = b.cond.double()
    t, r = levels[:, :1], levels[:, 1:]

    def u(z, tt):
        return net(z, torch.cat([tt, tt - r], 1) * COND_SCALE)

    def jvp(dcond):
        with math_attention():
            return torch.func.jvp(lambda z, c: net(z, c), (b.input, cond), (b.target, dcond))[1]

    with torch.no_grad():
        along_z = jvp(torch.zeros_like(cond))
        h = 1e-6
        fd_z = (u(b.input + h * b.target, t) - u(b.input - h * b.target, t)) / (2 * h)
        assert torch.allclose(along_z, fd_z, rtol=1e-6, atol=1e-8), (along_z - fd_z).abs().max()
        total = jvp(torch.full_like(cond, COND_SCALE))  # along (v, 1)
        h = 1e-4
        fd_t = (u(b.input, t + h) - u(b.input, t - h)) / (2 * h)
        with math_attention():
            only_t = torch.func.jvp(lambda c: net(b.input, c), (cond,), (torch.full_like(cond, COND_SCALE),))[1]
        assert (only_t - fd_t).abs().max() < 1e-2 * fd_t.abs().max()
        assert fd_t.abs().max() > 1e-2 * fd_z.abs().max()  # the t direction is not negligible here
        assert torch.allclose(total, along_z + only_t, rtol=1e-9, atol=1e-12)  # the JVP is linear in its tangent


def test_the_training_target_on_an_analytic_network():
    """A "network" whose average velocity is known in closed form: u(z, r, t) = a z + c (t + r) / 2 with
    cond (t, t - r) COND_SCALE. Then du/dt = a v + c / 2, and the loss is ||u - (v - (t - r) du/dt)||^2
    summed over the pixels, adaptively weighted: d / (d + eps)^p."""
    a, c = 0.3, 0.8
    obj = MeanFlowObjective(adaptive_p=0.75, adaptive_eps=1e-3)

    def net(z, cond, condition):
        t = cond[:, 0] / COND_SCALE
        r = t - cond[:, 1] / COND_SCALE
        return a * z + (c * (t + r) / 2).view(-1, 1, 1, 1)

    g = torch.Generator().manual_seed(2)
    x0, noise = torch.rand(4, 3, 4, 4, generator=g) * 2 - 1, torch.randn(4, 3, 4, 4, generator=g)
    levels = torch.tensor([[0.8, 0.1], [0.5, 0.5], [0.3, 0.0], [0.99, 0.6]])
    loss = per_sample_loss(obj, net, x0, None, levels, noise)
    t, r = levels[:, 0].view(-1, 1, 1, 1), levels[:, 1].view(-1, 1, 1, 1)
    z, v = (1 - t) * x0 + t * noise, noise - x0
    u = a * z + c * (t + r) / 2
    target = v - (t - r) * (a * v + c / 2)
    d = (u - target).square().sum(dim=(1, 2, 3))
    assert torch.allclose(loss, d / (d + 1e-3) ** 0.75, rtol=1e-5)
    # p = 0: the plain squared error; r = t (row 1): plain flow matching, target v
    plain = per_sample_loss(MeanFlowObjective(adaptive_p=0.0), net, x0, None, levels, noise)
    assert torch.allclose(plain, d, rtol=1e-5)
    assert torch.allclose(plain[1], (u[1] - v[1]).square().sum(), rtol=1e-5)


def test_the_loss_trains_the_network_through_u_only():
    net = _unet()
    obj = MeanFlowObjective()
    g = torch.Generator().manual_seed(3)
    x0, noise = torch.rand(4, 3, 8, 8, generator=g) * 2 - 1, torch.randn(4, 3, 8, 8, generator=g)
    loss = per_sample_loss(obj, net, x0, None, obj.draw_levels(4, g, CPU), noise)
    assert loss.shape == (4,) and bool(torch.isfinite(loss).all())
    loss.mean().backward()
    assert all(p.grad is not None for p in net.parameters())


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_the_sampler_takes_one_network_evaluation_per_step_over_1_to_0(steps):
    obj = MeanFlowObjective()
    calls = []

    def net(x, cond):
        calls.append(cond[0].tolist())
        return torch.ones_like(x)  # u = 1: every step moves x by -(t - r), in all -1

    x = torch.zeros(2, 3, 4, 4)
    out = obj.sample(net, x, "meanflow", steps, None, clip=False)
    assert len(calls) == steps == obj.sampler_nfe["meanflow"](steps)
    times = [1 - i / steps for i in range(steps + 1)]
    expected = [[COND_SCALE * t, COND_SCALE * (t - r)] for t, r in zip(times[:-1], times[1:])]
    assert torch.allclose(torch.tensor(calls), torch.tensor(expected), atol=1e-3)
    assert torch.allclose(out, torch.full_like(x, -1.0))
    with pytest.raises(ValueError, match="for meanflow models"):
        obj.sample(net, x, "heun", steps, None)


def test_the_second_time_embedding_is_optional_and_changes_nothing_when_off():
    torch.manual_seed(0)
    plain = build_unet("tiny", resolution=8, in_channels=3, channel_mult=(1, 2), attention_resolutions=(4,))
    torch.manual_seed(0)
    two = build_unet("tiny", resolution=8, in_channels=3, channel_mult=(1, 2), attention_resolutions=(4,),
                     interval_embedding=True)
    assert "interval_embedding" not in plain.config and two.config["interval_embedding"] is True
    extra = set(two.state_dict()) - set(plain.state_dict())
    assert extra == {f"interval_embed.linear_{i}.{p}" for i in (1, 2) for p in ("weight", "bias")}
    for name, tensor in plain.state_dict().items():  # every other layer's initial weights: the same draws
        assert torch.equal(tensor, two.state_dict()[name]), name
    net = _unet()
    x = torch.randn(2, 3, 8, 8)
    a = net(x, torch.tensor([[0.5, 0.0], [0.5, 0.0]]))
    b = net(x, torch.tensor([[0.5, 0.3], [0.5, 0.3]]))
    assert not torch.allclose(a, b)  # the second time conditions the output
    with pytest.raises(ValueError, match=r"\(B, 2\)"):
        net(x, torch.tensor([0.5, 0.5]))


def test_diffusers_unet2dmodel_with_timestep_class_embedding_computes_the_same():
    diffusers = pytest.importorskip("diffusers")
    from difftrain.models.diffusers_export import diffusers_config, to_diffusers_state_dict

    net = _unet().eval()
    hf = diffusers.UNet2DModel(**diffusers_config(net))
    hf.load_state_dict(to_diffusers_state_dict(net), strict=True)
    hf.eval()
    x = torch.randn(3, 3, 8, 8)
    t, gap = torch.tensor([0.9, 0.4, 1.0]), torch.tensor([0.7, 0.0, 1.0])
    with torch.no_grad():
        ours = net(x, torch.stack([t, gap], 1))
        theirs = hf(x, t, class_labels=gap).sample
    assert (ours - theirs).abs().max() < 1e-5
    # a class-conditional MeanFlow UNet has no UNet2DModel: class_embedding holds one of the two
    torch.manual_seed(0)
    labelled = build_unet("tiny", resolution=8, in_channels=3, channel_mult=(1, 2), attention_resolutions=(4,),
                          num_classes=4, interval_embedding=True)
    with pytest.raises(ValueError, match="class-conditional UNet with a second time embedding"):
        diffusers_config(labelled)


def test_meanflow_is_registered_and_builds_from_the_config():
    cfg = load_config(None, ["diffusion.objective=meanflow", "diffusion.meanflow_ratio=0.5",
                             "diffusion.meanflow_adaptive_p=1.0"])
    obj = build_objective(cfg.diffusion)
    assert isinstance(obj, MeanFlowObjective) and "meanflow" in OBJECTIVES
    assert (obj.ratio, obj.adaptive_p, obj.t_mean, obj.r_mean) == (0.5, 1.0, -0.6, -4.0)
    assert (cfg.validation.sampler, cfg.evaluation.fid_sampler, cfg.train.channels_last) == ("meanflow", "meanflow", "off")


@pytest.mark.parametrize("override, key", [
    ("validation.sampler=heun", "validation.sampler"),
    ("evaluation.fid_sampler=euler", "evaluation.fid_sampler"),
    ("diffusion.uncertainty_weighting=true", "diffusion.uncertainty_weighting"),
    ("lora.rank=4", "lora.rank"),
    ("model.gradient_checkpointing=true", "model.gradient_checkpointing"),
    ("train.channels_last=on", "train.channels_last"),
    ("validation.guidance_scale=2", "validation.guidance_scale"),
    ("validation.guide=/tmp/a-guide-run", "validation.guide"),
    ("diffusion.meanflow_ratio=1.5", "diffusion.meanflow_ratio"),
    ("diffusion.meanflow_adaptive_eps=0", "diffusion.meanflow_adaptive_eps"),
])
def test_options_meanflow_cannot_use_are_refused_in_one_line_naming_them(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        load_config(None, ["diffusion.objective=meanflow", override])
    assert "\n" not in str(e.value)


def test_the_sampler_registry_holds_meanflow_only_for_meanflow():
    from difftrain.diffusion.objective import OBJECTIVE_SAMPLERS

    assert OBJECTIVE_SAMPLERS["meanflow"] == ("meanflow",)
    assert all("meanflow" not in names for family, names in OBJECTIVE_SAMPLERS.items() if family != "meanflow")
    with pytest.raises(ConfigError, match="validation.sampler"):
        load_config(None, ["diffusion.objective=edm", "validation.sampler=meanflow"])
    assert math.isfinite(COND_SCALE)
