"""HiDream-I1 as a difftrain family, on the tiny offline base of tests/family_bases_hidream.py: the prompt
encoder and the denoiser equal HiDreamImagePipeline's own encode_prompt and transformer call (1e-5, float32);
detection, defaults from the scheduler and the script; the LoRA file loads in the pipeline with the merged
export's outputs (1e-4); the exported folder samples what difftrain samples; bad input gets one line."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.family_bases import T5_WIDTH
from tests.family_bases_hidream import (CLIP_G_WIDTH, CLIP_L_WIDTH, LENGTH, LLAMA_LAYERS, LLAMA_WIDTH, TOKENS,
                                        write_tiny_hidream_folder)

diffusers = pytest.importorskip("diffusers")

from difftrain.families.hidream import HiDreamFamily, fold_training_output  # noqa: E402

CAPTIONS = ["a red circle", "a blue square on a dark background"]


def close(a, b):
    """Equal up to float32 rounding."""
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hidream_folder(tmp_path_factory.mktemp("hidream") / "base")


def _pipe(folder):
    pipe = diffusers.HiDreamImagePipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    pipe.default_sample_size = 8  # the pipeline rescales every request to this area: 32 x 32 px here
    return pipe


def test_prompt_encoder_and_denoiser_equal_the_pipelines(folder):
    family, pipe = HiDreamFamily(), _pipe(folder)
    enc = family.load_prompt_encoder(folder, max_sequence_length=LENGTH)
    cond = enc.encode(CAPTIONS)
    t5, _, llama, _, pooled, _ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False,
                                                    max_sequence_length=LENGTH)
    assert set(cond) == {"pooled", "t5", "llama"}
    assert cond["llama"].shape == (2, LLAMA_LAYERS, LENGTH, pipe.text_encoder_4.config.hidden_size)  # batch-first
    close(cond["pooled"], pooled)
    close(cond["t5"], t5)
    close(cond["llama"], llama.transpose(0, 1))
    net = family.load_denoiser(folder).eval()
    t = torch.tensor([900.0, 25.0])
    for shape in ((2, 16, 8, 8), (2, 16, 8, 4)):  # square, and non-square (padded to max_seq with a mask)
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        want = -pipe.transformer(hidden_states=x, timesteps=t, encoder_hidden_states_t5=t5,
                                 encoder_hidden_states_llama3=llama, pooled_embeds=pooled, return_dict=False)[0]
        close(net(x, t, cond), want)
        net.train()  # the MoE's differentiable routing and the transformer's training-mode patches, folded back
        close(net(x, t, cond), want)
        net.eval()
    assert set(net.state_dict()) == set(pipe.transformer.state_dict())  # diffusers names, no prefix
    rebuilt = family.denoiser_from_record(net.record()).eval()
    rebuilt.load_state_dict(net.state_dict())
    close(rebuilt(x, t, cond), net(x, t, cond))
    units = family.fsdp_units(net)
    assert units == [*pipe.transformer.double_stream_blocks, *pipe.transformer.single_stream_blocks] or \
        len(units) == len(pipe.transformer.double_stream_blocks) + len(pipe.transformer.single_stream_blocks)


def test_the_default_lengths_and_the_null_condition_are_the_pipelines(folder):
    """max_sequence_length 0 -> the pipeline's 128 for CLIP, T5 and Llama; the null condition is "" through all
    four encoders, the pipeline's negative prompt."""
    family, pipe = HiDreamFamily(), _pipe(folder)
    enc = family.load_prompt_encoder(folder)
    assert (enc.clip_length, enc.t5_length, enc.llama_length) == (128, 128, 128) and TOKENS == 128
    null = enc.null(2, "cpu")
    _, t5, _, llama, _, pooled = pipe.encode_prompt(["x", "y"], do_classifier_free_guidance=True)
    close(null["t5"], t5)
    close(null["llama"], llama.transpose(0, 1))
    close(null["pooled"], pooled)
    shapes = family.condition_shapes(dict(pipe.transformer.config))
    assert {k: tuple(v.shape[1:]) for k, v in null.items()} == shapes


