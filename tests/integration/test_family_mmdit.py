"""SD3 and Flux as difftrain families, on the tiny offline bases of tests/family_bases.py: the
prompt encoders and denoisers equal diffusers' pipelines' own encode_prompt and transformer
calls; export and LoRA files load in the pipelines; bad inputs get one line."""

from __future__ import annotations

import pytest
import torch

from tests.family_bases import T5_LENGTH, with_run_conditions, write_tiny_flux_folder, write_tiny_sd3_folder

diffusers = pytest.importorskip("diffusers")

from difftrain.families.flux import FluxFamily, image_ids, pack, unpack  # noqa: E402
from difftrain.families.sd3 import SD3Family  # noqa: E402

def close(a, b):
    """Equal up to float32 rounding (the pipelines run the text encoders with autograd on)."""
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


CAPTIONS = ["a red circle", "a blue square on a dark background"]


@pytest.fixture(scope="module")
def sd3_folder(tmp_path_factory):
    return write_tiny_sd3_folder(tmp_path_factory.mktemp("sd3") / "base")


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    return write_tiny_flux_folder(tmp_path_factory.mktemp("flux") / "base")


def _pipe(name, folder):
    pipe = getattr(diffusers, name).from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_sd3_prompt_encoder_and_denoiser_equal_the_pipelines(sd3_folder):
    family, pipe = SD3Family(), _pipe("StableDiffusion3Pipeline", sd3_folder)
    enc = family.load_prompt_encoder(sd3_folder)
    assert enc.t5_length == T5_LENGTH  # min(the pipeline's 256, the tokenizer's model_max_length)
    cond = enc.encode(CAPTIONS)
    embeds, _, pooled, _ = pipe.encode_prompt(CAPTIONS, None, None, do_classifier_free_guidance=False,
                                              max_sequence_length=T5_LENGTH)
    close(cond["prompt_embeds"], embeds)
    close(cond["pooled"], pooled)
    net = family.load_denoiser(sd3_folder)
    x, t = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([900.0, 25.0])
    want = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds, pooled_projections=pooled,
                            return_dict=False)[0]
    close(net(x, t, cond), want)
    assert set(net.state_dict()) == set(pipe.transformer.state_dict())  # diffusers names, no prefix
    rebuilt = family.denoiser_from_record(net.record())
    rebuilt.load_state_dict(net.state_dict())
    close(rebuilt(x, t, cond), want)
    assert len(family.fsdp_units(net)) == len(pipe.transformer.transformer_blocks)


def test_flux_prompt_encoder_and_denoiser_equal_the_pipelines(flux_folder):
    family, pipe = FluxFamily(), _pipe("FluxPipeline", flux_folder)
    enc = family.load_prompt_encoder(flux_folder)
    cond = enc.encode(CAPTIONS)
    embeds, pooled, text_ids = pipe.encode_prompt(CAPTIONS, None, max_sequence_length=T5_LENGTH)
    close(cond["prompt_embeds"], embeds)
    close(cond["pooled"], pooled)
    assert set(cond) == {"prompt_embeds", "pooled"}  # the guidance is the run's, not the text's
    cond = with_run_conditions(family, cond)
    assert torch.equal(cond["guidance"], torch.full((2,), 3.5))
    x, t = torch.randn(2, 16, 8, 6, generator=torch.Generator().manual_seed(0)), torch.tensor([900.0, 25.0])
    packed = diffusers.FluxPipeline._pack_latents(x, 2, 16, 8, 6)
    assert torch.equal(pack(x), packed) and torch.equal(unpack(packed, 8, 6), x)
    assert torch.equal(image_ids(8, 6), diffusers.FluxPipeline._prepare_latent_image_ids(2, 4, 3, "cpu", torch.float32))
    want = pipe.transformer(hidden_states=packed, timestep=t / 1000, guidance=torch.full((2,), 3.5),
                            pooled_projections=pooled, encoder_hidden_states=embeds, txt_ids=text_ids,
                            img_ids=image_ids(8, 6), return_dict=False)[0]
    net = family.load_denoiser(flux_folder)
    close(net(x, t, cond), diffusers.FluxPipeline._unpack_latents(want, 8 * 4, 6 * 4, 4))
    assert len(family.fsdp_units(net)) == 2


