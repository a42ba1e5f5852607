"""Chroma and AuraFlow as difftrain families, on the tiny offline bases of tests/family_bases_chroma.py and
tests/family_bases_auraflow.py: the prompt encoders and denoisers equal the pipelines' own encode_prompt and
transformer calls (Chroma's kept padding token, AuraFlow's zeroed padding rows); export and LoRA files load in
the pipelines; bad inputs get one line."""

from __future__ import annotations

import pytest
import torch

from tests.family_bases import T5_LENGTH
from tests.family_bases_auraflow import write_tiny_auraflow_folder
from tests.family_bases_chroma import write_tiny_chroma_folder

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.families import detect, family_named, family_of_record  # noqa: E402
from difftrain.families.auraflow import AuraFlowFamily  # noqa: E402
from difftrain.families.chroma import ChromaFamily, chroma_text_mask  # noqa: E402
from tests.integration.test_family_mmdit import _difftrain_sample, _lora, _merged, _pipe, close  # noqa: E402

CAPTIONS = ["a red circle", "a blue square on a dark background"]
PIPELINES = {"chroma": "ChromaPipeline", "auraflow": "AuraFlowPipeline"}
CHANNELS = {"chroma": 16, "auraflow": 4}
GUIDANCE = {"chroma": 5.0, "auraflow": 3.5}  # the pipelines' default guidance_scale


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5fams")
    return {"chroma": write_tiny_chroma_folder(root / "chroma"), "auraflow": write_tiny_auraflow_folder(root / "auraflow")}


def test_chroma_prompt_encoder_and_denoiser_equal_the_pipelines(folders):
    folder = folders["chroma"]
    family, pipe = detect(folder), _pipe("ChromaPipeline", folder)
    assert isinstance(family, ChromaFamily) and family_named("chroma") is family
    enc = family.load_prompt_encoder(folder)
    assert enc.t5_length == T5_LENGTH  # min(the pipeline's 512, the tokenizer's model_max_length)
    cond = enc.encode(CAPTIONS)
    embeds, text_ids, mask, *_ = pipe.encode_prompt(CAPTIONS, None, do_classifier_free_guidance=False,
                                                    max_sequence_length=T5_LENGTH)
    close(cond["prompt_embeds"], embeds)
    assert torch.equal(cond["attention_mask"], mask.float())
    # the caption's tokens and ONE padding token unmasked: the counts differ from the tokenizer's by one
    tokens = enc.tok_t5(CAPTIONS, padding="max_length", max_length=T5_LENGTH, return_tensors="pt")["attention_mask"]
    assert torch.equal(cond["attention_mask"].sum(1), tokens.sum(1).float() + 1)
    assert torch.equal(chroma_text_mask(torch.ones(1, 4, dtype=torch.long)), torch.ones(1, 4))  # no padding: all kept
    x, t = torch.randn(2, 16, 8, 6, generator=torch.Generator().manual_seed(0)), torch.tensor([900.0, 25.0])
    packed = pipe._pack_latents(x, 2, 16, 8, 6)
    ids = pipe._prepare_latent_image_ids(2, 4, 3, "cpu", torch.float32)
    full_mask = pipe._prepare_attention_mask(2, packed.shape[1], torch.float32, mask)
    want = pipe.transformer(hidden_states=packed, timestep=t / 1000, encoder_hidden_states=embeds, txt_ids=text_ids,
                            img_ids=ids, attention_mask=full_mask, return_dict=False)[0]
    net = family.load_denoiser(folder)
    close(net(x, t, cond), pipe._unpack_latents(want, 8 * 4, 6 * 4, 4))
    assert set(net.state_dict()) == set(pipe.transformer.state_dict())
    rebuilt = family.denoiser_from_record(net.record())
    rebuilt.load_state_dict(net.state_dict())
    close(rebuilt(x, t, cond), pipe._unpack_latents(want, 8 * 4, 6 * 4, 4))
    assert family_of_record(net.record()) is family
    assert len(family.fsdp_units(net)) == 2  # the double block, then the single block
    assert family.condition_shapes(net.config, T5_LENGTH) == {k: tuple(v.shape[1:]) for k, v in cond.items()}


