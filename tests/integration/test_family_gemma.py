"""Sana and Lumina 2 as difftrain families, on the tiny offline bases of tests/family_bases_gemma.py: the
Gemma prompt encoders and the denoisers equal the pipelines' own encode_prompt and transformer calls
(float32, 1e-5); detection; export and LoRA files load in the pipelines; bad inputs get one line."""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.family_bases_gemma import GEMMA_WIDTH, SANA_LATENTS, write_tiny_lumina2_folder, write_tiny_sana_folder

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from difftrain.families.lumina2 import SYSTEM_PROMPT, Lumina2Family  # noqa: E402
from difftrain.families.sana import SanaFamily, sana_instruction  # noqa: E402

LENGTH = 20  # model.max_sequence_length of these tests (the pipelines' 300 / 256)
CAPTIONS = ["a red circle", "", "A Blue square on a dark background"]
PIPELINES = {"sana": "SanaPipeline", "lumina2": "Lumina2Pipeline"}
CHANNELS = {"sana": SANA_LATENTS, "lumina2": 16}
LATENT = {"sana": 8, "lumina2": 4}  # 32 px images: the tiny VAEs' factors 4 and 8


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma")
    return {"sana": write_tiny_sana_folder(root / "sana"), "lumina2": write_tiny_lumina2_folder(root / "lumina2")}


def _family(name):
    return SanaFamily() if name == "sana" else Lumina2Family()


def _pipe(name, folder):
    pipe = getattr(diffusers, PIPELINES[name]).from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_condition(name, pipe, captions):
    """(embeds, mask) the pipeline makes: each caption as its prompt, "" as its negative prompt."""
    rows = []
    for caption in captions:
        if name == "sana":
            if caption:
                chi = inspect.signature(pipe.__call__).parameters["complex_human_instruction"].default
                e, m, _, _ = pipe.encode_prompt([caption], do_classifier_free_guidance=False, max_sequence_length=LENGTH,
                                                complex_human_instruction=chi)
            else:
                _, _, e, m = pipe.encode_prompt(["x"], do_classifier_free_guidance=True, negative_prompt="",
                                                max_sequence_length=LENGTH)
        else:
            e, m, ne, nm = pipe.encode_prompt([caption or "x"], do_classifier_free_guidance=True, negative_prompt="",
                                              max_sequence_length=LENGTH)
            e, m = (e, m) if caption else (ne, nm)
        rows.append((e, m))
    return torch.cat([e for e, _ in rows]), torch.cat([m for _, m in rows])


@pytest.mark.parametrize("name", ["sana", "lumina2"])
def test_prompt_encoder_and_denoiser_equal_the_pipelines(bases, name):
    """encode(captions) = the pipeline's encode_prompt (its template: Sana's complex human instruction, Lumina 2's
    system prompt; "" = its negative prompt, no template); net(x, t, cond) = its transformer as its __call__
    calls it (Sana: timestep t; Lumina 2: 1 - t / 1000, the output negated)."""
    family, folder = _family(name), bases[name]
    pipe = _pipe(name, folder)
    enc = family.load_prompt_encoder(folder, max_sequence_length=LENGTH)
    cond = enc.encode(CAPTIONS)
    embeds, mask = _pipeline_condition(name, pipe, CAPTIONS)
    assert cond["prompt_embeds"].shape == (3, LENGTH, GEMMA_WIDTH) and enc.dim == GEMMA_WIDTH
    close(cond["prompt_embeds"], embeds)
    assert torch.equal(cond["prompt_attention_mask"], mask.float())
    assert cond["prompt_attention_mask"][1].sum() == 1  # "": BOS alone, no template
    null = enc.null(2, "cpu")
    close(null["prompt_embeds"], embeds[1:2].expand(2, -1, -1))

    net = family.load_denoiser(folder)
    c, s = CHANNELS[name], LATENT[name]
    x, t = torch.randn(3, c, s, s, generator=torch.Generator().manual_seed(0)), torch.tensor([900.0, 25.0, 500.0])
    if name == "sana":
        want = pipe.transformer(x, encoder_hidden_states=embeds, encoder_attention_mask=mask, timestep=t,
                                return_dict=False)[0]
    else:
        want = -pipe.transformer(hidden_states=x, timestep=1 - t / 1000, encoder_hidden_states=embeds,
                                 encoder_attention_mask=mask, return_dict=False)[0]
    close(net(x, t, cond), want)
    assert set(net.state_dict()) == set(pipe.transformer.state_dict())  # diffusers names, no prefix
    rebuilt = family.denoiser_from_record(net.record())
    rebuilt.load_state_dict(net.state_dict())
    close(rebuilt(x, t, cond), want)
    blocks = (len(pipe.transformer.transformer_blocks) if name == "sana" else
              len(pipe.transformer.layers) + 2 * len(pipe.transformer.noise_refiner))
    assert len(family.fsdp_units(net)) == blocks


