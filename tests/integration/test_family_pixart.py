"""PixArt-Sigma as a difftrain family, on the tiny offline base of tests/family_bases_pixart.py: the prompt
encoder and denoiser equal PixArtSigmaPipeline's own encode_prompt and transformer call; the exported folder
samples as difftrain samples; the LoRA file loads on the pipeline's transformer (peft: the pipeline has no
load_lora_weights) equal to the merged export; bad inputs get one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.family_bases_pixart import T5_LENGTH, write_tiny_pixart_folder

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from difftrain.families.pixart import PixArtSigmaFamily, pixart_text  # noqa: E402

CAPTIONS = ["A red circle", "a blue square on a dark background  "]
NO_SIZE_CONDITIONS = {"resolution": None, "aspect_ratio": None}


def relative_error(a, b):
    """max |a - b| over max(1, max |b|): sampled latents of a random tiny base reach a few hundred (the epsilon of
    random weights read as x0 at alpha_bar 4e-5), where float32's own spacing is 3e-5."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()


def close(a, b):
    """Equal up to float32 rounding (the pipeline runs the text encoder with autograd on)."""
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_pixart_folder(tmp_path_factory.mktemp("pixart") / "base")


def _pipe(folder):
    pipe = diffusers.PixArtSigmaPipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe, **kw):
    """The pipeline's latents for "a red circle" at 32 px (no resolution binning: the tiny sample_size has no
    bins; no caption cleaner: difftrain lower-cases and strips as the pipeline does without bs4 and ftfy)."""
    return pipe("a red circle", height=32, width=32, max_sequence_length=T5_LENGTH, use_resolution_binning=False,
                clean_caption=False, output_type="latent", **kw).images


def test_prompt_encoder_and_denoiser_equal_the_pipelines(folder):
    from difftrain.families import detect, family_named, family_of_record

    family, pipe = PixArtSigmaFamily(), _pipe(folder)
    assert isinstance(detect(folder), PixArtSigmaFamily) and family_named("pixart-sigma").name == "pixart-sigma"
    enc = family.load_prompt_encoder(folder)
    assert enc.t5_length == T5_LENGTH  # min(the pipeline's 300, the tokenizer's model_max_length)
    cond = enc.encode(CAPTIONS)
    embeds, mask, neg, neg_mask = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=True, clean_caption=False,
                                                     max_sequence_length=T5_LENGTH)
    close(cond["prompt_embeds"], embeds)
    assert torch.equal(cond["prompt_mask"], mask.float()) and 0 < mask.sum() < mask.numel()  # padding masked
    null = enc.null(2, "cpu")  # the pipeline's negative prompt ""
    close(null["prompt_embeds"], neg)
    assert torch.equal(null["prompt_mask"], neg_mask.float())
    assert pixart_text(CAPTIONS) == pipe._text_preprocessing(CAPTIONS, clean_caption=False)
    shapes = family.condition_shapes(pipe.transformer.config, T5_LENGTH)
    assert {k: tuple(v.shape[1:]) for k, v in cond.items()} == shapes
    net = family.load_denoiser(folder)
    x, t = torch.randn(2, 4, 8, 6, generator=torch.Generator().manual_seed(0)), torch.tensor([900, 25])
    full = pipe.transformer(x, encoder_hidden_states=embeds, encoder_attention_mask=mask, timestep=t,
                            added_cond_kwargs=NO_SIZE_CONDITIONS, return_dict=False)[0]
    assert full.shape[1] == 8 and net.out_channels == 4  # the learned-variance half, dropped as the pipeline does
    close(net(x, t, cond), full.chunk(2, dim=1)[0])
    assert set(net.state_dict()) == set(pipe.transformer.state_dict())  # diffusers names, no prefix
    record = net.record()
    assert record["kind"] == "family" and family_of_record(record).name == "pixart-sigma"
    rebuilt = family.denoiser_from_record(record)
    rebuilt.load_state_dict(net.state_dict())
    close(rebuilt(x, t, cond), full.chunk(2, dim=1)[0])
    assert len(family.fsdp_units(net)) == len(pipe.transformer.transformer_blocks) == 2
    deferred = family.load_prompt_encoder(folder, deferred=True)  # the text cache's fill: the same condition
    deferred.load_model("t5", torch.float32)
    close(deferred.encode(CAPTIONS)["prompt_embeds"], cond["prompt_embeds"])
    assert deferred.digest == enc.digest


def test_training_defaults_follow_the_scheduler(folder):
    """DDPM as the base's DPMSolverMultistepScheduler config says (linear betas of 1000 steps, epsilon); the
    native resolution is the pipeline's default height (sample_size x the VAE's factor)."""
    family = PixArtSigmaFamily()
    d = family.training_defaults(folder)
    assert {k: d[k] for k in ("diffusion.objective", "diffusion.schedule", "diffusion.prediction",
                              "diffusion.num_timesteps")} == {"diffusion.objective": "ddpm", "diffusion.schedule":
                                                             "linear", "diffusion.prediction": "epsilon",
                                                             "diffusion.num_timesteps": 1000}
    assert d["model.text_encoder"] == d["model.vae"] == str(folder) and d["data.captions"]
    pipe = _pipe(folder)
    assert family.native_resolution(folder) == pipe.transformer.config.sample_size * pipe.vae_scale_factor == 32
    codec = family.load_codec(folder)
    assert codec.latent_channels == 4 and not codec.shift_factor and family.image_side_multiple(codec) == 8


