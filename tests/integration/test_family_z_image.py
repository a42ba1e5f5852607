"""Z-Image as a difftrain family, on the tiny offline base of tests/family_bases_z_image.py: the prompt
encoder and denoiser equal ZImagePipeline's own encode_prompt and transformer call; the exported folder
samples what difftrain samples; the LoRA file loads with load_lora_weights equal to the merged export;
bad inputs get one line."""

from __future__ import annotations

import json

import pytest
import torch

from tests.family_bases_z_image import QWEN_LENGTH, write_tiny_z_image_folder

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from difftrain.families.z_image import ZImageFamily, caption_list  # noqa: E402
from tests.integration.test_family_mmdit import _lora, _merged  # noqa: E402

CAPTIONS = ["a red circle", "a blue square on a dark background"]


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_z_image_folder(tmp_path_factory.mktemp("z_image") / "base")


def _pipe(folder):
    pipe = diffusers.ZImagePipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(transformer, x, t, embeds):
    """ZImagePipeline's transformer call and its negation of the output, on (B, 16, h, w) latents at 1000 t."""
    out = transformer(list(x.unsqueeze(2).unbind(0)), (1000 - t) / 1000, embeds, return_dict=False)[0]
    return -torch.stack(out).squeeze(2)


def test_prompt_encoder_and_denoiser_equal_the_pipelines(folder):
    family, pipe = ZImageFamily(), _pipe(folder)
    enc = family.load_prompt_encoder(folder)
    assert enc.length == QWEN_LENGTH and enc.dim == pipe.text_encoder.config.hidden_size  # min(512, the tokenizer's)
    cond = enc.encode(CAPTIONS)
    assert set(cond) == {"prompt_embeds", "prompt_mask"} and cond["prompt_embeds"].shape == (2, QWEN_LENGTH, enc.dim)
    embeds, negative = pipe.encode_prompt(list(CAPTIONS), max_sequence_length=QWEN_LENGTH)
    ours = caption_list(cond["prompt_embeds"], cond["prompt_mask"])
    assert [e.shape[0] for e in ours] == [e.shape[0] for e in embeds] and embeds[0].shape[0] != embeds[1].shape[0]
    for a, b in zip(ours, embeds, strict=True):
        close(a, b)
    calls = []  # the states are taken from the layer by a hook: not every layer's kept (output_hidden_states)
    enc.qwen.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs), with_kwargs=True)
    torch.testing.assert_close(enc.encode(CAPTIONS), cond, rtol=0, atol=0)
    assert len(calls) == 1 and not calls[0].get("output_hidden_states")
    null = enc.null(2, "cpu")  # the pipeline's negative prompt ""
    for a, b in zip(caption_list(null["prompt_embeds"], null["prompt_mask"]), negative, strict=True):
        close(a, b)
    net = family.load_denoiser(folder)
    x, t = torch.randn(2, 16, 8, 6, generator=torch.Generator().manual_seed(0)), torch.tensor([900.0, 25.0])
    want = _call(pipe.transformer, x, t, embeds)
    close(net(x, t, cond), want)
    assert set(net.state_dict()) == set(pipe.transformer.state_dict())  # diffusers names, no prefix
    rebuilt = family.denoiser_from_record(net.record())
    rebuilt.load_state_dict(net.state_dict())
    close(rebuilt(x, t, cond), want)
    # every block, in forward order: the refiners then the main layers
    units, model = family.fsdp_units(net), net.model
    assert units == [*model.noise_refiner, *model.context_refiner, *model.layers] and len(units) == 4


