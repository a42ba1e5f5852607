"""SD3 and Flux fine-tuning end to end, offline, on the tiny bases of tests/family_bases.py: a few
LoRA steps and a few full fine-tuning steps run through difftrain's one training loop and resume
exactly (the same digests as a straight run), as tests/integration/test_lora.py checks SD."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.config import load_config  # noqa: E402
from tests.family_bases import T5_LENGTH, write_tiny_flux_folder, write_tiny_sd3_folder  # noqa: E402
from tests.family_exports import (assert_lora_export_loads_in_the_pipeline, assert_same_images,  # noqa: E402
                                  difftrain_image, exported_pipeline)
from tests.family_runs import (assert_bad_settings_refused, assert_dreambooth_resumes_exactly,  # noqa: E402
                               assert_lora_trained, assert_preset_trains_and_validates, assert_resumes_exactly,
                               straight_model, write_tiny_bases)

WRITERS = {"sd3": write_tiny_sd3_folder, "flux": write_tiny_flux_folder}
PIPELINES = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """The tiny SD3 and Flux bases; their runs: 4 steps on 8 captioned 32 px squares (latents 8 x 8: 16 tokens)."""
    return write_tiny_bases(tmp_path_factory.mktemp("mmdit-train"), WRITERS, length=T5_LENGTH)


@pytest.mark.parametrize("name", ["sd3", "flux"])
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_steps_run_and_resume_exactly(tmp_path, bases, name, mode):
    extra = ["lora.rank=4", "lora.alpha=4"] if mode == "lora" else []
    cfg = load_config(None, bases[name].run(*extra))
    assert cfg.diffusion.objective == "flow"  # the base decided it
    assert_resumes_exactly(cfg, tmp_path)
    model = straight_model(tmp_path)
    if mode == "lora":
        assert_lora_trained(model)
        assert_lora_export_loads_in_the_pipeline(tmp_path, name, bases[name], (16, 8, 8))
    else:
        assert any(n.startswith("transformer_blocks.0.") for n in model)  # diffusers' names, no prefix
        _export_samples_as_difftrain(tmp_path, name)


def _export_samples_as_difftrain(tmp_path, name):
    """``export`` of a full fine-tune: the family's pipeline loads the folder and, from the same initial
    noise, samples difftrain's images (Euler, 3 steps; SD3 with CFG 2, Flux with its guidance input)."""
    from difftrain.families.flux import pack
    from difftrain.generation.sampling import initial_noise

    cfg_scale = 2.0 if name == "sd3" else 1.0
    pipe = exported_pipeline(tmp_path, PIPELINES[name])
    expected = difftrain_image(tmp_path, cfg_scale)
    noise = initial_noise(1, (16, 8, 8), 5)
    theirs = pipe(["a red square"], latents=noise.clone() if name == "sd3" else pack(noise), num_inference_steps=3,
                  guidance_scale=cfg_scale if name == "sd3" else 3.5, max_sequence_length=T5_LENGTH,
                  output_type="pt", height=32, width=32).images * 2 - 1
    assert_same_images(theirs, expected)


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_the_preset_command_trains_and_validates(tmp_path, bases, name):
    """``difftrain train --config configs/<name>-lora.toml --set model.init_from=BASE --set data.path=DIR``
    (shrunk to 2 steps at 32 px), validation grid included (SD3: CFG 7; Flux: the guidance input)."""
    assert_preset_trains_and_validates(tmp_path / "run", name, bases[name].preset_run())


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, bases, name, capsys):
    """A T5 length the base cannot take, a resolution the VAE and 2x2 patches cannot divide."""
    assert_bad_settings_refused(tmp_path, capsys, bases[name], (
        (f"model.max_sequence_length={T5_LENGTH + 1}", "model.max_sequence_length"),
        ("data.resolution=28", "data.resolution=28 must be a multiple of 8")))


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_dreambooth_with_prior_preservation_resumes_exactly(tmp_path, bases, name):
    """DreamBooth (LoRA) with class images made once by the base (its flow sampler and grid)."""
    assert_dreambooth_resumes_exactly(tmp_path, bases[name])
