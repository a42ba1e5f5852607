"""FLUX.2 [dev] and [klein] as difftrain families, on the tiny offline bases of tests/family_bases_flux2.py:
the prompt encoders, the VAE's latent normalisation and the denoisers equal diffusers' pipelines' own
encode_prompt, _encode_vae_image and transformer calls (float32, 1e-5); detection; the LoRA file loads in the
pipelines (load_lora_weights) equal to the merged export (1e-4); the exported folder samples what difftrain
samples; bad inputs get one line."""

from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from difftrain.families.flux import pack, unpack  # noqa: E402
from difftrain.families.flux2 import Flux2Family, latent_ids, patchify, text_ids  # noqa: E402
from difftrain.families.flux2_klein import Flux2KleinFamily  # noqa: E402
from tests.family_bases import with_run_conditions  # noqa: E402
from tests.family_bases_flux2 import (LATENT_CHANNELS, TEXT_LENGTH, write_tiny_flux2_folder,  # noqa: E402
                                      write_tiny_flux2_klein_folder)
from tests.integration.test_family_mmdit import _lora, _merged  # noqa: E402

CAPTIONS = ["a red circle", "a blue square on a dark background"]
PIPELINES = {"flux2": "Flux2Pipeline", "flux2-klein": "Flux2KleinPipeline"}
FAMILY = {"flux2": Flux2Family, "flux2-klein": Flux2KleinFamily}


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux2")
    return {"flux2": write_tiny_flux2_folder(root / "dev"), "flux2-klein": write_tiny_flux2_klein_folder(root / "klein")}


def _pipe(name, folder):
    pipe = getattr(diffusers, PIPELINES[name]).from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("name", ["flux2", "flux2-klein"])
def test_prompt_encoder_vae_and_denoiser_equal_the_pipelines(bases, name):
    family, folder = FAMILY[name](), bases[name]
    pipe = _pipe(name, folder)
    enc = family.load_prompt_encoder(folder, max_sequence_length=TEXT_LENGTH)
    cond = enc.encode(CAPTIONS)
    embeds, ids = pipe.encode_prompt(CAPTIONS, max_sequence_length=TEXT_LENGTH)
    assert set(cond) == {"prompt_embeds"} and cond["prompt_embeds"].shape == embeds.shape == (2, TEXT_LENGTH, enc.dim)
    close(cond["prompt_embeds"], embeds)
    assert torch.equal(text_ids(TEXT_LENGTH), ids[0].float())
    cond = with_run_conditions(family, cond)
    assert set(cond) == ({"prompt_embeds", "guidance"} if name == "flux2" else {"prompt_embeds"})
    # latents: difftrain's (B, 32, h, w) pack to the pipeline's patchified, packed tokens; ids as its own
    x, t = torch.randn(2, LATENT_CHANNELS, 8, 6, generator=torch.Generator().manual_seed(0)), torch.tensor([900.0, 25.0])
    patches = pipe._patchify_latents(x)
    packed = pipe._pack_latents(patches)
    assert torch.equal(pack(x), packed) and torch.equal(unpack(packed, 8, 6), x) and torch.equal(patchify(x), patches)
    assert torch.equal(latent_ids(8, 6), pipe._prepare_latent_ids(patches)[0].float())
    want = pipe.transformer(hidden_states=packed, timestep=t / 1000,
                            guidance=torch.full((2,), 3.5) if name == "flux2" else None, encoder_hidden_states=embeds,
                            txt_ids=ids, img_ids=pipe._prepare_latent_ids(patches), return_dict=False)[0]
    net = family.load_denoiser(folder)
    close(net(x, t, cond), unpack(want, 8, 6))
    assert set(net.state_dict()) == set(pipe.transformer.state_dict())
    rebuilt = family.denoiser_from_record(net.record())
    rebuilt.load_state_dict(net.state_dict())
    close(rebuilt(x, t, cond), unpack(want, 8, 6))
    assert len(family.fsdp_units(net)) == 2
    # the VAE: the codec's model-space latents are the pipeline's normalised, patchified ones
    codec = family.load_codec(folder)
    assert codec.latent_channels == LATENT_CHANNELS and codec.factor == 4 and family.image_side_multiple(codec) == 8
    images = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    mean, _ = codec.encode_moments(images)
    with torch.no_grad():
        close(pack(codec.to_model(mean)), pipe._pack_latents(pipe._encode_vae_image(images, None)))
    close(codec.from_model(codec.to_model(mean)), mean)
    shapes = family.condition_shapes(dict(net.config), TEXT_LENGTH)
    assert {k: (len(cond[k]),) + s for k, s in shapes.items()} == {k: tuple(v.shape) for k, v in cond.items()}


def test_families_are_registered_and_detected(bases):
    from difftrain.families import detect, family_named, family_of_record

    assert isinstance(detect(bases["flux2"]), Flux2Family) and not isinstance(detect(bases["flux2"]), Flux2KleinFamily)
    assert isinstance(detect(bases["flux2-klein"]), Flux2KleinFamily)
    assert family_named("flux2").name == "flux2" and family_named("flux2-klein").name == "flux2-klein"
    for name in ("flux2", "flux2-klein"):
        record = FAMILY[name]().load_denoiser(bases[name]).record()
        assert record["kind"] == "family" and family_of_record(record).name == name


