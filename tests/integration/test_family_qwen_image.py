"""Qwen-Image as a difftrain family, on the tiny offline base of tests/family_bases_qwen_image.py: the
prompt encoder, the VAE and the denoiser equal QwenImagePipeline's own encode_prompt, VAE and transformer
calls; detection; bad input one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.family_bases_qwen_image import QWEN_LENGTH, QWEN_WIDTH, write_tiny_qwen_image_folder

diffusers = pytest.importorskip("diffusers")

from difftrain.families.flux import pack  # noqa: E402
from difftrain.families.qwen_image import DROP, QwenImageCodec, QwenImageFamily  # noqa: E402

CAPTIONS = ["a red circle", "a blue square on a dark background with a small green triangle"]


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    return write_tiny_qwen_image_folder(tmp_path_factory.mktemp("qwen") / "base")


@pytest.fixture(scope="module")
def pipe(qwen_folder):
    pipe = diffusers.QwenImagePipeline.from_pretrained(str(qwen_folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_the_tiny_tokenizer_drops_the_template_as_the_real_one(pipe):
    """The pipeline drops 34 template tokens; the tiny tokenizer makes the system part 34 tokens, as Qwen2's."""
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert pipe.prompt_template_encode_start_idx == DROP == len(pipe.tokenizer(prefix).input_ids)


