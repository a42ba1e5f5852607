"""SDXL end to end on a tiny random base (tests/family_bases.py): `difftrain train --set
model.init_from=SDXL --set lora.rank=4 --set data.path=DIR` with nothing else about the base, an exact
resume, and the exported LoRA file loaded by StableDiffusionXLPipeline.load_lora_weights sampling
what difftrain samples (DDIM, classifier-free guidance, same initial noise)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.config import load_config  # noqa: E402
from difftrain.generation.inference import generate_images, load_model  # noqa: E402
from difftrain.checkpoints import checkpoint as ckpt  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.family_bases import write_tiny_sdxl_folder  # noqa: E402
from tests.integration.test_text_train import _captioned_folder  # noqa: E402

PROMPT = "a red square on a dark background"
RES = 32


def _overrides(root, *extra):
    return [f"model.init_from={root / 'sdxl'}", "lora.rank=4", f"data.path={root / 'data'}",
            f"data.resolution={RES}", "data.num_workers=0", "train.batch_size=4", "train.total_steps=4",
            "optim.lr=1e-2", "validation.every_steps=0", "train.log_every_steps=1", *extra]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("sdxl_train")
    write_tiny_sdxl_folder(root / "sdxl")
    _captioned_folder(root / "data", n=8, size=RES)
    return root


def _digests(run):
    state = ckpt.load_checkpoint(run)
    return ckpt.state_dict_sha256(state["model"]), ckpt.state_dict_sha256(state["ema"]["model"])


def test_sdxl_lora_trains_from_the_bare_command_and_resumes_exactly(root, capfd):
    cfg = load_config(None, _overrides(root))
    assert cfg.model.text_encoder == str(root / "sdxl") and cfg.diffusion.schedule == "scaled_linear"
    train(cfg, root / "straight")
    start = capfd.readouterr()
    assert "sdxl UNet2DConditionModel" in start.out  # the start line names the base's network
    train(cfg, root / "resumed", stop_at_step=2)
    assert train(cfg, root / "resumed").step == 4
    assert _digests(root / "straight") == _digests(root / "resumed")
    state = ckpt.load_checkpoint(root / "straight")
    assert state["network"]["base"]["family"] == "sdxl"
    assert any(t.abs().sum() > 0 for n, t in state["model"].items() if "lora_B" in n)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_sdxl_lora_export_loads_in_the_pipeline_and_samples_as_difftrain(root, tmp_path, kind):
    from diffusers import DDIMScheduler, DDPMScheduler, StableDiffusionXLPipeline

    from difftrain import api
    from difftrain.diffusion.scheduler_configs import scheduler_config
    from difftrain.generation.sampling import initial_noise

    run = root / "straight"
    if kind != "lora":  # DoRA: the file carries each module's magnitude vector as well
        run = tmp_path / kind
        train(load_config(None, _overrides(root, f"lora.kind={kind}")), run)
    elif not (run / "checkpoints").exists():
        train(load_config(None, _overrides(root)), run)
    out = api.export(run, tmp_path / "adapter", format="lora")
    ours = load_model(run, device="cpu")
    steps, guidance = 4, 3.0
    expected = generate_images(ours, 2, sampler="ddim", steps=steps, seed=3, prompt=PROMPT, guidance_scale=guidance)
    pipe = StableDiffusionXLPipeline.from_pretrained(str(root / "sdxl"))
    ddpm = DDPMScheduler(**{**scheduler_config(ours.cfg.diffusion), "clip_sample": False, "steps_offset": 1})
    pipe.scheduler = DDIMScheduler.from_config(ddpm.config)
    pipe.load_lora_weights(str(out))
    noise = initial_noise(2, (4, RES // 2, RES // 2), 3)
    theirs = pipe([PROMPT] * 2, latents=noise.clone(), num_inference_steps=steps, guidance_scale=guidance, eta=0.0,
                  output_type="pt", height=RES, width=RES).images * 2 - 1
    assert theirs.shape == expected.shape
    assert (theirs - expected).abs().max() < 1e-4


def test_sdxl_full_fine_tune_exports_a_pipeline_folder_that_samples_as_difftrain(root, tmp_path):
    """Full fine-tuning (lora.rank 0) of the tiny SDXL base, then export: StableDiffusionXLPipeline loads the
    folder and, with difftrain's DDIM settings, samples difftrain's images to 1e-4 (measured 1e-6).

    The step count divides T = 1000: diffusers' DDIMScheduler takes each step's previous timestep as
    t - T // steps, not the grid's next one, so with "trailing" spacing and 3 steps it steps 666 -> 333 and then
    evaluates at 332 (difftrain steps 666 -> 332); that gap, not the export, gave 5e-4 here."""
    from diffusers import DDIMScheduler, StableDiffusionXLPipeline

    from difftrain import api
    from difftrain.generation.sampling import initial_noise

    cfg = load_config(None, _overrides(root, "lora.rank=0", "train.total_steps=2", "optim.lr=1e-4"))
    train(cfg, tmp_path / "full")
    state = ckpt.load_checkpoint(tmp_path / "full")
    assert state["network"]["family"] == "sdxl" and any("add_embedding" in k for k in state["model"])
    out = api.export(tmp_path / "full", tmp_path / "pipe")
    ours = load_model(tmp_path / "full", device="cpu")
    expected = generate_images(ours, 2, sampler="ddim", steps=4, seed=5, prompt=PROMPT, guidance_scale=2.0)
    pipe = StableDiffusionXLPipeline.from_pretrained(str(out))
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    noise = initial_noise(2, (4, RES // 2, RES // 2), 5)
    theirs = pipe([PROMPT] * 2, latents=noise.clone(), num_inference_steps=4, guidance_scale=2.0, eta=0.0,
                  output_type="pt", height=RES, width=RES).images * 2 - 1
    assert (theirs - expected).abs().max() < 1e-4


def test_sdxl_dreambooth_with_prior_preservation_resumes_exactly(root, tmp_path):
    """DreamBooth (LoRA) with class images made once by the SDXL base (dict conditions through generate)."""
    prior = ["dreambooth.instance_prompt=a photo of sks square", "dreambooth.class_prompt=a photo of a square",
             "dreambooth.num_class_images=2", "dreambooth.class_steps=2", "dreambooth.class_batch_size=2",
             f"dreambooth.class_dir={tmp_path / 'cls'}"]
    cfg = load_config(None, _overrides(root, *prior))
    train(cfg, tmp_path / "straight")
    assert sorted(p.name for p in (tmp_path / "cls").glob("*.png")) == ["class_00000.png", "class_00001.png"]
    train(cfg, tmp_path / "resumed", stop_at_step=2)
    assert train(cfg, tmp_path / "resumed").step == 4
    assert _digests(tmp_path / "straight") == _digests(tmp_path / "resumed")


def test_sdxl_kohya_export_loads_in_the_pipeline_as_the_diffusers_layout(root, tmp_path):
    """export --layout kohya (lora_unet_... with alpha, kohya's names): what
    StableDiffusionXLPipeline.load_lora_weights samples equals the diffusers layout's, and sample --lora
    reads it back to the run's samples."""
    from diffusers import StableDiffusionXLPipeline

    from difftrain import api

    if not (root / "straight" / "checkpoints").exists():
        train(load_config(None, _overrides(root)), root / "straight")
    images = []
    for layout in ("diffusers", "kohya"):
        out = api.export(root / "straight", tmp_path / layout, format="lora", lora_layout=layout)
        pipe = StableDiffusionXLPipeline.from_pretrained(str(root / "sdxl"))
        pipe.load_lora_weights(str(out))
        images.append(pipe([PROMPT], num_inference_steps=2, guidance_scale=3.0, output_type="pt", height=RES,
                           width=RES, generator=torch.Generator().manual_seed(0)).images)
    assert (images[0] - images[1]).abs().max() < 1e-5
    expected = generate_images(load_model(root / "straight", device="cpu"), 1, steps=2, prompt=PROMPT)
    got = generate_images(load_model(None, lora=tmp_path / "kohya", device="cpu"), 1, steps=2, prompt=PROMPT)
    assert (got - expected).abs().max() < 1e-5


def _sgm(module: str, layers_per_block: int) -> str:
    """kohya sd-scripts' name of an SDXL UNet module: it trains SDXL on the SGM UNet, whose blocks are
    input_blocks.N.1 / middle_block.1 / output_blocks.N.1 (N counting a block's layers, the resnet at .0),
    lora_unet_ + that path with '.' -> '_' (the layout its files have; built here to make one)."""
    import re

    per = layers_per_block + 1
    module = re.sub(r"^down_blocks\.(\d+)\.attentions\.(\d+)\.",
                    lambda m: f"input_blocks.{1 + int(m[1]) * per + int(m[2])}.1.", module)
    module = re.sub(r"^mid_block\.attentions\.0\.", "middle_block.1.", module)
    module = re.sub(r"^up_blocks\.(\d+)\.attentions\.(\d+)\.", lambda m: f"output_blocks.{int(m[1]) * per + int(m[2])}.1.",
                    module)
    return "lora_unet_" + module.replace(".", "_")


def test_a_kohya_sdxl_file_with_sgm_block_names_reads_onto_the_base(root, tmp_path):
    """A kohya sd-scripts SDXL file (SGM block names) is read through StableDiffusionXLPipeline.lora_state_dict
    with the UNet's config (diffusers maps the blocks): every tensor lands on the module it was trained on."""
    from safetensors.torch import save_file

    if not (root / "straight" / "checkpoints").exists():
        train(load_config(None, _overrides(root)), root / "straight")
    state = ckpt.load_checkpoint(root / "straight")
    ema, alpha = state["ema"]["model"], float(state["network"]["lora"]["alpha"])
    tensors = {}
    for key, value in ema.items():
        module, which = key.split(".lora_")
        name = _sgm(module, layers_per_block=1)
        assert "input_blocks" in name or "middle_block" in name or "output_blocks" in name, name
        tensors[f"{name}.lora_{'down' if which.startswith('A') else 'up'}.weight"] = value
        tensors[f"{name}.alpha"] = torch.tensor(alpha)
    save_file(tensors, tmp_path / "kohya_sdxl.safetensors")
    loaded = load_model(None, lora=tmp_path / "kohya_sdxl.safetensors", base=str(root / "sdxl"), device="cpu")
    got = loaded.model.state_dict()
    assert set(got) == set(ema) and all(torch.equal(got[k], ema[k]) for k in ema)
