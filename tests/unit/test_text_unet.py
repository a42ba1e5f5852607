"""Text-conditioned networks: difftrain's UNet with cross-attention (context_dim > 0), the
wrapped diffusers UNet2DConditionModel (ConditionUNet), and its export to a Stable Diffusion
pipeline folder, on tiny random components built here."""

from __future__ import annotations

import json

import pytest
import torch

from difftrain.models import UNet, build_model
from difftrain.checkpoints.checkpoint import state_dict_sha256
from tests.numerics import layout_sha256, total_signed_sums
from tests.unit.test_unet import SMALL, one_thread  # noqa: F401 - one_thread: the module's autouse fixture

CTX = 12  # width of the text embeddings in the difftrain UNet tests
# UNet(**SMALL) after torch.manual_seed(0), by the code before context_dim existed (main 9bd2624):
# names, dtypes and shapes pinned by digest, the initial values by four random-sign sums
# (tests/numerics.py) within a tolerance. A digest of the values (a0ca4c2f...) held only where
# torch draws normal_ with its vectorised AVX2 kernel: its scalar kernel (ATEN_CPU_CAPABILITY=default,
# or a CPU without AVX2) rounds differently, moving the sums by 4e-6; a changed draw moves them by ~10.
SMALL_INIT_LAYOUT_SHA256 = "90d2f2678d63fb06a9be67a40044ed2d4551334deaaadf058b763dbb5c6ada3a"
SMALL_INIT_SIGNED_SUMS = [55.828021612517944, -44.68083263159161, 37.54072568512157, -20.126931268562373]
SMALL_INIT_TOL = 1e-3  # 1e-6 x sqrt(467,235 elements), 250x the scalar kernel's drift