def test_auraflow_prompt_encoder_and_denoiser_equal_the_pipelines(folders):
    folder = folders["auraflow"]
    family, pipe = detect(folder), _pipe("AuraFlowPipeline", folder)
    assert isinstance(family, AuraFlowFamily) and family_named("auraflow") is family
    enc = family.load_prompt_encoder(folder)
    cond = enc.encode(CAPTIONS)
    assert set(cond) == {"prompt_embeds"}
    embeds, *_ = pipe.encode_prompt(CAPTIONS, None, do_classifier_free_guidance=False,
                                    max_sequence_length=T5_LENGTH)
    close(cond["prompt_embeds"], embeds)
    tokens = enc.tok_t5(CAPTIONS, padding="max_length", max_length=T5_LENGTH, return_tensors="pt")["attention_mask"]
    assert (tokens == 0).any() and not cond["prompt_embeds"][tokens == 0].any()  # the padding rows: zeros
    x, t = torch.randn(2, 4, 8, 6, generator=torch.Generator().manual_seed(0)), torch.tensor([900.0, 25.0])
    want = pipe.transformer(x, encoder_hidden_states=embeds, timestep=t / 1000, return_dict=False)[0]
    net = family.load_denoiser(folder)
    close(net(x, t, cond), want)
    rebuilt = family.denoiser_from_record(net.record())
    rebuilt.load_state_dict(net.state_dict())
    close(rebuilt(x, t, cond), want)
    assert len(family.fsdp_units(net)) == 2  # the joint block, then the single block
    assert family.condition_shapes(net.config, T5_LENGTH) == {"prompt_embeds": tuple(cond["prompt_embeds"].shape[1:])}


def test_training_defaults_follow_the_schedulers(folders):
    chroma = ChromaFamily().training_defaults(folders["chroma"])
    assert chroma["diffusion.flow_dynamic_shift"] and chroma["diffusion.flow_t_sampling"] == "uniform"
    assert chroma["diffusion.flow_train_shift"] == 1.0
    aura = AuraFlowFamily().training_defaults(folders["auraflow"])
    assert aura["diffusion.flow_train_shift"] == aura["diffusion.flow_shift"] == 1.73
    assert not aura["diffusion.flow_dynamic_shift"]
    assert aura["diffusion.flow_grid_end"] == pytest.approx(diffusers.FlowMatchEulerDiscreteScheduler(shift=1.73).sigma_min)
    # data.resolution: ChromaPipeline's default_sample_size 128 x the VAE's factor; AuraFlowPipeline's fixed 1024
    chroma_pipe = _pipe("ChromaPipeline", folders["chroma"])
    assert ChromaFamily().native_resolution(folders["chroma"]) == chroma_pipe.default_sample_size * chroma_pipe.vae_scale_factor
    assert AuraFlowFamily().native_resolution(folders["auraflow"]) == 1024
    assert not AuraFlowFamily().applies_shift_factor and ChromaFamily().applies_shift_factor


@pytest.mark.parametrize("name", ["chroma", "auraflow"])
def test_bad_input_gets_one_line(folders, name):
    family, folder = family_named(name), folders[name]
    with pytest.raises(ValueError, match="max_sequence_length=600") as info:
        family.load_prompt_encoder(folder, max_sequence_length=600)
    assert "\n" not in str(info.value) and str(folder) in str(info.value)
    net, cond = family.load_denoiser(folder), family.load_prompt_encoder(folder).encode(["a"])
    c = CHANNELS[name]
    with pytest.raises(ValueError, match="patches") as info:
        net(torch.zeros(1, c, 7, 8), torch.tensor([500.0]), cond)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="lacks 'prompt_embeds'") as info:
        net(torch.zeros(1, c, 8, 8), torch.tensor([500.0]), {})
    if name == "auraflow":  # 64 positions: 8 x 8 patches of 2, 16 latent pixels a side at most
        with pytest.raises(ValueError, match="position embedding") as info:
            net(torch.zeros(1, 4, 18, 8), torch.tensor([500.0]), cond)
        assert "\n" not in str(info.value)
    (folder / "tokenizer").rename(folder / "tokenizer.away")
    try:
        with pytest.raises(ValueError, match="tokenizer") as info:
            family.load_prompt_encoder(folder)
        assert "\n" not in str(info.value) and str(folder) in str(info.value)
    finally:
        (folder / "tokenizer.away").rename(folder / "tokenizer")


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("name", ["chroma", "auraflow"])
def test_lora_file_loads_in_the_pipeline_equal_to_the_merged_export(tmp_path, folders, name, dora):
    """export --format lora -> the pipeline's load_lora_weights gives what the merged export gives (1e-4);
    the other family's file is refused in one line."""
    family, folder, pipeline = family_named(name), folders[name], PIPELINES[name]
    net = family.load_denoiser(folder)
    state = _lora(net, family.lora_targets, dora=dora)
    assert {k.split(".lora_")[0].split(".", 2)[-1] for k in state} >= {"attn.to_q", "attn.to_out.0"}
    path = family.save_lora(state, {"r": 2, "lora_alpha": 2, "target_modules": list(family.lora_targets),
                                    "use_dora": dora}, tmp_path / "lora", {"difftrain": "test"})
    back = family.read_lora(path, denoiser=family.load_denoiser(folder))
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    merged = family.load_denoiser(folder)
    merged.load_state_dict(_merged(net))
    out = family.export_pipeline(merged, folder, tmp_path / "export")
    prompt = dict(prompt="a red circle", height=32, width=32, num_inference_steps=2, max_sequence_length=T5_LENGTH,
                  output_type="latent", guidance_scale=GUIDANCE[name])
    with_lora = _pipe(pipeline, folder)
    with_lora.load_lora_weights(str(path))
    a = with_lora(**prompt, generator=torch.Generator().manual_seed(1)).images
    b = _pipe(pipeline, out)(**prompt, generator=torch.Generator().manual_seed(1)).images
    assert (a - b).abs().max() < 1e-4
    plain = _pipe(pipeline, folder)(**prompt, generator=torch.Generator().manual_seed(1)).images
    assert (a - plain).abs().max() > 1e-3  # the LoRA changes the output
    other_name = "auraflow" if name == "chroma" else "chroma"
    other_family = family_named(other_name)
    other = other_family.load_denoiser(folders[other_name])
    other_path = other_family.save_lora(_lora(other, other_family.lora_targets), {}, tmp_path / "other")
    with pytest.raises(ValueError, match="not a") as info:
        family.read_lora(other_path, denoiser=family.load_denoiser(folder))
    assert "\n" not in str(info.value) and str(other_path) in str(info.value)


