"""Sana and Lumina 2 fine-tuning end to end, offline, on the tiny bases of tests/family_bases_gemma.py: LoRA and
full fine-tuning steps through difftrain's one training loop resume exactly (the digests of a straight run),
the text cache holds the Gemma condition (its mask included), DreamBooth with prior preservation resumes
exactly, the export samples as difftrain does, the LoRA export loads in the pipeline, the preset trains and
validates, and bad input is one line and exit 2."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

import torch  # noqa: E402

from difftrain.checkpoints import checkpoint as ckpt  # noqa: E402
from difftrain.config import load_config  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.family_bases_gemma import write_tiny_lumina2_folder, write_tiny_sana_folder  # noqa: E402
from tests.integration.test_text_train import _captioned_folder  # noqa: E402
from tests.family_runs import run_digests as _digests, tiny_run  # noqa: E402

LENGTH = 16  # model.max_sequence_length of these runs
WRITERS = {"sana": write_tiny_sana_folder, "lumina2": write_tiny_lumina2_folder}
PIPELINES = {"sana": "SanaPipeline", "lumina2": "Lumina2Pipeline"}
CHANNELS, LATENT = {"sana": 32, "lumina2": 16}, {"sana": 8, "lumina2": 4}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma-train")
    _captioned_folder(root / "data", n=8, size=32)
    return {name: write(root / name) for name, write in WRITERS.items()} | {"data": root / "data"}


def _overrides(bases, name, *extra):
    """A 4-step run of the tiny base on 8 captioned 32 px squares."""
    return tiny_run(bases['data'], bases[name], *extra, length=LENGTH)


@pytest.mark.parametrize("name", ["sana", "lumina2"])
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_steps_run_and_resume_exactly(tmp_path, bases, name, mode):
    """LoRA (with the text cache) and full fine-tuning: 4 steps straight = 2 steps, stop, resume, 2 more. The
    text cache holds the Gemma condition, its mask included, and trains what the encoder itself gives."""
    import json

    extra = (["lora.rank=4", "lora.alpha=4", "text.cache=on", f"data.cache_dir={tmp_path / 'cache'}"] if mode == "lora"
             else ["text.cache=off"])
    cfg = load_config(None, _overrides(bases, name, *extra))
    assert cfg.diffusion.objective == "flow" and cfg.diffusion.flow_t_sampling == "uniform"  # the base decided it
    train(cfg, tmp_path / "straight")
    train(cfg, tmp_path / "resumed", stop_at_step=2)
    assert train(cfg, tmp_path / "resumed").step == 4
    assert _digests(tmp_path / "straight") == _digests(tmp_path / "resumed")
    names = list(ckpt.load_checkpoint(tmp_path / "straight")["model"])
    if mode == "lora":
        assert names and all("lora_" in n for n in names)
        manifests = list((tmp_path / "cache").rglob("manifest.json"))
        assert len(manifests) == 1 and f"text-{name}-" in str(manifests[0])
        shapes = json.loads(manifests[0].read_text())["shapes"]
        assert shapes == {"prompt_embeds": [LENGTH, 32], "prompt_attention_mask": [LENGTH]}, shapes
        uncached = load_config(None, _overrides(bases, name, *extra[:2], "text.cache=off"))
        train(uncached, tmp_path / "uncached")
        assert _digests(tmp_path / "uncached") == _digests(tmp_path / "straight")
        _lora_export_loads_in_the_pipeline(tmp_path, bases, name)
    else:
        block = "transformer_blocks.0." if name == "sana" else "layers.0."
        assert any(n.startswith(block) for n in names)  # diffusers' names, no prefix
        _export_samples_as_difftrain(tmp_path, name)


def _export_samples_as_difftrain(tmp_path, name):
    """``export`` of a full fine-tune: the family's pipeline loads the folder and, from the same initial noise,
    samples difftrain's images (Euler, 3 steps, CFG 2 on the negative prompt ""; Lumina 2 with its default
    cfg_normalization=True, Sana with the Euler scheduler the export writes), 1e-4."""
    import diffusers

    from difftrain import api
    from difftrain.generation.inference import generate_images, load_model
    from difftrain.generation.sampling import initial_noise

    out = api.export(tmp_path / "straight", tmp_path / "pipe")
    ours = load_model(tmp_path / "straight", device="cpu")
    expected = generate_images(ours, 1, sampler="euler", steps=3, seed=5, prompt="a red square", guidance_scale=2.0)
    pipe = getattr(diffusers, PIPELINES[name]).from_pretrained(str(out))
    pipe.set_progress_bar_config(disable=True)
    noise = initial_noise(1, (CHANNELS[name], LATENT[name], LATENT[name]), 5)
    extra = {"use_resolution_binning": False} if name == "sana" else {}  # Lumina 2: the pipeline's defaults
    theirs = pipe(["a red square"], latents=noise.clone(), num_inference_steps=3, guidance_scale=2.0,
                  max_sequence_length=LENGTH, output_type="pt", height=32, width=32, **extra).images * 2 - 1
    assert theirs.shape == expected.shape
    assert (theirs - expected).abs().max() < 1e-4, (theirs - expected).abs().max()


def _lora_export_loads_in_the_pipeline(tmp_path, bases, name):
    """``export --format lora`` -> the pipeline's load_lora_weights: its transformer gives what difftrain's
    adapted network gives (1e-4)."""
    import diffusers

    from difftrain.cli import main
    from difftrain.families import family_named
    from difftrain.generation.inference import load_model

    assert main(["export", str(tmp_path / "straight"), str(tmp_path / "lora"), "--format", "lora"]) == 0
    family = family_named(name)
    pipe = getattr(diffusers, family.pipeline_class).from_pretrained(str(bases[name]))
    pipe.load_lora_weights(str(tmp_path / "lora"))
    ours = load_model(tmp_path / "straight", device="cpu").model.eval()
    cond = family.load_prompt_encoder(bases[name], max_sequence_length=LENGTH).encode(["a red square"])
    x = torch.randn(1, CHANNELS[name], LATENT[name], LATENT[name], generator=torch.Generator().manual_seed(0))
    t = torch.tensor([700.0])
    theirs = family.denoiser_class(pipe.transformer)
    with torch.no_grad():
        assert (ours(x, t, cond) - theirs(x, t, cond)).abs().max() < 1e-4
        assert (family.load_denoiser(bases[name])(x, t, cond) - theirs(x, t, cond)).abs().max() > 1e-6


@pytest.mark.parametrize("name", ["sana", "lumina2"])
def test_the_preset_command_trains_and_validates(tmp_path, bases, name):
    """``difftrain train --config configs/<name>-lora.toml --set model.init_from=BASE --set data.path=DIR``
    (shrunk to 2 steps at 32 px), the validation grid included (CFG 4.5 / 4.0, the pipelines')."""
    from pathlib import Path

    from difftrain.cli import main

    preset = Path(__file__).resolve().parents[2] / "configs" / f"{name}-lora.toml"
    sets = [f"model.init_from={bases[name]}", f"data.path={bases['data']}", "data.resolution=32",
            "data.num_workers=0", "train.total_steps=2", "train.grad_accum_steps=1",
            "train.precision=fp32", "train.progress_bar=false", "checkpoint.every_steps=2", "validation.every_steps=2",
            "validation.steps=2", "validation.num_images=2", "validation.prompts=['a red square']",
            f"model.max_sequence_length={LENGTH}"]
    args = ["train", "--config", str(preset), "--run-dir", str(tmp_path / "run")]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    assert ckpt.load_checkpoint(tmp_path / "run")["step"] == 2
    assert list((tmp_path / "run" / "samples").glob("*.png"))  # the validation grid


@pytest.mark.parametrize("name", ["sana", "lumina2"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, bases, name, capsys):
    """A Gemma length the base cannot take; a resolution the VAE (and Lumina 2's 2x2 patches) cannot divide."""
    from difftrain.cli import main

    side = "data.resolution=30" if name == "sana" else "data.resolution=24"  # Lumina 2: the VAE's 8, not 8 x 2
    for setting, needle in (("model.max_sequence_length=5000", "model.max_sequence_length"),
                            (side, f"{side} must be a multiple of " + ("the VAE's downsampling factor 4" if name == "sana"
                                                                      else "16"))):
        args = ["train", "--run-dir", str(tmp_path / setting.split("=")[0])]
        for s in _overrides(bases, name, setting):
            args += ["--set", s]
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert needle in err[-1] and str(bases[name]) in err[-1], err


@pytest.mark.parametrize("name", ["sana", "lumina2"])
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
