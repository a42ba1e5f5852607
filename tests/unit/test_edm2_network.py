"""EDM2's network (models/edm2.py, Karras et al. 2024 config G): each operation preserves magnitude, the
preset is built through the registry, forced weight normalisation after each step, and the options it refuses at config time."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_OVERRIDES
from difftrain.config import EDM2_PRESET_NAMES, MODEL_PRESET_NAMES, ConfigError, load_config
from difftrain.models import MODEL_PRESETS, NETWORKS, PRESET_NETWORKS, build_model, weight_normalised_layers
from difftrain.models import edm2
from difftrain.training.state import build_optimizer

EDM2 = TINY_OVERRIDES + ["model.preset=edm2-tiny", "model.base_channels=16", "diffusion.objective=edm"]


def _unit(*shape: int, seed: int = 0) -> torch.Tensor:
    """Unit Gaussian inputs, drawn apart from the global generator the weights come from."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 + seed))


def _assert_unit_variance(y: torch.Tensor, what: str) -> None:
    # tens of thousands of values: a 5% band is many standard errors wide, and no rounding matters
    assert 0.95 < y.float().pow(2).mean().sqrt().item() < 1.05, (what, y.pow(2).mean().sqrt().item())


def test_each_operation_maps_unit_variance_to_unit_variance():
    x = _unit(64, 32, 8, 8)
    _assert_unit_variance(edm2.mp_silu(x), "mp_silu")
    for t in (0.3, 0.5, 0.9):
        _assert_unit_variance(edm2.mp_sum(x, _unit(64, 32, 8, 8, seed=1), t), f"mp_sum t={t}")
        cat = edm2.mp_cat(x, _unit(64, 8, 8, 8, seed=2), t)
        assert cat.shape == (64, 40, 8, 8)
        _assert_unit_variance(cat, f"mp_cat t={t}")
    scaled = 7.0 * x
    _assert_unit_variance(edm2.pixel_norm(scaled), "pixel_norm")
    per_pixel = edm2.pixel_norm(scaled).pow(2).mean(1)  # every position's channel vector at unit RMS
    torch.testing.assert_close(per_pixel, torch.ones_like(per_pixel), rtol=1e-3, atol=1e-3)
    torch.manual_seed(0)
    conv, linear = edm2.MPConv(32, 48, (3, 3)), edm2.MPConv(256, 128, ())
    for layer in (conv, linear):
        assert not any("bias" in name for name, _ in layer.named_parameters())
    _assert_unit_variance(conv(x)[..., 1:-1, 1:-1], "MPConv 3x3")  # the border sees zero padding
    _assert_unit_variance(linear(_unit(512, 256)), "MPConv linear")
    _assert_unit_variance(edm2.MPFourier(256)(torch.randn(512)), "MPFourier")
    with torch.no_grad():  # the stored scale does not reach the output; a gain scales it
        before = linear(_unit(512, 256))
        linear.weight.mul_(50.0)
        torch.testing.assert_close(linear(_unit(512, 256)), before, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(linear(_unit(512, 256), gain=2.0), 2 * before, rtol=1e-4, atol=1e-4)


def test_every_block_keeps_activations_at_unit_magnitude():
    torch.manual_seed(0)
    cfg = load_config(None, EDM2 + ["model.base_channels=32", "data.resolution=16"])
    model = build_model(cfg).eval()
    with torch.no_grad():  # trained-like: the zero-started gains open, so every branch contributes
        for name, p in model.named_parameters():
            if name.endswith("_gain"):
                p.fill_(1.0)
    seen = []
    hooks = [block.register_forward_hook(lambda m, i, o: seen.append(o.pow(2).mean().sqrt().item()))
             for block in model.modules() if isinstance(block, edm2.Block)]
    with torch.no_grad():
        out = model(_unit(16, 3, 16, 16), torch.full((16,), 500.0))
    for h in hooks:
        h.remove()
    assert len(seen) == 15  # 5 encoder blocks (2 downsampling), 10 decoder blocks (2 upsampling)
    assert all(0.7 < rms < 1.3 for rms in seen), seen  # no growth or decay through the depth
    assert 0.3 < out.pow(2).mean().sqrt().item() < 3.0


def test_the_preset_is_edm2s_network_built_through_the_registry():
    assert tuple(PRESET_NETWORKS) == tuple(MODEL_PRESETS) == MODEL_PRESET_NAMES
    assert EDM2_PRESET_NAMES == tuple(p for p, n in PRESET_NETWORKS.items() if NETWORKS[n].cls is edm2.EDM2UNet)
    cfg = load_config(None, EDM2 + ["diffusion.uncertainty_weighting=true"])
    model = build_model(cfg)
    assert isinstance(model, edm2.EDM2UNet)
    names = dict(model.named_parameters())
    assert not any(n.endswith("bias") for n in names)  # no biases anywhere
    assert not any(isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm)) for m in model.modules())
    assert model.out_gain.item() == 0 and model.enc["16_conv"].weight.shape[1] == 4  # the constant channel
    assert names["logvar.linear.weight"].shape == (1, 128) and "logvar.fourier.freqs" in model.state_dict()
    x, t = _unit(2, 3, 16, 16), torch.tensor([10.0, 900.0])
    out, u = model(x, t, return_logvar=True)
    assert out.shape == x.shape and not out.any() and u.shape == (2,)  # zero output at the start (out_gain 0)
    # the tiny UNet's overrides are its overrides too
    assert build_model(load_config(None, EDM2 + ["model.num_res_blocks=2"])).config["num_res_blocks"] == 2
    full = build_model(load_config(None, TINY_OVERRIDES + ["model.preset=edm2-tiny", "diffusion.objective=edm",
                                                            "model.attention_resolutions=[8]"]))
    assert 800_000 < sum(p.numel() for p in full.parameters()) < 820_000  # the preset: 0.81M at 16 px