def _ddpm(folder):
    from difftrain.config import load_config

    keys = {k: v for k, v in PixArtSigmaFamily().training_defaults(folder).items() if k.startswith("diffusion.")}
    return load_config(overrides=[f"{k}={v}" for k, v in keys.items()]).diffusion


def _difftrain_sample(family, folder, net, x_T, steps, guidance_scale):
    """x_0 latents as difftrain samples them: the base's DDPM, DPM-Solver++(2M) on the trailing grid, CFG on
    the null condition encode([""]) as the pipeline's (uncond + s (text - uncond))."""
    from difftrain.diffusion.objective import build_objective

    enc = family.load_prompt_encoder(folder, max_sequence_length=T5_LENGTH)
    cond, null = enc.encode(["a red circle"]), enc.null(1, "cpu")

    def network(x, t):
        both = {k: torch.cat([null[k], cond[k]]) for k in cond}
        uncond, text = net(torch.cat([x, x]), torch.cat([t, t]), both).chunk(2)
        return uncond + guidance_scale * (text - uncond)

    with torch.no_grad():
        return build_objective(_ddpm(folder)).sample(network, x_T, "dpmpp_2m", steps, None, clip=False)


def test_exported_pipeline_samples_what_difftrain_samples(tmp_path, folder):
    """export's folder (the base's DPMSolverMultistepScheduler with difftrain's betas, prediction and trailing
    grid) samples what difftrain's dpmpp_2m samples, CFG 4.5 (the pipeline's default), 4 steps: within 5e-4 (diffusers
    forms alpha_bar in float32, difftrain in float64: tests/unit/test_fast_samplers.py)."""
    family = PixArtSigmaFamily()
    net = family.load_denoiser(folder)
    out = family.export_pipeline(net, folder, tmp_path / "export", scheduler=family.export_scheduler(_ddpm(folder)))
    pipe = _pipe(out)
    assert type(pipe.scheduler).__name__ == "DPMSolverMultistepScheduler"
    assert pipe.scheduler.config.timestep_spacing == "trailing" and pipe.scheduler.config.variance_type is None
    x_T = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    ours = _difftrain_sample(family, folder, net, x_T, 4, 4.5)
    theirs = _call(pipe, num_inference_steps=4, guidance_scale=4.5, latents=x_T.clone())
    assert relative_error(ours, theirs) < 5e-6, relative_error(ours, theirs)