def test_the_family_is_registered_and_detected(folder):
    from difftrain.families import detect, family_named, family_of_record

    assert isinstance(detect(folder), HiDreamFamily) and family_named("hidream").name == "hidream"
    record = HiDreamFamily().load_denoiser(folder).record()
    assert record["kind"] == "family" and family_of_record(record).name == "hidream"
    assert record["lora_targets"] == ["to_k", "to_q", "to_v", "to_out"]  # the script's defaults


def test_training_defaults_follow_the_scheduler_and_the_script(folder):
    import json

    from difftrain.config import load_config

    family = HiDreamFamily()
    d = family.training_defaults(folder)
    assert d["diffusion.flow_t_sampling"] == "uniform" and d["diffusion.flow_train_shift"] == 3.0
    assert d["diffusion.flow_shift"] == 3.0 and not d["diffusion.flow_dynamic_shift"]
    assert d["diffusion.flow_grid_end"] == pytest.approx(diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0).sigma_min)
    pipe = _pipe(folder)
    assert family.native_resolution(folder) == 128 * 4 == diffusers.HiDreamImagePipeline.from_pretrained(
        str(folder)).default_sample_size * pipe.vae_scale_factor
    keys = {k: v for k, v in d.items() if k.startswith("diffusion.")}
    cfg = load_config(overrides=[f"{k}={v}" for k, v in keys.items()])
    ours = family.flow_scheduler(cfg.diffusion)
    base = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    assert {k: base[k] for k in ours} == ours


def _lora(net, targets, seed=0, dora=False):
    """Random LoRA (rank 2, B non-zero) on the denoiser's transformer; its peft state dict."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=list(targets), init_lora_weights=False,
                                       use_dora=dora), net.model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1 if "magnitude" in name else 0))
    return get_peft_model_state_dict(net.model)


def _merged(net):
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in net.model.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    return {k.replace(".base_layer", ""): v for k, v in net.state_dict().items() if "lora_" not in k}


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_lora_file_loads_in_the_pipeline_equal_to_the_merged_export(tmp_path, folder, dora):
    """save_lora -> HiDreamImagePipeline.load_lora_weights samples what the merged export samples (1e-4), LoRA and
    DoRA; a file of another family is refused in one line."""
    pytest.importorskip("peft")
    family = HiDreamFamily()
    net = family.load_denoiser(folder)
    state = _lora(net, family.lora_targets, dora=dora)
    path = family.save_lora(state, {"r": 2, "lora_alpha": 2, "target_modules": list(family.lora_targets),
                                    "use_dora": dora}, tmp_path / "lora", {"difftrain": "test"})
    back = family.read_lora(path, denoiser=family.load_denoiser(folder))
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    merged = family.load_denoiser(folder)
    merged.load_state_dict(_merged(net))
    out = family.export_pipeline(merged, folder, tmp_path / "export")
    prompt = dict(prompt="a red circle", height=32, width=32, num_inference_steps=2, max_sequence_length=LENGTH,
                  output_type="latent")
    with_lora = _pipe(folder)
    with_lora.load_lora_weights(str(path))
    a = with_lora(**prompt, generator=torch.Generator().manual_seed(1)).images
    b = _pipe(out)(**prompt, generator=torch.Generator().manual_seed(1)).images
    assert (a - b).abs().max() < 1e-4, (a - b).abs().max()
    plain = _pipe(folder)(**prompt, generator=torch.Generator().manual_seed(1)).images
    assert (a - plain).abs().max() > 1e-3  # the LoRA changes the output
    from difftrain.families import family_named
    from tests.family_bases import write_tiny_flux_folder

    flux = family_named("flux")
    flux_folder = write_tiny_flux_folder(tmp_path / "flux")
    other = flux.load_denoiser(flux_folder)
    other_path = flux.save_lora(_lora(other, flux.lora_targets), {}, tmp_path / "other")
    with pytest.raises(ValueError, match="not a") as info:
        family.read_lora(other_path, denoiser=family.load_denoiser(folder))
    assert "\n" not in str(info.value) and str(other_path) in str(info.value)


def test_exported_pipeline_samples_what_difftrain_samples(tmp_path, folder):
    """The base exported, sampled by the pipeline (CFG 5, its default, Euler on its scheduler) and by difftrain's
    flow objective with the family's defaults and CFG on encode([""]): the same latents (1e-4)."""
    from difftrain.diffusion.flow import FlowObjective

    family = HiDreamFamily()
    out = family.export_pipeline(family.load_denoiser(folder), folder, tmp_path / "export")
    x_T = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(3))
    d = family.training_defaults(folder)
    obj = FlowObjective(shift=d["diffusion.flow_shift"], grid_end=d["diffusion.flow_grid_end"],
                        dynamic_shift=d["diffusion.flow_dynamic_shift"])
    enc, net = family.load_prompt_encoder(folder, max_sequence_length=LENGTH), family.load_denoiser(folder).eval()
    cond, null = enc.encode(["a red circle"]), enc.null(1, "cpu")

    def network(x, t):
        both = {k: torch.cat([null[k], cond[k]]) for k in cond}
        uncond, text = net(torch.cat([x, x]), torch.cat([t, t]), both).chunk(2)
        return uncond + 5.0 * (text - uncond)

    with torch.no_grad():
        ours = obj.sample(network, x_T, "euler", 4, None, clip=False)
    theirs = _pipe(out)("a red circle", height=32, width=32, num_inference_steps=4, guidance_scale=5.0,
                        max_sequence_length=LENGTH, latents=x_T, output_type="latent").images
    assert (ours - theirs).abs().max() < 1e-4, (ours - theirs).abs().max()


