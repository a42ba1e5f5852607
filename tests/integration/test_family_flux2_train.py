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

from difftrain.config import load_config  # noqa: E402
from tests.family_bases_flux2 import (LATENT_CHANNELS, TEXT_LENGTH, write_tiny_flux2_folder,  # noqa: E402
                                      write_tiny_flux2_klein_folder)
from tests.family_exports import (assert_lora_export_loads_in_the_pipeline, assert_same_images,  # noqa: E402
                                  difftrain_image, exported_pipeline)
from tests.family_runs import (assert_bad_settings_refused, assert_dreambooth_resumes_exactly,  # noqa: E402
                               assert_lora_trained, assert_preset_trains_and_validates, assert_resumes_exactly,
                               preset_path, straight_model, write_tiny_bases)

WRITERS = {"flux2": write_tiny_flux2_folder, "flux2-klein": write_tiny_flux2_klein_folder}
PIPELINES = {"flux2": "Flux2Pipeline", "flux2-klein": "Flux2KleinPipeline"}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """The tiny [dev] and [klein] bases; their runs: 4 steps on 8 captioned 32 px squares (latents 32 x 8 x 8:
    16 tokens)."""
    return write_tiny_bases(tmp_path_factory.mktemp("flux2-train"), WRITERS, length=TEXT_LENGTH)


@pytest.mark.parametrize("name,mode", [("flux2", "lora"), ("flux2-klein", "lora"), ("flux2", "full")])
def test_steps_run_and_resume_exactly(tmp_path, bases, name, mode):
    extra = ["lora.rank=4", "lora.alpha=4", "text.cache=on"] if mode == "lora" else []
    cfg = load_config(None, bases[name].run(*extra))
    assert cfg.diffusion.objective == "flow" and cfg.diffusion.flow_t_sampling == "uniform"  # the base decided them
    assert cfg.diffusion.flow_dynamic_shift and cfg.diffusion.flow_shift_rule == "empirical"  # the pipelines' grid
    assert_resumes_exactly(cfg, tmp_path)
    model = straight_model(tmp_path)
    if mode == "lora":
        names = assert_lora_trained(model)
        assert any("single_transformer_blocks.0.attn.to_out" in n for n in names)  # the script's targets
        assert_lora_export_loads_in_the_pipeline(tmp_path, name, bases[name], (LATENT_CHANNELS, 8, 8))
    else:
        assert any(n.startswith("transformer_blocks.0.") for n in model)  # diffusers' names, no prefix
        _export_samples_as_difftrain(tmp_path, name)


def _export_samples_as_difftrain(tmp_path, name):
    """``export`` of a full fine-tune: the pipeline loads the folder and, from the same initial noise,
    samples difftrain's images (Euler, 3 steps on the pipelines' empirical grid, the guidance input 4.0:
    validation.distilled_guidance)."""
    from difftrain.families.flux2 import patchify
    from difftrain.generation.sampling import initial_noise

    pipe = exported_pipeline(tmp_path, PIPELINES[name])
    expected = difftrain_image(tmp_path, 1.0)
    noise = initial_noise(1, (LATENT_CHANNELS, 8, 8), 5)
    theirs = pipe(prompt=["a red square"], latents=patchify(noise), num_inference_steps=3, guidance_scale=4.0,
                  max_sequence_length=TEXT_LENGTH, output_type="pt", height=32, width=32).images * 2 - 1
    assert_same_images(theirs, expected)


@pytest.mark.parametrize("name", ["flux2", "flux2-klein"])
def test_the_preset_command_trains_and_validates(tmp_path, bases, name):
    """``difftrain train --config configs/<name>-lora.toml --set model.init_from=BASE --set data.path=DIR``
    (shrunk to 2 steps at 32 px), the validation grid included (dev: the guidance input; klein: CFG 4)."""
    assert_preset_trains_and_validates(tmp_path / "run", name, bases[name].preset_run("model.quantize_base=off"))
    cfg = load_config(str(preset_path(name)), [f"model.init_from={bases[name].folder}",
                                               f"data.path={bases[name].data}"])
    if name == "flux2":
        assert cfg.validation.distilled_guidance == 4.0 and cfg.validation.guidance_scale == 1.0
    else:
        assert cfg.validation.guidance_scale == 4.0


@pytest.mark.parametrize("name", ["flux2", "flux2-klein"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, bases, name, capsys):
    """A sequence length the pipeline cannot take, a resolution the VAE and 2x2 patches cannot divide."""
    assert_bad_settings_refused(tmp_path, capsys, bases[name], (
        ("model.max_sequence_length=513", "model.max_sequence_length"),
        ("data.resolution=28", "data.resolution=28 must be a multiple of 8")))


@pytest.mark.parametrize("name", ["flux2", "flux2-klein"])
def test_dreambooth_with_prior_preservation_resumes_exactly(tmp_path, bases, name):
    """DreamBooth (LoRA) with class images made once by the base (its flow sampler, grid and guidance)."""
    assert_dreambooth_resumes_exactly(tmp_path, bases[name])