def test_sd3_without_t5_encodes_zeros_as_the_pipeline_and_trains(tmp_path):
    """A base without text_encoder_3/ and tokenizer_3/: the T5 part is zeros (the transformer's
    joint_attention_dim wide), what StableDiffusion3Pipeline(text_encoder_3=None).encode_prompt gives;
    a LoRA run on it trains a step and samples its validation grid."""
    from difftrain.config import load_config
    from difftrain.training.loop import train
    from tests.integration.test_text_train import _captioned_folder

    folder = write_tiny_sd3_folder(tmp_path / "no_t5", t5=False)
    assert not (folder / "text_encoder_3").exists() and not (folder / "tokenizer_3").exists()
    pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(str(folder), text_encoder_3=None, tokenizer_3=None)
    enc = SD3Family().load_prompt_encoder(folder, max_sequence_length=T5_LENGTH)
    assert enc.t5 is None and enc.dim == pipe.transformer.config.joint_attention_dim
    cond = enc.encode(CAPTIONS)
    embeds, _, pooled, _ = pipe.encode_prompt(CAPTIONS, None, None, do_classifier_free_guidance=False,
                                              max_sequence_length=T5_LENGTH)
    assert cond["prompt_embeds"].shape == embeds.shape == (2, 16 + T5_LENGTH, enc.dim)
    close(cond["prompt_embeds"], embeds)
    close(cond["pooled"], pooled)
    assert not cond["prompt_embeds"][:, 16:].any()  # the T5 part: zeros
    assert SD3Family().load_prompt_encoder(folder).t5_length == 256  # the pipeline's default, no tokenizer to cap it
    _captioned_folder(tmp_path / "data", n=4, size=32)
    cfg = load_config(None, ["data.resolution=32", "data.num_workers=0", f"data.path={tmp_path / 'data'}",
                             f"model.init_from={folder}", f"model.max_sequence_length={T5_LENGTH}", "lora.rank=2",
                             "train.total_steps=1", "train.batch_size=2", "train.progress_bar=false",
                             "checkpoint.every_steps=1", "validation.every_steps=1", "validation.steps=1",
                             "validation.num_images=1", "validation.prompts=['a red square']", "text.cache=off"])
    assert train(cfg, tmp_path / "run").step == 1
    assert list((tmp_path / "run" / "samples").glob("*.png"))
    (folder / "tokenizer_3").mkdir()  # half a T5: one line naming the missing part
    with pytest.raises(ValueError, match="text_encoder_3") as info:
        SD3Family().load_prompt_encoder(folder)
    assert "\n" not in str(info.value)


def test_families_are_registered_and_detected(sd3_folder, flux_folder):
    from difftrain.families import detect, family_named, family_of_record

    assert isinstance(detect(sd3_folder), SD3Family) and isinstance(detect(flux_folder), FluxFamily)
    assert family_named("sd3").name == "sd3" and family_named("flux").name == "flux"
    record = FluxFamily().load_denoiser(flux_folder).record()
    assert record["kind"] == "family" and family_of_record(record).name == "flux"


@pytest.mark.parametrize("which", ["sd3", "flux"])
def test_the_flow_scheduler_of_the_base_defaults_is_the_bases(sd3_folder, flux_folder, which):
    """Export's scheduler from difftrain's flow keys, set by the family's defaults, is the base's own."""
    import json

    from difftrain.config import load_config

    family, folder = (SD3Family(), sd3_folder) if which == "sd3" else (FluxFamily(), flux_folder)
    keys = {k: v for k, v in family.training_defaults(folder).items() if k.startswith("diffusion.")}
    cfg = load_config(overrides=[f"{k}={'none' if v is None else v}" for k, v in keys.items()])
    ours = family.flow_scheduler(cfg.diffusion)
    base = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    assert {k: base[k] for k in ours if k in base} == {k: v for k, v in ours.items() if k in base}
    assert ours["use_dynamic_shifting"] == (which == "flux")


def test_training_defaults_follow_the_schedulers(sd3_folder, flux_folder):
    sd3 = SD3Family().training_defaults(sd3_folder)
    assert sd3["diffusion.flow_train_shift"] == sd3["diffusion.flow_shift"] == 3.0
    assert sd3["diffusion.flow_grid_end"] == pytest.approx(diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0).sigma_min)
    flux = FluxFamily().training_defaults(flux_folder)
    assert flux["diffusion.flow_dynamic_shift"] and flux["diffusion.flow_t_sampling"] == "uniform"
    assert flux["diffusion.flow_train_shift"] == 1.0
    # data.resolution: the pipelines' default height, sample_size x the VAE's factor (4 in the tiny bases); Flux's
    # transformer has no sample_size: FluxPipeline's default_sample_size 128
    assert SD3Family().native_resolution(sd3_folder) == 8 * 4
    flux_pipe = _pipe("FluxPipeline", flux_folder)
    assert FluxFamily().native_resolution(flux_folder) == 128 * 4 == flux_pipe.default_sample_size * flux_pipe.vae_scale_factor