def test_the_templates_are_the_pipelines(bases):
    """Sana's instruction is SanaPipeline's __call__ default; Lumina 2's system prompt its self.system_prompt."""
    chi = inspect.signature(diffusers.SanaPipeline.__call__).parameters["complex_human_instruction"].default
    assert sana_instruction() == "\n".join(chi) and chi
    assert SYSTEM_PROMPT == _pipe("lumina2", bases["lumina2"]).system_prompt


def test_families_are_registered_and_detected(bases):
    from difftrain.families import detect, family_named, family_of_record

    assert isinstance(detect(bases["sana"]), SanaFamily) and isinstance(detect(bases["lumina2"]), Lumina2Family)
    assert family_named("sana").name == "sana" and family_named("lumina2").name == "lumina2"
    record = Lumina2Family().load_denoiser(bases["lumina2"]).record()
    assert record["kind"] == "family" and family_of_record(record).name == "lumina2"


def test_training_defaults_and_the_vaes(bases):
    """Sana: uniform t, the shift of the Euler scheduler the script builds from the DPM-Solver config (1), the
    sampling shift its flow_shift (3); Lumina 2: uniform t shifted by 1 / 3 (its reversed time), sampled with
    shift 3 on the scheduler's grid. The VAEs: the DC-AE's 32 channels (no shift), Flux's 16 (shifted)."""
    sana = SanaFamily().training_defaults(bases["sana"])
    assert sana["diffusion.flow_t_sampling"] == "uniform" and sana["diffusion.flow_train_shift"] == 1.0
    assert sana["diffusion.flow_shift"] == 3.0
    assert sana["diffusion.flow_grid_end"] == pytest.approx(diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0).sigma_min)
    lumina = Lumina2Family().training_defaults(bases["lumina2"])
    assert lumina["diffusion.flow_train_shift"] == pytest.approx(1 / 3) and lumina["diffusion.flow_shift"] == 3.0
    assert lumina["diffusion.flow_grid_end"] is None and not lumina["diffusion.flow_dynamic_shift"]
    codec = SanaFamily().load_codec(bases["sana"])
    assert (codec.latent_channels, codec.factor, codec.shift_factor) == (32, 4, 0.0)
    mean, std = codec.encode_moments(torch.zeros(1, 3, 32, 32))
    assert mean.shape == (1, 32, 8, 8) and not std.any()  # deterministic
    assert SanaFamily().image_side_multiple(codec) == 4
    assert SanaFamily().native_resolution(bases["sana"]) == 32
    codec = Lumina2Family().load_codec(bases["lumina2"])
    assert codec.factor == 8 and codec.shift_factor != 0 and Lumina2Family().image_side_multiple(codec) == 16
    pipe = _pipe("lumina2", bases["lumina2"])
    assert Lumina2Family().native_resolution(bases["lumina2"]) == pipe.default_sample_size * pipe.vae_scale_factor


@pytest.mark.parametrize("name", ["sana", "lumina2"])
def test_bad_input_gets_one_line(bases, name):
    family, folder = _family(name), bases[name]
    with pytest.raises(ValueError, match="max_sequence_length=5000") as info:
        family.load_prompt_encoder(folder, max_sequence_length=5000)
    assert "\n" not in str(info.value) and str(folder) in str(info.value)
    net = family.load_denoiser(folder)
    cond = family.load_prompt_encoder(folder, max_sequence_length=LENGTH).encode(["a"])
    with pytest.raises(ValueError, match="prompt_attention_mask") as info:
        net(torch.zeros(1, CHANNELS[name], 4, 4), torch.tensor([500.0]), {"prompt_embeds": cond["prompt_embeds"]})
    assert "\n" not in str(info.value)
    if name == "lumina2":
        with pytest.raises(ValueError, match="patches") as info:
            net(torch.zeros(1, 16, 3, 4), torch.tensor([500.0]), cond)
        assert "\n" not in str(info.value)


