"""Unit tests of the DDPM UNet, its presets and its export to diffusers' UNet2DModel."""

import pytest
import torch

from difftrain.models import MODEL_PRESETS, UNet, build_unet
from difftrain.models.diffusers_export import diffusers_config, to_diffusers_state_dict

# A small UNet with attention at two levels and a channel change at every level.
SMALL = dict(
    resolution=16,
    in_channels=3,
    base_channels=16,
    channel_mult=(1, 2, 3),
    num_res_blocks=1,
    attention_resolutions=(8, 4),
    norm_groups=4,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are small: one intra-op thread is as fast, and avoids OpenMP spin-waiting
    when the cores are shared with other processes (which made this file 5x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Replace every parameter by N(0, 0.05^2) noise: the DDPM init zeros the output layers,
    which would make comparisons of outputs and gradients trivial."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def inputs(batch: int, channels: int, size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, size, size, generator=gen)
    t = torch.randint(0, 1000, (batch,), generator=gen)
    return x, t


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# Presets.


@pytest.mark.parametrize("preset,resolution", [("tiny", 32), ("ddpm-cifar10", 32), ("ddpm-64", 64)])
def test_preset_output_shape(preset, resolution):
    model = build_unet(preset, resolution=resolution, in_channels=3).eval()
    x, t = inputs(1, 3, resolution)
    with torch.no_grad():
        out = model(x, t)
    assert out.shape == (1, 3, resolution, resolution)
    assert torch.isfinite(out).all()


def test_ddpm_cifar10_matches_diffusers_parameter_count():
    # google/ddpm-cifar10-32 has 35,746,307 parameters (DDPM paper: 35.7M).
    model = build_unet("ddpm-cifar10", resolution=32, in_channels=3)
    assert num_params(model) == 35_746_307


def test_tiny_preset_is_small():
    model = build_unet("tiny", resolution=32, in_channels=3)
    assert 300_000 <= num_params(model) <= 1_000_000


def test_build_unet_rejects_unknown_preset_and_override():
    with pytest.raises(ValueError, match="'huge'.*tiny.*ddpm-cifar10.*ddpm-64"):
        build_unet("huge", resolution=32, in_channels=3)
    with pytest.raises(ValueError, match="'channels'"):
        build_unet("tiny", resolution=32, in_channels=3, channels=64)


def test_build_unet_applies_overrides():
    model = build_unet("tiny", resolution=32, in_channels=1, num_classes=10, out_channels=2, dropout=0.2)
    assert model.config["out_channels"] == 2 and model.config["dropout"] == 0.2
    assert model.config["base_channels"] == MODEL_PRESETS["tiny"]["base_channels"]


# Behaviour of the network.


def test_fresh_model_outputs_zero():
    # DDPM init: conv_out starts at zero, so the initial prediction is exactly zero.
    model = UNet(**SMALL)
    x, t = inputs(2, 3, 16)
    assert torch.equal(model(x, t), torch.zeros(2, 3, 16, 16))


def test_out_channels_and_float_and_scalar_timesteps():
    model = randomize_(UNet(**{**SMALL, "in_channels": 1, "out_channels": 2})).eval()
    x, t = inputs(3, 1, 16)
    with torch.no_grad():
        out = model(x, t)
        assert out.shape == (3, 2, 16, 16)
        torch.testing.assert_close(model(x, t.float()), out)
        torch.testing.assert_close(model(x, torch.tensor(7)), model(x, torch.full((3,), 7)))


def test_config_rebuilds_the_same_architecture():
    model = UNet(**SMALL, num_classes=5)
    rebuilt = UNet(**model.config)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    assert shapes == {k: v.shape for k, v in rebuilt.state_dict().items()}


def test_channels_last_gives_same_output():
    model = randomize_(UNet(**SMALL)).eval()
    x, t = inputs(2, 3, 16)
    with torch.no_grad():
        expected = model(x, t)
        model = model.to(memory_format=torch.channels_last)
        out = model(x.to(memory_format=torch.channels_last), t)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_class_conditioning():
    model = randomize_(UNet(**SMALL, num_classes=10)).eval()
    assert model.class_embed.num_embeddings == 11  # 10 classes + the null label
    x, t = inputs(2, 3, 16)
    with torch.no_grad():
        out_a = model(x, t, torch.tensor([0, 1]))
        out_b = model(x, t, torch.tensor([2, 3]))
        out_none = model(x, t)
        out_null = model(x, t, torch.tensor([10, 10]))
    assert out_a.shape == out_none.shape == (2, 3, 16, 16)
    assert not torch.allclose(out_a, out_b)
    torch.testing.assert_close(out_none, out_null)  # no labels means the null label


def test_unconditional_model_rejects_labels():
    model = UNet(**SMALL)
    x, t = inputs(2, 3, 16)
    with pytest.raises(ValueError, match="cond was given"):
        model(x, t, torch.tensor([0, 1]))


@pytest.mark.parametrize(
    "overrides,argument",
    [
        (dict(resolution=18), "resolution"),  # not divisible by 2**2
        (dict(resolution=0), "resolution"),
        (dict(in_channels=0), "in_channels"),
        (dict(out_channels=-1), "out_channels"),
        (dict(base_channels=18), "norm_groups"),  # 18 not divisible by 4 groups
        (dict(base_channels=7, norm_groups=1), "base_channels"),  # odd: no sinusoidal embedding
        (dict(channel_mult=()), "channel_mult"),
        (dict(channel_mult=(1, 0)), "channel_mult"),
        (dict(num_res_blocks=0), "num_res_blocks"),
        (dict(attention_resolutions=(5,)), "attention_resolutions"),
        (dict(dropout=1.0), "dropout"),
        (dict(num_classes=-1), "num_classes"),
        (dict(norm_groups=0), "norm_groups"),
    ],
)
def test_invalid_arguments_name_the_argument(overrides, argument):
    with pytest.raises(ValueError, match=argument):
        UNet(**{**SMALL, **overrides})


def test_gradient_checkpointing_gives_same_output_and_grads():
    kwargs = {**SMALL, "dropout": 0.1, "num_classes": 3}
    plain = randomize_(UNet(**kwargs))
    ckpt = randomize_(UNet(**kwargs, gradient_checkpointing=True))
    x, t = inputs(2, 3, 16)
    labels = torch.tensor([0, 2])
    results = []
    for model in (plain, ckpt):
        torch.manual_seed(123)  # same dropout masks; checkpointing replays the RNG state
        out = model(x, t, labels)
        out.square().mean().backward()
        results.append((out, {n: p.grad for n, p in model.named_parameters()}))
    (out_a, grads_a), (out_b, grads_b) = results
    torch.testing.assert_close(out_b, out_a)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, msg=name)


# Export to diffusers: the proof that the structure maps one to one.


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(preset="tiny", resolution=32, in_channels=3),
        dict(preset="tiny", resolution=32, in_channels=3, num_classes=10),
        dict(preset="tiny", resolution=16, in_channels=1, out_channels=2, attention_resolutions=(16, 4)),
    ],
    ids=["tiny", "tiny-conditional", "tiny-attention-everywhere"],
)
def test_diffusers_unet2d_computes_the_same_function(kwargs):
    diffusers = pytest.importorskip("diffusers")
    kwargs = dict(kwargs)
    model = randomize_(build_unet(kwargs.pop("preset"), **kwargs)).eval()
    theirs = diffusers.UNet2DModel(**diffusers_config(model)).eval()
    theirs.load_state_dict(to_diffusers_state_dict(model), strict=True)
    assert num_params(theirs) == num_params(model)

    size, channels = model.config["resolution"], model.config["in_channels"]
    x, t = inputs(2, channels, size)
    labels = torch.tensor([3, 10]) if model.config["num_classes"] else None
    with torch.no_grad():
        ours = model(x, t, labels)
        expected = theirs(x, t, class_labels=labels).sample
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_ddpm_cifar10_config_matches_the_released_ddpm_checkpoint():
    # The published config of google/ddpm-cifar10-32 (the DDPM authors' weights, converted).
    released = {
        "sample_size": 32,
        "in_channels": 3,
        "out_channels": 3,
        "center_input_sample": False,
        "time_embedding_type": "positional",
        "flip_sin_to_cos": False,
        "freq_shift": 1,
        "block_out_channels": (128, 256, 256, 256),
        "down_block_types": ("DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"),
        "up_block_types": ("UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
        "layers_per_block": 2,
        "mid_block_scale_factor": 1,
        "downsample_padding": 0,
        "act_fn": "silu",
        "attention_head_dim": None,
        "norm_num_groups": 32,
        "norm_eps": 1e-6,
    }
    config = diffusers_config(build_unet("ddpm-cifar10", resolution=32, in_channels=3))
    assert {k: config[k] for k in released} == released


def test_to_diffusers_state_dict_is_a_pure_renaming():
    model = UNet(**SMALL, num_classes=4)
    ours = model.state_dict()
    theirs = to_diffusers_state_dict(model)
    assert len(theirs) == len(ours)
    assert sorted(v.data_ptr() for v in theirs.values()) == sorted(v.data_ptr() for v in ours.values())


@pytest.mark.slow
def test_compiles_without_graph_breaks():
    model = randomize_(UNet(**SMALL, num_classes=3, gradient_checkpointing=True))
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x, t = inputs(2, 3, 16)
    compiled(x, t).sum().backward()
    compiled.eval()
    with torch.no_grad():
        compiled(x, t, torch.tensor([0, 3]))