def test_bad_input_gets_one_line(tmp_path, folder):
    family = HiDreamFamily()
    with pytest.raises(ValueError, match="max_sequence_length=129") as info:  # more than the CLIPs' 128 positions
        family.load_prompt_encoder(folder, max_sequence_length=129)
    assert "\n" not in str(info.value) and str(folder) in str(info.value)
    net = family.load_denoiser(folder)
    cond = family.load_prompt_encoder(folder, max_sequence_length=LENGTH).encode(["a"])
    for shape, needle in (((1, 16, 7, 8), "patches"), ((1, 16, 8, 40), "max_resolution")):
        with pytest.raises(ValueError, match=needle) as info:
            net(torch.zeros(*shape), torch.tensor([500.0]), cond)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="'llama'"):
        net(torch.zeros(1, 16, 8, 8), torch.tensor([500.0]), {k: v for k, v in cond.items() if k != "llama"})
    partial = tmp_path / "no_llama"
    shutil.copytree(folder, partial)
    shutil.rmtree(partial / "text_encoder_4")  # the released folders often lack Llama: one line naming it
    with pytest.raises(ValueError, match="text_encoder_4") as info:
        family.load_prompt_encoder(partial)
    assert "\n" not in str(info.value) and "Llama" in str(info.value)


def _op_counts(fn) -> dict[str, int]:
    """How many times ``fn()`` ran each aten op (torch.profiler's events, CPU)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages()}


def test_the_moe_routes_without_a_mask_per_expert_and_trains_as_diffusers(folder):
    """In training mode the MoE feed-forwards give diffusers' training path's values and gradients bit for bit (full
    fine-tuning: every weight's, the experts' and gates' too; with gradient checkpointing, whose recompute runs
    them again), without a boolean mask per expert (aten::nonzero: a host sync on CUDA, 8 per MoE forward in
    diffusers) and without the auxiliary loss diffusers computes and drops (aten::one_hot)."""
    family = HiDreamFamily()
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(3, 16, 8, 8, generator=g), torch.tensor([900.0, 25.0, 500.0])
    cond = {"pooled": torch.randn(3, CLIP_L_WIDTH + CLIP_G_WIDTH, generator=g),
            "t5": torch.randn(3, LENGTH, T5_WIDTH, generator=g),
            "llama": torch.randn(3, LLAMA_LAYERS, LENGTH, LLAMA_WIDTH, generator=g)}
    for checkpointing in (False, True):
        net = family.load_denoiser(folder).train()
        ref = diffusers.HiDreamImageTransformer2DModel.from_pretrained(str(folder / "transformer")).train()
        net.set_gradient_checkpointing(checkpointing)
        if checkpointing:
            ref.enable_gradient_checkpointing()
        weights = torch.linspace(-1, 1, x.numel()).view_as(x)
        counts = _op_counts(lambda net=net, w=weights: (net(x, t, cond) * w).sum().backward())
        reference = _op_counts(lambda ref=ref, w=weights: (fold_training_output(-ref(
            hidden_states=x, timesteps=t, encoder_hidden_states_t5=cond["t5"],
            encoder_hidden_states_llama3=cond["llama"].transpose(0, 1), pooled_embeds=cond["pooled"],
            return_dict=False)[0], 8, 8, 2) * w).sum().backward())
        assert reference.get("aten::nonzero", 0) > 0 and reference.get("aten::one_hot", 0) > 0  # what is measured
        assert counts.get("aten::nonzero", 0) == 0 and counts.get("aten::one_hot", 0) == 0
        grads = {n: p.grad for n, p in ref.named_parameters()}
        ours_grads = {n: p.grad for n, p in net.model.named_parameters()}
        assert ours_grads.keys() == grads.keys() and any(".experts." in n for n in grads)
        for name, grad in grads.items():
            assert (grad is None) == (ours_grads[name] is None), name
            if grad is not None:
                assert torch.equal(ours_grads[name], grad), name
        net.eval()
        with torch.no_grad():  # inference mode: diffusers' own path
            assert torch.equal(net(x, t, cond), -ref.eval()(hidden_states=x, timesteps=t,
                                                            encoder_hidden_states_t5=cond["t5"],
                                                            encoder_hidden_states_llama3=cond["llama"].transpose(0, 1),
                                                            pooled_embeds=cond["pooled"], return_dict=False)[0])


def test_estimate_counts_the_moe_activations_on_the_meta_device(folder):
    """``difftrain estimate --base`` runs the denoiser's training forward on meta tensors, where the MoE's routing
    (data: boolean masks) cannot run: each MoE feed-forward then splits its tokens' copies evenly among the
    experts, and the activations are counted, not left out."""
    from difftrain.config import load_config
    from difftrain.tools.base_memory import count_base

    cfg = load_config(None, [f"model.init_from={folder}", "data.resolution=32", "lora.rank=4",
                             f"model.max_sequence_length={LENGTH}", "train.precision=bf16"])
    counted = count_base(cfg, str(folder), ranks=1)
    assert counted["activations_note"].startswith("counted"), counted["activations_note"]
    assert all(row["activations"] > 0 for row in counted["rows"])


def test_the_known_base_is_hidream_i1_full():
    """tools/bases/hidream builds HiDream-I1's transformer on meta: 17.1B parameters (published: 17B), 48 blocks."""
    from difftrain.families import detect
    from difftrain.tools.base_memory import base_folder, denoiser_config

    folder = base_folder("hidream")
    with torch.device("meta"):
        net = detect(folder).denoiser_from_record({"config": denoiser_config(folder)})
    assert sum(p.numel() for p in net.parameters()) == 17_105_733_184
    assert len(HiDreamFamily().fsdp_units(net)) == 16 + 32
    assert HiDreamFamily().condition_shapes(denoiser_config(folder)) == {
        "pooled": (2048,), "t5": (128, 4096), "llama": (32, 128, 4096)}


def test_a_comfyui_layout_lora_file_is_read(tmp_path, folder):
    """A LoRA file in ComfyUI's layout for HiDream (``diffusion_model.`` + the diffusers module names, what
    HiDreamImageLoraLoaderMixin.lora_state_dict converts) is read as the same adapter as difftrain's own file."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file, save_file

    family = HiDreamFamily()
    net = family.load_denoiser(folder)
    state = _lora(net, family.lora_targets)
    ours = family.save_lora(state, {"r": 2, "lora_alpha": 2}, tmp_path / "ours")
    comfy = tmp_path / "comfy.safetensors"
    save_file({"diffusion_model." + k.removeprefix("transformer."): v for k, v in load_file(str(ours)).items()},
              str(comfy))
    back = family.read_lora(comfy, denoiser=family.load_denoiser(folder))
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