def _lora(net, targets, seed=0):
    """Random LoRA (rank 2, B non-zero) on the denoiser's transformer; its peft state dict."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=list(targets), init_lora_weights=False),
                            net.model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in net.model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return get_peft_model_state_dict(net.model)


def _merged(net):
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in net.model.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    return {k.replace(".base_layer", ""): v for k, v in net.state_dict().items() if "lora_" not in k}


def _call(name):
    """The pipeline's call of these tests: 32 px, 2 steps, latents; Sana without its resolution bins (they know
    the published sample sizes only), Lumina 2 with plain CFG."""
    common = dict(prompt="a red circle", height=32, width=32, num_inference_steps=2, max_sequence_length=LENGTH,
                  output_type="latent")
    return common | ({"use_resolution_binning": False} if name == "sana" else {"cfg_normalization": False})


@pytest.mark.parametrize("name", ["sana", "lumina2"])
def test_lora_file_loads_in_the_pipeline_equal_to_the_merged_export(tmp_path, bases, name):
    """save_lora -> the pipeline's load_lora_weights samples what the merged export samples (1e-4); the other
    family's file is refused in one line."""
    pytest.importorskip("peft")
    family, folder = _family(name), bases[name]
    net = family.load_denoiser(folder)
    state = _lora(net, family.lora_targets)
    path = family.save_lora(state, {"r": 2, "lora_alpha": 2, "target_modules": list(family.lora_targets)},
                            tmp_path / "lora", {"difftrain": "test"})
    back = family.read_lora(path, denoiser=family.load_denoiser(folder))
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    merged = family.load_denoiser(folder)
    merged.load_state_dict(_merged(net))
    out = family.export_pipeline(merged, folder, tmp_path / "export")
    with_lora = _pipe(name, folder)
    with_lora.load_lora_weights(str(path))
    a = with_lora(**_call(name), generator=torch.Generator().manual_seed(1)).images
    b = _pipe(name, out)(**_call(name), generator=torch.Generator().manual_seed(1)).images
    assert (a - b).abs().max() < 1e-4
    plain = _pipe(name, folder)(**_call(name), generator=torch.Generator().manual_seed(1)).images
    assert (a - plain).abs().max() > 1e-3  # the LoRA changes the output
    other_name = "lumina2" if name == "sana" else "sana"
    other_family = _family(other_name)
    other = other_family.load_denoiser(bases[other_name])
    other_path = other_family.save_lora(_lora(other, other_family.lora_targets), {}, tmp_path / "other")
    with pytest.raises(ValueError, match="not a") as info:
        family.read_lora(other_path, denoiser=family.load_denoiser(folder))
    assert "\n" not in str(info.value) and str(other_path) in str(info.value)


def test_the_known_bases_are_the_published_sizes():
    """tools/bases/sana, sana-4.8b and lumina2 build on meta at the published sizes: Sana 1600M's transformer
    (SanaTransformer2DModel's defaults, the 1600M 1024px config), SANA 1.5 4.8B (NVlabs' SanaMS_4800M_P1_D60:
    60 blocks of the same width, qk norm), Lumina-Image 2.0's 2.6B transformer, Gemma 2 2B (Gemma2Config's
    defaults: 2.6B); the AutoencoderDC's factor 32 and 32 channels."""
    from difftrain.families import detect
    from difftrain.tools.base_memory import base_folder, denoiser_config, text_encoder_params, vae_factor

    sizes = {"sana": 1_604_462_752, "sana-4.8b": 4_721_825_952, "lumina2": 2_609_769_152}
    for name, params in sizes.items():
        folder = base_folder(name)
        with torch.device("meta"):
            net = detect(folder).denoiser_from_record({"config": denoiser_config(folder)})
        assert sum(p.numel() for p in net.parameters()) == params, name
        assert text_encoder_params(folder) == 2_614_341_888
    assert vae_factor(base_folder("sana")) == 32 and vae_factor(base_folder("lumina2")) == 8


def test_estimate_counts_sanas_activations_and_gemmas_fill_at_the_prompts_tokens():
    """``estimate --base sana``: the masked cross-attention runs on meta through the fused stand-in (before, the
    forward stopped at it and no activation was counted), and the text cache's fill counts Gemma at the prompt's
    tokens (model.max_sequence_length or 512), not its 8192 positions (104.87 GiB before, for Gemma 2 2B)."""
    from pathlib import Path

    from difftrain.config import load_config
    from difftrain.tools.base_memory import GiB, base_folder, count_base, text_cache_fill_bytes

    preset = Path(__file__).resolve().parents[2] / "configs" / "sana-lora.toml"
    cfg = load_config(preset, [f"model.init_from={base_folder('sana')}"])
    counted = count_base(cfg, "sana", ranks=1)
    assert "not counted" not in counted["activations_note"], counted["activations_note"]
    assert counted["rows"][0]["activations"] > 0.1 * GiB
    fill, _ = text_cache_fill_bytes(base_folder("sana"), cfg)
    assert 2_614_341_888 * 2 < fill < 8 * GiB