@pytest.mark.parametrize("which", ["sd3", "flux"])
def test_bad_input_gets_one_line(tmp_path, sd3_folder, flux_folder, which):
    family, folder = (SD3Family(), sd3_folder) if which == "sd3" else (FluxFamily(), flux_folder)
    with pytest.raises(ValueError, match="max_sequence_length=600") as info:
        family.load_prompt_encoder(folder, max_sequence_length=600)
    assert "\n" not in str(info.value) and str(folder) in str(info.value)
    net = family.load_denoiser(folder)
    cond = with_run_conditions(family, family.load_prompt_encoder(folder).encode(["a"]))
    with pytest.raises(ValueError, match="patches") as info:
        net(torch.zeros(1, 16, 7, 8), torch.tensor([500.0]), cond)
    assert "\n" not in str(info.value)
    codec = family.load_codec(folder)
    assert codec.latent_channels == 16 and codec.shift_factor != 0 and codec.factor == 4
    assert family.image_side_multiple(codec) == 8  # the tiny VAE's factor 4 x 2x2 patches


def _lora(net, targets, seed=0, dora=False):
    """Random LoRA (rank 2, B non-zero; DoRA: magnitudes about 1) on the denoiser's transformer; its peft
    state dict."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=targets, init_lora_weights=False,
                                       use_dora=dora), net.model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1 if "magnitude" in name else 0))
    return get_peft_model_state_dict(net.model)


def _merged(net):
    """The denoiser with its LoRA merged into the base weights (peft's merge, adapters removed)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in net.model.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    state = {k.replace(".base_layer", ""): v for k, v in net.state_dict().items() if "lora_" not in k}
    return state


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("which", ["sd3", "flux"])
def test_lora_file_loads_in_the_pipeline_equal_to_the_merged_export(tmp_path, sd3_folder, flux_folder, which, dora):
    """export --format lora -> Pipeline.load_lora_weights gives what the merged export gives (1e-4), for
    LoRA and DoRA (lora.kind); a file of the other family (or of another base) is refused in one line."""
    family, folder, name = ((SD3Family(), sd3_folder, "StableDiffusion3Pipeline") if which == "sd3"
                            else (FluxFamily(), flux_folder, "FluxPipeline"))
    net = family.load_denoiser(folder)
    state = _lora(net, family.lora_targets, dora=dora)
    path = family.save_lora(state, {"r": 2, "lora_alpha": 2, "target_modules": list(family.lora_targets),
                                    "use_dora": dora}, tmp_path / "lora", {"difftrain": "test"})
    back = family.read_lora(path, denoiser=family.load_denoiser(folder))
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    merged = family.load_denoiser(folder)
    merged.load_state_dict(_merged(net))
    out = family.export_pipeline(merged, folder, tmp_path / "export")
    prompt = dict(prompt="a red circle", height=32, width=32, num_inference_steps=2, max_sequence_length=T5_LENGTH,
                  output_type="latent")
    with_lora = _pipe(name, folder)
    with_lora.load_lora_weights(str(path))
    a = with_lora(**prompt, generator=torch.Generator().manual_seed(1)).images
    b = _pipe(name, out)(**prompt, generator=torch.Generator().manual_seed(1)).images
    assert (a - b).abs().max() < 1e-4
    plain = _pipe(name, folder)(**prompt, generator=torch.Generator().manual_seed(1)).images
    assert (a - plain).abs().max() > 1e-3  # the LoRA changes the output
    # another family's file
    other_family, other_folder = (FluxFamily(), flux_folder) if which == "sd3" else (SD3Family(), sd3_folder)
    other = other_family.load_denoiser(other_folder)
    other_path = other_family.save_lora(_lora(other, other_family.lora_targets), {}, tmp_path / "other")
    with pytest.raises(ValueError, match="not a") as info:
        family.read_lora(other_path, denoiser=family.load_denoiser(folder))
    assert "\n" not in str(info.value) and str(other_path) in str(info.value)


def _difftrain_sample(family, folder, x_T, steps, guidance_scale):
    """x_0 latents (B, 16, h, w) as difftrain samples them: the flow objective with the family's
    training defaults (grid, shift), Euler, the family's denoiser and prompt encoder, CFG on the
    null condition encode([""]) when guidance_scale > 1."""
    from difftrain.diffusion.flow import FlowObjective

    d = family.training_defaults(folder)
    obj = FlowObjective(shift=d["diffusion.flow_shift"], grid_end=d["diffusion.flow_grid_end"],
                        dynamic_shift=d["diffusion.flow_dynamic_shift"])
    enc, net = family.load_prompt_encoder(folder), family.load_denoiser(folder)
    cond, null = (with_run_conditions(family, enc.encode(c)) for c in (["a red circle"], [""]))

    def network(x, t):
        if guidance_scale <= 1:
            return net(x, t, cond)
        both = {k: torch.cat([null[k], cond[k]]) for k in cond}
        uncond, text = net(torch.cat([x, x]), torch.cat([t, t]), both).chunk(2)
        return uncond + guidance_scale * (text - uncond)

    with torch.no_grad():
        return obj.sample(network, x_T, "euler", steps, None, clip=False)


@pytest.mark.parametrize("which", ["sd3", "flux"])
def test_exported_pipeline_samples_what_difftrain_samples(tmp_path, sd3_folder, flux_folder, which):
    family, folder, name = ((SD3Family(), sd3_folder, "StableDiffusion3Pipeline") if which == "sd3"
                            else (FluxFamily(), flux_folder, "FluxPipeline"))
    out = family.export_pipeline(family.load_denoiser(folder), folder, tmp_path / "export")
    pipe = _pipe(name, out)
    x_T = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(3))
    steps, scale = 4, (5.0 if which == "sd3" else 3.5)
    ours = _difftrain_sample(family, folder, x_T, steps, scale if which == "sd3" else 1.0)
    latents = x_T if which == "sd3" else pack(x_T)
    theirs = pipe("a red circle", height=32, width=32, num_inference_steps=steps, guidance_scale=scale,
                  max_sequence_length=T5_LENGTH, latents=latents, output_type="latent").images
    if which == "flux":
        theirs = unpack(theirs, 8, 8)
    assert (ours - theirs).abs().max() < 1e-4, (ours - theirs).abs().max()