def test_training_defaults_follow_the_script_and_the_pipelines(bases):
    dev = Flux2Family().training_defaults(bases["flux2"])
    assert dev["diffusion.objective"] == "flow" and dev["diffusion.flow_t_sampling"] == "uniform"
    assert dev["diffusion.flow_train_shift"] == 1.0 and dev["diffusion.flow_dynamic_shift"]
    assert dev["validation.distilled_guidance"] == 4.0  # Flux2Pipeline's guidance_scale default
    klein = Flux2KleinFamily().training_defaults(bases["flux2-klein"])
    assert klein["validation.guidance_scale"] == 4.0 and "validation.distilled_guidance" not in klein
    pipe = _pipe("flux2", bases["flux2"])
    assert Flux2Family().native_resolution(bases["flux2"]) == pipe.default_sample_size * pipe.vae_scale_factor


@pytest.mark.parametrize("name", ["flux2", "flux2-klein"])
def test_bad_input_gets_one_line(tmp_path, bases, name):
    from tests.text_components import write_tiny_vae

    family, folder = FAMILY[name](), bases[name]
    with pytest.raises(ValueError, match="max_sequence_length=600") as info:
        family.load_prompt_encoder(folder, max_sequence_length=600)
    assert "\n" not in str(info.value) and str(folder) in str(info.value)
    net = family.load_denoiser(folder)
    cond = with_run_conditions(family, family.load_prompt_encoder(folder, max_sequence_length=8).encode(["a"]))
    with pytest.raises(ValueError, match="patches") as info:
        net(torch.zeros(1, LATENT_CHANNELS, 7, 8), torch.tensor([500.0]), cond)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="AutoencoderKLFlux2") as info:  # another family's VAE
        family.load_codec(write_tiny_vae(tmp_path / "vae"))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("name", ["flux2", "flux2-klein"])
def test_lora_file_loads_in_the_pipeline_equal_to_the_merged_export(tmp_path, bases, name, dora):
    """export --format lora -> the pipeline's load_lora_weights samples what the merged export samples (1e-4),
    LoRA and DoRA; a Flux.1 file is refused in one line."""
    from tests.family_bases import write_tiny_flux_folder
    from difftrain.families.flux import FluxFamily

    family, folder = FAMILY[name](), bases[name]
    net = family.load_denoiser(folder)
    state = _lora(net, list(family.lora_targets), dora=dora)
    assert any("single_transformer_blocks.0.attn.to_out" in k for k in state)  # the script's targets
    assert any("to_qkv_mlp_proj" in k for k in state) and not any("add_q_proj" in k for k in state)
    path = family.save_lora(state, {"r": 2, "lora_alpha": 2, "target_modules": list(family.lora_targets),
                                    "use_dora": dora}, tmp_path / "lora", {"difftrain": "test"})
    back = family.read_lora(path, denoiser=family.load_denoiser(folder))
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    merged = family.load_denoiser(folder)
    merged.load_state_dict(_merged(net))
    out = family.export_pipeline(merged, folder, tmp_path / "export")
    prompt = dict(prompt="a red circle", height=32, width=32, num_inference_steps=2, max_sequence_length=TEXT_LENGTH,
                  output_type="latent")
    with_lora = _pipe(name, folder)
    with_lora.load_lora_weights(str(path))
    a = with_lora(**prompt, generator=torch.Generator().manual_seed(1)).images
    b = _pipe(name, out)(**prompt, generator=torch.Generator().manual_seed(1)).images
    assert (a - b).abs().max() < 1e-4
    plain = _pipe(name, folder)(**prompt, generator=torch.Generator().manual_seed(1)).images
    assert (a - plain).abs().max() > 1e-3  # the LoRA changes the output
    flux = write_tiny_flux_folder(tmp_path / "flux")
    other = FluxFamily().load_denoiser(flux)
    other_path = FluxFamily().save_lora(_lora(other, FluxFamily().lora_targets), {}, tmp_path / "other")
    with pytest.raises(ValueError, match="not a") as info:
        family.read_lora(other_path, denoiser=family.load_denoiser(folder))
    assert "\n" not in str(info.value) and str(other_path) in str(info.value)


