"""SD3 and Flux fine-tuning end to end, offline, on the tiny bases of tests/family_bases.py: a few
LoRA steps and a few full fine-tuning steps run through difftrain's one training loop and resume
exactly (the same digests as a straight run), as tests/integration/test_lora.py checks SD."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.config import load_config  # noqa: E402
from difftrain.checkpoints import checkpoint as ckpt  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.family_bases import (T5_LENGTH, with_run_conditions, write_tiny_flux_folder,  # noqa: E402
                                write_tiny_sd3_folder)
from tests.integration.test_text_train import _captioned_folder  # noqa: E402
from tests.family_runs import run_digests as _digests, tiny_run  # noqa: E402

WRITERS = {"sd3": write_tiny_sd3_folder, "flux": write_tiny_flux_folder}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("mmdit-train")
    _captioned_folder(root / "data", n=8, size=32)
    return {name: write(root / name) for name, write in WRITERS.items()} | {"data": root / "data"}


def _overrides(bases, name, *extra):
    """A 4-step run of the tiny base on 8 captioned 32 px squares (latents 8 x 8: 16 tokens)."""
    return tiny_run(bases['data'], bases[name], *extra, length=T5_LENGTH)


@pytest.mark.parametrize("name", ["sd3", "flux"])
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_steps_run_and_resume_exactly(tmp_path, bases, name, mode):
    extra = ["lora.rank=4", "lora.alpha=4"] if mode == "lora" else []
    cfg = load_config(None, _overrides(bases, name, *extra))
    assert cfg.diffusion.objective == "flow"  # the base decided it
    train(cfg, tmp_path / "straight")
    train(cfg, tmp_path / "resumed", stop_at_step=2)
    assert train(cfg, tmp_path / "resumed").step == 4
    assert _digests(tmp_path / "straight") == _digests(tmp_path / "resumed")
    state = ckpt.load_checkpoint(tmp_path / "straight")
    names = list(state["model"])
    if mode == "lora":
        assert names and all("lora_" in n for n in names)
        assert any(t.abs().sum() > 0 for n, t in state["model"].items() if "lora_B" in n)  # it trained
    else:
        assert any(n.startswith("transformer_blocks.0.") for n in names)  # diffusers' names, no prefix
    if mode == "lora":
        _lora_export_loads_in_the_pipeline(tmp_path, bases, name)
    else:
        _export_samples_as_difftrain(tmp_path, name)


def _export_samples_as_difftrain(tmp_path, name):
    """``export`` of a full fine-tune: the family's pipeline loads the folder and, from the same initial
    noise, samples difftrain's images (Euler, 3 steps; SD3 with CFG 2, Flux with its guidance input)."""
    import diffusers

    from difftrain import api
    from difftrain.families.flux import pack
    from difftrain.generation.inference import generate_images, load_model
    from difftrain.generation.sampling import initial_noise

    out = api.export(tmp_path / "straight", tmp_path / "pipe")
    ours = load_model(tmp_path / "straight", device="cpu")
    cfg_scale = 2.0 if name == "sd3" else 1.0
    expected = generate_images(ours, 1, sampler="euler", steps=3, seed=5, prompt="a red square",
                               guidance_scale=cfg_scale)
    pipe = getattr(diffusers, {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}[name]).from_pretrained(str(out))
    pipe.set_progress_bar_config(disable=True)
    noise = initial_noise(1, (16, 8, 8), 5)
    theirs = pipe(["a red square"], latents=noise.clone() if name == "sd3" else pack(noise), num_inference_steps=3,
                  guidance_scale=cfg_scale if name == "sd3" else 3.5, max_sequence_length=T5_LENGTH,
                  output_type="pt", height=32, width=32).images * 2 - 1
    assert theirs.shape == expected.shape
    assert (theirs - expected).abs().max() < 1e-4, (theirs - expected).abs().max()


def _lora_export_loads_in_the_pipeline(tmp_path, bases, name):
    """``export --format lora`` of the run -> the pipeline's load_lora_weights: its transformer gives
    what difftrain's adapted network gives (1e-4) on the same input."""
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
    cond = with_run_conditions(family, family.load_prompt_encoder(bases[name], max_sequence_length=T5_LENGTH)
                               .encode(["a red square"]))
    x, t = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([700.0])
    theirs = family.denoiser_class(pipe.transformer)  # the pipeline's transformer behind difftrain's call
    with torch.no_grad():
        assert (ours(x, t, cond) - theirs(x, t, cond)).abs().max() < 1e-4
        plain = family.load_denoiser(bases[name])
        assert (plain(x, t, cond) - theirs(x, t, cond)).abs().max() > 1e-6  # the adapter is in


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_the_preset_command_trains_and_validates(tmp_path, bases, name):
    """``difftrain train --config configs/<name>-lora.toml --set model.init_from=BASE --set data.path=DIR``
    (shrunk to 2 steps at 32 px), validation grid included (SD3: CFG 7; Flux: the guidance input)."""
    from pathlib import Path

    from difftrain.cli import main

    preset = Path(__file__).resolve().parents[2] / "configs" / f"{name}-lora.toml"
    sets = [f"model.init_from={bases[name]}", f"data.path={bases['data']}", "data.resolution=32",
            "data.num_workers=0", "train.total_steps=2", "train.grad_accum_steps=1", "train.precision=fp32",
            "train.progress_bar=false", "checkpoint.every_steps=2", "validation.every_steps=2",
            "validation.steps=2", "validation.num_images=2", "validation.prompts=['a red square']",
            f"model.max_sequence_length={T5_LENGTH}"]
    args = ["train", "--config", str(preset), "--run-dir", str(tmp_path / "run")]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    assert ckpt.load_checkpoint(tmp_path / "run")["step"] == 2
    assert list((tmp_path / "run" / "samples").glob("*.png"))  # the validation grid


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, bases, name, capsys):
    """A T5 length the base cannot take, a resolution the VAE and 2x2 patches cannot divide."""
    from difftrain.cli import main

    for setting, needle in ((f"model.max_sequence_length={T5_LENGTH + 1}", "model.max_sequence_length"),
                            ("data.resolution=28", "data.resolution=28 must be a multiple of 8")):
        args = ["train", "--run-dir", str(tmp_path / setting.split("=")[0])]
        for s in _overrides(bases, name, setting):
            args += ["--set", s]
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert needle in err[-1] and str(bases[name]) in err[-1], err


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_dreambooth_with_prior_preservation_resumes_exactly(tmp_path, bases, name):
    """DreamBooth (LoRA) with class images made once by the base (its flow sampler and grid)."""
    prior = ["dreambooth.instance_prompt=a photo of sks square", "dreambooth.class_prompt=a photo of a square",
             "dreambooth.num_class_images=2", "dreambooth.class_steps=2", "dreambooth.class_batch_size=2",
             f"dreambooth.class_dir={tmp_path / 'cls'}", "lora.rank=4"]
    cfg = load_config(None, _overrides(bases, name, *prior))
    train(cfg, tmp_path / "straight")
    assert sorted(p.name for p in (tmp_path / "cls").glob("*.png")) == ["class_00000.png", "class_00001.png"]
    train(cfg, tmp_path / "resumed", stop_at_step=2)
    assert train(cfg, tmp_path / "resumed").step == 4
    assert _digests(tmp_path / "straight") == _digests(tmp_path / "resumed")
