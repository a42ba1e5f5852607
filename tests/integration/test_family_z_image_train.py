"""Z-Image fine-tuning end to end, offline, on the tiny base of tests/family_bases_z_image.py: LoRA and full
fine-tuning steps run and resume exactly (the digests of a straight run), with the text cache and without;
the exported LoRA file loads in ZImagePipeline; the exported folder samples difftrain's images; the preset
command trains and validates; DreamBooth with prior preservation resumes exactly; bad input is one line and
exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.checkpoints import checkpoint as ckpt  # noqa: E402
from difftrain.config import load_config  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.family_bases_z_image import QWEN_LENGTH, write_tiny_z_image_folder  # noqa: E402
from tests.integration.test_text_train import _captioned_folder  # noqa: E402
from tests.family_runs import run_digests as _digests, tiny_run  # noqa: E402


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("z-image-train")
    _captioned_folder(root / "data", n=8, size=32)
    return {"z-image": write_tiny_z_image_folder(root / "base"), "data": root / "data"}


def _overrides(bases, *extra):
    """A 4-step run of the tiny base on 8 captioned 32 px squares (latents 8 x 8: 16 tokens)."""
    return tiny_run(bases['data'], bases['z-image'], *extra)


@pytest.mark.parametrize("mode", ["lora", "lora-no-cache", "full"])
def test_steps_run_and_resume_exactly(tmp_path, bases, mode):
    extra = {"lora": ["lora.rank=4", "lora.alpha=4", f"data.cache_dir={tmp_path / 'cache'}"],
             "lora-no-cache": ["lora.rank=4", "lora.alpha=4", "text.cache=off"], "full": []}[mode]
    cfg = load_config(None, _overrides(bases, *extra))
    assert cfg.diffusion.objective == "flow" and cfg.diffusion.flow_train_shift == 3.0  # the base decided it
    assert cfg.model.family == "auto" and cfg.data.captions
    train(cfg, tmp_path / "straight")
    train(cfg, tmp_path / "resumed", stop_at_step=2)
    assert train(cfg, tmp_path / "resumed").step == 4
    assert _digests(tmp_path / "straight") == _digests(tmp_path / "resumed")
    if mode == "lora":
        assert list((tmp_path / "cache").rglob("*.safetensors"))  # the text cache was filled and read
    state = ckpt.load_checkpoint(tmp_path / "straight")
    names = list(state["model"])
    if mode.startswith("lora"):
        assert names and all("lora_" in n for n in names)
        assert any(t.abs().sum() > 0 for n, t in state["model"].items() if "lora_B" in n)  # it trained
        assert any(".attention.to_q." in n for n in names) and any(n.startswith("layers.") for n in names)
    else:
        assert any(n.startswith("layers.0.") for n in names)  # diffusers' names, no prefix
    if mode == "lora":
        _lora_export_loads_in_the_pipeline(tmp_path, bases)
    elif mode == "full":
        _export_samples_as_difftrain(tmp_path)


def _export_samples_as_difftrain(tmp_path):
    """``export`` of a full fine-tune: ZImagePipeline loads the folder and, from the same initial noise,
    samples difftrain's images (Euler, 3 steps, difftrain's CFG 3 = the pipeline's guidance_scale 2)."""
    import diffusers

    from difftrain import api
    from difftrain.generation.inference import generate_images, load_model
    from difftrain.generation.sampling import initial_noise

    out = api.export(tmp_path / "straight", tmp_path / "pipe")
    ours = load_model(tmp_path / "straight", device="cpu")
    expected = generate_images(ours, 1, sampler="euler", steps=3, seed=5, prompt="a red square", guidance_scale=3.0)
    pipe = diffusers.ZImagePipeline.from_pretrained(str(out))
    pipe.set_progress_bar_config(disable=True)
    noise = initial_noise(1, (16, 8, 8), 5)
    theirs = pipe(["a red square"], latents=noise.clone(), num_inference_steps=3, guidance_scale=2.0,
                  max_sequence_length=QWEN_LENGTH, output_type="pt", height=32, width=32).images * 2 - 1
    assert theirs.shape == expected.shape
    assert (theirs - expected).abs().max() < 1e-4, (theirs - expected).abs().max()


