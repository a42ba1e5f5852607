"""The SDXL family (families/sdxl.py) on a tiny random base: detection, the prompt encoder against
StableDiffusionXLPipeline.encode_prompt, the denoiser against the UNet's own call with added_cond_kwargs,
time_ids from each sample's original size and crop, and a LoRA file through the pipeline's own
save_lora_weights / lora_state_dict / load_lora_weights."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from difftrain.families import detect  # noqa: E402
from tests.family_bases import write_tiny_sdxl_folder  # noqa: E402

CAPTIONS = ["a red square on a dark background", "a blue disc"]


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    return write_tiny_sdxl_folder(tmp_path_factory.mktemp("sdxl") / "base")


@pytest.fixture(scope="module")
def pipe(sdxl):
    from diffusers import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline.from_pretrained(str(sdxl), torch_dtype=torch.float32)


def test_detect_and_defaults(sdxl):
    family = detect(sdxl)
    assert family.name == "sdxl"
    d = family.training_defaults(sdxl)
    assert d["model.text_encoder"] == str(sdxl) and d["data.captions"] is True
    assert (d["diffusion.schedule"], d["diffusion.prediction"]) == ("scaled_linear", "epsilon")


def test_prompt_encoder_is_the_pipelines_encode_prompt(sdxl, pipe):
    text = detect(sdxl).load_prompt_encoder(sdxl)
    cond = text.encode(CAPTIONS, "cpu")
    embeds, neg, pooled, neg_pooled = pipe.encode_prompt(CAPTIONS, device="cpu", do_classifier_free_guidance=True)
    assert torch.allclose(cond["prompt_embeds"], embeds, atol=1e-6) and torch.allclose(cond["pooled"], pooled, atol=1e-6)
    null = text.null(2, "cpu")  # force_zeros_for_empty_prompt: the pipeline's negative prompt is zeros
    assert torch.equal(null["prompt_embeds"], neg) and torch.equal(null["pooled"], neg_pooled)
    assert len(text.digest) == 64


def test_denoiser_is_the_unet_with_its_added_conditions(sdxl, pipe):
    family = detect(sdxl)
    net = family.load_denoiser(sdxl).eval()
    text = family.load_prompt_encoder(sdxl)
    geometry = torch.tensor([[40, 32, 4, 0], [16, 16, 0, 0]])  # original (h, w), crop (top, left)
    cond = text.encode(CAPTIONS, "cpu") | family.image_conditions(geometry, (16, 16), "cpu")
    assert cond["time_ids"].tolist() == [[40, 32, 4, 0, 16, 16], [16, 16, 0, 0, 16, 16]]
    x, t = torch.randn(2, 4, 8, 8), torch.tensor([10, 500])
    with torch.no_grad():
        ours = net(x, t, cond)
        theirs = pipe.unet(x, t, encoder_hidden_states=cond["prompt_embeds"],
                           added_cond_kwargs={"text_embeds": cond["pooled"], "time_ids": cond["time_ids"]}).sample
    assert torch.equal(ours, theirs)
    rebuilt = family.denoiser_from_record(net.record())
    rebuilt.load_state_dict(net.state_dict())
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(x, t, cond), ours)
    assert net.record()["family"] == "sdxl" and family.fsdp_units(net)
    with pytest.raises(ValueError, match="lacks 'time_ids'"):
        net(x, t, {k: cond[k] for k in ("prompt_embeds", "pooled")})


def test_lora_file_round_trips_and_loads_in_the_pipeline(sdxl, pipe, tmp_path):
    from difftrain.families import FAMILIES

    peft = pytest.importorskip("peft")
    family = detect(sdxl)
    net = family.load_denoiser(sdxl)
    config = peft.LoraConfig(r=2, lora_alpha=2, target_modules=list(family.lora_targets), init_lora_weights="gaussian")
    peft.inject_adapter_in_model(config, net.model)
    adapter = {k.replace(".default", ""): v for k, v in peft.get_peft_model_state_dict(net.model).items()}
    file = family.save_lora(adapter, config.to_dict(), tmp_path / "lora", {"difftrain_adapter": "{}"})
    back = family.read_lora(file)
    assert set(back) == set(adapter) and all(torch.equal(back[k], adapter[k]) for k in adapter)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    assert any("lora" in n for n, _ in pipe.unet.named_parameters())
    pipe.unload_lora_weights()
    with pytest.raises(ValueError, match="another family"):  # an SD3 file's tensors live under transformer.
        from safetensors.torch import save_file

        save_file({"transformer.a.lora_A.weight": torch.zeros(2, 2)}, str(tmp_path / "other.safetensors"))
        FAMILIES["sdxl"].read_lora(tmp_path / "other.safetensors")
    assert FAMILIES["sdxl"] is family


def test_a_missing_part_is_one_line_naming_the_folder_and_the_part(sdxl, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(sdxl, broken)
    shutil.rmtree(broken / "tokenizer_2")
    with pytest.raises(ValueError) as info:
        detect(broken).load_prompt_encoder(broken)
    message = str(info.value)
    assert "\n" not in message and str(broken) in message and "tokenizer_2/" in message
    shutil.rmtree(broken / "text_encoder")
    with pytest.raises(ValueError, match=r"no text_encoder/ \(the first text encoder"):
        detect(broken).load_prompt_encoder(broken)