@pytest.mark.parametrize("name", ["chroma", "auraflow"])
def test_exported_pipeline_samples_what_difftrain_samples(tmp_path, folders, name):
    """The exported folder in the family's pipeline, from the same noise, with its own CFG (Chroma 5.0,
    AuraFlow 3.5 on the null prompt ""), samples what difftrain's flow sampler samples (1e-4)."""
    from difftrain.families.flux import pack, unpack

    family, folder = family_named(name), folders[name]
    out = family.export_pipeline(family.load_denoiser(folder), folder, tmp_path / "export")
    pipe = _pipe(PIPELINES[name], out)
    x_T = torch.randn(1, CHANNELS[name], 8, 8, generator=torch.Generator().manual_seed(3))
    ours = _difftrain_sample(family, folder, x_T, 4, GUIDANCE[name])
    theirs = pipe("a red circle", height=32, width=32, num_inference_steps=4, guidance_scale=GUIDANCE[name],
                  max_sequence_length=T5_LENGTH, latents=pack(x_T) if name == "chroma" else x_T,
                  output_type="latent").images
    if name == "chroma":
        theirs = unpack(theirs, 8, 8)
    assert (ours - theirs).abs().max() < 1e-4, (ours - theirs).abs().max()


def test_chroma_gradient_checkpointing_keeps_the_text_mask(folders):
    """ChromaTransformer2DModel.forward calls its single-stream blocks without the attention mask under
    diffusers' gradient checkpointing; the Chroma denoiser's own checkpointing gives it back: the loss and the
    gradients equal those of the run without checkpointing."""
    family = family_named("chroma")
    cond = family.load_prompt_encoder(folders["chroma"]).encode(CAPTIONS)
    assert (cond["attention_mask"] == 0).any()  # padding masked: the mask matters
    x, t = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([900.0, 25.0])

    def loss_and_grads(checkpointing: bool):
        net = family.load_denoiser(folders["chroma"])
        net.set_gradient_checkpointing(checkpointing)
        loss = net(x, t, cond).square().mean()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in net.named_parameters() if p.grad is not None}

    (plain, plain_grads), (checked, checked_grads) = loss_and_grads(False), loss_and_grads(True)
    close(checked, plain)
    assert set(checked_grads) == set(plain_grads)
    for name in plain_grads:
        close(checked_grads[name], plain_grads[name])


@pytest.mark.parametrize("base", ["chroma", "auraflow"])
def test_estimate_counts_the_known_bases_activations(base):
    """`difftrain estimate --base chroma|auraflow` builds the published transformers on the meta device and counts
    their activations: Chroma's attention takes a mask, which the fused-attention stand-in keeps as the
    memory-efficient kernel keeps its bias (before: "not counted", 0 bytes)."""
    from difftrain.config import load_config
    from difftrain.tools.base_memory import _config_setting, base_folder, count_settings, read_base

    cfg = load_config(None, [f"model.init_from={base_folder(base)}", "data.resolution=256", "lora.rank=4",
                             "model.gradient_checkpointing=true", "train.precision=bf16"])
    b = read_base(cfg, base)
    own = _config_setting(cfg, 1, None)
    rows, info = count_settings(cfg, b, [own])
    assert "not counted" not in info["activations_note"], info["activations_note"]
    assert rows[own]["activations"] > 0
    params = {"chroma": 8.90e9, "auraflow": 6.86e9}[base]  # Chroma1-HD, AuraFlow v0.3: counted on meta
    assert abs(info["parameters"] - params) < 0.01e9, info["parameters"]