@pytest.mark.parametrize("grid", ["defaults", "shift3"])
@pytest.mark.parametrize("name", ["flux2", "flux2-klein"])
def test_exported_pipeline_samples_what_difftrain_samples(tmp_path, bases, name, grid):
    """The exported folder (its scheduler from difftrain's flow keys: the base's defaults, the pipelines'
    empirical resolution- and step-dependent shift; or a fixed shift 3) samples, from the same noise, difftrain's
    latents (Euler, 4 steps; dev with its guidance input 4.0, klein with CFG 4 on encode([""]), the pipeline's
    negative prompt)."""
    from difftrain.config import load_config
    from difftrain.diffusion.objective import build_objective

    family, folder = FAMILY[name](), bases[name]
    keys = {k: v for k, v in family.training_defaults(folder).items() if k.startswith("diffusion.")}
    if grid == "shift3":
        keys |= {"diffusion.flow_dynamic_shift": False, "diffusion.flow_shift": 3.0}
    diffusion = load_config(overrides=[f"{k}={'none' if v is None else v}" for k, v in keys.items()]).diffusion
    out = family.export_pipeline(family.load_denoiser(folder), folder, tmp_path / "export",
                                 scheduler=family.export_scheduler(diffusion))
    x_T = torch.randn(1, LATENT_CHANNELS, 8, 8, generator=torch.Generator().manual_seed(3))
    steps, scale = 4, 4.0
    enc, net = family.load_prompt_encoder(folder, max_sequence_length=TEXT_LENGTH), family.load_denoiser(folder)
    guidance = {"guidance": torch.full((1,), scale)} if name == "flux2" else {}
    cond, null = (enc.encode(c) | guidance for c in (["a red circle"], [""]))

    def network(x, t):
        if name == "flux2":
            return net(x, t, cond)
        both = {k: torch.cat([null[k], cond[k]]) for k in cond}
        uncond, text = net(torch.cat([x, x]), torch.cat([t, t]), both).chunk(2)
        return uncond + scale * (text - uncond)

    with torch.no_grad():
        ours = build_objective(diffusion).sample(network, x_T, "euler", steps, None, clip=False)
    theirs = _pipe(name, out)(prompt="a red circle", height=32, width=32, num_inference_steps=steps,
                              guidance_scale=scale, max_sequence_length=TEXT_LENGTH, latents=patchify(x_T),
                              output_type="latent").images
    if name == "flux2":  # the packed, normalised latents
        theirs = unpack(theirs, 8, 8)
    else:  # Flux2KleinPipeline's "latent" output: the VAE's own (denormalised, unpatchified)
        ours = family.load_codec(folder).from_model(ours)
    assert (ours - theirs).abs().max() < 1e-4, (ours - theirs).abs().max()


def test_known_bases_are_the_published_sizes():
    """tools/bases/flux2-*: the transformers at FLUX.2 [dev]'s 32B (Flux2Transformer2DModel's defaults) and klein's
    4B / 9B (5 + 20 and 8 + 24 blocks, 24 and 32 heads), the text encoders at Mistral Small 3.1's 24B (vision tower
    included) and Qwen3's 4B / 8B, counted on the meta device; each detected as its family."""
    from difftrain.families import detect
    from difftrain.tools.base_memory import base_folder, denoiser_config, text_encoder_params

    sizes = {"flux2-dev": (32_223_281_152, 24_011_361_280), "flux2-klein-4b": (3_875_544_576, 4_022_468_096),
             "flux2-klein-9b": (9_078_581_248, 8_190_735_360)}
    for name, (denoiser, text) in sizes.items():
        folder = base_folder(name)
        family = detect(folder)
        assert family.name == ("flux2" if name == "flux2-dev" else "flux2-klein")
        with torch.device("meta"):
            net = family.denoiser_from_record({"config": denoiser_config(folder)})
        assert (sum(p.numel() for p in net.parameters()), text_encoder_params(folder)) == (denoiser, text), name


def test_the_empirical_shift_is_the_pipelines():
    """diffusion.flow_shift_rule = "empirical": FLUX.2's mu of the token and step counts, as its pipelines compute it."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    from difftrain.diffusion.ode_samplers import empirical_shift

    for tokens in (16, 256, 1024, 4096, 4301, 8192):
        for steps in (1, 4, 28, 50, 250):
            assert empirical_shift(tokens, steps) == pytest.approx(compute_empirical_mu(tokens, steps), abs=1e-12)


def test_a_folder_without_a_part_is_one_line_naming_it_and_a_distilled_klein_samples_without_cfg(tmp_path, bases):
    import json
    import shutil

    for name in ("flux2", "flux2-klein"):
        folder = tmp_path / name
        folder.mkdir()
        shutil.copy(bases[name] / "model_index.json", folder)
        with pytest.raises(ValueError, match="text_encoder/") as info:
            FAMILY[name]().load_prompt_encoder(folder)
        assert "\n" not in str(info.value) and str(folder) in str(info.value)
        shutil.copytree(bases[name] / "text_encoder", folder / "text_encoder")
        with pytest.raises(ValueError, match="tokenizer/") as info:
            FAMILY[name]().load_prompt_encoder(folder)
        assert "\n" not in str(info.value)
    index = json.loads((tmp_path / "flux2-klein" / "model_index.json").read_text())
    (tmp_path / "flux2-klein" / "model_index.json").write_text(json.dumps(index | {"is_distilled": True}))
    assert Flux2KleinFamily().guidance_defaults(tmp_path / "flux2-klein") == {"validation.guidance_scale": 1.0}