@pytest.mark.parametrize("family", [SD3Family(), FluxFamily()], ids=lambda f: f.name)
def test_lora_of_a_unet_or_a_broken_file_is_refused_in_one_line(tmp_path, family):
    from safetensors.torch import save_file

    unet = tmp_path / "sd_lora.safetensors"
    save_file({"unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 8),
               "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_B.weight": torch.zeros(8, 4)},
              str(unet))
    junk = tmp_path / "junk.safetensors"
    junk.write_text("junk")
    for path, needle in ((unet, "tensors of unet"), (junk, "not a"), (tmp_path / "missing.safetensors", "does not exist")):
        with pytest.raises(ValueError, match=needle) as info:
            family.read_lora(path)
        assert "\n" not in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("which", ["sd3", "flux"])
def test_a_lora_file_of_diffusers_scripts_samples_on_the_base_it_names(tmp_path, sd3_folder, flux_folder, which):
    """A file as diffusers' train_dreambooth_lora_sd3.py / _flux.py write it (save_lora_weights, no difftrain
    record), read by difftrain.load(lora=FILE, base=FOLDER) through the pipeline's lora_state_dict and the
    transformer's load_lora_adapter: the adapted network computes what peft's adapter on the base computes;
    the other family's file is refused in one line saying 0 modules match."""
    pytest.importorskip("peft")
    from difftrain.generation.inference import load_model

    family, folder = (SD3Family(), sd3_folder) if which == "sd3" else (FluxFamily(), flux_folder)
    net = family.load_denoiser(folder)
    state = _lora(net, family.lora_targets)
    path = family.save_lora(state, {"r": 2, "lora_alpha": 4, "target_modules": list(family.lora_targets)},
                            tmp_path / "theirs")
    loaded = load_model(None, lora=path, base=str(folder), device="cpu")
    assert loaded.model.rank == 2 and loaded.model.alpha == 4.0 and loaded.cfg.diffusion.objective == "flow"
    with torch.no_grad():  # the file says alpha 4: scale 2 where _lora's own adapter ran at scale 1
        for layer in net.model.modules():
            if hasattr(layer, "scaling") and "default" in getattr(layer, "scaling", {}):
                layer.scaling["default"] = 2.0
    cond = with_run_conditions(family, family.load_prompt_encoder(folder).encode(CAPTIONS, "cpu"))
    x, t = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([900.0, 25.0])
    with torch.no_grad():
        close(loaded.model(x, t, cond), net(x, t, cond))
    other_family, other_folder = (FluxFamily(), flux_folder) if which == "sd3" else (SD3Family(), sd3_folder)
    other = other_family.load_denoiser(other_folder)
    other_path = other_family.save_lora(_lora(other, other_family.lora_targets), {}, tmp_path / "other")
    with pytest.raises(ValueError, match="modules match") as info:
        load_model(None, lora=other_path, base=str(folder), device="cpu")
    assert "\n" not in str(info.value) and str(other_path) in str(info.value)