def test_prompt_encoder_and_denoiser_equal_the_pipelines(qwen_folder, pipe):
    family = QwenImageFamily()
    enc = family.load_prompt_encoder(qwen_folder, max_sequence_length=QWEN_LENGTH)
    assert enc.dim == QWEN_WIDTH and enc.parts == ("qwen",)
    cond = enc.encode(CAPTIONS)
    embeds, mask = pipe.encode_prompt(CAPTIONS, device="cpu", max_sequence_length=QWEN_LENGTH)
    assert cond["prompt_embeds"].shape == (2, QWEN_LENGTH, QWEN_WIDTH) and cond["prompt_mask"].shape == (2, QWEN_LENGTH)
    n = embeds.shape[1]  # the pipeline's: the longer prompt's length (cut to QWEN_LENGTH)
    assert mask is not None and 0 < int(mask[0].sum()) < n  # variable lengths: the short prompt padded
    close(cond["prompt_embeds"][:, :n], embeds)
    assert torch.equal(cond["prompt_mask"][:, :n], mask.float())
    assert not cond["prompt_mask"][:, n:].any() and not cond["prompt_embeds"][:, n:].any()
    # the longer prompt runs past QWEN_LENGTH: cut as the pipeline cuts it
    assert int(cond["prompt_mask"][1].sum()) == n == QWEN_LENGTH
    # each prompt alone: the same states (padding masked), and the null prompt = the pipeline's empty prompt
    close(enc.encode(CAPTIONS[:1])["prompt_embeds"], cond["prompt_embeds"][:1])
    empty, empty_mask = pipe.encode_prompt([""], device="cpu", max_sequence_length=QWEN_LENGTH)
    null = enc.null(1, "cpu")
    close(null["prompt_embeds"][:, :empty.shape[1]], empty)
    assert empty_mask is None and int(null["prompt_mask"].sum()) == empty.shape[1] == 5  # the closing template

    net = family.load_denoiser(qwen_folder)
    x = torch.randn(2, 16, 8, 6, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([900.0, 25.0])
    packed = diffusers.QwenImagePipeline._pack_latents(x, 2, 16, 8, 6)
    assert torch.equal(pack(x), packed)
    want = pipe.transformer(hidden_states=packed, timestep=t / 1000, encoder_hidden_states=embeds,
                            encoder_hidden_states_mask=mask, img_shapes=[[(1, 4, 3)]] * 2, return_dict=False)[0]
    want = diffusers.QwenImagePipeline._unpack_latents(want, 8 * 4, 6 * 4, 4)[:, :, 0]
    close(net(x, t, cond), want)
    assert set(net.state_dict()) == set(pipe.transformer.state_dict())  # diffusers names, no prefix
    rebuilt = family.denoiser_from_record(net.record())
    rebuilt.load_state_dict(net.state_dict())
    close(rebuilt(x, t, cond), want)
    assert len(family.fsdp_units(net)) == len(pipe.transformer.transformer_blocks)


def test_codec_equals_the_pipelines_vae(qwen_folder, pipe):
    """Latents (z - latents_mean) / latents_std of the VAE's one frame, decoded as the pipeline decodes."""
    codec = QwenImageFamily().load_codec(qwen_folder)
    assert isinstance(codec, QwenImageCodec) and codec.factor == 4 and codec.latent_channels == 16
    images = torch.rand(1, 3, 32, 24, generator=torch.Generator().manual_seed(1)) * 2 - 1
    mean, _ = codec.encode_moments(images)
    want = pipe.vae.encode(images[:, :, None]).latent_dist.mean
    close(mean, want[:, :, 0])
    latents = codec.to_model(mean)
    stats = torch.tensor(pipe.vae.config.latents_mean).view(1, 16, 1, 1, 1), torch.tensor(pipe.vae.config.latents_std)
    close(latents[:, :, None], (want - stats[0]) * (1.0 / stats[1].view(1, 16, 1, 1, 1)))
    z = latents[:, :, None] / (1.0 / stats[1].view(1, 16, 1, 1, 1)) + stats[0]  # the pipeline's decode
    close(codec.decode(latents), pipe.vae.decode(z).sample[:, :, 0].clamp(-1, 1))


def test_detected_defaults_and_bad_input(qwen_folder, tmp_path):
    from difftrain.families import detect, family_named
    from difftrain.models.vae import vae_factor

    family = detect(qwen_folder)
    assert family is family_named("qwen-image") and family.name == "qwen-image"
    defaults = family.training_defaults(qwen_folder)
    assert defaults["diffusion.objective"] == "flow" and defaults["diffusion.flow_t_sampling"] == "uniform"
    assert defaults["diffusion.flow_dynamic_shift"] is True and defaults["diffusion.flow_max_shift"] == 0.9
    assert defaults["validation.guidance_scale"] == 4.0
    assert family.native_resolution(qwen_folder) == 128 * 4  # the pipeline's default_sample_size x factor
    assert vae_factor(str(qwen_folder)) == 4
    assert family.condition_shapes({"joint_attention_dim": 3584}) == {"prompt_embeds": (512, 3584),
                                                                      "prompt_mask": (512,)}
    for bad in (0.5, 1025):
        with pytest.raises(ValueError, match="model.max_sequence_length") as info:
            family.load_prompt_encoder(qwen_folder, max_sequence_length=bad)
        assert "\n" not in str(info.value)
    broken = tmp_path / "broken"
    shutil.copytree(qwen_folder, broken, ignore=shutil.ignore_patterns("text_encoder"))
    with pytest.raises(ValueError, match="text_encoder/") as info:
        family.load_prompt_encoder(broken)
    assert "\n" not in str(info.value)
    (broken / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    with pytest.raises(ValueError, match="not the AutoencoderKLQwenImage") as info:
        family.load_codec(broken)
    assert "\n" not in str(info.value)


def test_the_known_base_is_the_public_architecture():
    """tools/bases/qwen-image builds Qwen-Image's 20B transformer (20,430,401,088 parameters, QwenImageTransformer2DModel's
    defaults, the published "20B MMDiT") and Qwen2.5-VL-7B (8,292,166,656: its 7.6B language model and 0.67B vision
    tower) on the meta device; its VAE's factor is 8 (three levels, two temporal downsamplings)."""
    from difftrain.families import detect
    from difftrain.tools.base_memory import base_folder, denoiser_config, text_encoder_params, vae_factor

    folder = base_folder("qwen-image")
    assert detect(folder).name == "qwen-image"
    with torch.device("meta"):
        net = detect(folder).denoiser_from_record({"config": denoiser_config(folder)})
    assert sum(p.numel() for p in net.parameters()) == 20_430_401_088
    assert text_encoder_params(folder) == 8_292_166_656
    assert vae_factor(folder) == 8


def test_estimate_counts_the_masked_attention(qwen_folder):
    """The transformer attends with the prompt's mask: `estimate --base` counts its activations on the meta device
    (the mask kept as the memory-efficient kernel keeps it), where it said "not counted" before."""
    from difftrain.config import load_config
    from difftrain.tools.base_memory import _config_setting, count_settings, read_base

    cfg = load_config(None, [f"model.init_from={qwen_folder}", "data.resolution=32", "data.path=/nonexistent",
                             f"model.max_sequence_length={QWEN_LENGTH}", "train.precision=bf16", "lora.rank=4",
                             "validation.every_steps=0", "train.progress_bar=false"])
    own = _config_setting(cfg, 1, None)
    rows, info = count_settings(cfg, read_base(cfg, str(qwen_folder)), [own])
    assert "not counted" not in info["activations_note"], info["activations_note"]
    assert rows[own]["activations"] > 0


def test_a_lora_file_of_another_family_is_one_line(tmp_path):
    """A Flux LoRA file (its single-stream blocks) given to a Qwen-Image base: refused naming the file."""
    from difftrain.families import family_named

    adapter = {"single_transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 8),
               "single_transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(8, 2)}
    path = family_named("flux").save_lora(adapter, {}, tmp_path / "flux-lora")
    with pytest.raises(ValueError, match="not a qwen-image LoRA file: it names single_transformer_blocks") as info:
        family_named("qwen-image").read_lora(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)