def test_caption_states_are_slices_of_the_padded_states_not_a_mask_per_caption():
    """The denoiser's list of caption states (the pipeline's) is taken from the text cache's padded states per step:
    each caption's tokens are one run of its row (right or left padding, or none), so each entry is a view of the
    states, the mask read on the host once, not a boolean index per caption (aten::nonzero: a host sync on CUDA,
    and a copy); a mask that is not one run per row is still indexed by it."""
    embeds = torch.randn(4, 6, 3)
    rows = [[1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]]  # right, left, none, empty
    mask = torch.tensor(rows, dtype=torch.float32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        states = caption_list(embeds, mask)
    assert not [e for e in prof.key_averages() if e.key == "aten::nonzero"]
    for state, row, keep in zip(states, embeds, mask.bool(), strict=True):
        assert torch.equal(state, row[keep])
        assert state.numel() == 0 or state.untyped_storage().data_ptr() == embeds.untyped_storage().data_ptr()
    holes = torch.tensor([[1, 0, 1, 0, 0, 0]] * 4, dtype=torch.float32)  # not one run: indexed by the mask
    for state, row in zip(caption_list(embeds, holes), embeds, strict=True):
        assert torch.equal(state, row[holes[0].bool()])


def test_family_is_registered_and_detected(folder):
    from difftrain.families import detect, family_named, family_of_record

    assert isinstance(detect(folder), ZImageFamily) and family_named("z-image").name == "z-image"
    record = ZImageFamily().load_denoiser(folder).record()
    assert record["kind"] == "family" and family_of_record(record).name == "z-image"
    assert ZImageFamily().native_resolution(folder) == 128 * 4  # ZImagePipeline's 1024 px default, factor 4 here


def test_training_defaults_follow_the_scheduler(folder, tmp_path):
    import shutil

    from difftrain.config import load_config

    family = ZImageFamily()
    d = family.training_defaults(folder)
    assert d["diffusion.flow_t_sampling"] == "uniform" and d["diffusion.flow_grid_end"] is None
    assert d["diffusion.flow_train_shift"] == d["diffusion.flow_shift"] == 3.0 and not d["diffusion.flow_dynamic_shift"]
    cfg = load_config(overrides=[f"{k}={'none' if v is None else v}" for k, v in d.items() if k.startswith("diffusion.")])
    ours = family.flow_scheduler(cfg.diffusion)
    base = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    assert {k: base[k] for k in ours} == ours
    dynamic = tmp_path / "dynamic"  # a scheduler with dynamic shifting: the script's sigmas are unshifted
    shutil.copytree(folder / "scheduler", dynamic / "scheduler")
    (dynamic / "scheduler" / "scheduler_config.json").write_text(json.dumps({**base, "use_dynamic_shifting": True}))
    d = family.training_defaults(dynamic)
    assert d["diffusion.flow_train_shift"] == 1.0 and d["diffusion.flow_dynamic_shift"]


def _difftrain_sample(family, folder, x_T, steps, guidance_scale):
    """x_0 latents as difftrain samples them: the flow objective with the family's defaults, Euler, CFG
    ``uncond + w (cond - uncond)`` on the null condition encode([""]) when w > 1."""
    from difftrain.diffusion.flow import FlowObjective

    d = family.training_defaults(folder)
    obj = FlowObjective(shift=d["diffusion.flow_shift"], grid_end=d["diffusion.flow_grid_end"],
                        dynamic_shift=d["diffusion.flow_dynamic_shift"])
    enc, net = family.load_prompt_encoder(folder), family.load_denoiser(folder)
    cond, null = enc.encode(["a red circle"]), enc.encode([""])

    def network(x, t):
        if guidance_scale <= 1:
            return net(x, t, cond)
        both = {k: torch.cat([null[k], cond[k]]) for k in cond}
        uncond, text = net(torch.cat([x, x]), torch.cat([t, t]), both).chunk(2)
        return uncond + guidance_scale * (text - uncond)

    with torch.no_grad():
        return obj.sample(network, x_T, "euler", steps, None, clip=False)


@pytest.mark.parametrize("pipeline_guidance", [0.0, 4.0], ids=["turbo", "cfg"])
def test_exported_pipeline_samples_what_difftrain_samples(tmp_path, folder, pipeline_guidance):
    """The pipeline's guidance_scale g is difftrain's w = g + 1 (ZImagePipeline: pos + g (pos - neg))."""
    family = ZImageFamily()
    out = family.export_pipeline(family.load_denoiser(folder), folder, tmp_path / "export")
    pipe = _pipe(out)
    x_T = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(3))
    ours = _difftrain_sample(family, folder, x_T, 4, pipeline_guidance + 1)
    theirs = pipe("a red circle", height=32, width=32, num_inference_steps=4, guidance_scale=pipeline_guidance,
                  max_sequence_length=QWEN_LENGTH, latents=x_T.clone(), output_type="latent").images
    assert (ours - theirs).abs().max() < 1e-4, (ours - theirs).abs().max()


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_lora_file_loads_in_the_pipeline_equal_to_the_merged_export(tmp_path, folder, dora):
    """save_lora -> ZImagePipeline.load_lora_weights samples what the merged export samples (1e-4); read_lora
    gives the adapter back; a Flux file is refused in one line."""
    family = ZImageFamily()
    net = family.load_denoiser(folder)
    state = _lora(net, family.lora_targets, dora=dora)
    assert any(k.startswith("layers.") for k in state) and any(k.startswith("noise_refiner.") for k in state)
    path = family.save_lora(state, {"r": 2, "lora_alpha": 2, "target_modules": list(family.lora_targets),
                                    "use_dora": dora}, tmp_path / "lora", {"difftrain": "test"})
    back = family.read_lora(path, denoiser=family.load_denoiser(folder))
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    merged = family.load_denoiser(folder)
    merged.load_state_dict(_merged(net))
    out = family.export_pipeline(merged, folder, tmp_path / "export")
    prompt = dict(prompt="a red circle", height=32, width=32, num_inference_steps=2, guidance_scale=0.0,
                  max_sequence_length=QWEN_LENGTH, output_type="latent")
    with_lora = _pipe(folder)
    with_lora.load_lora_weights(str(path))
    a = with_lora(**prompt, generator=torch.Generator().manual_seed(1)).images
    b = _pipe(out)(**prompt, generator=torch.Generator().manual_seed(1)).images
    assert (a - b).abs().max() < 1e-4
    plain = _pipe(folder)(**prompt, generator=torch.Generator().manual_seed(1)).images
    assert (a - plain).abs().max() > 1e-3  # the LoRA changes the output
    from safetensors.torch import save_file

    flux = tmp_path / "flux_lora.safetensors"  # Flux's names (its attention is "attn", blocks "transformer_blocks")
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 32),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(32, 2)}, str(flux))
    with pytest.raises(ValueError, match="not a z-image LoRA file") as info:
        family.read_lora(flux, denoiser=family.load_denoiser(folder))
    assert "\n" not in str(info.value) and str(flux) in str(info.value)