def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.05) -> torch.nn.Module:
    """N(0, std^2) parameters: the zero-initialised output layers would hide any difference."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(std * torch.randn(p.shape, generator=gen))
    return model


def inputs(batch: int, channels: int, size: int, tokens: int = 5, dim: int = CTX, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, size, size, generator=gen)
    t = torch.randint(0, 1000, (batch,), generator=gen)
    context = torch.randn(batch, tokens, dim, generator=gen)
    return x, t, context


# difftrain's UNet with context.


def test_context_dim_zero_builds_the_old_model():
    for kwargs in ({}, {"context_dim": 0}):
        torch.manual_seed(0)
        state = UNet(**SMALL, **kwargs).state_dict()
        assert layout_sha256(state) == SMALL_INIT_LAYOUT_SHA256
        assert total_signed_sums(state, 4) == pytest.approx(SMALL_INIT_SIGNED_SUMS, abs=SMALL_INIT_TOL)


def test_text_model_adds_cross_attention_only_to_the_attention_blocks():
    old = set(UNet(**SMALL).state_dict())
    new = set(UNet(**SMALL, context_dim=CTX).state_dict())
    assert old < new
    added = new - old
    assert all(".cross." in name for name in added)
    blocks = sorted({name.split(".cross.")[0] for name in added})
    old_attn = sorted({name.rsplit(".", 2)[0] for name in old if name.endswith(".q.weight")})
    assert blocks == old_attn and "mid.attn" in blocks  # every attention block, the middle one included
    model = UNet(**SMALL, context_dim=CTX)
    assert model.mid.attn.cross.k.weight.shape == (48, CTX)
    assert set(UNet(**model.config).state_dict()) == new  # the config rebuilds it


def test_output_shape_and_fresh_model_outputs_zero():
    model = UNet(**SMALL, context_dim=CTX)
    x, t, context = inputs(2, 3, 16)
    assert torch.equal(model(x, t, context), torch.zeros(2, 3, 16, 16))
    out = randomize_(model).eval()(x, t, context)
    assert out.shape == (2, 3, 16, 16) and torch.isfinite(out).all()


def test_context_changes_the_output_per_sample():
    model = randomize_(UNet(**SMALL, context_dim=CTX), std=0.2).eval()
    x, t, context = inputs(2, 3, 16)
    other = context.clone()
    other[1] = torch.randn(5, CTX, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        out = model(x, t, context)
        out_other = model(x, t, other)
        out_zeros = model(x, t, torch.zeros_like(context))
        # attention has no notion of token order: permuted tokens give the same output
        out_permuted = model(x, t, context[:, torch.tensor([3, 0, 4, 1, 2])])
    scale = out.abs().max()
    torch.testing.assert_close(out_other[0], out[0])  # sample 0 kept its context
    assert (out_other[1] - out[1]).abs().max() > 0.01 * scale
    assert (out_zeros - out).abs().max() > 0.01 * scale
    torch.testing.assert_close(out_permuted, out, rtol=1e-5, atol=1e-5)


def test_text_model_rejects_a_missing_or_misshapen_context():
    model = UNet(**SMALL, context_dim=CTX)
    x, t, context = inputs(2, 3, 16)
    with pytest.raises(ValueError, match=r"needs cond.*got None"):
        model(x, t)
    with pytest.raises(ValueError, match=r"\(2, L, 12\).*\(2, 5, 8\)"):
        model(x, t, context[..., :8])
    with pytest.raises(ValueError, match="text embeddings"):
        model(x, t, context[0])
    with pytest.raises(ValueError, match="text embeddings"):
        model(x, t, torch.tensor([0, 1]))  # labels to a text model
    with pytest.raises(ValueError, match="not both"):
        UNet(**SMALL, context_dim=CTX, num_classes=3)
    with pytest.raises(ValueError, match="context_dim"):
        UNet(**SMALL, context_dim=-1)


def test_gradient_checkpointing_with_context_gives_same_output_and_grads():
    kwargs = {**SMALL, "dropout": 0.1, "context_dim": CTX}
    plain = randomize_(UNet(**kwargs))
    ckpt = randomize_(UNet(**kwargs, gradient_checkpointing=True))
    assert ckpt.mid.attn.gradient_checkpointing
    x, t, context = inputs(2, 3, 16)
    results = []
    for model in (plain, ckpt):
        ctx = context.clone().requires_grad_(True)
        torch.manual_seed(123)  # same dropout masks; checkpointing replays the RNG state
        out = model(x, t, ctx)
        out.square().mean().backward()
        results.append((out, ctx.grad, {n: p.grad for n, p in model.named_parameters()}))
    (out_a, ctx_a, grads_a), (out_b, ctx_b, grads_b) = results
    torch.testing.assert_close(out_b, out_a)
    torch.testing.assert_close(ctx_b, ctx_a)
    assert ctx_a.abs().max() > 0
    for name, grad in grads_a.items():
        assert grad is not None, name
        torch.testing.assert_close(grads_b[name], grad, msg=name)


def test_build_model_takes_context_channels_and_resolution():
    from difftrain.config import load_config

    cfg = load_config(None, ["data.resolution=32", "model.preset=tiny"])
    model = build_model(cfg, context_dim=CTX, in_channels=4, resolution=8)
    assert (model.config["context_dim"], model.config["in_channels"], model.config["resolution"]) == (CTX, 4, 8)
    x, t, context = inputs(1, 4, 8)
    assert model(x, t, context).shape == (1, 4, 8, 8)
    plain = build_model(cfg)
    assert (plain.config["context_dim"], plain.config["in_channels"], plain.config["resolution"]) == (0, 3, 32)


def test_text_model_has_no_unet2dmodel_export():
    from difftrain.models.diffusers_export import diffusers_config, to_diffusers_state_dict

    model = UNet(**SMALL, context_dim=CTX)
    for export in (diffusers_config, to_diffusers_state_dict):
        with pytest.raises(ValueError, match="no diffusers equivalent"):
            export(model)


@pytest.mark.slow
def test_text_model_compiles_without_graph_breaks():
    model = randomize_(UNet(**SMALL, context_dim=CTX, gradient_checkpointing=True))
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x, t, context = inputs(2, 3, 16)
    compiled(x, t, context).sum().backward()


# Tiny Stable Diffusion components (random weights, built offline).

from tests.text_components import TEXT_HIDDEN as WIDTH  # noqa: E402 - the text width = cross_attention_dim


@pytest.fixture(scope="module")
def sd_folder(tmp_path_factory):
    """A tiny Stable Diffusion pipeline folder (model_index.json, unet/, vae/, text_encoder/, ...)."""
    pytest.importorskip("diffusers")
    from tests.text_components import write_tiny_sd_folder

    return write_tiny_sd_folder(tmp_path_factory.mktemp("sd") / "sd")


def test_condition_unet_folder_detection(sd_folder, tmp_path):
    from diffusers import UNet2DModel

    from difftrain.families.sd import ConditionUNet, is_condition_unet_folder

    plain = UNet2DModel(sample_size=8, block_out_channels=(8, 8), norm_num_groups=4,
                        down_block_types=("DownBlock2D",) * 2, up_block_types=("UpBlock2D",) * 2)
    plain.save_pretrained(tmp_path / "u2d")
    assert is_condition_unet_folder(sd_folder) and is_condition_unet_folder(sd_folder / "unet")
    for other in (sd_folder / "vae", tmp_path / "u2d", tmp_path / "missing", sd_folder / "model_index.json"):
        assert not is_condition_unet_folder(other), other
    with pytest.raises(ValueError, match=r"u2d/config.json describes a UNet2DModel"):
        ConditionUNet.from_folder(tmp_path / "u2d")
    with pytest.raises(ValueError, match=r"missing does not exist"):
        ConditionUNet.from_folder(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"vae.*not a UNet2DConditionModel folder|vae/config.json describes"):
        ConditionUNet.from_folder(sd_folder / "vae")
    (tmp_path / "broken" / "unet").mkdir(parents=True)
    (tmp_path / "broken" / "unet" / "config.json").write_text((sd_folder / "unet" / "config.json").read_text())
    with pytest.raises(ValueError, match=r"cannot load the UNet2DConditionModel in .*broken/unet"):
        ConditionUNet.from_folder(tmp_path / "broken")


def test_condition_unet_is_the_diffusers_unet(sd_folder):
    import copy

    from diffusers import UNet2DConditionModel

    from difftrain.families.sd import ConditionUNet

    net = ConditionUNet.from_folder(sd_folder).eval()
    raw = UNet2DConditionModel.from_pretrained(str(sd_folder / "unet")).eval()
    assert net.context_dim == WIDTH and net.in_channels == 4 and net.num_classes == 0
    assert list(net.state_dict()) == list(raw.state_dict())  # no prefix
    assert state_dict_sha256(net.state_dict()) == state_dict_sha256(raw.state_dict())
    x, t, context = inputs(2, 4, 8, tokens=8, dim=WIDTH)
    with torch.no_grad():
        torch.testing.assert_close(net(x, t, context), raw(x, t, encoder_hidden_states=context).sample)
        assert net(x, torch.tensor(7), context).shape == (2, 4, 8, 8)
    with pytest.raises(ValueError, match=rf"\(2, L, {WIDTH}\); got None"):
        net(x, t)

    # the config rebuilds it without the folder; its state dict (and an EMA's deep copy) loads back
    rebuilt = ConditionUNet.from_config(json.loads(json.dumps(net.unet_config)))
    assert state_dict_sha256(rebuilt.state_dict()) != state_dict_sha256(net.state_dict())
    rebuilt.load_state_dict(copy.deepcopy(net).state_dict())
    assert state_dict_sha256(rebuilt.state_dict()) == state_dict_sha256(net.state_dict())


def test_condition_unet_gradient_checkpointing_gives_same_grads(sd_folder):
    from difftrain.families.sd import ConditionUNet

    plain = randomize_(ConditionUNet.from_folder(sd_folder))
    ckpt = randomize_(ConditionUNet.from_folder(sd_folder))
    ckpt.set_gradient_checkpointing(True)
    assert ckpt.unet.is_gradient_checkpointing
    x, t, context = inputs(2, 4, 8, tokens=8, dim=WIDTH)
    grads = []
    for model in (plain, ckpt):
        model(x, t, context).square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)


def test_init_from_loads_a_condition_unet(sd_folder, tmp_path):
    from difftrain.networks.init_from import load_init_network, load_init_weights
    from difftrain.families.sd import ConditionUNet

    net = load_init_network(sd_folder)
    fresh = ConditionUNet.from_config(net.unet_config)
    load_init_weights(fresh, sd_folder / "unet")
    assert state_dict_sha256(fresh.state_dict()) == state_dict_sha256(net.state_dict())
    other = ConditionUNet.from_config({**net.unet_config, "layers_per_block": 2})
    with pytest.raises(ValueError, match=r"model.init_from .*first mismatched key 'layers_per_block'"):
        load_init_weights(other, sd_folder)
    with pytest.raises(ValueError, match=r"model.init_from .*UNet2DConditionModel.*load_init_network"):
        load_init_weights(UNet(**SMALL), sd_folder)
    with pytest.raises(ValueError, match=r"model.init_from: .*vae"):
        load_init_network(sd_folder / "vae")


def _perturbed(net):
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    return net


def test_export_stable_diffusion_loads_in_the_pipeline(sd_folder, tmp_path):
    from diffusers import StableDiffusionPipeline

    from difftrain.config import load_config
    from difftrain.diffusion.objective import build_objective
    from difftrain.interop.diffusers import export_stable_diffusion
    from difftrain.networks.init_from import load_init_network

    net = _perturbed(load_init_network(sd_folder)).eval()
    cfg = load_config(None, ["diffusion.schedule=scaled_linear", "diffusion.prediction=v"])
    out = export_stable_diffusion(net, objective_cfg=cfg.diffusion, text_encoder_source=str(sd_folder),
                                  vae_source=str(sd_folder), out_dir=tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == [
        "model_index.json", "scheduler", "text_encoder", "tokenizer", "unet", "vae"]
    pipe = StableDiffusionPipeline.from_pretrained(str(out), safety_checker=None)
    assert state_dict_sha256(pipe.unet.state_dict()) == state_dict_sha256(net.state_dict())
    source = StableDiffusionPipeline.from_pretrained(str(sd_folder), safety_checker=None)
    for part in ("vae", "text_encoder"):
        assert state_dict_sha256(getattr(pipe, part).state_dict()) == \
            state_dict_sha256(getattr(source, part).state_dict()), part
    assert pipe.tokenizer("a cat").input_ids == source.tokenizer("a cat").input_ids

    # the scheduler is difftrain's: same alpha_bar and prediction, no clipping of latents
    sched = pipe.scheduler
    assert sched.config.prediction_type == "v_prediction" and not sched.config.clip_sample
    torch.testing.assert_close(sched.alphas_cumprod, build_objective(cfg.diffusion).alpha_bar.float(),
                               rtol=1e-5, atol=1e-6)

    # one denoising call of the pipeline's UNet on the pipeline's own prompt embeddings
    ids = pipe.tokenizer(["a red cat", ""], padding="max_length", max_length=8, truncation=True,
                         return_tensors="pt").input_ids
    with torch.no_grad():
        context = pipe.text_encoder(ids)[0]
        x, t, _ = inputs(2, 4, 8, tokens=8, dim=WIDTH)
        torch.testing.assert_close(pipe.unet(x, t, encoder_hidden_states=context).sample, net(x, t, context))
    images = pipe("a red cat", num_inference_steps=2, height=16, width=16, output_type="np",
                  generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (1, 16, 16, 3)


def test_export_stable_diffusion_refuses_what_cannot_be_a_pipeline(sd_folder, tmp_path):
    from difftrain.config import load_config
    from difftrain.interop.diffusers import export_stable_diffusion
    from difftrain.networks.init_from import load_init_network

    diffusion = load_config(None, []).diffusion
    kwargs = dict(objective_cfg=diffusion, text_encoder_source=str(sd_folder), out_dir=tmp_path / "x")
    with pytest.raises(ValueError, match="difftrain's own text UNet has a different architecture"):
        export_stable_diffusion(UNet(**SMALL, context_dim=WIDTH), vae_source=str(sd_folder), **kwargs)
    net = load_init_network(sd_folder)
    with pytest.raises(ValueError, match=r"needs a VAE \(model.vae\)"):
        export_stable_diffusion(net, vae_source=None, **kwargs)
    with pytest.raises(ValueError, match=r"text encoder .*missing: no such folder"):
        export_stable_diffusion(net, vae_source=str(sd_folder),
                                **{**kwargs, "text_encoder_source": str(tmp_path / "missing")})
    assert not (tmp_path / "x").exists()