def test_labels_condition_it_and_the_null_label_is_no_label():
    torch.manual_seed(0)
    model = edm2.EDM2UNet(resolution=16, base_channels=16, num_classes=10).eval()
    with torch.no_grad():
        model.out_gain.fill_(1.0)
        for block in model.modules():
            if isinstance(block, edm2.Block):
                block.emb_gain.fill_(1.0)
        x, t = _unit(3, 3, 16, 16), torch.full((3,), 400.0)
        a, b = model(x, t, torch.tensor([0, 0, 0])), model(x, t, torch.tensor([5, 5, 5]))
        assert (a - b).abs().max() > 1e-3
        torch.testing.assert_close(model(x, t, torch.tensor([10, 10, 10])), model(x, t, None))


def test_c_noise_is_edms_ln_sigma_over_4():
    from difftrain.diffusion.edm import EDMObjective, c_noise_of_cond

    sigma = torch.tensor([0.002, 0.5, 80.0])
    torch.testing.assert_close(c_noise_of_cond(EDMObjective().cond(sigma)), sigma.log() / 4, rtol=1e-5, atol=1e-6)


def _rms_spread(layers) -> float:
    rows = torch.cat([m.weight.detach().flatten(1).pow(2).mean(1).sqrt() for m in layers])
    return rows.sub(1).abs().max().item()


def test_forced_weight_normalisation_after_every_optimizer_step():
    cfg = load_config(None, EDM2 + ["optim.lr=0.3", "optim.warmup_steps=0"])
    model = build_model(cfg)
    layers = weight_normalised_layers(model)
    assert len(layers) == sum(1 for m in model.modules() if isinstance(m, edm2.MPConv)) > 20
    assert _rms_spread(layers) < 1e-3  # stored at unit RMS from the start
    x, t = _unit(4, 3, 16, 16), torch.tensor([10.0, 300.0, 600.0, 900.0])
    for hooked in (True, False):
        optimizer = build_optimizer(cfg.optim, model, torch.device("cpu"))
        if not hooked:  # the same step without the hook leaves the rows off unit RMS: the hook acts
            optimizer._optimizer_step_post_hooks.clear()
        model(x, t).square().mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                p.grad = torch.randn_like(p) if p.grad is None else p.grad + torch.randn_like(p)
        optimizer.step()
        optimizer.zero_grad()
        assert (_rms_spread(layers) < 1e-3) is hooked


@pytest.mark.parametrize("extra, match", [
    (["lora.rank=4"], r"model.preset='edm2-tiny' .*lora.rank"),
    (["model.init_from=/some/folder"], r"model.preset='edm2-tiny' .*model.init_from"),
    (["model.family=sd"], r"model.preset='edm2-tiny' .*model.family"),
    (["diffusion.objective=ddpm"], r"model.preset='edm2-tiny' .*diffusion.objective='edm', got 'ddpm'"),
    (["diffusion.objective=flow"], r"model.preset='edm2-tiny' .*diffusion.objective='edm', got 'flow'"),
    (["data.captions=true", "model.text_encoder=builtin:tiny-clip"], r"model.preset='edm2-tiny' .*model.text_encoder"),
    (["model.magnitude_preserving=true"], r"model.preset='edm2-tiny' .*model.magnitude_preserving"),
    (["optim.name=schedulefree", "optim.lr_schedule=constant"], r"model.preset='edm2-tiny' .*schedulefree"),
    (["train.parallel=fsdp"], r"model.preset='edm2-tiny' .*train.parallel"),
])
def test_what_it_does_not_combine_with_is_one_line_at_config_time(extra, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, EDM2 + extra)
    assert "\n" not in str(e.value)


def test_gradient_checkpointing_computes_the_same_gradients():
    grads = []
    for on in (False, True):
        torch.manual_seed(0)
        model = build_model(load_config(None, EDM2 + [f"model.gradient_checkpointing={str(on).lower()}"])).train()
        with torch.no_grad():
            model.out_gain.fill_(1.0)
        assert all(b.gradient_checkpointing is on for b in model.modules() if isinstance(b, edm2.Block))
        model(_unit(2, 3, 16, 16), torch.tensor([100.0, 700.0])).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0])
