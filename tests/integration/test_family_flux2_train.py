"""FLUX.2 [dev] and [klein] fine-tuning end to end, offline, on the tiny bases of tests/family_bases_flux2.py:
LoRA and full fine-tuning steps run through difftrain's one training loop and resume exactly (the digests of
a straight run), the text cache filled and read, the validation grid at each family's guidance convention,
the LoRA export loads in the pipeline, the full export samples what difftrain samples, DreamBooth with prior
preservation resumes exactly, the preset trains, bad input is one line and exit 2."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.checkpoints import checkpoint as ckpt  # noqa: E402
from difftrain.config import load_config  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.family_bases import with_run_conditions  # noqa: E402
from tests.family_bases_flux2 import (LATENT_CHANNELS, TEXT_LENGTH, write_tiny_flux2_folder,  # noqa: E402
                                      write_tiny_flux2_klein_folder)
from tests.integration.test_text_train import _captioned_folder  # noqa: E402
from tests.family_runs import run_digests as _digests, tiny_run  # noqa: E402

WRITERS = {"flux2": write_tiny_flux2_folder, "flux2-klein": write_tiny_flux2_klein_folder}
PIPELINES = {"flux2": "Flux2Pipeline", "flux2-klein": "Flux2KleinPipeline"}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux2-train")
    _captioned_folder(root / "data", n=8, size=32)
    return {name: write(root / name) for name, write in WRITERS.items()} | {"data": root / "data"}


def _overrides(bases, name, *extra):
    """A 4-step run of the tiny base on 8 captioned 32 px squares (latents 32 x 8 x 8: 16 tokens)."""
    return tiny_run(bases['data'], bases[name], *extra, length=TEXT_LENGTH)


@pytest.mark.parametrize("name,mode", [("flux2", "lora"), ("flux2-klein", "lora"), ("flux2", "full")])
def test_steps_run_and_resume_exactly(tmp_path, bases, name, mode):
    extra = ["lora.rank=4", "lora.alpha=4", "text.cache=on"] if mode == "lora" else []
    cfg = load_config(None, _overrides(bases, name, *extra))
    assert cfg.diffusion.objective == "flow" and cfg.diffusion.flow_t_sampling == "uniform"  # the base decided them
    assert cfg.diffusion.flow_dynamic_shift and cfg.diffusion.flow_shift_rule == "empirical"  # the pipelines' grid
    train(cfg, tmp_path / "straight")
    train(cfg, tmp_path / "resumed", stop_at_step=2)
    assert train(cfg, tmp_path / "resumed").step == 4
    assert _digests(tmp_path / "straight") == _digests(tmp_path / "resumed")
    state = ckpt.load_checkpoint(tmp_path / "straight")
    names = list(state["model"])
    if mode == "lora":
        assert names and all("lora_" in n for n in names)
        assert any("single_transformer_blocks.0.attn.to_out" in n for n in names)  # the script's targets
        assert any(t.abs().sum() > 0 for n, t in state["model"].items() if "lora_B" in n)  # it trained
        _lora_export_loads_in_the_pipeline(tmp_path, bases, name)
    else:
        assert any(n.startswith("transformer_blocks.0.") for n in names)  # diffusers' names, no prefix
        _export_samples_as_difftrain(tmp_path, name)


def _export_samples_as_difftrain(tmp_path, name):
    """``export`` of a full fine-tune: the pipeline loads the folder and, from the same initial noise,
    samples difftrain's images (Euler, 3 steps on the pipelines' empirical grid, the guidance input 4.0:
    validation.distilled_guidance)."""
    import diffusers

    from difftrain import api
    from difftrain.families.flux2 import patchify
    from difftrain.generation.inference import generate_images, load_model
    from difftrain.generation.sampling import initial_noise

    out = api.export(tmp_path / "straight", tmp_path / "pipe")
    ours = load_model(tmp_path / "straight", device="cpu")
    expected = generate_images(ours, 1, sampler="euler", steps=3, seed=5, prompt="a red square", guidance_scale=1.0)
    pipe = getattr(diffusers, PIPELINES[name]).from_pretrained(str(out))
    pipe.set_progress_bar_config(disable=True)
    noise = initial_noise(1, (LATENT_CHANNELS, 8, 8), 5)
    theirs = pipe(prompt=["a red square"], latents=patchify(noise), num_inference_steps=3, guidance_scale=4.0,
                  max_sequence_length=TEXT_LENGTH, output_type="pt", height=32, width=32).images * 2 - 1
    assert theirs.shape == expected.shape
    assert (theirs - expected).abs().max() < 1e-4, (theirs - expected).abs().max()


def _lora_export_loads_in_the_pipeline(tmp_path, bases, name):
    """``export --format lora`` -> the pipeline's load_lora_weights: its transformer gives what difftrain's
    adapted network gives (1e-4) on the same input."""
    import diffusers
    import torch

    from difftrain.cli import main
    from difftrain.families import family_named
    from difftrain.generation.inference import load_model

    assert main(["export", str(tmp_path / "straight"), str(tmp_path / "lora"), "--format", "lora"]) == 0
    family = family_named(name)
    pipe = getattr(diffusers, family.pipeline_class).from_pretrained(str(bases[name]))
    pipe.load_lora_weights(str(tmp_path / "lora"))
    ours = load_model(tmp_path / "straight", device="cpu").model.eval()
    cond = with_run_conditions(family, family.load_prompt_encoder(bases[name], max_sequence_length=TEXT_LENGTH)
                               .encode(["a red square"]))
    x, t = torch.randn(1, LATENT_CHANNELS, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([700.0])
    theirs = family.denoiser_class(pipe.transformer)  # the pipeline's transformer behind difftrain's call
    with torch.no_grad():
        assert (ours(x, t, cond) - theirs(x, t, cond)).abs().max() < 1e-4
        plain = family.load_denoiser(bases[name])
        assert (plain(x, t, cond) - theirs(x, t, cond)).abs().max() > 1e-6  # the adapter is in


@pytest.mark.parametrize("name", ["flux2", "flux2-klein"])
def test_the_preset_command_trains_and_validates(tmp_path, bases, name):
    """``difftrain train --config configs/<name>-lora.toml --set model.init_from=BASE --set data.path=DIR``
    (shrunk to 2 steps at 32 px), the validation grid included (dev: the guidance input; klein: CFG 4)."""
    from pathlib import Path

    from difftrain.cli import main

    preset = Path(__file__).resolve().parents[2] / "configs" / f"{name}-lora.toml"
    sets = [f"model.init_from={bases[name]}", f"data.path={bases['data']}", "data.resolution=32",
            "data.num_workers=0", "train.total_steps=2", "train.grad_accum_steps=1", "train.precision=fp32",
            "train.progress_bar=false", "checkpoint.every_steps=2", "validation.every_steps=2",
            "validation.steps=2", "validation.num_images=2", "validation.prompts=['a red square']",
            f"model.max_sequence_length={TEXT_LENGTH}", "model.quantize_base=off"]
    args = ["train", "--config", str(preset), "--run-dir", str(tmp_path / "run")]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    assert ckpt.load_checkpoint(tmp_path / "run")["step"] == 2
    assert list((tmp_path / "run" / "samples").glob("*.png"))  # the validation grid
    cfg = load_config(str(preset), [f"model.init_from={bases[name]}", f"data.path={bases['data']}"])
    if name == "flux2":
        assert cfg.validation.distilled_guidance == 4.0 and cfg.validation.guidance_scale == 1.0
    else:
        assert cfg.validation.guidance_scale == 4.0


@pytest.mark.parametrize("name", ["flux2", "flux2-klein"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, bases, name, capsys):
    """A sequence length the pipeline cannot take, a resolution the VAE and 2x2 patches cannot divide."""
    from difftrain.cli import main

    for setting, needle in (("model.max_sequence_length=513", "model.max_sequence_length"),
                            ("data.resolution=28", "data.resolution=28 must be a multiple of 8")):
        args = ["train", "--run-dir", str(tmp_path / setting.split("=")[0])]
        for s in _overrides(bases, name, setting):
            args += ["--set", s]
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert needle in err[-1] and str(bases[name]) in err[-1], err


@pytest.mark.parametrize("name", ["flux2", "flux2-klein"])
def test_dreambooth_with_prior_preservation_resumes_exactly(tmp_path, bases, name):
    """DreamBooth (LoRA) with class images made once by the base (its flow sampler, grid and guidance)."""
    prior = ["dreambooth.instance_prompt=a photo of sks square", "dreambooth.class_prompt=a photo of a square",
             "dreambooth.num_class_images=2", "dreambooth.class_steps=2", "dreambooth.class_batch_size=2",
             f"dreambooth.class_dir={tmp_path / 'cls'}", "lora.rank=4"]
    cfg = load_config(None, _overrides(bases, name, *prior))
    train(cfg, tmp_path / "straight")
    assert sorted(p.name for p in (tmp_path / "cls").glob("*.png")) == ["class_00000.png", "class_00001.png"]
    train(cfg, tmp_path / "resumed", stop_at_step=2)
    assert train(cfg, tmp_path / "resumed").step == 4
    assert _digests(tmp_path / "straight") == _digests(tmp_path / "resumed")
