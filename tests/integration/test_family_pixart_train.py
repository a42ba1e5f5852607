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
from tests.family_bases_pixart import T5_LENGTH, write_tiny_pixart_folder  # noqa: E402
from tests.family_exports import (assert_same_images, assert_transformer_is_the_adapted_run,  # noqa: E402
                                  difftrain_image, export_lora, exported_pipeline)
from tests.family_runs import (assert_bad_settings_refused, assert_dreambooth_resumes_exactly,  # noqa: E402
                               assert_lora_trained, assert_preset_trains_and_validates, assert_resumes_exactly,
                               preset_path, straight_model, write_tiny_bases)
from tests.integration.test_family_pixart import load_lora_with_peft  # noqa: E402


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """The tiny PixArt-Sigma base; its runs: 4 steps on 8 captioned 32 px squares (latents 8 x 8: 16 tokens)."""
    return write_tiny_bases(tmp_path_factory.mktemp("pixart-train"), {"base": write_tiny_pixart_folder},
                            length=T5_LENGTH)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_steps_run_and_resume_exactly(tmp_path, bases, mode):
    """4 steps straight and 2 + 2 resumed give the same digests, through the text cache (text.cache on: its
    entries hold the T5 states and their masks); LoRA: its export loads on the pipeline's transformer;
    full: the exported pipeline samples what difftrain samples."""
    extra = ["lora.rank=4", "lora.alpha=4"] if mode == "lora" else []
    cfg = load_config(None, bases["base"].run("text.cache=on", *extra))
    assert cfg.diffusion.objective == "ddpm" and cfg.diffusion.schedule == "linear"  # the base decided it
    assert_resumes_exactly(cfg, tmp_path)
    model = straight_model(tmp_path)
    if mode == "lora":
        names = assert_lora_trained(model)
        assert {n.split(".")[2] for n in names} == {"attn1", "attn2", "ff"}
        _lora_export_loads_on_the_pipelines_transformer(tmp_path, bases)
    else:
        base = write_tiny_pixart_folder(tmp_path / "again")  # the variance half of proj_out: no loss, unchanged
        from safetensors.torch import load_file

        proj = load_file(str(base / "transformer" / "diffusion_pytorch_model.safetensors"))["proj_out.weight"]
        trained = model["proj_out.weight"].view(2, 2, 2, -1, proj.shape[1])  # p, p, (eps, var) x 4, D
        assert torch.equal(trained[:, :, 1], proj.view(2, 2, 2, -1, proj.shape[1])[:, :, 1])
        assert not torch.equal(trained[:, :, 0], proj.view(2, 2, 2, -1, proj.shape[1])[:, :, 0])
        _export_samples_as_difftrain(tmp_path)


def _export_samples_as_difftrain(tmp_path):
    """``export`` of a full fine-tune: PixArtSigmaPipeline loads the folder and, from the same initial noise,
    samples difftrain's images (DPM-Solver++ 2M, 3 steps, CFG 4.5)."""
    from difftrain.generation.sampling import initial_noise

    pipe = exported_pipeline(tmp_path, "PixArtSigmaPipeline")
    expected = difftrain_image(tmp_path, 4.5, sampler="dpmpp_2m")
    theirs = pipe(["a red square"], latents=initial_noise(1, (4, 8, 8), 5), num_inference_steps=3, guidance_scale=4.5,
                  max_sequence_length=T5_LENGTH, use_resolution_binning=False, clean_caption=False, output_type="pt",
                  height=32, width=32).images * 2 - 1
    assert_same_images(theirs, expected)


def _lora_export_loads_on_the_pipelines_transformer(tmp_path, bases):
    """``export --format lora`` of the run, loaded with peft on PixArtSigmaPipeline's transformer: it gives what
    difftrain's adapted network gives (1e-4) on the same input."""
    import diffusers

    from difftrain.families import family_named
    from difftrain.networks.lora_import import read_adapter

    lora = export_lora(tmp_path)
    pipe = diffusers.PixArtSigmaPipeline.from_pretrained(str(bases["base"].folder))
    load_lora_with_peft(pipe.transformer, lora / "pytorch_lora_weights.safetensors")
    assert_transformer_is_the_adapted_run(tmp_path, family_named("pixart-sigma"), bases["base"], pipe.transformer,
                                          (4, 8, 8), t=torch.tensor([700]))
    back = read_adapter(lora / "pytorch_lora_weights.safetensors")  # difftrain reads its file back
    assert set(back["tensors"]) == set(ckpt.load_checkpoint(tmp_path / "straight")["model"])


def test_the_preset_command_trains_and_validates(tmp_path, bases):
    """``difftrain train --config configs/pixart-sigma-lora.toml --set model.init_from=BASE --set data.path=DIR``
    (shrunk to 2 steps at 32 px), validation grid included (DPM-Solver++ 2M, CFG 4.5: the pipeline's)."""
    cfg = load_config(preset_path("pixart-sigma"), [f"model.init_from={bases['base'].folder}"])
    assert cfg.validation.sampler == "dpmpp_2m" and cfg.validation.guidance_scale == 4.5
    assert_preset_trains_and_validates(tmp_path / "run", "pixart-sigma", bases["base"].preset_run())


def test_bad_input_is_one_line_and_exit_2(tmp_path, bases, capsys):
    """A T5 length the base cannot take, a resolution the VAE and 2x2 patches cannot divide."""
    assert_bad_settings_refused(tmp_path, capsys, bases["base"], (
        (f"model.max_sequence_length={T5_LENGTH + 1}", "model.max_sequence_length"),
        ("data.resolution=28", "data.resolution=28 must be a multiple of 8")))


def test_dreambooth_with_prior_preservation_resumes_exactly(tmp_path, bases):
    """DreamBooth (LoRA) with class images made once by the base (its DDPM sampler)."""
    assert_dreambooth_resumes_exactly(tmp_path, bases["base"])
