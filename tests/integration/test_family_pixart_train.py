"""PixArt-Sigma fine-tuning end to end, offline, on the tiny base of tests/family_bases_pixart.py: LoRA and full
fine-tuning steps run through difftrain's one training loop and resume exactly (the digests), with the text
cache; `export` gives files the pipeline loads (the LoRA file with peft: PixArtSigmaPipeline has no
load_lora_weights); the preset command trains and validates at the pipeline's CFG; DreamBooth with prior
preservation resumes exactly; bad input is one line and exit 2."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

import torch  # noqa: E402

from difftrain.checkpoints import checkpoint as ckpt  # noqa: E402
from difftrain.config import load_config  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.family_bases_pixart import T5_LENGTH, write_tiny_pixart_folder  # noqa: E402
from tests.integration.test_family_pixart import load_lora_with_peft  # noqa: E402
from tests.integration.test_text_train import _captioned_folder  # noqa: E402
from tests.family_runs import run_digests as _digests, tiny_run  # noqa: E402


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("pixart-train")
    _captioned_folder(root / "data", n=8, size=32)
    return {"base": write_tiny_pixart_folder(root / "base"), "data": root / "data"}


def _overrides(bases, *extra):
    """A 4-step run of the tiny base on 8 captioned 32 px squares (latents 8 x 8: 16 tokens)."""
    return tiny_run(bases['data'], bases['base'], *extra, length=T5_LENGTH)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_steps_run_and_resume_exactly(tmp_path, bases, mode):
    """4 steps straight and 2 + 2 resumed give the same digests, through the text cache (text.cache on: its
    entries hold the T5 states and their masks); LoRA: its export loads on the pipeline's transformer;
    full: the exported pipeline samples what difftrain samples."""
    extra = ["lora.rank=4", "lora.alpha=4"] if mode == "lora" else []
    cfg = load_config(None, _overrides(bases, "text.cache=on", *extra))
    assert cfg.diffusion.objective == "ddpm" and cfg.diffusion.schedule == "linear"  # the base decided it
    train(cfg, tmp_path / "straight")
    train(cfg, tmp_path / "resumed", stop_at_step=2)
    assert train(cfg, tmp_path / "resumed").step == 4
    assert _digests(tmp_path / "straight") == _digests(tmp_path / "resumed")
    state = ckpt.load_checkpoint(tmp_path / "straight")
    names = list(state["model"])
    if mode == "lora":
        assert names and all("lora_" in n for n in names)
        assert any(t.abs().sum() > 0 for n, t in state["model"].items() if "lora_B" in n)  # it trained
        assert {n.split(".")[2] for n in names} == {"attn1", "attn2", "ff"}
        _lora_export_loads_on_the_pipelines_transformer(tmp_path, bases)
    else:
        base = write_tiny_pixart_folder(tmp_path / "again")  # the variance half of proj_out: no loss, unchanged
        from safetensors.torch import load_file

        proj = load_file(str(base / "transformer" / "diffusion_pytorch_model.safetensors"))["proj_out.weight"]
        trained = state["model"]["proj_out.weight"].view(2, 2, 2, -1, proj.shape[1])  # p, p, (eps, var) x 4, D
        assert torch.equal(trained[:, :, 1], proj.view(2, 2, 2, -1, proj.shape[1])[:, :, 1])
        assert not torch.equal(trained[:, :, 0], proj.view(2, 2, 2, -1, proj.shape[1])[:, :, 0])
        _export_samples_as_difftrain(tmp_path)


def _export_samples_as_difftrain(tmp_path):
    """``export`` of a full fine-tune: PixArtSigmaPipeline loads the folder and, from the same initial noise,
    samples difftrain's images (DPM-Solver++ 2M, 3 steps, CFG 4.5)."""
    import diffusers

    from difftrain import api
    from difftrain.generation.inference import generate_images, load_model
    from difftrain.generation.sampling import initial_noise

    out = api.export(tmp_path / "straight", tmp_path / "pipe")
    ours = load_model(tmp_path / "straight", device="cpu")
    expected = generate_images(ours, 1, sampler="dpmpp_2m", steps=3, seed=5, prompt="a red square",
                               guidance_scale=4.5)
    pipe = diffusers.PixArtSigmaPipeline.from_pretrained(str(out))
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(["a red square"], latents=initial_noise(1, (4, 8, 8), 5), num_inference_steps=3, guidance_scale=4.5,
                  max_sequence_length=T5_LENGTH, use_resolution_binning=False, clean_caption=False, output_type="pt",
                  height=32, width=32).images * 2 - 1
    assert theirs.shape == expected.shape
    assert (theirs - expected).abs().max() < 1e-4, (theirs - expected).abs().max()


