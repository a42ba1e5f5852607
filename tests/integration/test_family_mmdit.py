"""SD3 and Flux as difftrain families, on the tiny offline bases of tests/family_bases.py: the
prompt encoders and denoisers equal diffusers' pipelines' own encode_prompt and transformer
calls; export and LoRA files load in the pipelines; bad inputs get one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.family_bases import T5_LENGTH, write_tiny_flux_folder, write_tiny_sd3_folder

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


def test_training_defaults_follow_the_schedulers(sd3_folder, flux_folder):
    sd3 = SD3Family().training_defaults(sd3_folder)
    assert sd3["diffusion.flow_train_shift"] == sd3["diffusion.flow_shift"] == 3.0
    assert sd3["diffusion.flow_grid_end"] == pytest.approx(diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0).sigma_min)
    flux = FluxFamily().training_defaults(flux_folder)
    assert flux["diffusion.flow_dynamic_shift"] and flux["diffusion.flow_t_sampling"] == "uniform"
    assert flux["diffusion.flow_train_shift"] == 1.0


@pytest.mark.parametrize("which", ["sd3", "flux"])
def test_bad_input_gets_one_line(tmp_path, sd3_folder, flux_folder, which):
    family, folder = (SD3Family(), sd3_folder) if which == "sd3" else (FluxFamily(), flux_folder)
    with pytest.raises(ValueError, match="T5 sequence length 600") as info:
        family.load_prompt_encoder(folder, t5_length=600)
    assert "\n" not in str(info.value) and str(folder) in str(info.value)
    net = family.load_denoiser(folder)
    cond = family.load_prompt_encoder(folder).encode(["a"])
    with pytest.raises(ValueError, match="patches") as info:
        net(torch.zeros(1, 16, 7, 8), torch.tensor([500.0]), cond)
    assert "\n" not in str(info.value)