def test_bad_input_gets_one_line(tmp_path, folder):
    import shutil

    family = ZImageFamily()
    with pytest.raises(ValueError, match="max_sequence_length=600") as info:
        family.load_prompt_encoder(folder, max_sequence_length=600)
    assert "\n" not in str(info.value) and str(folder) in str(info.value)
    net = family.load_denoiser(folder)
    cond = family.load_prompt_encoder(folder).encode(["a"])
    with pytest.raises(ValueError, match="patches") as info:
        net(torch.zeros(1, 16, 7, 8), torch.tensor([500.0]), cond)
    with pytest.raises(ValueError, match="prompt_mask") as info:
        net(torch.zeros(1, 16, 8, 8), torch.tensor([500.0]), {"prompt_embeds": cond["prompt_embeds"]})
    assert "\n" not in str(info.value)
    codec = family.load_codec(folder)
    assert codec.latent_channels == 16 and codec.shift_factor != 0 and family.image_side_multiple(codec) == 8
    other = tmp_path / "t5"  # a text encoder class difftrain does not run for Z-Image
    shutil.copytree(folder, other)
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "text_encoder": ["transformers", "T5EncoderModel"]}))
    with pytest.raises(ValueError, match="T5EncoderModel") as info:
        family.load_prompt_encoder(other)
    assert "\n" not in str(info.value) and str(other) in str(info.value)
    shutil.rmtree(other / "text_encoder")
    (other / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="text_encoder/") as info:
        family.load_prompt_encoder(other)
    assert "\n" not in str(info.value)


def test_the_known_base_has_z_image_turbos_sizes_and_its_text_cache_fill_counts_the_prompt_length():
    """tools/bases/z-image: the 6.15B transformer and Qwen3-4B, counted on the meta device; the text cache's fill
    counts the Qwen3 model on 512-token prompts (max_sequence_length), not on its 40,960-token context."""
    import transformers

    from difftrain.config import load_config
    from difftrain.tools.base_memory import GiB, base_folder, text_cache_fill_bytes

    folder = base_folder("z-image")
    assert ZImageFamily().native_resolution(folder) == 1024  # ZImagePipeline's default height and width
    with torch.device("meta"):
        transformer = diffusers.ZImageTransformer2DModel.from_config(
            diffusers.ZImageTransformer2DModel.load_config(str(folder / "transformer")))
        raw = {k: v for k, v in json.loads((folder / "text_encoder" / "config.json").read_text()).items()
               if not k.startswith("_")}
        qwen = transformers.Qwen3Model(transformers.Qwen3Config.from_dict(raw))
    assert 6.1e9 < sum(p.numel() for p in transformer.parameters()) < 6.2e9
    params = sum(p.numel() for p in qwen.parameters())
    assert 3.9e9 < params < 4.1e9  # Qwen3-4B without its (tied) head
    fill, name = text_cache_fill_bytes(folder, load_config(None, ["train.precision=bf16"]))
    batch = 100 * max(2 * 512 * raw["intermediate_size"], raw["num_attention_heads"] * 512**2)
    assert "Qwen3Model" in name and fill == 2 * (params + batch) and fill < 12 * GiB
