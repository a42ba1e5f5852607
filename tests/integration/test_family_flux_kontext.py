"""FLUX.1 Kontext as a difftrain family, on the tiny offline base of tests/family_bases_flux_kontext.py: the
denoiser with a reference equals FluxKontextPipeline's transformer call (reference tokens appended, ids
marked, output cut to the target's tokens), detection, export and LoRA files loading in the pipeline."""

from __future__ import annotations

import pytest
import torch

from tests.family_bases import T5_LENGTH, with_run_conditions
from tests.family_bases_flux_kontext import write_tiny_flux_kontext_folder

diffusers = pytest.importorskip("diffusers")

from difftrain.families import detect, family_named, family_of_record  # noqa: E402
from difftrain.families.flux import image_ids, pack, unpack  # noqa: E402
from difftrain.families.flux_kontext import FluxKontextFamily  # noqa: E402

CAPTIONS = ["make the circle red", "turn the square blue"]


def close(a, b):
    """Equal up to float32 rounding."""
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_flux_kontext_folder(tmp_path_factory.mktemp("kontext") / "base")


def _pipe(folder):
    pipe = diffusers.FluxKontextPipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_denoiser_with_a_reference_equals_the_pipelines_transformer_call(folder):
    family, pipe = FluxKontextFamily(), _pipe(folder)
    assert isinstance(detect(folder), FluxKontextFamily) and family_named("flux-kontext").references == 1
    enc = family.load_prompt_encoder(folder)
    embeds, pooled, text_ids = pipe.encode_prompt(CAPTIONS, None, max_sequence_length=T5_LENGTH)
    cond = with_run_conditions(family, enc.encode(CAPTIONS))
    close(cond["prompt_embeds"], embeds)
    g = torch.Generator().manual_seed(0)
    x, ref = torch.randn(2, 16, 8, 6, generator=g), torch.randn(2, 16, 4, 10, generator=g)
    t = torch.tensor([900.0, 25.0])
    # the pipeline's own pieces: prepare_latents packs the image latents and marks their ids' first axis 1
    _, ref_packed, latent_ids, ref_ids = pipe.prepare_latents(ref, 2, 16, 8 * 4, 6 * 4, torch.float32, "cpu", None,
                                                              latents=pack(x))
    ids = torch.cat([latent_ids, ref_ids], dim=0)
    assert torch.equal(ref_ids[:, 0], torch.ones(len(ref_ids))) and torch.equal(latent_ids, image_ids(8, 6))
    want = pipe.transformer(hidden_states=torch.cat([pack(x), ref_packed], dim=1), timestep=t / 1000,
                            guidance=torch.full((2,), 3.5), pooled_projections=pooled, encoder_hidden_states=embeds,
                            txt_ids=text_ids, img_ids=ids, return_dict=False)[0][:, : pack(x).shape[1]]
    net = family.load_denoiser(folder)
    got = net(x, t, cond | family.reference_condition([ref]))
    close(got, unpack(want, 8, 6))
    # the reference changes the output: it is seen, not ignored
    assert (got - net(x, t, cond)).abs().max() > 1e-4
    assert family_of_record(net.record()).name == "flux-kontext"
    assert "proj_mlp" in family.lora_targets  # the Kontext script's default targets add it
    assert len(family.fsdp_units(net)) == 2


def test_a_family_without_references_refuses_them_in_one_line():
    with pytest.raises(ValueError, match="takes no reference images") as info:
        family_named("flux").reference_condition([torch.zeros(1, 16, 2, 2)])
    assert "\n" not in str(info.value)