def _lora_export_loads_on_the_pipelines_transformer(tmp_path, bases):
    """``export --format lora`` of the run, loaded with peft on PixArtSigmaPipeline's transformer: it gives what
    difftrain's adapted network gives (1e-4) on the same input."""
    import diffusers

    from difftrain.cli import main
    from difftrain.families import family_named
    from difftrain.generation.inference import load_model

    assert main(["export", str(tmp_path / "straight"), str(tmp_path / "lora"), "--format", "lora"]) == 0
    family = family_named("pixart-sigma")
    pipe = diffusers.PixArtSigmaPipeline.from_pretrained(str(bases["base"]))
    load_lora_with_peft(pipe.transformer, tmp_path / "lora" / "pytorch_lora_weights.safetensors")
    ours = load_model(tmp_path / "straight", device="cpu").model.eval()
    cond = family.load_prompt_encoder(bases["base"], max_sequence_length=T5_LENGTH).encode(["a red square"])
    x, t = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([700])
    theirs = family.denoiser_class(pipe.transformer)  # the pipeline's transformer behind difftrain's call
    with torch.no_grad():
        assert (ours(x, t, cond) - theirs(x, t, cond)).abs().max() < 1e-4
        plain = family.load_denoiser(bases["base"])
        assert (plain(x, t, cond) - theirs(x, t, cond)).abs().max() > 1e-6  # the adapter is in
    from difftrain.networks.lora_import import read_adapter

    back = read_adapter(tmp_path / "lora" / "pytorch_lora_weights.safetensors")  # difftrain reads its file back
    assert set(back["tensors"]) == set(ckpt.load_checkpoint(tmp_path / "straight")["model"])


def test_the_preset_command_trains_and_validates(tmp_path, bases):
    """``difftrain train --config configs/pixart-sigma-lora.toml --set model.init_from=BASE --set data.path=DIR``
    (shrunk to 2 steps at 32 px), validation grid included (DPM-Solver++ 2M, CFG 4.5: the pipeline's)."""
    from pathlib import Path

    from difftrain.cli import main

    preset = Path(__file__).resolve().parents[2] / "configs" / "pixart-sigma-lora.toml"
    cfg = load_config(preset, [f"model.init_from={bases['base']}"])
    assert cfg.validation.sampler == "dpmpp_2m" and cfg.validation.guidance_scale == 4.5
    sets = [f"model.init_from={bases['base']}", f"data.path={bases['data']}", "data.resolution=32",
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


def test_bad_input_is_one_line_and_exit_2(tmp_path, bases, capsys):
    """A T5 length the base cannot take, a resolution the VAE and 2x2 patches cannot divide."""
    from difftrain.cli import main

    for setting, needle in ((f"model.max_sequence_length={T5_LENGTH + 1}", "model.max_sequence_length"),
                            ("data.resolution=28", "data.resolution=28 must be a multiple of 8")):
        args = ["train", "--run-dir", str(tmp_path / setting.split("=")[0])]
        for s in _overrides(bases, setting):
            args += ["--set", s]
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert needle in err[-1] and str(bases["base"]) in err[-1], err


def test_dreambooth_with_prior_preservation_resumes_exactly(tmp_path, bases):
    """DreamBooth (LoRA) with class images made once by the base (its DDPM sampler)."""
    prior = ["dreambooth.instance_prompt=a photo of sks square", "dreambooth.class_prompt=a photo of a square",
             "dreambooth.num_class_images=2", "dreambooth.class_steps=2", "dreambooth.class_batch_size=2",
             f"dreambooth.class_dir={tmp_path / 'cls'}", "lora.rank=4"]
    cfg = load_config(None, _overrides(bases, *prior))
    train(cfg, tmp_path / "straight")
    assert sorted(p.name for p in (tmp_path / "cls").glob("*.png")) == ["class_00000.png", "class_00001.png"]
    train(cfg, tmp_path / "resumed", stop_at_step=2)
    assert train(cfg, tmp_path / "resumed").step == 4
    assert _digests(tmp_path / "straight") == _digests(tmp_path / "resumed")