def _lora_export_loads_in_the_pipeline(tmp_path, bases):
    """``export --format lora`` of the run -> ZImagePipeline.load_lora_weights: its transformer gives what
    difftrain's adapted network gives (1e-4) on the same input."""
    import diffusers
    import torch

    from difftrain.cli import main
    from difftrain.families import family_named
    from difftrain.generation.inference import load_model

    assert main(["export", str(tmp_path / "straight"), str(tmp_path / "lora"), "--format", "lora"]) == 0
    family = family_named("z-image")
    pipe = diffusers.ZImagePipeline.from_pretrained(str(bases["z-image"]))
    pipe.load_lora_weights(str(tmp_path / "lora"))
    ours = load_model(tmp_path / "straight", device="cpu").model.eval()
    cond = family.load_prompt_encoder(bases["z-image"]).encode(["a red square"])
    x, t = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([700.0])
    theirs = family.denoiser_class(pipe.transformer)  # the pipeline's transformer behind difftrain's call
    with torch.no_grad():
        assert (ours(x, t, cond) - theirs(x, t, cond)).abs().max() < 1e-4
        plain = family.load_denoiser(bases["z-image"])
        assert (plain(x, t, cond) - theirs(x, t, cond)).abs().max() > 1e-6  # the adapter is in


def test_the_preset_command_trains_and_validates(tmp_path, bases):
    """``difftrain train --config configs/z-image-lora.toml --set model.init_from=BASE --set data.path=DIR``
    (shrunk to 2 steps at 32 px), validation grid included."""
    from difftrain.cli import main

    preset = Path(__file__).resolve().parents[2] / "configs" / "z-image-lora.toml"
    sets = [f"model.init_from={bases['z-image']}", f"data.path={bases['data']}", "data.resolution=32",
            "data.num_workers=0", "train.total_steps=2", "train.grad_accum_steps=1", "train.precision=fp32",
            "model.quantize_base=off", "train.progress_bar=false", "checkpoint.every_steps=2",
            "validation.every_steps=2", "validation.steps=2", "validation.num_images=2",
            "validation.prompts=['a red square']", f"data.cache_dir={tmp_path / 'cache'}"]
    args = ["train", "--config", str(preset), "--run-dir", str(tmp_path / "run")]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    assert ckpt.load_checkpoint(tmp_path / "run")["step"] == 2
    assert list((tmp_path / "run" / "samples").glob("*.png"))  # the validation grid


def test_bad_input_is_one_line_and_exit_2(tmp_path, bases, capsys):
    """A prompt length the tokenizer cannot take, a resolution the VAE and 2x2 patches cannot divide."""
    from difftrain.cli import main

    for setting, needle in ((f"model.max_sequence_length={QWEN_LENGTH + 1}", "model.max_sequence_length"),
                            ("data.resolution=28", "data.resolution=28 must be a multiple of 8")):
        args = ["train", "--run-dir", str(tmp_path / setting.split("=")[0])]
        for s in _overrides(bases, setting, "text.cache=off"):
            args += ["--set", s]
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert needle in err[-1] and str(bases["z-image"]) in err[-1], err


def test_dreambooth_with_prior_preservation_resumes_exactly(tmp_path, bases):
    """DreamBooth (LoRA) with class images made once by the base (its flow sampler and grid)."""
    prior = ["dreambooth.instance_prompt=a photo of sks square", "dreambooth.class_prompt=a photo of a square",
             "dreambooth.num_class_images=2", "dreambooth.class_steps=2", "dreambooth.class_batch_size=2",
             f"dreambooth.class_dir={tmp_path / 'cls'}", "lora.rank=4", "text.cache=off"]
    cfg = load_config(None, _overrides(bases, *prior))
    train(cfg, tmp_path / "straight")
    assert sorted(p.name for p in (tmp_path / "cls").glob("*.png")) == ["class_00000.png", "class_00001.png"]
    train(cfg, tmp_path / "resumed", stop_at_step=2)
    assert train(cfg, tmp_path / "resumed").step == 4
    assert _digests(tmp_path / "straight") == _digests(tmp_path / "resumed")