def _difftrain_sample(family, folder, x_T, ref, steps):
    """x_0 latents as difftrain samples them with a reference: the flow objective on the family's defaults,
    Euler, the denoiser with the prompt's condition and the reference's (distilled guidance, no CFG)."""
    from difftrain.diffusion.flow import FlowObjective

    d = family.training_defaults(folder)
    obj = FlowObjective(shift=d["diffusion.flow_shift"], grid_end=d["diffusion.flow_grid_end"],
                        dynamic_shift=d["diffusion.flow_dynamic_shift"])
    enc, net = family.load_prompt_encoder(folder), family.load_denoiser(folder)
    cond = with_run_conditions(family, enc.encode(["make the circle red"])) | family.reference_condition([ref])
    with torch.no_grad():
        return obj.sample(lambda x, t: net(x, t, cond), x_T, "euler", steps, None, clip=False)


def test_exported_pipeline_samples_what_difftrain_samples_with_a_reference(tmp_path, folder):
    family = FluxKontextFamily()
    out = family.export_pipeline(family.load_denoiser(folder), folder, tmp_path / "export")
    x_T = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(3))
    ref = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(4))
    ours = _difftrain_sample(family, folder, x_T, ref, 4)
    # image given as latents (16 channels): the pipeline takes them as they are, packed after the target's
    theirs = _pipe(out)(image=ref, prompt="make the circle red", height=32, width=32, max_area=32 * 32,
                        num_inference_steps=4, guidance_scale=3.5, max_sequence_length=T5_LENGTH, latents=pack(x_T),
                        output_type="latent").images
    assert (ours - unpack(theirs, 8, 8)).abs().max() < 1e-4


def test_lora_file_loads_in_the_pipeline_equal_to_the_merged_export(tmp_path, folder):
    from tests.integration.test_family_mmdit import _lora, _merged

    family = FluxKontextFamily()
    net = family.load_denoiser(folder)
    state = _lora(net, family.lora_targets)
    assert any("proj_mlp" in k for k in state)
    path = family.save_lora(state, {"r": 2, "lora_alpha": 2, "target_modules": list(family.lora_targets)},
                            tmp_path / "lora", {"difftrain": "test"})
    back = family.read_lora(path, denoiser=family.load_denoiser(folder))
    assert set(back) == set(state)
    merged = family.load_denoiser(folder)
    merged.load_state_dict(_merged(net))
    out = family.export_pipeline(merged, folder, tmp_path / "export")
    ref = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(4))
    prompt = dict(image=ref, prompt="make the circle red", height=32, width=32, max_area=32 * 32, num_inference_steps=2,
                  max_sequence_length=T5_LENGTH, output_type="latent")
    with_lora = _pipe(folder)
    with_lora.load_lora_weights(str(path))
    a = with_lora(**prompt, generator=torch.Generator().manual_seed(1)).images
    b = _pipe(out)(**prompt, generator=torch.Generator().manual_seed(1)).images
    assert (a - b).abs().max() < 1e-4
    plain = _pipe(folder)(**prompt, generator=torch.Generator().manual_seed(1)).images
    assert (a - plain).abs().max() > 1e-3


def test_estimate_counts_the_reference_tokens():
    """``difftrain estimate --base flux-kontext-dev``: the known base (FLUX.1-dev's configs as a Kontext folder)
    is detected as this family and its activations count the reference's tokens beside the target's (more than
    the same setting on flux-dev, whose transformer is the same)."""
    from pathlib import Path

    from difftrain.config import load_config
    from difftrain.tools.base_memory import _config_setting, base_folder, count_settings, read_base

    preset = Path(__file__).resolve().parents[2] / "configs" / "flux-kontext-lora.toml"
    rows = {}
    for base in ("flux-dev", "flux-kontext-dev"):
        cfg = load_config(preset, [f"model.init_from={base_folder(base)}", "data.resolution=512"])
        b = read_base(cfg, base)
        own = _config_setting(cfg, 1, None)
        rows[base] = count_settings(cfg, b, [own])[0][own]
    assert detect(base_folder("flux-kontext-dev")).name == "flux-kontext"
    assert rows["flux-kontext-dev"]["activations"] > 1.5 * rows["flux-dev"]["activations"]