def _lora(net, targets, seed=0):
    """A random LoRA (rank 2, B non-zero) on the denoiser's transformer; its peft state dict."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=list(targets), init_lora_weights=False),
                            net.model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return get_peft_model_state_dict(net.model)


def load_lora_with_peft(transformer, file):
    """What a user does with the file (PixArtSigmaPipeline has no load_lora_weights, its transformer no
    load_lora_adapter): peft's adapter from the file's LoraConfig metadata, its ``transformer.`` tensors set."""
    import json

    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors import safe_open

    with safe_open(str(file), framework="pt", device="cpu") as f:
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
        state = {k.removeprefix("transformer."): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    config = {k.removeprefix("transformer."): v for k, v in meta.items()}
    inject_adapter_in_model(LoraConfig(**config), transformer)
    result = set_peft_model_state_dict(transformer, state)
    assert not result.unexpected_keys


def test_lora_file_loads_on_the_pipelines_transformer_equal_to_the_merged_export(tmp_path, folder):
    """Family.save_lora's file (diffusers' layout, peft's config as metadata) loaded with peft on the pipeline's
    transformer samples what the merged export samples (1e-4); read_lora gives the adapter back; a Flux-layout
    file (its joint "attn") and a file naming modules the base lacks are refused in one line."""
    pytest.importorskip("peft")
    from peft.tuners.tuners_utils import BaseTunerLayer

    family = PixArtSigmaFamily()
    net = family.load_denoiser(folder)
    state = _lora(net, family.lora_targets)
    assert {k.split(".lora_")[0].split(".", 2)[2] for k in state} == set(family.lora_targets)  # every target hit
    path = family.save_lora(state, {"r": 2, "lora_alpha": 2, "target_modules": list(family.lora_targets)},
                            tmp_path / "lora", {"difftrain": "test"})
    back = family.read_lora(path, denoiser=family.load_denoiser(folder))
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    for module in net.model.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    merged = family.load_denoiser(folder)
    merged.load_state_dict({k.replace(".base_layer", ""): v for k, v in net.state_dict().items() if "lora_" not in k})
    out = family.export_pipeline(merged, folder, tmp_path / "export")
    with_lora = _pipe(folder)
    load_lora_with_peft(with_lora.transformer, path)
    exported = _pipe(out)
    enc = family.load_prompt_encoder(folder)
    cond = enc.encode(CAPTIONS)
    x, t = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([700, 30])
    with torch.no_grad():  # the transformers: 1e-4
        theirs, ours = (family.denoiser_class(p.transformer)(x, t, cond) for p in (with_lora, exported))
        assert (theirs - ours).abs().max() < 1e-4
        assert (theirs - family.load_denoiser(folder)(x, t, cond)).abs().max() > 1e-3  # the adapter is in
    a = _call(with_lora, num_inference_steps=2, generator=torch.Generator().manual_seed(1))
    b = _call(exported, num_inference_steps=2, generator=torch.Generator().manual_seed(1))
    assert relative_error(a, b) < 1e-5, relative_error(a, b)  # the samples (CFG 4.5, 2 steps)
    plain = _call(_pipe(folder), num_inference_steps=2, generator=torch.Generator().manual_seed(1))
    assert relative_error(a, plain) > 1e-3  # the LoRA changes the output
    from safetensors.torch import save_file

    flux = tmp_path / "flux.safetensors"
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 16),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(16, 2)}, str(flux))
    wide = tmp_path / "wide.safetensors"
    save_file({"transformer.transformer_blocks.0.attn1.to_q.lora_A.weight": torch.zeros(2, 64),
               "transformer.transformer_blocks.0.attn1.to_q.lora_B.weight": torch.zeros(64, 2)}, str(wide))
    junk = tmp_path / "junk.safetensors"
    junk.write_text("junk")
    for bad, needle in ((flux, "another family"), (wide, "shape"), (junk, "not a"),
                        (tmp_path / "missing.safetensors", "does not exist")):
        with pytest.raises(ValueError, match=needle) as info:
            family.read_lora(bad, denoiser=family.load_denoiser(folder))
        assert "\n" not in str(info.value) and str(bad) in str(info.value)


def test_bad_input_gets_one_line(tmp_path, folder):
    family = PixArtSigmaFamily()
    with pytest.raises(ValueError, match="max_sequence_length=600") as info:
        family.load_prompt_encoder(folder, max_sequence_length=600)
    assert "\n" not in str(info.value) and str(folder) in str(info.value)
    net = family.load_denoiser(folder)
    cond = family.load_prompt_encoder(folder).encode(["a"])
    with pytest.raises(ValueError, match="patches") as info:
        net(torch.zeros(1, 4, 7, 8), torch.tensor([500]), cond)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="prompt_mask") as info:
        net(torch.zeros(1, 4, 8, 8), torch.tensor([500]), {"prompt_embeds": cond["prompt_embeds"]})
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    shutil.rmtree(broken / "text_encoder")
    with pytest.raises(ValueError, match="text_encoder") as info:
        family.load_prompt_encoder(broken)
    assert "\n" not in str(info.value) and str(broken) in str(info.value)


def test_the_known_base_is_pixart_sigma_and_estimate_counts_its_masked_attention():
    """tools/bases/pixart-sigma builds PixArt-Sigma-XL-2-1024-MS on meta: 610,856,096 transformer parameters (the
    published "0.6B"; the sizes of diffusers' scripts/convert_pixart_sigma_to_diffusers.py: 28 layers, 16 heads of
    72, caption_channels 4096), T5 v1.1 XXL's encoder 4,762,310,656; `estimate` counts the preset's activations on
    meta (the cross-attention's padding mask: tools/meta_step.py's stand-in keeps it; before, it refused a mask
    and the activations were left out), and the preset fits 24 GB as its header says."""
    from difftrain.config import load_config
    from difftrain.families import detect
    from difftrain.tools.base_memory import (GiB, HEADROOM, _config_setting, base_folder, count_settings,
                                             denoiser_config, read_base, text_encoder_params)

    folder = base_folder("pixart-sigma")
    with torch.device("meta"):
        net = detect(folder).denoiser_from_record({"config": denoiser_config(folder)})
    assert isinstance(detect(folder), PixArtSigmaFamily)
    assert sum(p.numel() for p in net.parameters()) == 610_856_096
    assert text_encoder_params(folder) == 4_762_310_656
    preset = load_config(Path(__file__).resolve().parents[2] / "configs" / "pixart-sigma-lora.toml",
                         [f"model.init_from={folder}"])
    setting = _config_setting(preset, 1, None)  # the preset's own setting, as `estimate --config` counts it
    rows, info = count_settings(preset, read_base(preset, "pixart-sigma"), [setting])
    own = rows[setting]
    assert info["activations_note"].startswith("counted") and own["activations"] > 0.1 * GiB
    assert own["total"] <= HEADROOM * 16 * GiB
    assert f"{own['total'] / GiB:.2f} GiB" in (Path(__file__).resolve().parents[2] / "configs" /
                                                "pixart-sigma-lora.toml").read_text()
